"""Every reference phrase is in our message for the configuration that violates it.

Users paste errors into search engines, so for each constraint our message quotes the
phrase megatron-core, Megatron-LM or Megatron-Bridge raise for it (``source: "phrase"``),
next to our field, value and fix. Where the phrases come from:

* megatron-core 0.16.1 (installed here; checked against its source below):
  ``megatron/core/transformer/transformer_config.py`` (``__post_init__``) and
  ``megatron/core/transformer/cuda_graphs.py`` (``CudaGraphManager``, ``TECudaGraphHelper``);
* megatron-core 0.19.2: ``megatron/core/transformer/transformer_config.py`` (the
  ``cuda_graph_modules`` spellings) and ``megatron/core/transformer/cuda_graph_config.py``;
* Megatron-LM 0.19.2: ``megatron/training/arguments.py`` (``validate_args``);
* Megatron-Bridge: ``src/megatron/bridge/training/config.py``,
  ``src/megatron/bridge/utils/cuda_graph.py``, ``scripts/performance/utils/overrides.py``
  and ``scripts/performance/argument_parser.py``.
"""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace as NS

import pytest

from cudagraph_plugin.config.check import check_config
from cudagraph_plugin.config.errors import (
    BRIDGE,
    MCORE,
    MCORE_16,
    MCORE_19,
    MLM,
    CudaGraphConfigError,
)
from cudagraph_plugin.config.rules import find_violations
from cudagraph_plugin.config.settings import read_settings

MOE = dict(num_moe_experts=8)
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
# (megatron-core takes delayed weight gradients only with expert-parallel overlap, which allows
# TE graphs of attn, moe_router and moe_preprocess only)
WGRAD = dict(
    delay_wgrad_compute=True,
    overlap_moe_expert_parallel_comm=True,
    gradient_accumulation_fusion=True,
    add_bias_linear=False,
)
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def cfg(impl="transformer_engine", scope="attn,mlp", **fields):
    """A flat (TransformerConfig-like) config that is valid unless ``fields`` break it."""
    values = dict(
        cuda_graph_impl=impl,
        cuda_graph_scope=scope,
        use_te_rng_tracker=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return NS(**{**values, **fields})


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform")
SELECTIVE = dict(recompute_granularity="selective")

# (source, phrase, violating config, check_config keyword arguments)
REFERENCES = [
    (MCORE, "Invalid cuda graph implementation", cfg("bogus"), {}),
    (BRIDGE, "Invalid value for cuda_graph_impl", cfg("bogus"), {}),
    (BRIDGE, "Invalid cuda graph scope", cfg(scope="attn,bogus"), {}),
    (MCORE, "full scope is deprecated", cfg(scope="full,attn"), {}),
    (MCORE, "full scope cannot be used with other scopes", cfg(scope="full,attn"), {}),
    (
        MCORE_19,
        "cuda_graph_modules 'full_iteration_inference' is deprecated",
        cfg("local", None, cuda_graph_modules=["full_iteration_inference"]),
        {},
    ),
    (
        MCORE_19,
        "cuda_graph_scope and cuda_graph_modules cannot be set together",
        cfg(scope="attn", cuda_graph_modules=["mlp"]),
        {},
    ),
    (
        MLM,
        "--cuda-graph-scope and --cuda-graph-modules cannot be used together",
        cfg(scope="attn", cuda_graph_modules=["mlp"]),
        {},
    ),
    (
        MCORE,
        "full_iteration cuda graph is not supported for cuda_graph_impl=transformer_engine",
        cfg(scope="full_iteration"),
        {},
    ),
    (
        MCORE_16,
        "To use full iteration cuda graph, please use cuda_graph_impl=local instead of "
        "cuda_graph_impl=transformer_engine",
        cfg(scope="full_iteration"),
        {},
    ),
    (
        BRIDGE,
        "full_iteration CUDA graph scope cannot use cuda_graph_impl=transformer_engine",
        cfg(scope="full_iteration"),
        {},
    ),
    (
        BRIDGE,
        "full_iteration CUDA graph scope cannot be combined with other scopes",
        cfg("local", "full_iteration,attn"),
        {},
    ),
    (
        MCORE_19,
        'cuda_graph_modules must be empty when cuda_graph_impl="full_iteration"',
        cfg("full_iteration", None, cuda_graph_modules=["attn"]),
        {},
    ),
    (
        BRIDGE,
        'cuda_graph_impl="local" only for full-iteration CUDA graphs',
        cfg("local", "attn"),
        {},
    ),
    (
        MCORE,
        "enable_cuda_graph and external_cuda_graph cannot be enabled at the same time",
        cfg("none", None, enable_cuda_graph=True, external_cuda_graph=True),
        {},
    ),
    (
        MCORE,
        "Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl",
        cfg("local", "full_iteration", external_cuda_graph=True),
        {},
    ),
    (
        MCORE,
        "enable_cuda_graph is deprecated, use cuda_graph_impl=local instead",
        cfg("none", None, enable_cuda_graph=True),
        {},
    ),
    (
        MCORE,
        "external_cuda_graph is deprecated, use cuda_graph_impl=transformer_engine instead",
        cfg("none", None, external_cuda_graph=True),
        {},
    ),
    (
        BRIDGE,
        "Offline packing with CUDA graphs requires dataset pad_to_max_length=True",
        cfg(variable_seq_lengths=True),
        {},
    ),
    (
        BRIDGE,
        "check_for_nan_in_loss must be disabled when using full_iteration CUDA graph",
        cfg("local", "full_iteration", check_for_nan_in_loss=True),
        {},
    ),
    (
        MLM,
        "--no-check-for-nan-in-loss-and-grad should be set with "
        "--cuda-graph-impl=full_iteration for training",
        cfg("local", "full_iteration", check_for_nan_in_loss=True),
        {},
    ),
    (MCORE, "CUDA graphs not supported with CPU offloading", cfg(cpu_offloading=True), {}),
    (
        MCORE_16,
        "cuda_graph_scope must not contain both moe and moe_router",
        cfg(scope="moe,moe_router", **MOE, **PAD),
        {},
    ),
    (
        MCORE_19,
        "cuda_graph_modules must not contain both moe and moe_router",
        cfg(scope="moe,moe_router", **MOE, **PAD),
        {},
    ),
    (
        MCORE,
        "moe_preprocess cuda graph is only supported with moe_router cuda graph",
        cfg(scope="attn,moe_preprocess", **MOE),
        {},
    ),
    (MCORE, "moe cuda graph is only supported for MoE", cfg(scope="attn,moe_router"), {}),
    (
        MCORE,
        "mlp cuda graph is only supported for dense layers, but not found in the model",
        cfg(scope="attn,mlp", **MOE),
        {},
    ),
    (
        MCORE,
        "moe cuda graph is only supported with drop-padding MoE",
        cfg(scope="attn,moe", **MOE),
        {},
    ),
    (
        MCORE,
        "moe_preprocess cuda graph is not supported when there are DtoH copies and "
        "synchronizations in the preprocess step",
        cfg(
            scope="moe_router,moe_preprocess",
            moe_token_dispatcher_type="alltoall",
            moe_expert_capacity_factor=1.0,
            moe_permute_fusion=True,
            **MOE,
        ),
        {},
    ),
    (
        "CUDA, at capture",
        "operation not permitted when stream is capturing",
        cfg(scope="moe_router,moe_preprocess", moe_token_dispatcher_type="alltoall", **MOE),
        {},
    ),
    (
        MCORE,
        "CUDA graph scope on moe and mlp is not supported with overlap_moe_expert_parallel_comm",
        cfg(scope="attn,moe", overlap_moe_expert_parallel_comm=True, **MOE, **PAD),
        {},
    ),
    (
        MCORE,
        "full recompute is only supported with full iteration CUDA graph",
        cfg(scope="mlp", **FULL_RECOMPUTE),
        {},
    ),
    (
        MCORE,
        "moe recompute is not supported with moe_router CUDA graph",
        cfg(scope="attn,moe_router", recompute_modules=["moe"], **SELECTIVE, **MOE),
        {},
    ),
    (
        MCORE,
        "attention dropout is not supported with graphed attention recomputation",
        cfg(scope="attn", **{**SELECTIVE, "attention_dropout": 0.1}),
        {},
    ),
    (
        MCORE,
        "hidden dropout is not supported with graphed MLP/MoE recomputation",
        cfg(scope="attn,mlp", recompute_modules=["mlp"], **{**SELECTIVE, "hidden_dropout": 0.1}),
        {},
    ),
    (
        MCORE,
        "moe_input_jitter_eps is not supported with graphed moe recomputation",
        cfg(
            scope="attn,moe",
            recompute_modules=["moe"],
            moe_input_jitter_eps=0.01,
            **SELECTIVE,
            **MOE,
            **PAD,
        ),
        {},
    ),
    (
        MCORE,
        "TE version >= 2.10.0 is required for delay_wgrad_compute with partial cuda graph",
        cfg(scope="moe_router,moe_preprocess", num_moe_experts=8, **WGRAD),
        {"te_version": "2.9.0"},
    ),
    (
        MLM,
        "CUDA graph with delay_wgrad_compute requires TE version >= 2.12.0",
        cfg(scope="attn", **WGRAD),
        {"te_version": "2.11.0"},
    ),
    (
        MLM,
        "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion to be enabled",
        cfg(scope="attn", **{**WGRAD, "gradient_accumulation_fusion": False}),
        {"te_version": "2.12.0"},
    ),
    (
        MLM,
        "CUDA graph with delay_wgrad_compute doesn't support attn bias for now",
        cfg(scope="attn", **{**WGRAD, "add_qkv_bias": True}),
        {"te_version": "2.12.0"},
    ),
    (
        MCORE,
        "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute",
        cfg(scope="attn", **{**WGRAD, "overlap_moe_expert_parallel_comm": False}),
        {"te_version": "2.12.0"},
    ),
    (
        MCORE_19,
        "cuda_graph_modules 'full_iteration' is deprecated",
        cfg("none", None, cuda_graph_modules=["full_iteration"]),
        {},
    ),
    (
        MCORE,
        "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph "
        "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        cfg(),
        {"environ": {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "1"}},
    ),
    (MCORE, "CUDA Graphs are not supported without TE", cfg(), {"te_available": False}),
]
# The TE RNG tracker flags are auto-fixed by a run, so this one is the rules' own verdict.
RNG = (MCORE, "RNG tracker does not support cudagraphs", cfg(use_te_rng_tracker=False))


def _id(entry) -> str:
    return f"{entry[0]}: {entry[1][:60]}"


@pytest.mark.parametrize("entry", REFERENCES, ids=_id)
def test_reference_phrase_is_quoted_in_our_message(entry):
    source, phrase, config, kwargs = entry
    result = check_config(config, **{"environ": {}, **kwargs})
    assert not result.ok, f"{phrase!r}: the configuration was accepted"
    message = str(CudaGraphConfigError(list(result.problems)))
    assert f'{source}: "{phrase}"' in message, message
    (violation,) = [v for v in result.problems if phrase in v.text]
    # ... next to our own field, value and fix
    assert violation.fields and violation.value and violation.fix
    assert violation.problem != phrase


def test_rng_tracker_reference_phrase_is_quoted_by_the_rule():
    source, phrase, config = RNG
    message = str(CudaGraphConfigError(find_violations(read_settings(config))))
    assert f'{source}: "{phrase}"' in message


def test_the_table_has_every_reference_phrase_of_the_rules_once():
    phrases = [(source, phrase) for source, phrase, *_ in REFERENCES] + [RNG[:2]]
    assert len(phrases) == len(set(phrases))
    assert len(phrases) >= 40


def _string_constants(path: pathlib.Path) -> list[str]:
    """Every string literal of a module (implicit concatenations joined, f-string parts)."""
    tree = ast.parse(path.read_text())
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@pytest.mark.parametrize(
    "entry",
    [e for e in [*REFERENCES, RNG] if e[0] in (MCORE, MCORE_16)],
    ids=_id,
)
def test_megatron_core_phrases_are_in_the_installed_megatron_core(entry):
    import megatron.core

    root = pathlib.Path(megatron.core.__file__).parent / "transformer"
    constants = [
        text
        for module in ("transformer_config.py", "cuda_graphs.py")
        for text in _string_constants(root / module)
    ]
    phrase = entry[1]
    assert any(phrase in text for text in constants), phrase
