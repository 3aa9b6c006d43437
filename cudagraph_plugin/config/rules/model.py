"""Rules on the model: MoE scopes and dispatchers, expert-parallel overlap, recompute, the
precision of the layers (TE graphs)."""

from __future__ import annotations

from collections.abc import Iterator

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import MCORE, MCORE_16, MCORE_19, Note, Violation
from cudagraph_plugin.config.rules.base import did_you_mean, rule, scope_value, violation
from cudagraph_plugin.config.settings import Settings

# -- MoE --------------------------------------------------------------------------------------


@rule
def _moe_scopes(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled:
        return
    scope = set(s.scope)
    if {"moe", "moe_router"} <= scope:
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            "moe (the whole MoE layer) and moe_router (its dense part) are mutually exclusive",
            "use moe for drop-and-pad MoE, or moe_router[,moe_preprocess] for dropless MoE",
            (MCORE_16, "cuda_graph_scope must not contain both moe and moe_router"),
            (MCORE_19, "cuda_graph_modules must not contain both moe and moe_router"),
        )
    if "moe_preprocess" in scope and "moe_router" not in scope:
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            "moe_preprocess is captured together with the router graph only",
            "add moe_router to the scope",
            (MCORE, "moe_preprocess cuda graph is only supported with moe_router cuda graph"),
        )
    moe_scopes = sorted(scope & {"moe", "moe_router"})
    if moe_scopes and not s.is_moe:
        yield violation(
            s,
            ("scope", "num_moe_experts"),
            (scope_value(s), s.num_moe_experts),
            f"{', '.join(moe_scopes)} needs an MoE model (num_moe_experts > 1)",
            "drop the MoE scopes for a dense model (use attn,mlp)",
            (MCORE, "moe cuda graph is only supported for MoE"),
        )
    if not s.is_moe:
        return
    freq = s.moe_layer_freq
    all_moe = freq == 1 or (isinstance(freq, (list, tuple)) and 0 not in freq)
    if "mlp" in scope and all_moe:
        yield violation(
            s,
            ("scope", "moe_layer_freq"),
            (scope_value(s), freq),
            "scope mlp captures dense MLP layers, and every layer of this model is MoE",
            "drop mlp from the scope (every layer is MoE); use moe_router,moe_preprocess",
            (
                MCORE,
                "mlp cuda graph is only supported for dense layers, but not found in the model",
            ),
        )
    if "moe" in scope and s.dropless_moe:
        yield violation(
            s,
            ("scope", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"),
            (scope_value(s), s.moe_expert_capacity_factor, s.moe_pad_expert_input_to_capacity),
            "scope moe needs drop-and-pad MoE; dropless MoE has dynamic expert shapes, only its "
            "dense parts are graphable",
            "use moe_router,moe_preprocess for dropless MoE, or set "
            f"{s.field('moe_expert_capacity_factor')} and "
            f"{s.set_text('moe_pad_expert_input_to_capacity', True)}",
            (MCORE, "moe cuda graph is only supported with drop-padding MoE"),
        )
    if (
        "moe_preprocess" in scope
        and s.dropless_moe
        and s.moe_token_dispatcher_type == "alltoall"
        and (s.moe_expert_capacity_factor is not None or s.moe_router_padding_for_fp8)
    ):
        yield violation(
            s,
            ("scope", "moe_token_dispatcher_type"),
            (scope_value(s), "alltoall"),
            "the alltoall dispatcher's preprocess step copies to the host and synchronises "
            "with a capacity factor or FP8 router padding",
            "drop moe_preprocess from the scope, or pad to capacity "
            f"({s.set_text('moe_pad_expert_input_to_capacity', True)})",
            (
                MCORE,
                "moe_preprocess cuda graph is not supported when there are DtoH copies "
                "and synchronizations in the preprocess step",
            ),
        )


@rule
def _moe_preprocess_needs_fused_permute(s: Settings, env: Environment) -> Iterator[Violation]:
    # Seen on an H200 (megatron-core 0.16.1, TE 2.11): the alltoall dispatcher's unfused
    # permutation uses masked_select, whose device-to-host sync invalidates the capture.
    # megatron-core has no check for it; the reference is the CUDA error users get.
    if (
        s.impl == "transformer_engine"
        and "moe_preprocess" in s.scope
        and s.dropless_moe
        and s.moe_token_dispatcher_type == "alltoall"
        and not s.moe_permute_fusion
    ):
        yield violation(
            s,
            ("scope", "moe_permute_fusion"),
            (scope_value(s), False),
            "moe_preprocess cuda graph with the dropless alltoall dispatcher needs the fused "
            "permutation: the unfused one synchronizes with the host (masked_select) inside "
            "the captured region",
            f"{s.set_text('moe_permute_fusion', True)} (needs Transformer Engine), or drop "
            "moe_preprocess from the scope",
            ("CUDA, at capture", "operation not permitted when stream is capturing"),
        )


@rule
def _ep_overlap(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.overlap_moe_expert_parallel_comm:
        bad = sorted(set(s.scope) & {"moe", "mlp", "full_iteration"})
        if s.impl != "transformer_engine" or bad:
            yield violation(
                s,
                ("overlap_moe_expert_parallel_comm", "impl", "scope"),
                (True, s.impl, scope_value(s)),
                "with expert-parallel communication overlap only TE graphs of attn, moe_router "
                "and moe_preprocess are supported",
                "use cuda_graph_impl=transformer_engine with attn/moe_router/moe_preprocess, "
                f"or {s.set_text('overlap_moe_expert_parallel_comm', False)}",
                (
                    MCORE,
                    "CUDA graph scope on moe and mlp is not supported with "
                    "overlap_moe_expert_parallel_comm",
                ),
            )


# -- recompute --------------------------------------------------------------------------------


@rule
def _recompute_modules_known(s: Settings, env: Environment) -> Iterator[Violation]:
    # (a misspelt name would also hide the dropout rules below, which look for the names;
    # the installed megatron-core's names: 0.19 adds gdn_norm_out, which 0.16.1 refuses)
    if not s.enabled or s.recompute_granularity != "selective":
        return
    known = environment.mcore_recompute_modules()
    unknown = [name for name in s.effective_recompute_modules if name not in known]
    if unknown:
        yield violation(
            s,
            ("recompute_modules",),
            list(s.effective_recompute_modules),
            f"unknown selective-recompute module(s) {', '.join(map(repr, unknown))}",
            f"use names from {', '.join(known)} (megatron-core {environment.mcore_version()}, "
            f"installed here){did_you_mean(unknown[0], known)}",
            (MCORE, "Invalid choices for recompute_modules"),
        )


@rule
def _full_recompute(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled or s.full_iteration:
        return
    # recompute_num_layers only counts with granularity "full"; megatron-core ignores it
    # otherwise (hosts often carry a default for it).
    if s.recompute_granularity == "full":
        yield violation(
            s,
            ("recompute_granularity", "recompute_num_layers", "scope"),
            (s.recompute_granularity, s.recompute_num_layers, scope_value(s)),
            "layer-level (full) recompute works only with the full-iteration graph, not with "
            "per-layer graphs",
            "use selective recompute (recompute_granularity=selective), turn CUDA graphs "
            "off, or use cuda_graph_impl=local with scope full_iteration",
            (MCORE, "full recompute is only supported with full iteration CUDA graph"),
        )


@rule
def _selective_recompute(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled or s.recompute_granularity != "selective":
        return
    modules = s.effective_recompute_modules
    scope = set(s.scope)
    if s.impl == "transformer_engine" and "moe" in modules and "moe_router" in scope:
        yield violation(
            s,
            ("recompute_modules", "scope"),
            (list(modules), scope_value(s)),
            "recomputing the MoE layer would re-run the graphed router with "
            "--cuda-graph-impl transformer_engine",
            f"{s.set_text('moe_layer_recompute', False)} (it recomputes moe) and leave 'moe' "
            "out of recompute_modules, or drop moe_router from the scope"
            if s.moe_layer_recompute
            else "drop 'moe' from recompute_modules, or moe_router from the scope",
            (MCORE, "moe recompute is not supported with moe_router CUDA graph"),
        )
    whole = s.full_iteration
    if s.attention_dropout != 0.0 and "core_attn" in modules and (whole or "attn" in scope):
        yield violation(
            s,
            ("attention_dropout", "recompute_modules", "scope"),
            (s.attention_dropout, list(modules), scope_value(s)),
            "recomputed attention inside a graph would replay its dropout mask",
            f"set {s.field('attention_dropout')}=0.0, or drop core_attn from "
            f"{s.field('recompute_modules')}",
            (MCORE, "attention dropout is not supported with graphed attention recomputation"),
        )
    if s.hidden_dropout != 0.0 and (
        ("mlp" in modules and (whole or "mlp" in scope))
        or ("moe" in modules and (whole or "moe" in scope))
    ):
        yield violation(
            s,
            ("hidden_dropout", "recompute_modules", "scope"),
            (s.hidden_dropout, list(modules), scope_value(s)),
            "recomputed MLP/MoE inside a graph would replay its dropout mask",
            f"set {s.field('hidden_dropout')}=0.0, or drop mlp/moe from "
            f"{s.field('recompute_modules')}",
            (MCORE, "hidden dropout is not supported with graphed MLP/MoE recomputation"),
        )
    if s.moe_input_jitter_eps is not None and "moe" in modules and (whole or "moe" in scope):
        yield violation(
            s,
            ("moe_input_jitter_eps", "recompute_modules", "scope"),
            (s.moe_input_jitter_eps, list(modules), scope_value(s)),
            "recomputed MoE inside a graph would replay its input jitter",
            f"unset {s.field('moe_input_jitter_eps')}, or drop moe from "
            f"{s.field('recompute_modules')}",
            (MCORE, "moe_input_jitter_eps is not supported with graphed moe recomputation"),
        )


# -- precision --------------------------------------------------------------------------------

TE_SAMPLE_DTYPE_PROBLEM = (
    "megatron-core captures each layer's Transformer Engine graph with bfloat16 sample inputs "
    "(TransformerLayer.get_layer_static_inputs), so layers whose parameters are {dtype} fail "
    'at the capture step, after the warm-up ("expected scalar type BFloat16 but found '
    '...", or Transformer Engine\'s "Data types for parameters must match")'
)
TE_SAMPLE_DTYPE_FIX = (
    "train in bf16 ({bf16}), or use {impl}=local with {scope}=full_iteration (captured from "
    "the run's own tensors, in any precision)"
)


@rule
def _te_graphs_need_bf16_layers(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    dtype = s.layer_dtype
    if (
        s.impl != "transformer_engine"
        or dtype == "bf16"
        or not environment.te_layers_need_bf16()  # (it takes the config's dtype)
    ):
        return
    if dtype is None:
        if s.from_command_line and s.mixed_precision is None and s.bf16 is None:
            yield Note(
                # (worded for any argparse host too: at run time it is said where the
                # command line has no precision flag at all, e.g. examples/minimal_loop.py)
                "TE graphs need bf16 layers (megatron-core captures them with bfloat16 sample "
                "inputs), and this command line says no precision (no --bf16 or --fp16): a "
                "Megatron-LM launcher then trains in fp32 and its capture fails (give it "
                "--bf16); the layers' dtypes are checked once the model is built"
            )
        return
    path = s.paths.get("bf16", "")
    if dtype == "fp32" and not s.from_command_line and path == "bf16":
        # a flat config (a TransformerConfig's defaults: bf16 off, fp32) whose host may cast
        # the model itself (model.bfloat16()): the parameters say it at run.model_built()
        return
    # (a command line without --bf16 holds no bf16 field to name: the switch it lacks)
    bf16 = s.set_text("bf16", True) if path or not s.from_command_line else "pass --bf16"
    if "." in path:  # (Megatron-Bridge: the optimizer's bf16 too, which the recipe sets)
        bf16 += ', or mixed_precision="bf16_mixed", which sets the optimizer\'s too'
    if dtype == "fp16":
        names, values = ("impl", "fp16"), ("transformer_engine", True)
        bf16 = f"{bf16}; {s.set_text('fp16', False)}"
    else:
        # (Megatron-LM derives params_dtype from --bf16/--fp16: no flag of its own to name)
        dtype_named = "params_dtype" in s.paths and not s.from_command_line
        names = ("impl", "bf16", "params_dtype") if dtype_named else ("impl", "bf16")
        values = ("transformer_engine", False, dtype)[: len(names)]
    yield violation(
        s,
        names,
        values,
        TE_SAMPLE_DTYPE_PROBLEM.format(dtype=dtype),
        TE_SAMPLE_DTYPE_FIX.format(bf16=bf16, impl=s.field("impl"), scope=s.field("scope")),
    )
