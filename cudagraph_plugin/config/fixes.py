"""The one place that plans and writes automatic fixes.

The documented auto-fixes (DESIGN.md, "configure"): with CUDA graphs on, every TE RNG
tracker flag the config has is set to True and the impl and scope fields are written in
the spelling megatron-core parses; with ``impl="none"`` the scope is cleared; on a
command line (Megatron-Bridge's performance harness) ``full_iteration`` also turns the NaN
checks off; and in the environment, ``NCCL_GRAPH_REGISTER=0`` when expandable segments are
on and NCCL has not read its environment yet.

:func:`plan_fixes` says what would change without touching anything (``check_config``
uses it); :func:`write_fixes` is the only code that writes a fix into a host config or
the environment, logging each once. A run writes them only into a configuration without
problems (:meth:`cudagraph_plugin.config.check.ConfigCheck.apply`).

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
from collections.abc import (
    Callable,
    Iterable,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
)
from collections.abc import Set as AbstractSet
from enum import Enum
from typing import Any

from cudagraph_plugin.config.environment import (
    EXPANDABLE,
    Fact,
    environment_problems,
    full_iteration_scope_turns_graphs_on,
    nccl_register_fixable,
    once,
)
from cudagraph_plugin.config.errors import CudaGraphConfigError, Violation
from cudagraph_plugin.config.fields import (
    MISSING,
    assign,
    display_name,
    existing_paths,
    resolve,
    set_words,
    trial_writes,
    write_refusal,
)
from cudagraph_plugin.config.libraries import error_text
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.config.settings import Settings
from cudagraph_plugin.config.values import normalise, parse_scope, to_bool

logger = logging.getLogger("cudagraph_plugin")


@dataclasses.dataclass(frozen=True)
class AutoFix:
    """One documented auto-fix: the setting, the config path (or, for ``environment``
    fixes, the variable) it writes, the value and the line that says so."""

    setting: str
    path: str
    value: Any
    message: str
    environment: bool = False
    respelled: bool = False  # the same setting in megatron-core's spelling: nothing changes


def _readable_bool(value: Any) -> bool | None:
    try:
        return None if value is None else to_bool(value)
    except ValueError:
        return None


def plan_autofixes(config: Any, settings: Settings, *, harness: bool = False) -> list[AutoFix]:
    """The documented auto-fixes ``config`` needs, without touching it.

    * CUDA graphs on: every TE RNG tracker flag the config has is set to True, and the
      impl and scope fields are written in megatron-core's spelling (no spaces around
      names, a list for a tuple of scope names).
    * ``impl="none"``: the scope is cleared (not a ``full_iteration`` that megatron-core
      0.18+ reads as graphs on: a problem of its own).
    * ``harness`` (a command line, as Megatron-Bridge's performance harness): local
      ``full_iteration`` also turns the loss and gradient NaN checks off (Megatron-LM
      asserts both off; its one flag holds both).

    A field whose value cannot be read is left alone (validation reports it).
    """
    fixes: list[AutoFix] = []
    if settings.enabled:
        fixes += _respelled(config)
        for setting in ("model_te_rng_tracker", "rng_te_rng_tracker"):
            for path in existing_paths(config, setting):
                value = resolve(config, path)
                if value is None or _readable_bool(value) is False:
                    fixes.append(
                        AutoFix(
                            setting,
                            path,
                            True,
                            "CUDA graphs are on (TE RNG tracker): " + set_words(config, path, True),
                        )
                    )
        if harness and settings.impl == "local" and settings.full_iteration:
            written: set[str] = set()
            for setting, what in (
                ("check_for_nan_in_loss", "the loss"),
                ("check_for_nan_in_grad", "the gradients"),
            ):
                for path in existing_paths(config, setting):
                    if path in written or _readable_bool(resolve(config, path)) is not True:
                        continue
                    written.add(path)
                    fixes.append(
                        AutoFix(
                            setting,
                            path,
                            False,
                            f"full_iteration CUDA graph ({what} cannot be inspected inside "
                            f"the captured iteration): {set_words(config, path, False)}",
                        )
                    )
    elif (
        settings.scope
        and not full_iteration_scope_turns_graphs_on(settings)
        # (an impl that could not be read is no "none": ``cuda_graph_impl: ???`` had its
        # scope cleared; user trial, 2026-12-05)
        and not any(problem.setting == "impl" for problem in settings.input_problems)
    ):
        # (that one is a problem instead: megatron-core 0.18+ turns graphs on for it)
        for path in existing_paths(config, "scope"):
            value = resolve(config, path)
            if value:
                # each field's own value: both generations' fields may be set, and the
                # settings hold only the scope they merge into
                was = ",".join(parse_scope(value)) or "(empty)"
                fixes.append(
                    AutoFix(
                        "scope",
                        path,
                        [],
                        f"cuda_graph_impl is none: cleared {display_name(config, path)} "
                        f"(was {was})",
                    )
                )
    return fixes


def _respelled(config: Any) -> list[AutoFix]:
    """The impl and scope fields in a spelling megatron-core parses, where the host wrote
    one only the plugin reads: spaces around names (``"attn, mlp"``: megatron-core splits
    on the commas alone, ``KeyError: ' mlp'``; in a list each item is looked up as
    written), a list item holding several names (``["attn,mlp"]``), a tuple or a set of
    names or enum members, or a list mixing the two (it asserts a string, a list of names
    or a list of members); and a warm-up given as a string (``"5"``: megatron-core computes
    with it). That matters wherever megatron-core parses the host's own field (a Bridge
    provider, a TransformerConfig built from the host's dict)."""
    fixes: list[AutoFix] = []
    for setting in ("impl", "scope", "warmup_steps"):
        for path in existing_paths(config, setting):
            value = resolve(config, path)
            if setting == "warmup_steps":
                # (megatron-core computes with it: a string fails in its TE helper; a command
                # line's is the check command's lenient reading, Megatron-LM's parser has ints)
                if not isinstance(value, str) or isinstance(config, argparse.Namespace):
                    continue
                try:
                    tidy: Any = normalise(setting, value)
                except ValueError:
                    continue  # (a problem of its own)
            elif isinstance(value, str):
                names = value.split(",") if setting == "scope" else [value]
                tidy = ",".join(name.strip() for name in names)
            elif setting == "scope" and isinstance(value, Sequence | AbstractSet):
                # (any sequence or set: an OmegaConf ListConfig too; user trial, 2026-12-05)
                listed = isinstance(value, MutableSequence)  # (a ListConfig too: review)
                if listed and value and not any(isinstance(i, str) for i in value):
                    continue  # a list of enum members: megatron-core's own form
                items = sorted(value, key=str) if isinstance(value, AbstractSet) else list(value)
                names = [i if isinstance(i, str) else getattr(i, "name", None) for i in items]
                if not all(isinstance(name, str) for name in names):
                    continue  # (an item that is no name: validation says what is wrong)
                # megatron-core takes a list of names or of enum members, not a tuple, a set
                # or a mix; each name is looked up as written
                tidy = [part.strip() for name in names for part in name.split(",")]
            else:
                continue
            if tidy != value:  # (a tuple never equals a list: written as one)
                fixes.append(
                    AutoFix(
                        setting,
                        path,
                        tidy,
                        f"set {display_name(config, path)}={tidy!r} (was {value!r}: "
                        "megatron-core reads only that spelling)",
                        respelled=True,
                    )
                )
    return fixes


def settings_after(settings: Settings, fixes: list[AutoFix]) -> Settings:
    """``settings`` as they read once ``fixes`` are applied to the config: every setting
    read from a path a fix writes (Megatron-LM's ``check_for_nan_in_loss_and_grad`` holds
    both NaN checks) takes the written value."""
    written = {fix.path: fix.value for fix in fixes if not (fix.environment or fix.respelled)}
    changed = {
        setting: (() if setting == "scope" else written[path])
        for setting, path in settings.paths.items()
        if path in written
    }
    return dataclasses.replace(settings, **changed) if changed else settings


def plan_environment_fixes(
    settings: Settings, environ: Mapping[str, str], *, nccl_initialized: Fact
) -> list[AutoFix]:
    """The environment's auto-fix: ``NCCL_GRAPH_REGISTER=0`` while it still takes effect."""
    alloc_var = nccl_register_fixable(settings, environ, nccl_initialized)
    if alloc_var is None:
        return []
    return [
        AutoFix(
            "NCCL_GRAPH_REGISTER",
            "NCCL_GRAPH_REGISTER",
            "0",
            f"set NCCL_GRAPH_REGISTER=0: {alloc_var} has {EXPANDABLE} and "
            "CUDA graphs are on (NCCL is not initialised yet, so it takes effect)",
            environment=True,
        )
    ]


def plan_fixes(
    config: Any,
    settings: Settings,
    environ: Mapping[str, str],
    *,
    nccl_initialized: Fact,
    harness: bool,
) -> list[AutoFix]:
    """Every auto-fix ``config`` and ``environ`` need, config fields first; writes nothing."""
    return plan_autofixes(config, settings, harness=harness) + plan_environment_fixes(
        settings, environ, nccl_initialized=nccl_initialized
    )


def write_fixes(
    config: Any,
    fixes: list[AutoFix],
    environ: MutableMapping[str, str] | None = None,
    *,
    dry_run: bool = False,
) -> list[str]:
    """Write ``fixes`` into ``config`` (and ``environ``, ``os.environ`` by default), logging
    each once; with ``dry_run`` only log what would be written. Returns the messages.

    All or nothing: fields the config refuses to take (a frozen dataclass, a read-only
    mapping) put back the ones written and raise :class:`CudaGraphConfigError` naming each;
    the environment is written only after every config field was."""
    env = os.environ if environ is None else environ
    converted = {} if dry_run else _write_all(config, [f for f in fixes if not f.environment])
    for fix in fixes:
        if fix.environment:
            if not dry_run:
                env[fix.path] = fix.value
            logger.warning(
                "preflight: %s%s",
                "(dry run) would " if dry_run else "",
                fix.message,
                extra=JOB_WIDE,
            )
        elif fix.path in converted:
            logger.warning(
                "auto-fix: %s, but the config holds %r after the write (its field's type "
                "converts the value): megatron-core, where it reads that field, gets that; "
                "give the field the type %s",
                fix.message,
                converted[fix.path],
                type(fix.value).__name__,
                extra=JOB_WIDE,
            )
        else:
            logger.warning(
                "auto-fix: %s%s", "(dry run) would " if dry_run else "", fix.message, extra=JOB_WIDE
            )
    return [fix.message for fix in fixes]


def _refused_write(config: Any, fix: AutoFix, before: Any, why: str) -> Violation:
    name = display_name(config, fix.path)
    value = fix.value
    if fix.setting == "scope" and isinstance(value, list):
        # (the string megatron-core reads as well, None for no scope: a container that
        # holds no list, a FrozenConfigDict's tuples, a str-typed field take it; user
        # trial and review, 2026-12-05)
        value = ",".join(value) if value else None
    return Violation(
        (name,),
        repr(before),
        f"the run must set it ({fix.message}), but the config refuses the write ({why}); "
        "none of the auto-fixes was written",
        f"set {name}={value!r} yourself before the run, or give the run a config whose "
        "fields can be set",
    )


def check_writes(config: Any, fixes: Iterable[AutoFix]) -> tuple[list[Violation], list[str]]:
    """What the run's writes of ``fixes`` will meet, seen without writing: the fields it
    could not write (a frozen dataclass, a read-only mapping or OmegaConf container; a
    frozen pydantic model or one validating assignments, a frozen attrs class, a
    ``FrozenConfigDict``, tried on a copy in the run's order), as problems
    (``check_config`` says so as the run would refuse it; user trials, 2026-12-05), and the
    writes a field's declared type would convert (an OmegaConf structured config's ``str``
    warm-up, a converter turning the list into a tuple), as notes (the run's log line says
    so too)."""
    written = [fix for fix in fixes if not fix.environment]
    problems: list[Violation] = []
    notes: list[str] = []
    trials = trial_writes(config, [(fix.path, fix.value) for fix in written])
    for fix, (tried, after) in zip(written, trials, strict=True):
        why = write_refusal(config, fix.path) or tried
        if why is not None:
            problems.append(_refused_write(config, fix, resolve(config, fix.path), why))
        elif after is not MISSING and _converted(after, fix.value):
            notes.append(
                f"{display_name(config, fix.path)}: the run's fix writes {fix.value!r}, but the "
                f"field's declared type converts it to {after!r}, which megatron-core gets "
                f"where it reads that field; give the field the type {type(fix.value).__name__}"
            )
    return problems, notes


def _write_all(config: Any, fixes: list[AutoFix]) -> dict[str, Any]:
    """Write every fix, or none: each field the config refuses is named (every one at once,
    not one per attempt; user trial, 2026-12-05), and what was written is put back. Returns
    what a field holds where it took the write but converted the value (an OmegaConf
    structured config's ``str`` field, an attrs converter, a pydantic validator), by path."""
    converted: dict[str, Any] = {}
    written: list[tuple[str, Any]] = []
    refused: list[Violation] = []
    for fix in fixes:
        before = resolve(config, fix.path)
        try:
            assign(config, fix.path, fix.value)
        except Exception as error:
            refused.append(_refused_write(config, fix, before, error_text(error)))
            continue
        written.append((fix.path, before))
        after = resolve(config, fix.path)
        if _converted(after, fix.value):
            converted[fix.path] = after
    if refused:
        for path, value in reversed(written):  # (as the config was; best effort)
            with contextlib.suppress(Exception):
                assign(config, path, value)
        raise CudaGraphConfigError(refused) from None
    return converted


def _converted(held: Any, written: Any) -> bool:
    """The field holds another value than the one written (its type converted it)."""
    return _plain(held) != _plain(written)


def _plain(value: Any) -> Any:
    """``value`` compared as written: a list as its items (an OmegaConf ListConfig equals
    the list written), another sequence as its items and its kind (a converter that turns
    the list into a tuple changed it: megatron-core asserts a list; user trial), an enum
    member as its name."""
    if isinstance(value, MutableSequence):
        return [_plain(item) for item in value]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return type(value).__name__, [_plain(item) for item in value]
    return getattr(value, "name", value) if isinstance(value, Enum) else value


def apply_autofixes(config: Any, settings: Settings) -> list[str]:
    """Plan and write the config's documented auto-fixes unconditionally; return what
    changed. For callers that mean it (the harness's overrides); a run writes its fixes
    through :meth:`~cudagraph_plugin.config.check.ConfigCheck.apply`, only into a valid
    configuration."""
    return write_fixes(config, plan_autofixes(config, settings))


def inspect_environment(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    nccl_initialized: Fact,
    te_available: Fact | None,
) -> tuple[list[AutoFix], list[Violation], list[str]]:
    """The environment's auto-fixes, problems and notes for ``settings``; changes nothing."""
    nccl_initialized = once(nccl_initialized)
    fixes = plan_environment_fixes(settings, environ, nccl_initialized=nccl_initialized)
    violations, notes = environment_problems(
        settings, environ, nccl_initialized=nccl_initialized, te_available=te_available
    )
    return fixes, violations, notes


def preflight(
    settings: Settings,
    *,
    environ: MutableMapping[str, str] | None = None,
    nccl_initialized: Callable[[], bool],
    te_available: Callable[[], bool],
    dry_run: bool = False,
) -> list[str]:
    """Check (and where safe, fix) the environment for ``settings``.

    :param environ: The environment to check and update (``os.environ`` by default).
    :param nccl_initialized: Tells whether NCCL has already read its environment.
    :param te_available: Tells whether Transformer Engine's graph support is usable.
    :param dry_run: Report what would be set without changing ``environ``.
    :returns: The changes made (or, with ``dry_run``, that would be made), each logged.
    :raises CudaGraphConfigError: listing every environment problem with its fix.
    """
    if not settings.enabled:
        return []
    env = os.environ if environ is None else environ
    fixes, violations, _ = inspect_environment(
        settings, env, nccl_initialized=nccl_initialized, te_available=te_available
    )
    if violations:
        raise CudaGraphConfigError(violations)
    return write_fixes(None, fixes, env, dry_run=dry_run)
