"""Every constraint on a CUDA-graph configuration, checked before anything is built.

The rules are DESIGN.md's constraints plus megatron-core's own cuda-graph assertions that
apply to the model config, one module per topic (``names``, ``training``, ``optimizer``,
``model``, ``te``, ``buckets``, ``report``); :func:`evaluate` runs them all and returns every
violation and what could not be checked here.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import CudaGraphConfigError, Note, Violation
from cudagraph_plugin.config.rules import buckets, model, names, optimizer, report, te, training
from cudagraph_plugin.config.rules.base import RULES
from cudagraph_plugin.config.settings import Settings

_TOPICS = (
    names,
    training,
    optimizer,
    model,
    te,
    buckets,
    report,
)  # imported for their registrations, in this order


def evaluate(
    settings: Settings, environment: Environment | None = None
) -> tuple[list[Violation], list[str]]:
    """Every broken constraint of ``settings``, and what could not be checked here.

    A rule's violation that names a field whose value could not be read is left out: the
    unreadable value is the problem to report, not what a default put in its place implies.
    """
    env = Environment.of() if environment is None else environment
    unreadable = {settings.field(p.setting) for p in settings.input_problems}
    violations: list[Violation] = []
    notes: list[str] = []
    for rule in RULES:
        for finding in rule(settings, env):
            if isinstance(finding, Note):
                notes.append(finding.text)
            elif rule is names.field_values or not unreadable & set(finding.fields):
                violations.append(finding)
    return violations, notes


def find_violations(settings: Settings, environment: Environment | None = None) -> list[Violation]:
    """Every broken constraint of ``settings`` (empty when the configuration can work)."""
    return evaluate(settings, environment)[0]


def validate(settings: Settings, environment: Environment | None = None) -> None:
    """Raise :class:`CudaGraphConfigError` listing every violation, if any."""
    violations = find_violations(settings, environment)
    if violations:
        raise CudaGraphConfigError(violations)
