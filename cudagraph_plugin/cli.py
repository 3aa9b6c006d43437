"""Command-line flags and the performance-harness overrides.

* :func:`add_cuda_graph_arguments` adds ``--cuda-graph-impl``, ``--cuda-graph-scope``
  (comma-separated, spaces tolerated, each name checked), ``--cuda-graph-warmup-steps``
  and the report options to any argparse parser, also under the underscore spellings of
  Megatron-Bridge's performance harness (``--cuda_graph_impl`` ...).
* :func:`apply_overrides` is the harness's ``set_cuda_graph_overrides`` for any config
  shape: it sets the given values and the harness's side effects (TE RNG tracker flags on
  for graphs, scope cleared for ``none``, loss NaN check off for ``full_iteration``), each
  logged.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from cudagraph_plugin.settings import (
    FIELD_PATHS,
    IMPLS,
    MISSING,
    SCOPES,
    assign,
    display_name,
    existing_paths,
    parse_scope,
    read_settings,
    resolve,
)
from cudagraph_plugin.validation import apply_autofixes

logger = logging.getLogger("cudagraph_plugin")

FLAG_DESTS = ("cuda_graph_impl", "cuda_graph_scope", "cuda_graph_warmup_steps")


def parse_scope_arg(text: str) -> list[str]:
    """argparse ``type`` for ``--cuda-graph-scope``: ``"attn, mlp"`` -> ``["attn", "mlp"]``."""
    names = list(parse_scope(text))
    if not names:
        raise argparse.ArgumentTypeError(
            f"empty scope {text!r}: give comma-separated names from {', '.join(SCOPES)}"
        )
    unknown = [name for name in names if name not in SCOPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown scope(s) {', '.join(map(repr, unknown))} in {text!r}; valid: "
            f"{', '.join(SCOPES)}"
        )
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise argparse.ArgumentTypeError(f"scope(s) listed twice in {text!r}: {duplicated}")
    return names


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _flags(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    """Both spellings of a flag, or none when the parser already has either: the host's
    own definition (its choices, its default) then governs both spellings' meaning."""
    spellings = ["--" + dest.replace("_", "-"), "--" + dest]
    if any(flag in parser._option_string_actions for flag in spellings):
        return []
    return spellings


def add_cuda_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the CUDA-graph flags to ``parser`` (flags the parser already has are left alone)."""
    group = parser.add_argument_group("CUDA graphs (megatron-cudagraph-plugin)")
    options: list[tuple[str, dict[str, Any]]] = [
        (
            "cuda_graph_impl",
            dict(
                choices=IMPLS,
                default="none",
                help="none; local (with scope full_iteration: megatron-core's "
                "FullCudaGraphWrapper); transformer_engine (per-layer TE graphs)",
            ),
        ),
        (
            "cuda_graph_scope",
            dict(
                type=parse_scope_arg,
                default=None,
                metavar="SCOPE[,SCOPE...]",
                help=f"comma-separated: {', '.join(SCOPES)}",
            ),
        ),
        (
            "cuda_graph_warmup_steps",
            dict(
                type=_non_negative_int,
                default=None,
                metavar="N",
                help="eager steps before capture (default: megatron-core's 3)",
            ),
        ),
        (
            "cuda_graph_report_json",
            dict(default=None, metavar="PATH", help="also write the run report as JSON here"),
        ),
        (
            "cuda_graph_fallback_on_slowdown",
            dict(
                action="store_true",
                help="full_iteration only: if replay is measurably slower than eager, free the "
                "graph and continue with the plain forward_backward_func",
            ),
        ),
    ]
    for dest, kwargs in options:
        flags = _flags(parser, dest)
        if not flags:
            logger.debug("parser already has %s; keeping its definition", dest)
            continue
        group.add_argument(*flags, dest=dest, **kwargs)


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

    for change in changes:
        logger.warning("override: %s", change)
    settings = read_settings(config)
    changes += apply_autofixes(config, settings)
    if settings.impl == "local" and settings.full_iteration:
        for path in existing_paths(config, "check_for_nan_in_loss"):
            if resolve(config, path):
                assign(config, path, False)
                change = (
                    f"full_iteration CUDA graph: set {display_name(config, path)}=False (the "
                    "loss cannot be "
                    "inspected inside the captured iteration)"
                )
                logger.warning("auto-fix: %s", change)
                changes.append(change)
    return changes
