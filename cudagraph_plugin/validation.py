"""Every constraint on a CUDA-graph configuration, checked before anything is built.

Owns the rules (DESIGN.md's constraints plus megatron-core's own cuda-graph assertions that
apply to the model config), the error type that lists all violations at once, the advice
(warnings that are logged, never raised) and the documented auto-fixes. Messages keep the
key phrases of megatron-core's and Megatron-Bridge's messages so users can search them.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.settings import (
    IMPLS,
    SCOPES,
    Settings,
    assign,
    display_name,
    existing_paths,
    resolve,
)

logger = logging.getLogger("cudagraph_plugin")

TE_SCOPES = tuple(s for s in SCOPES if s != "full_iteration")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken constraint: the field(s) involved, their value, what is wrong, the fix."""

    fields: tuple[str, ...]
    value: str
    problem: str
    fix: str

    def format(self) -> str:
        return f"{', '.join(self.fields)} = {self.value}: {self.problem}\n     fix: {self.fix}"


class CudaGraphConfigError(ValueError):
    """The CUDA-graph configuration cannot work; ``violations`` lists every problem."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = list(violations)
        lines = [f"{len(self.violations)} problem(s) with the CUDA graph configuration:"]
        lines += [f"  {i}. {v.format()}" for i, v in enumerate(self.violations, 1)]
        super().__init__("\n".join(lines))


Rule = Callable[[Settings], Iterator[Violation]]
_RULES: list[Rule] = []


def _rule(func: Rule) -> Rule:
    _RULES.append(func)
    return func


def _v(s: Settings, settings: tuple[str, ...], value: Any, problem: str, fix: str) -> Violation:
    return Violation(tuple(s.field(name) for name in settings), repr(value), problem, fix)


def _scope_value(s: Settings) -> str:
    return ",".join(s.scope) if s.scope else "(empty)"


# -- impl and scope names ---------------------------------------------------------------------


@_rule
def _impl_known(s: Settings) -> Iterator[Violation]:
    if s.impl not in IMPLS:
        yield _v(
            s,
            ("impl",),
            s.impl,
            f"Invalid cuda graph implementation: {s.impl!r}",
            f"use one of {', '.join(IMPLS)}",
        )


@_rule
def _scope_names_known(s: Settings) -> Iterator[Violation]:
    unknown = [name for name in s.scope if name not in SCOPES]
    if unknown:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            f"unknown CUDA graph scope(s) {', '.join(map(repr, unknown))}",
            f"use names from {', '.join(SCOPES)} (comma-separated)",
        )


@_rule
def _scope_not_duplicated(s: Settings) -> Iterator[Violation]:
    duplicated = sorted({name for name in s.scope if s.scope.count(name) > 1})
    if duplicated:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            f"scope(s) listed more than once: {', '.join(duplicated)}",
            "list each scope once",
        )


@_rule
def _scope_not_empty(s: Settings) -> Iterator[Violation]:
    if s.enabled and s.impl in IMPLS and not s.scope:
        example = "full_iteration" if s.impl == "local" else "attn or attn,mlp"
        yield _v(
            s,
            ("impl", "scope"),
            (s.impl, _scope_value(s)),
            "CUDA graphs are on but no scope is given (whole-layer capture is not managed "
            "by this plugin)",
            f"name the scope explicitly, e.g. {example}",
        )


@_rule
def _full_iteration_only_local(s: Settings) -> Iterator[Violation]:
    if s.full_iteration and s.impl == "transformer_engine":
        yield _v(
            s,
            ("impl", "scope"),
            (s.impl, _scope_value(s)),
            "full_iteration cuda graph is not supported for cuda_graph_impl=transformer_engine",
            "Please use cuda_graph_impl=local instead (or TE scopes such as attn,mlp)",
        )


@_rule
def _full_iteration_alone(s: Settings) -> Iterator[Violation]:
    if s.full_iteration and len(set(s.scope)) > 1:
        others = sorted(set(s.scope) - {"full_iteration"})
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            f"full_iteration cannot be mixed with other scopes ({', '.join(others)}): it "
            "already captures the whole forward and backward",
            "use scope full_iteration alone, or drop it and use TE scopes",
        )


@_rule
def _local_is_full_iteration(s: Settings) -> Iterator[Violation]:
    per_layer = [name for name in s.scope if name in TE_SCOPES]
    if s.impl == "local" and per_layer:
        yield _v(
            s,
            ("impl", "scope"),
            (s.impl, _scope_value(s)),
            f"impl local with per-layer scopes ({', '.join(per_layer)}) uses megatron-core's "
            "per-layer CudaGraphManager, which this plugin does not manage",
            "use cuda_graph_impl=transformer_engine for per-layer scopes, or "
            "cuda_graph_impl=local with scope full_iteration",
        )


@_rule
def _warmup_steps_valid(s: Settings) -> Iterator[Violation]:
    w = s.warmup_steps
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        yield _v(
            s,
            ("warmup_steps",),
            w,
            "cuda_graph_warmup_steps must be a non-negative integer",
            "set it to the number of eager steps before capture (megatron-core's default: 3)",
        )


# -- legacy flags and RNG ---------------------------------------------------------------------


@_rule
def _legacy_flags(s: Settings) -> Iterator[Violation]:
    if s.enable_cuda_graph and s.external_cuda_graph:
        yield _v(
            s,
            ("enable_cuda_graph", "external_cuda_graph"),
            (True, True),
            "enable_cuda_graph and external_cuda_graph cannot be enabled at the same time",
            "drop both deprecated flags and set cuda_graph_impl",
        )
    elif (s.enable_cuda_graph or s.external_cuda_graph) and s.enabled:
        yield _v(
            s,
            ("enable_cuda_graph" if s.enable_cuda_graph else "external_cuda_graph", "impl"),
            (True, s.impl),
            "Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl",
            "drop the deprecated flag; cuda_graph_impl says it all",
        )
    elif s.enable_cuda_graph or s.external_cuda_graph:
        flag = "enable_cuda_graph" if s.enable_cuda_graph else "external_cuda_graph"
        new = "local" if s.enable_cuda_graph else "transformer_engine"
        yield _v(
            s,
            (flag,),
            True,
            f"{flag} is deprecated and not handled by this plugin",
            f"use cuda_graph_impl={new} with an explicit cuda_graph_scope instead",
        )


@_rule
def _te_rng_tracker(s: Settings) -> Iterator[Violation]:
    if not s.enabled:
        return
    for setting in ("model_te_rng_tracker", "rng_te_rng_tracker"):
        if getattr(s, setting) is False:
            yield _v(
                s,
                (setting,),
                False,
                "CUDA graphs require the TE RNG tracker (graph-safe RNG states)",
                f"set {s.field(setting)}=True (the plugin's configure does this for you)",
            )


# -- static shapes, NaN checks, offloading ----------------------------------------------------


@_rule
def _static_shapes(s: Settings) -> Iterator[Violation]:
    if s.enabled and s.variable_seq_lengths:
        yield _v(
            s,
            ("variable_seq_lengths",),
            True,
            "CUDA graphs need static tensor shapes; variable-length sequences do not work",
            "fix seq_length and micro_batch_size; pad packed sequences to a fixed width and "
            "set variable_seq_lengths=False",
        )


@_rule
def _nan_loss_check(s: Settings) -> Iterator[Violation]:
    if s.impl == "local" and s.full_iteration and s.check_for_nan_in_loss:
        yield _v(
            s,
            ("check_for_nan_in_loss",),
            True,
            "full_iteration CUDA graph requires check_for_nan_in_loss=False: the whole "
            "forward and backward is captured, so the loss cannot be inspected in between",
            f"turn {s.field('check_for_nan_in_loss')} off (check_for_nan_in_grad=False is "
            "also recommended)",
        )


@_rule
def _cpu_offloading(s: Settings) -> Iterator[Violation]:
    if s.enabled and s.cpu_offloading:
        yield _v(
            s,
            ("cpu_offloading",),
            True,
            "CUDA graphs not supported with CPU offloading",
            "set cpu_offloading=False, or turn CUDA graphs off",
        )


# -- MoE --------------------------------------------------------------------------------------


@_rule
def _moe_scopes(s: Settings) -> Iterator[Violation]:
    if not s.enabled:
        return
    scope = set(s.scope)
    if {"moe", "moe_router"} <= scope:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "cuda_graph_scope must not contain both moe and moe_router (they are mutually "
            "exclusive)",
            "use moe for drop-and-pad MoE, or moe_router[,moe_preprocess] for dropless MoE",
        )
    if "moe_preprocess" in scope and "moe_router" not in scope:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "moe_preprocess cuda graph is only supported with moe_router cuda graph",
            "add moe_router to the scope",
        )
    moe_scopes = sorted(scope & {"moe", "moe_router"})
    if moe_scopes and not s.is_moe:
        yield _v(
            s,
            ("scope", "num_moe_experts"),
            (_scope_value(s), s.num_moe_experts),
            f"moe cuda graph is only supported for MoE ({', '.join(moe_scopes)} needs "
            "num_moe_experts > 1)",
            "drop the MoE scopes for a dense model (use attn,mlp)",
        )
    if not s.is_moe:
        return
    freq = s.moe_layer_freq
    all_moe = freq == 1 or (isinstance(freq, (list, tuple)) and 0 not in freq)
    if "mlp" in scope and all_moe:
        yield _v(
            s,
            ("scope", "moe_layer_freq"),
            (_scope_value(s), freq),
            "mlp cuda graph is only supported for dense layers, but not found in the model",
            "drop mlp from the scope (every layer is MoE); use moe_router,moe_preprocess",
        )
    if "moe" in scope and s.dropless_moe:
        yield _v(
            s,
            ("scope", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"),
            (_scope_value(s), s.moe_expert_capacity_factor, s.moe_pad_expert_input_to_capacity),
            "moe cuda graph is only supported with drop-padding MoE; dropless MoE has dynamic "
            "expert shapes, only its dense parts are graphable",
            "use moe_router,moe_preprocess for dropless MoE, or set "
            "moe_expert_capacity_factor and moe_pad_expert_input_to_capacity=True",
        )
    if (
        "moe_preprocess" in scope
        and s.dropless_moe
        and s.moe_token_dispatcher_type == "alltoall"
        and (s.moe_expert_capacity_factor is not None or s.moe_router_padding_for_fp8)
    ):
        yield _v(
            s,
            ("scope", "moe_token_dispatcher_type"),
            (_scope_value(s), "alltoall"),
            "moe_preprocess cuda graph is not supported when there are DtoH copies and "
            "synchronizations in the preprocess step",
            "drop moe_preprocess from the scope, or pad to capacity "
            "(moe_pad_expert_input_to_capacity=True)",
        )


@_rule
def _moe_preprocess_needs_fused_permute(s: Settings) -> Iterator[Violation]:
    # Seen on an H200 (megatron-core 0.16.1, TE 2.11): the alltoall dispatcher's unfused
    # permutation uses masked_select, whose device-to-host sync invalidates the capture
    # ("operation not permitted when stream is capturing").
    if (
        s.impl == "transformer_engine"
        and "moe_preprocess" in s.scope
        and s.dropless_moe
        and s.moe_token_dispatcher_type == "alltoall"
        and not s.moe_permute_fusion
    ):
        yield _v(
            s,
            ("scope", "moe_permute_fusion"),
            (_scope_value(s), False),
            "moe_preprocess cuda graph with the dropless alltoall dispatcher needs the fused "
            "permutation: the unfused one synchronizes with the host (masked_select) inside "
            "the captured region",
            "set moe_permute_fusion=True (needs Transformer Engine), or drop moe_preprocess "
            "from the scope",
        )


@_rule
def _ep_overlap(s: Settings) -> Iterator[Violation]:
    if s.enabled and s.overlap_moe_expert_parallel_comm:
        bad = sorted(set(s.scope) & {"moe", "mlp", "full_iteration"})
        if s.impl != "transformer_engine" or bad:
            yield _v(
                s,
                ("overlap_moe_expert_parallel_comm", "impl", "scope"),
                (True, s.impl, _scope_value(s)),
                "CUDA graph scope on moe and mlp is not supported with "
                "overlap_moe_expert_parallel_comm (only TE graphs of the other scopes are)",
                "use cuda_graph_impl=transformer_engine with attn/moe_router/moe_preprocess, "
                "or turn overlap_moe_expert_parallel_comm off",
            )


# -- recompute --------------------------------------------------------------------------------


@_rule
def _full_recompute(s: Settings) -> Iterator[Violation]:
    if not s.enabled or s.full_iteration:
        return
    # recompute_num_layers only counts with granularity "full"; megatron-core ignores it
    # otherwise (hosts often carry a default for it).
    if s.recompute_granularity == "full":
        yield _v(
            s,
            ("recompute_granularity", "recompute_num_layers", "scope"),
            (s.recompute_granularity, s.recompute_num_layers, _scope_value(s)),
            "full recompute is only supported with full iteration CUDA graph",
            "use selective recompute (recompute_granularity=selective), turn CUDA graphs "
            "off, or use cuda_graph_impl=local with scope full_iteration",
        )


@_rule
def _selective_recompute(s: Settings) -> Iterator[Violation]:
    if not s.enabled or s.recompute_granularity != "selective":
        return
    modules = s.effective_recompute_modules
    scope = set(s.scope)
    if s.impl == "transformer_engine" and "moe" in modules and "moe_router" in scope:
        yield _v(
            s,
            ("recompute_modules", "scope"),
            (list(modules), _scope_value(s)),
            "moe recompute is not supported with moe_router CUDA graph with: "
            "--cuda-graph-impl transformer_engine",
            "drop 'moe' from recompute_modules, or moe_router from the scope",
        )
    whole = s.full_iteration
    if s.attention_dropout != 0.0 and "core_attn" in modules and (whole or "attn" in scope):
        yield _v(
            s,
            ("attention_dropout", "recompute_modules", "scope"),
            (s.attention_dropout, list(modules), _scope_value(s)),
            "attention dropout is not supported with graphed attention recomputation",
            "set attention_dropout=0.0, or drop core_attn from recompute_modules",
        )
    if s.hidden_dropout != 0.0 and (
        ("mlp" in modules and (whole or "mlp" in scope))
        or ("moe" in modules and (whole or "moe" in scope))
    ):
        yield _v(
            s,
            ("hidden_dropout", "recompute_modules", "scope"),
            (s.hidden_dropout, list(modules), _scope_value(s)),
            "hidden dropout is not supported with graphed MLP/MoE recomputation",
            "set hidden_dropout=0.0, or drop mlp/moe from recompute_modules",
        )
    if s.moe_input_jitter_eps is not None and "moe" in modules and (whole or "moe" in scope):
        yield _v(
            s,
            ("moe_input_jitter_eps", "recompute_modules", "scope"),
            (s.moe_input_jitter_eps, list(modules), _scope_value(s)),
            "moe_input_jitter_eps is not supported with graphed moe recomputation",
            "unset moe_input_jitter_eps, or drop moe from recompute_modules",
        )


# -- delayed weight gradients -----------------------------------------------------------------


@_rule
def _delay_wgrad(s: Settings) -> Iterator[Violation]:
    if not (s.delay_wgrad_compute and s.impl == "transformer_engine"):
        return
    te = compat.te_version()
    scope = set(s.scope)
    needs_new_te = "attn" in scope or (
        "moe_router" in scope and s.moe_shared_expert_intermediate_size is not None
    )
    if needs_new_te:
        problems = []
        if te is None or te < compat.TE_DELAY_WGRAD_WITH_ATTN:
            problems.append(
                f"Transformer Engine >= {compat.TE_DELAY_WGRAD_WITH_ATTN} "
                f"(installed: {te or 'none'})"
            )
        if not s.gradient_accumulation_fusion:
            problems.append("gradient_accumulation_fusion=True")
        # Megatron-LM checks the bias only for graphed attention.
        if "attn" in scope and (s.add_qkv_bias or s.add_bias_linear):
            problems.append("no attention bias (add_qkv_bias=False, add_bias_linear=False)")
        if problems:
            yield _v(
                s,
                ("delay_wgrad_compute", "scope"),
                (True, _scope_value(s)),
                "delay_wgrad_compute with attn (or moe_router with shared experts) in the CUDA "
                "graph scope requires " + "; ".join(problems),
                "meet those requirements, or drop attn/moe_router from the scope, or set "
                "delay_wgrad_compute=False",
            )
    elif te is not None and te < compat.TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS:
        yield _v(
            s,
            ("delay_wgrad_compute",),
            True,
            f"TE version >= {compat.TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS} is required for "
            f"delay_wgrad_compute with partial cuda graph (installed: {te})",
            "upgrade Transformer Engine or set delay_wgrad_compute=False",
        )


# -- entry points -----------------------------------------------------------------------------


def find_violations(settings: Settings) -> list[Violation]:
    """Every broken constraint of ``settings`` (empty when the configuration can work)."""
    return [violation for rule in _RULES for violation in rule(settings)]


def validate(settings: Settings) -> None:
    """Raise :class:`CudaGraphConfigError` listing every violation, if any."""
    violations = find_violations(settings)
    if violations:
        raise CudaGraphConfigError(violations)


def _model_kind(s: Settings) -> str:
    if not s.is_moe:
        return "dense"
    return "dropless MoE" if s.dropless_moe else "drop-and-pad MoE"


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads both
EXPANDABLE = "expandable_segments:True"


def expandable_segments_source(environ: Any) -> str | None:
    """The allocator variable that turns expandable segments on, if any."""
    for name in ALLOC_CONF_VARS:
        if EXPANDABLE in environ.get(name, ""):
            return name
    return None


RECOMMENDED_SCOPES = {
    "dense": ("attn", "mlp"),
    "dropless MoE": ("attn", "moe_router", "moe_preprocess"),
    "drop-and-pad MoE": ("attn", "moe"),
}


def advice(settings: Settings, environ: Any = None) -> list[str]:
    """Warnings worth logging for a configuration that is valid (never raised)."""
    s = settings
    env = os.environ if environ is None else environ
    notes: list[str] = []
    if not s.enabled:
        return notes
    kind = _model_kind(s)
    recommended = RECOMMENDED_SCOPES[kind]
    scope = set(s.scope)
    if s.full_iteration:
        notes.append(
            f"scope full_iteration is wider than recommended for a first {kind} run "
            f"(start with TE {','.join(recommended)}): it can raise peak memory 1.5-2x; "
            "check replay works and memory fits, and compare eager vs replay"
        )
    elif scope and scope < set(recommended):
        missing = [name for name in recommended if name not in scope]
        notes.append(
            f"scope {_scope_value(s)} is narrower than recommended for a {kind} model "
            f"({','.join(recommended)}); once replay works, memory fits and replay beats "
            f"eager, consider adding {','.join(missing)}"
        )
    elif scope - set(recommended) - {"mamba"}:
        extra = sorted(scope - set(recommended) - {"mamba"})
        notes.append(
            f"scope {_scope_value(s)} is wider than recommended for a {kind} model "
            f"({','.join(recommended)}): {','.join(extra)} adds memory; widen only after "
            "measuring eager vs replay"
        )
    if s.full_iteration and s.check_for_nan_in_grad:
        notes.append(
            f"{s.field('check_for_nan_in_grad')}=True with full_iteration: "
            "check_for_nan_in_grad=False is recommended (the gradients are produced inside "
            "the captured graph)"
        )
    source = expandable_segments_source(env)
    if source:
        notes.append(
            f"{source} has expandable_segments:True: CUDA graphs then need "
            "NCCL_GRAPH_REGISTER=0 (the preflight sets it when it can)"
        )
    if (
        isinstance(s.warmup_steps, int)
        and not isinstance(s.warmup_steps, bool)
        and (s.warmup_steps < 2)
    ):
        notes.append(
            f"{s.field('warmup_steps')}={s.warmup_steps}: the run report needs at least 2 "
            "warm-up steps to measure eager step time (the first step is excluded)"
        )
    return notes


def apply_autofixes(config: Any, settings: Settings) -> list[str]:
    """Apply the documented auto-fixes to the host config in place; return what changed.

    * CUDA graphs on: every TE RNG tracker flag the config has is set to True.
    * ``impl="none"``: the scope is cleared.

    Each change is logged once. Nothing else is ever changed here.
    """
    changes: list[str] = []
    if settings.enabled:
        for setting in ("model_te_rng_tracker", "rng_te_rng_tracker"):
            for path in existing_paths(config, setting):
                if resolve(config, path) is not True:
                    assign(config, path, True)
                    changes.append(
                        f"CUDA graphs are on: set {display_name(config, path)}=True "
                        "(TE RNG tracker)"
                    )
    elif settings.scope:
        for path in existing_paths(config, "scope"):
            if resolve(config, path):
                assign(config, path, [])
                changes.append(
                    f"cuda_graph_impl is none: cleared {display_name(config, path)} "
                    f"(was {_scope_value(settings)})"
                )
    for change in changes:
        logger.warning("auto-fix: %s", change)
    return changes
