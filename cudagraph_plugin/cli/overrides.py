"""Megatron-Bridge's performance-harness overrides (``set_cuda_graph_overrides``) for any
config shape: :func:`apply_overrides` sets the given values, then the harness's automatic
fixes (TE RNG tracker flags on for graphs, scope cleared for ``none`` (a ``full_iteration``
scope too, which megatron-core 0.18+ would read as graphs on), NaN checks off for
``full_iteration``) through :mod:`cudagraph_plugin.config.fixes`, each logged.
"""

from __future__ import annotations

import logging
from typing import Any

from cudagraph_plugin.config.environment import full_iteration_scope_turns_graphs_on
from cudagraph_plugin.config.fields import (
    FIELD_PATHS,
    MISSING,
    assign,
    display_name,
    existing_paths,
    resolve,
)
from cudagraph_plugin.config.fixes import plan_autofixes, write_fixes
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.config.values import parse_scope

logger = logging.getLogger("cudagraph_plugin")


def _target_path(config: Any, setting: str) -> str:
    """Where to write ``setting``: its first existing path, else the first whose parent
    exists (so a nested config gets ``model.x`` and a flat one ``x``)."""
    existing = existing_paths(config, setting)
    if existing:
        for path in existing:
            if resolve(config, path) is not None:
                return path
        return existing[0]
    for path in FIELD_PATHS[setting]:
        parent = path.rpartition(".")[0]
        if not parent or resolve(config, parent) is not MISSING:
            return path
    raise ValueError(f"cannot place {setting} in a {type(config).__name__}")


def apply_overrides(
    config: Any,
    *,
    cuda_graph_impl: str | None = None,
    cuda_graph_scope: str | list[str] | None = None,
    cuda_graph_warmup_steps: int | None = None,
) -> list[str]:
    """Apply command-line CUDA-graph overrides to ``config`` like Megatron-Bridge's harness.

    ``None`` leaves a value as the recipe has it. Returns the changes, each logged once.
    Scopes are written as names, as a recipe holds them before megatron-core's
    ``TransformerConfig.__post_init__`` turns them into enum members: apply overrides to the
    recipe, before the model config is finalised (as the harness does).
    """
    changes: list[str] = []

    def put(setting: str, value: Any, why: str) -> None:
        path = _target_path(config, setting)
        if resolve(config, path) != value:
            assign(config, path, value)
            changes.append(f"{why}: set {display_name(config, path)}={value!r}")

    if cuda_graph_impl is not None:
        put("impl", cuda_graph_impl, "--cuda-graph-impl")
    if cuda_graph_scope is not None:
        put("scope", list(parse_scope(cuda_graph_scope)), "--cuda-graph-scope")
    if cuda_graph_warmup_steps is not None:
        put("warmup_steps", cuda_graph_warmup_steps, "--cuda-graph-warmup-steps")

    settings = read_settings(config)
    if cuda_graph_impl == "none" and full_iteration_scope_turns_graphs_on(settings):
        # graphs asked off here: a full_iteration left in the scope would turn them on again
        # in megatron-core 0.18+ (its migration of that spelling); cleared as any scope
        put("scope", [], "--cuda-graph-impl none (megatron-core 0.18+ reads full_iteration as on)")
        settings = read_settings(config)
    for change in changes:
        logger.warning("override: %s", change, extra=JOB_WIDE)
    changes += write_fixes(config, plan_autofixes(config, settings, harness=True))
    return changes
