"""One side-effect-free check of a CUDA-graph configuration, with the verdict a run gives.

:func:`check_config` reads the host's configuration (any shape ``read_settings``
takes), plans the documented auto-fixes without applying them, validates the configuration
as it will be once they are applied, inspects the environment and returns a
:class:`ConfigCheck`: the problems, the auto-fixes, the advice, and what could not be
checked here. It changes nothing: not the configuration, not the environment, and it logs
nothing.

The run (``CudaGraphPlugin.configure``) and ``python -m cudagraph_plugin check`` both use
it. Only the run writes the auto-fixes, through :meth:`ConfigCheck.apply`, and only into a
configuration without problems.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from cudagraph_plugin.config.advice import advice
from cudagraph_plugin.config.environment import (
    INSTALLED,
    Environment,
    environment_problems,
    once,
)
from cudagraph_plugin.config.errors import CudaGraphConfigError, Violation
from cudagraph_plugin.config.fixes import (
    AutoFix,
    check_writes,
    plan_autofixes,
    plan_environment_fixes,
    settings_after,
    write_fixes,
)
from cudagraph_plugin.config.rules import evaluate
from cudagraph_plugin.config.settings import Settings, read_settings


@dataclasses.dataclass(frozen=True)
class ConfigCheck:
    """The verdict on one configuration.

    :ivar settings: The settings as the run will see them (auto-fixes included).
    :ivar problems: Every violation; the configuration can work only when there are none.
    :ivar autofixes: The documented auto-fixes the run applies (config fields and
        environment variables), not applied by the check.
    :ivar advice: Warnings for a configuration that can work (never raised); none while
        there are problems (advice on a refused setting can contradict its fix).
    :ivar notes: What could not be checked here (e.g. Transformer Engine rules on a
        machine without it).
    :ivar environment: The facts the rules were checked against (Transformer Engine
        version).
    """

    settings: Settings
    problems: tuple[Violation, ...]
    autofixes: tuple[AutoFix, ...]
    advice: tuple[str, ...]
    notes: tuple[str, ...]
    environment: Environment

    @property
    def ok(self) -> bool:
        """The configuration can work (no problems)."""
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise :class:`CudaGraphConfigError` listing every problem, if there are any."""
        if self.problems:
            raise CudaGraphConfigError(list(self.problems))

    def apply(self, config: Any, environ: MutableMapping[str, str] | None = None) -> list[str]:
        """Write the auto-fixes into ``config`` (the object that was checked) and
        ``environ`` (``os.environ`` by default), logging each; return what changed.

        :raises CudaGraphConfigError: if there are problems; nothing is written then.
        """
        self.raise_for_problems()
        return write_fixes(config, list(self.autofixes), environ)


def check_config(
    config: Any,
    *,
    te_version: Any = INSTALLED,
    te_available: bool | Callable[[], bool] | None = None,
    environ: Mapping[str, str] | None = None,
    nccl_initialized: bool | Callable[[], bool] = False,
    harness: bool | None = None,
    paths_here: bool = True,
) -> ConfigCheck:
    """Check ``config`` as a run would, without changing anything.

    :param config: The host's configuration: a Megatron-Bridge-style nested config, a
        megatron-core ``TransformerConfig``, a Megatron-LM ``args`` namespace, a dict, or
        an OmegaConf, pydantic, attrs or ml_collections config object.
    :param te_version: The Transformer Engine version the rules check against:
        ``"installed"`` (this machine's, the default), a version such as ``"2.12"`` (to check
        a GPU recipe on a laptop), or None. Without a version those rules are not checked
        and say so in ``notes``.
    :param te_available: Whether Transformer Engine's graph support can be used (a bool or
        a query, asked only for TE graphs); None: not checked here (a note says so).
    :param environ: The environment to inspect (``os.environ`` by default; only read).
    :param nccl_initialized: NCCL has already read its environment (a bool or a query,
        asked only when it matters).
    :param harness: Apply the performance harness's auto-fixes too (a ``full_iteration``
        command line turns the loss NaN check off). Default: for an argparse namespace.
    :param paths_here: The run writes its files on this machine, so the paths it will write
        (``cuda_graph_report_json``) are checked here; False (a check made elsewhere, where
        the run's filesystem may not be mounted): a note says they are not.
    :raises ValueError: if ``te_version`` is not a version number.
    """
    if harness is None:
        harness = isinstance(config, argparse.Namespace)
    env = os.environ if environ is None else environ
    given = dataclasses.replace(Environment.of(te_version), paths_here=paths_here)
    read = read_settings(config)
    fixes = plan_autofixes(config, read, harness=harness)
    settings = settings_after(read, fixes)
    problems, notes = evaluate(settings, given)
    nccl_initialized = once(nccl_initialized)
    env_problems, env_notes = environment_problems(
        settings, env, nccl_initialized=nccl_initialized, te_available=te_available
    )
    env_fixes = plan_environment_fixes(settings, env, nccl_initialized=nccl_initialized)
    unwritable, converted = check_writes(config, fixes)
    problems += unwritable
    notes += converted
    refused = bool(problems or env_problems)
    return ConfigCheck(
        settings=settings,
        problems=tuple(problems + env_problems),
        autofixes=tuple(fixes + env_fixes),
        advice=() if refused else tuple(advice(settings, env)),
        notes=tuple(notes + env_notes),
        environment=given,
    )
