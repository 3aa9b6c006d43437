"""Every constraint, accepted and rejected; the advice; the documented auto-fixes."""

from __future__ import annotations

import argparse
import copy
import logging
import os
import re
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from packaging.version import Version

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.advice import advice, warmup_warning
from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.config.fixes import apply_autofixes
from cudagraph_plugin.config.rules import evaluate, find_violations, validate
from cudagraph_plugin.config.rules.base import RULES
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.config.vocabulary import SCOPES

DROPLESS = dict(num_moe_experts=8)
DROP_PAD = dict(
    num_moe_experts=8, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
)


def bridge(impl="transformer_engine", scope="attn,mlp", *, nan_loss=False, nan_grad=False, **model):
    """A Megatron-Bridge-style nested config that is valid unless the arguments break it."""
    fields = dict(
        cuda_graph_impl=impl,
        cuda_graph_scope=scope,
        cuda_graph_warmup_steps=3,
        use_te_rng_tracker=True,
        num_moe_experts=None,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    fields.update(model)
    return NS(
        model=NS(**fields),
        rng=NS(te_rng_tracker=True),
        rerun_state_machine=NS(check_for_nan_in_loss=nan_loss),
        ddp=NS(check_for_nan_in_grad=nan_grad),
        train=NS(micro_batch_size=1),
        dataset=NS(sequence_length=4096),
    )


def full_iteration(**model):
    return bridge("local", "full_iteration", **model)


def with_optimizer(config, **fields):
    """``config`` with a Bridge-style ``optimizer`` section (an OptimizerConfig's fields)."""
    config.optimizer = NS(**{"optimizer": "adam", "optimizer_cuda_graph": False, **fields})
    return config


def with_fallback(config, value=True):
    """``config`` with the fallback policy set (a top-level field, as the plugin's own)."""
    config.cuda_graph_fallback_on_slowdown = value
    return config


def with_report(config, path):
    """``config`` with the run report's JSON path set (a top-level field, as the plugin's own)."""
    config.cuda_graph_report_json = path
    return config


def accepted(config):
    violations = find_violations(read_settings(config))
    assert violations == [], "\n".join(v.format() for v in violations)
    validate(read_settings(config))


def rejected(config, *, fields, value, phrase, fix):
    """Assert ``config`` is rejected with a violation naming ``fields`` and ``value``, holding
    MCore's/Bridge's key ``phrase`` and the ``fix``; returns the error."""
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(config))
    err = info.value
    assert isinstance(err, ValueError)
    matching = [v for v in err.violations if phrase in v.text]
    assert len(matching) == 1, str(err)
    violation = matching[0]
    assert violation.fields == tuple(fields), str(err)
    assert violation.value == value, str(err)
    assert fix in violation.fix, str(err)
    message = str(err)
    assert f"{', '.join(fields)} = {value}: " in message
    assert phrase in message
    assert f"fix: {violation.fix}" in message
    return err


def megatron_lm_args(**fields):
    """A Megatron-LM args namespace asking for full_iteration graphs: no batch_p2p_comm
    field there (it passes ``not overlap_p2p_comm``; --no-overlap-p2p-communication stores
    False, the default is True)."""
    values = dict(
        cuda_graph_impl="local",
        cuda_graph_scope=["full_iteration"],
        te_rng_tracker=True,
        check_for_nan_in_loss_and_grad=False,
        attention_dropout=0.1,
        hidden_dropout=0.1,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
        overlap_p2p_comm=True,
    )
    return argparse.Namespace(**{**values, **fields})


# -- every rule is covered, both ways -----------------------------------------------------------

# rule name -> (a config it accepts, a config it rejects); the detailed tests below check the
# messages, this table makes a new rule without tests fail loudly.
RULE_CASES = {
    "_impl_known": (bridge("local", "full_iteration"), bridge("cuda", "attn")),
    "_scope_names_known": (bridge(scope="attn,mlp"), bridge(scope="attn,bogus")),
    "_scope_not_empty": (bridge("none", []), bridge(scope=[])),
    "_full_iteration_only_local": (full_iteration(), bridge(scope="full_iteration")),
    "_full_iteration_alone": (full_iteration(), bridge("local", "full_iteration,attn")),
    "_local_is_full_iteration": (full_iteration(), bridge("local", "attn")),
    "field_values": (bridge(cuda_graph_warmup_steps="0"), bridge(cuda_graph_warmup_steps=-1)),
    "_scope_names_deprecated": (bridge("none", "full"), bridge(scope="full,attn")),
    "_scope_fields_not_both": (
        bridge(scope=None, cuda_graph_modules=["attn"]),
        bridge(scope="attn", cuda_graph_modules=["attn"]),
    ),
    "_legacy_flags": (bridge(enable_cuda_graph=False), bridge(enable_cuda_graph=True)),
    "_te_rng_tracker": (bridge(), bridge(use_te_rng_tracker=False)),
    "_static_shapes": (bridge(variable_seq_lengths=False), bridge(variable_seq_lengths=True)),
    "_nan_loss_check": (full_iteration(), bridge("local", "full_iteration", nan_loss=True)),
    "_cpu_offloading": (bridge("none", [], cpu_offloading=True), bridge(cpu_offloading=True)),
    "_moe_scopes": (
        bridge(scope="attn,moe_router,moe_preprocess", **DROPLESS),
        bridge(scope="attn,moe,moe_router", **DROP_PAD),
    ),
    "_moe_preprocess_needs_fused_permute": (
        bridge(
            scope="attn,moe_router,moe_preprocess",
            num_moe_experts=8,
            moe_token_dispatcher_type="alltoall",
            moe_permute_fusion=True,
        ),
        bridge(
            scope="attn,moe_router,moe_preprocess",
            num_moe_experts=8,
            moe_token_dispatcher_type="alltoall",
        ),
    ),
    "_ep_overlap": (
        bridge(scope="attn,moe_router", overlap_moe_expert_parallel_comm=True, **DROPLESS),
        bridge(scope="attn,moe", overlap_moe_expert_parallel_comm=True, **DROP_PAD),
    ),
    "_full_recompute": (
        full_iteration(recompute_granularity="full", recompute_num_layers=1),
        bridge(scope="mlp", recompute_granularity="full", recompute_num_layers=1),
    ),
    "_selective_recompute": (
        bridge(scope="attn", recompute_granularity="selective", attention_dropout=0.0),
        bridge(scope="attn", recompute_granularity="selective", attention_dropout=0.1),
    ),
    "_recompute_modules_known": (
        bridge(scope="attn", recompute_granularity="selective", recompute_modules=["layernorm"]),
        bridge(scope="attn", recompute_granularity="selective", recompute_modules=["layernrm"]),
    ),
    "_delay_wgrad_needs_ep_overlap": (
        bridge(
            scope="moe_router,moe_preprocess",
            num_moe_experts=8,
            delay_wgrad_compute=True,
            overlap_moe_expert_parallel_comm=True,
        ),
        bridge(scope="moe_router,moe_preprocess", num_moe_experts=8, delay_wgrad_compute=True),
    ),
    "_delay_wgrad": (
        bridge(scope="mlp", delay_wgrad_compute=False),
        bridge(
            scope="attn",
            delay_wgrad_compute=True,
            overlap_moe_expert_parallel_comm=True,
            gradient_accumulation_fusion=False,
        ),
    ),
    "_full_iteration_scope_without_impl": (
        bridge("none", "full_iteration"),  # (0.16's spelling, on 0.16: graphs off)
        bridge("none", None, cuda_graph_modules=["full_iteration"]),  # (0.18+: on)
    ),
    "_nan_grad_check": (full_iteration(), bridge("local", "full_iteration", nan_grad=True)),
    "_history_checks": (
        megatron_lm_args(pipeline_model_parallel_size=1),
        megatron_lm_args(pipeline_model_parallel_size=1, check_for_spiky_loss=True),
    ),
    "_full_iteration_warmup": (
        bridge(scope="attn", cuda_graph_warmup_steps=0),
        full_iteration(cuda_graph_warmup_steps=0),
    ),
    "_fp16_full_iteration": (full_iteration(bf16=True), full_iteration(fp16=True)),
    "_te_graphs_need_bf16_layers": (bridge(bf16=False, params_dtype="bf16"), bridge(bf16=False)),
    "_graphs_only_settings": (
        with_fallback(full_iteration()),
        with_fallback(bridge()),  # TE scopes: no full-iteration graph
    ),
    "_pipeline_full_iteration": (
        full_iteration(pipeline_model_parallel_size=2, batch_p2p_comm=False),
        full_iteration(pipeline_model_parallel_size=2),
    ),
    "_buckets": (
        full_iteration(cuda_graph_buckets="256,512"),
        bridge(cuda_graph_buckets="256,512"),  # TE scopes: buckets are full-iteration graphs
    ),
    "_report_json_writable": (
        with_report(bridge(), os.path.join(tempfile.gettempdir(), "no-such-dir", "r.json")),
        with_report(bridge(), tempfile.gettempdir()),  # a directory
    ),
    "_optimizer_graph": (
        with_optimizer(bridge(), optimizer_cuda_graph=False),
        with_optimizer(bridge(), optimizer_cuda_graph=True),
    ),
}


def test_rule_table_covers_every_rule():
    assert set(RULE_CASES) == {rule.__name__ for rule in RULES}


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_each_rule_accepts_and_rejects(rule):
    good, bad = RULE_CASES[rule.__name__]
    env = Environment()
    assert list(rule(read_settings(good), env)) == []
    assert find_violations(read_settings(good)) == []
    assert list(rule(read_settings(bad), env)) != []
    with pytest.raises(CudaGraphConfigError):
        validate(read_settings(bad))


def test_error_is_a_value_error_listing_violations():
    assert issubclass(CudaGraphConfigError, ValueError)
    err = rejected(
        bridge(scope="attn,bogus"),
        fields=["model.cuda_graph_scope"],
        value="'attn,bogus'",
        phrase="unknown CUDA graph scope(s) 'bogus'",
        fix="use names from full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba",
    )
    assert str(err).startswith("1 problem(s) with the CUDA graph configuration:\n  1. ")


# -- impl and scope names -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        bridge("none", []),
        bridge("none", "full"),
        bridge("local", "full_iteration"),
        bridge("transformer_engine", "attn"),
        bridge("transformer_engine", ["attn", "mlp"]),
        bridge("full_iteration", []),  # megatron-core 0.18+ spelling
    ],
)
def test_known_impls_accepted(config):
    accepted(config)


def test_unknown_impl_rejected():
    rejected(
        bridge("cuda", "attn"),
        fields=["model.cuda_graph_impl"],
        value="'cuda'",
        phrase="unknown CUDA graph implementation 'cuda' (megatron-core: \"Invalid cuda graph "
        'implementation"; Megatron-Bridge: "Invalid value for cuda_graph_impl")',
        fix="use one of none, local, transformer_engine",
    )


def test_misspelled_impl_gets_a_suggestion():
    rejected(
        bridge("transformer_engin", "attn"),
        fields=["model.cuda_graph_impl"],
        value="'transformer_engin'",
        phrase="unknown CUDA graph implementation",
        fix="(did you mean transformer_engine?)",
    )


def test_a_plain_enum_member_for_the_impl_is_told_to_give_the_string():
    """(user trial, 2026-12-05: ``Impl.local`` was refused with "use one of none, local,
    ...", which it seemed to be; megatron-core compares the string.)"""
    import enum

    class Impl(enum.Enum):
        local = "local"

    rejected(
        bridge(Impl.local, "full_iteration"),
        fields=["model.cuda_graph_impl"],
        value="<Impl.local: 'local'>",
        phrase="unknown CUDA graph implementation",
        fix="(give the string 'local': an enum member is not the string itself)",
    )


def test_unknown_impl_named_as_flag_on_a_namespace():
    args = argparse.Namespace(cuda_graph_impl="te", cuda_graph_scope="attn", te_rng_tracker=True)
    rejected(
        args,
        fields=["--cuda-graph-impl"],
        value="'te'",
        phrase="Invalid cuda graph implementation",
        fix="use one of none, local, transformer_engine",
    )


@pytest.mark.parametrize("scope", ["bogus", "attn,bogus", ["attn", "ATTN"]])
def test_unknown_scope_rejected(scope):
    config = bridge(scope=scope)
    names = [n.strip() for n in (scope.split(",") if isinstance(scope, str) else scope)]
    unknown = [n for n in names if n not in SCOPES]
    rejected(
        config,
        fields=["model.cuda_graph_scope"],
        value=repr(",".join(names)),
        phrase=f"unknown CUDA graph scope(s) {', '.join(map(repr, unknown))}",
        fix="(comma-separated)",
    )


def test_unknown_scope_named_as_flag_on_a_namespace():
    args = argparse.Namespace(cuda_graph_impl="transformer_engine", cuda_graph_scope="atn")
    err = rejected(
        args,
        fields=["--cuda-graph-scope"],
        value="'atn'",
        phrase="unknown CUDA graph scope(s) 'atn'",
        fix="use names from",
    )
    assert "model." not in str(err)


def test_duplicated_scope_is_used_once_with_a_warning():
    # megatron-core accepts "attn,attn": warn and de-duplicate rather than refuse (issue 22).
    settings = read_settings(bridge(scope="attn, mlp, attn, mlp"))
    assert settings.scope == ("attn", "mlp")
    assert settings.duplicated_scopes == ("attn", "mlp")
    assert find_violations(settings) == []
    [note] = [n for n in advice(settings, environ={}) if "more than once" in n]
    assert note == (
        "model.cuda_graph_scope lists attn, mlp more than once (megatron-core accepts that); "
        "using each once: attn,mlp"
    )
    assert not any(
        "more than once" in n for n in advice(read_settings(bridge(scope="attn,mlp")), environ={})
    )


@pytest.mark.parametrize("scope", [[], "", "full"])
def test_empty_scope_rejected_for_te(scope):
    config = bridge(scope=scope)
    rejected(
        config,
        fields=["model.cuda_graph_impl", "model.cuda_graph_scope"],
        value="('transformer_engine', '(empty)')",
        phrase="CUDA graphs are on but no scope is given",
        fix="name the scope explicitly, e.g. attn, or attn,mlp for the most of a layer",
    )


def test_empty_scope_given_as_none_is_named_by_its_path():
    # model.cuda_graph_scope exists (holding None): the message must name it as the user
    # knows it, not as a bare "cuda_graph_scope".
    rejected(
        bridge(scope=None),
        fields=["model.cuda_graph_impl", "model.cuda_graph_scope"],
        value="('transformer_engine', '(empty)')",
        phrase="CUDA graphs are on but no scope is given",
        fix="name the scope explicitly",
    )


def test_empty_scope_rejected_for_local_suggests_full_iteration():
    rejected(
        bridge("local", []),
        fields=["model.cuda_graph_impl", "model.cuda_graph_scope"],
        value="('local', '(empty)')",
        phrase="no scope is given",
        fix="e.g. full_iteration",
    )


def test_full_iteration_with_te_rejected():
    rejected(
        bridge("transformer_engine", "full_iteration"),
        fields=["model.cuda_graph_impl", "model.cuda_graph_scope"],
        value="('transformer_engine', 'full_iteration')",
        phrase="full_iteration cuda graph is not supported for cuda_graph_impl=transformer_engine",
        fix="use cuda_graph_impl=local with scope full_iteration",
    )


def test_full_iteration_mixed_rejected():
    err = rejected(
        bridge("local", "full_iteration,attn,mlp"),
        fields=["model.cuda_graph_scope"],
        value="'full_iteration,attn,mlp'",
        phrase="full_iteration cannot be mixed with other scopes (attn, mlp)",
        fix="use scope full_iteration alone",
    )
    # The per-layer names under impl=local are a second, separate problem.
    assert len(err.violations) == 2


@pytest.mark.parametrize("modules", [["attn"], ["full_iteration", "attn"]])
def test_full_iteration_mixed_new_generation_spelling_rejected_in_its_words(modules):
    """One problem, in the fields and values the user wrote: it was two, both quoting the
    plugin's reading of them (impl 'local', scope 'full_iteration,attn'), with a fix in
    megatron-core 0.16's spelling (a user review, 2026-12-05)."""
    err = rejected(
        bridge("full_iteration", None, cuda_graph_modules=modules),
        fields=["model.cuda_graph_impl", "model.cuda_graph_modules"],
        value="('full_iteration', 'attn')",
        phrase="model.cuda_graph_impl=full_iteration captures the whole forward and backward "
        "and takes no modules (attn)",
        fix="drop model.cuda_graph_modules, or use model.cuda_graph_impl=transformer_engine",
    )
    assert len(err.violations) == 1, str(err)
    assert "'local'" not in str(err)


def test_local_with_per_layer_scopes_rejected():
    rejected(
        bridge("local", "attn,mlp"),
        fields=["model.cuda_graph_impl", "model.cuda_graph_scope"],
        value="('local', 'attn,mlp')",
        phrase="impl local with per-layer scopes (attn, mlp)",
        fix="use cuda_graph_impl=transformer_engine for per-layer scopes",
    )


# -- warm-up steps ------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, 1, 3, 100, None])
def test_warmup_steps_accepted(steps):
    accepted(bridge(cuda_graph_warmup_steps=steps))


@pytest.mark.parametrize(
    "steps, shown",
    [
        (-1, "-1"),
        (True, "True"),
        (False, "False"),
        ("three", "'three'"),
        ("-2", "'-2'"),
        ("2.5", "'2.5'"),
        (2.0, "2.0"),
    ],
)
def test_bad_warmup_steps_rejected(steps, shown):
    rejected(
        bridge(cuda_graph_warmup_steps=steps),
        fields=["model.cuda_graph_warmup_steps"],
        value=shown,
        phrase="cuda_graph_warmup_steps must be a non-negative integer",
        fix="megatron-core's default: 3",
    )


# -- legacy flags -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, new", [("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")]
)
def test_legacy_flag_alone_rejected(flag, new):
    rejected(
        bridge("none", [], **{flag: True}),
        fields=[f"model.{flag}"],
        value="True",
        phrase=f"{flag} is deprecated",
        fix=f"drop {flag} and set cuda_graph_impl={new} with an explicit cuda_graph_scope",
    )


def test_legacy_flags_both_rejected():
    rejected(
        bridge("none", [], enable_cuda_graph=True, external_cuda_graph=True),
        fields=["model.enable_cuda_graph", "model.external_cuda_graph"],
        value="(True, True)",
        phrase="enable_cuda_graph and external_cuda_graph cannot be enabled at the same time",
        fix="drop both deprecated flags and set cuda_graph_impl",
    )


@pytest.mark.parametrize(
    "flag, impl", [("enable_cuda_graph", "transformer_engine"), ("external_cuda_graph", "local")]
)
def test_legacy_flag_with_impl_rejected(flag, impl):
    scope = "full_iteration" if impl == "local" else "attn,mlp"
    rejected(
        bridge(impl, scope, **{flag: True}),
        fields=[f"model.{flag}", "model.cuda_graph_impl"],
        value=f"(True, {impl!r})",
        phrase="Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl",
        fix="drop the deprecated flag",
    )


def test_legacy_flags_false_accepted():
    accepted(bridge(enable_cuda_graph=False, external_cuda_graph=False))


# -- TE RNG tracker -----------------------------------------------------------------------------


def test_te_rng_tracker_model_flag_false_rejected():
    config = bridge()
    config.model.use_te_rng_tracker = False
    rejected(
        config,
        fields=["model.use_te_rng_tracker"],
        value="False",
        phrase="CUDA graphs require the TE RNG tracker",
        fix="set model.use_te_rng_tracker=True",
    )


def test_te_rng_tracker_rng_flag_false_rejected():
    config = bridge()
    config.rng.te_rng_tracker = False
    rejected(
        config,
        fields=["rng.te_rng_tracker"],
        value="False",
        phrase="CUDA graphs require the TE RNG tracker",
        fix="set rng.te_rng_tracker=True",
    )


def test_te_rng_tracker_both_false_two_violations():
    config = bridge()
    config.model.use_te_rng_tracker = False
    config.rng.te_rng_tracker = False
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(config))
    assert [v.fields for v in info.value.violations] == [
        ("model.use_te_rng_tracker",),
        ("rng.te_rng_tracker",),
    ]


def test_te_rng_tracker_on_a_megatron_lm_namespace_names_the_flag():
    args = argparse.Namespace(
        cuda_graph_impl="transformer_engine", cuda_graph_scope="attn", te_rng_tracker=False
    )
    rejected(
        args,
        fields=["--te-rng-tracker"],
        value="False",
        phrase="require the TE RNG tracker",
        fix="pass --te-rng-tracker",
    )


def test_te_rng_tracker_off_is_fine_when_graphs_are_off_or_flags_absent():
    config = bridge("none", [])
    config.model.use_te_rng_tracker = False
    config.rng.te_rng_tracker = False
    accepted(config)
    accepted(NS(cuda_graph_impl="transformer_engine", cuda_graph_scope="attn"))


# -- static shapes, NaN checks, CPU offloading --------------------------------------------------


def test_variable_seq_lengths_rejected():
    rejected(
        bridge(variable_seq_lengths=True),
        fields=["model.variable_seq_lengths"],
        value="True",
        phrase="CUDA graphs need static tensor shapes; variable-length sequences do not work",
        fix="pad packed sequences to a fixed width and set model.variable_seq_lengths=False; "
        "for lengths that change from step to step, pad each step to a bucket "
        "(cuda_graph_buckets: one full-iteration graph per length)",
    )
    # with buckets the fix says they are the way (user trial, 2026-12-05)
    [problem] = find_violations(
        read_settings(full_iteration(variable_seq_lengths=True, cuda_graph_buckets="256,512"))
    )
    assert problem.fix == (
        "set model.variable_seq_lengths=False: with model.cuda_graph_buckets each step is "
        "padded to a bucket (pad_step, run.step_padded), which serves lengths that change"
    )


def test_variable_seq_lengths_fine_without_graphs():
    accepted(bridge("none", [], variable_seq_lengths=True))


def test_nan_loss_check_with_full_iteration_rejected():
    rejected(
        bridge("local", "full_iteration", nan_loss=True),
        fields=["rerun_state_machine.check_for_nan_in_loss"],
        value="True",
        phrase="full_iteration CUDA graph requires check_for_nan_in_loss=False",
        fix="set rerun_state_machine.check_for_nan_in_loss=False",
    )


def test_nan_loss_check_with_full_iteration_on_megatron_lm_args():
    args = argparse.Namespace(
        cuda_graph_impl="local",
        cuda_graph_scope="full_iteration",
        te_rng_tracker=True,
        check_for_nan_in_loss_and_grad=True,
    )
    rejected(
        args,
        fields=["check_for_nan_in_loss_and_grad (--no-check-for-nan-in-loss-and-grad)"],
        value="True",
        phrase="requires check_for_nan_in_loss=False",
        fix="pass --no-check-for-nan-in-loss-and-grad",
    )


def test_nan_loss_check_fine_with_te_scopes_or_off():
    accepted(bridge(nan_loss=True))
    accepted(full_iteration())


def test_cpu_offloading_rejected():
    rejected(
        full_iteration(cpu_offloading=True),
        fields=["model.cpu_offloading"],
        value="True",
        phrase="CUDA graphs not supported with CPU offloading",
        fix="set model.cpu_offloading=False, or turn CUDA graphs off",
    )


def test_cpu_offloading_fine_without_graphs():
    accepted(bridge("none", [], cpu_offloading=True))


# -- MoE ----------------------------------------------------------------------------------------


def test_moe_and_moe_router_rejected():
    rejected(
        bridge(scope="moe,moe_router", **DROP_PAD),
        fields=["model.cuda_graph_scope"],
        value="'moe,moe_router'",
        phrase="cuda_graph_scope must not contain both moe and moe_router",
        fix="use moe for drop-and-pad MoE, or moe_router[,moe_preprocess] for dropless MoE",
    )


def test_moe_preprocess_without_moe_router_rejected():
    rejected(
        bridge(scope="attn,moe_preprocess", **DROPLESS),
        fields=["model.cuda_graph_scope"],
        value="'attn,moe_preprocess'",
        phrase="moe_preprocess cuda graph is only supported with moe_router cuda graph",
        fix="add moe_router to the scope",
    )


@pytest.mark.parametrize("experts", [None, 0, 1])
@pytest.mark.parametrize("scope", ["attn,moe_router", "moe"])
def test_moe_scopes_on_dense_model_rejected(experts, scope):
    rejected(
        bridge(scope=scope, num_moe_experts=experts),
        fields=["model.cuda_graph_scope", "model.num_moe_experts"],
        value=repr((scope, experts)),
        phrase="moe cuda graph is only supported for MoE",
        fix="drop the MoE scopes for a dense model",
    )


@pytest.mark.parametrize("freq", [1, [1, 1, 1, 1], (1, 1)])
def test_mlp_on_all_moe_layers_rejected(freq):
    rejected(
        bridge(scope="attn,mlp,moe_router", moe_layer_freq=freq, **DROPLESS),
        fields=["model.cuda_graph_scope", "model.moe_layer_freq"],
        value=repr(("attn,mlp,moe_router", freq)),
        phrase="mlp cuda graph is only supported for dense layers, but not found in the model",
        fix="drop mlp from the scope",
    )


@pytest.mark.parametrize("freq", [[0, 1, 1, 1], [1, 0]])
def test_mlp_with_some_dense_layers_accepted(freq):
    accepted(bridge(scope="attn,mlp,moe_router", moe_layer_freq=freq, **DROPLESS))


@pytest.mark.parametrize(
    "capacity, pad",
    [(None, False), (None, True), (1.0, False)],
)
def test_moe_scope_on_dropless_moe_rejected(capacity, pad):
    rejected(
        bridge(
            scope="attn,moe",
            num_moe_experts=8,
            moe_expert_capacity_factor=capacity,
            moe_pad_expert_input_to_capacity=pad,
        ),
        fields=[
            "model.cuda_graph_scope",
            "model.moe_expert_capacity_factor",
            "model.moe_pad_expert_input_to_capacity",
        ],
        value=repr(("attn,moe", capacity, pad)),
        phrase="moe cuda graph is only supported with drop-padding MoE",
        fix="use moe_router,moe_preprocess for dropless MoE",
    )


def test_moe_scope_on_drop_and_pad_moe_accepted():
    accepted(bridge(scope="attn,moe", **DROP_PAD))


def test_dropless_moe_dense_parts_accepted():
    accepted(bridge(scope="attn,moe_router,moe_preprocess", **DROPLESS))
    accepted(bridge(scope="moe_router", **DROPLESS))


@pytest.mark.parametrize(
    "extra",
    [dict(moe_expert_capacity_factor=1.0), dict(moe_router_padding_for_fp8=True)],
    ids=["capacity-factor", "router-padding-for-fp8"],
)
def test_moe_preprocess_with_dtoh_syncs_rejected(extra):
    rejected(
        bridge(
            scope="attn,moe_router,moe_preprocess",
            num_moe_experts=8,
            moe_token_dispatcher_type="alltoall",
            **extra,
        ),
        fields=["model.cuda_graph_scope", "model.moe_token_dispatcher_type"],
        value="('attn,moe_router,moe_preprocess', 'alltoall')",
        phrase="moe_preprocess cuda graph is not supported when there are DtoH copies and "
        "synchronizations in the preprocess step",
        fix="drop moe_preprocess from the scope",
    )


@pytest.mark.parametrize(
    "extra",
    [
        dict(moe_token_dispatcher_type="alltoall", moe_permute_fusion=True),
        dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0),
        dict(
            moe_token_dispatcher_type="alltoall",
            moe_expert_capacity_factor=1.0,
            moe_pad_expert_input_to_capacity=True,
        ),
    ],
    ids=["alltoall-no-capacity", "allgather-capacity", "alltoall-padded"],
)
def test_moe_preprocess_without_dtoh_syncs_accepted(extra):
    accepted(bridge(scope="attn,moe_router,moe_preprocess", num_moe_experts=8, **extra))


def test_moe_preprocess_with_unfused_alltoall_permutation_rejected():
    rejected(
        bridge(
            scope="attn,moe_router,moe_preprocess",
            num_moe_experts=8,
            moe_token_dispatcher_type="alltoall",
        ),
        fields=["model.cuda_graph_scope", "moe_permute_fusion"],
        value="('attn,moe_router,moe_preprocess', False)",
        phrase="needs the fused permutation",
        fix="set moe_permute_fusion=True",
    )


def test_moe_rules_ignored_when_graphs_are_off():
    accepted(bridge("none", [], num_moe_experts=None))
    config = bridge("none", [])
    config.model.cuda_graph_scope = []
    accepted(config)


@pytest.mark.parametrize(
    "impl, scope, moe",
    [
        ("transformer_engine", "attn,moe", DROP_PAD),
        ("transformer_engine", "attn,mlp,moe_router", dict(DROPLESS, moe_layer_freq=[0, 1])),
        ("local", "full_iteration", DROPLESS),
    ],
)
def test_ep_overlap_rejected(impl, scope, moe):
    rejected(
        bridge(impl, scope, overlap_moe_expert_parallel_comm=True, **moe),
        fields=[
            "model.overlap_moe_expert_parallel_comm",
            "model.cuda_graph_impl",
            "model.cuda_graph_scope",
        ],
        value=repr((True, impl, scope)),
        phrase="CUDA graph scope on moe and mlp is not supported with "
        "overlap_moe_expert_parallel_comm",
        fix="use cuda_graph_impl=transformer_engine with attn/moe_router/moe_preprocess",
    )


def test_ep_overlap_with_dense_te_scopes_accepted():
    accepted(
        bridge(
            scope="attn,moe_router,moe_preprocess",
            overlap_moe_expert_parallel_comm=True,
            moe_token_dispatcher_type="alltoall",
            moe_permute_fusion=True,
            **DROPLESS,
        )
    )
    accepted(bridge("none", [], overlap_moe_expert_parallel_comm=True, **DROPLESS))


# -- recompute ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "granularity, layers",
    [("full", 1), ("full", None)],
    ids=["full", "full-no-layers"],
)
def test_full_recompute_with_te_scopes_rejected(granularity, layers):
    rejected(
        bridge(
            scope="mlp",
            recompute_granularity=granularity,
            recompute_num_layers=layers,
            recompute_method="uniform",
        ),
        fields=[
            "model.recompute_granularity",
            "model.recompute_num_layers",
            "model.cuda_graph_scope",
        ],
        value=repr((granularity, layers, "mlp")),
        phrase="full recompute is only supported with full iteration CUDA graph",
        fix="use selective recompute (recompute_granularity=selective), turn CUDA graphs off, "
        "or use cuda_graph_impl=local with scope full_iteration",
    )


def test_full_recompute_with_full_iteration_accepted():
    accepted(
        full_iteration(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    )


def test_recompute_num_layers_without_granularity_is_ignored_like_megatron_core():
    accepted(bridge(scope="attn,mlp", recompute_granularity=None, recompute_num_layers=2))


def test_full_recompute_without_graphs_accepted():
    accepted(bridge("none", [], recompute_granularity="full", recompute_num_layers=1))


def test_selective_recompute_with_te_scopes_accepted():
    accepted(bridge(scope="attn,mlp", recompute_granularity="selective", recompute_num_layers=2))
    accepted(
        bridge(
            scope="attn,mlp",
            recompute_granularity="selective",
            recompute_modules=["core_attn", "layernorm"],
        )
    )


def test_moe_recompute_with_moe_router_rejected():
    rejected(
        bridge(
            scope="attn,moe_router",
            recompute_granularity="selective",
            recompute_modules=["moe"],
            **DROPLESS,
        ),
        fields=["model.recompute_modules", "model.cuda_graph_scope"],
        value="(['moe'], 'attn,moe_router')",
        phrase="moe recompute is not supported with moe_router CUDA graph",
        fix="drop 'moe' from recompute_modules, or moe_router from the scope",
    )


def test_moe_recompute_without_moe_router_or_other_modules_accepted():
    accepted(
        bridge(
            scope="attn", recompute_granularity="selective", recompute_modules=["moe"], **DROPLESS
        )
    )
    accepted(
        bridge(
            scope="attn,moe_router",
            recompute_granularity="selective",
            recompute_modules=["moe_act"],
            **DROPLESS,
        )
    )


@pytest.mark.parametrize("modules", [None, ["core_attn"], ["core_attn", "mlp"]])
def test_attention_dropout_with_graphed_attention_recompute_rejected(modules):
    shown = ["core_attn"] if modules is None else modules
    rejected(
        bridge(
            scope="attn",
            recompute_granularity="selective",
            recompute_modules=modules,
            attention_dropout=0.1,
        ),
        fields=["model.attention_dropout", "model.recompute_modules", "model.cuda_graph_scope"],
        value=repr((0.1, shown, "attn")),
        phrase="attention dropout is not supported with graphed attention recomputation",
        fix="set model.attention_dropout=0.0, or drop core_attn from model.recompute_modules",
    )


def test_attention_dropout_with_full_iteration_selective_recompute_rejected():
    rejected(
        full_iteration(recompute_granularity="selective", attention_dropout=0.1),
        # recompute_modules is not in the config: shown by its plain name, MCore's default.
        fields=["model.attention_dropout", "recompute_modules", "model.cuda_graph_scope"],
        value="(0.1, ['core_attn'], 'full_iteration')",
        phrase="attention dropout is not supported with graphed attention recomputation",
        fix="set model.attention_dropout=0.0",
    )


@pytest.mark.parametrize(
    "changes",
    [
        dict(scope="mlp"),  # attention is not graphed
        dict(attention_dropout=0.0),
        dict(recompute_modules=["layernorm"]),
        dict(recompute_granularity=None),
    ],
)
def test_attention_dropout_accepted_when_not_graphed_with_recompute(changes):
    kwargs = dict(
        scope="attn",
        recompute_granularity="selective",
        recompute_modules=None,
        attention_dropout=0.1,
    )
    kwargs.update(changes)
    accepted(bridge(**kwargs))


@pytest.mark.parametrize(
    "scope, modules, moe",
    [
        ("attn,mlp", ["mlp"], {}),
        ("attn,moe", ["moe"], DROP_PAD),
        ("full_iteration", ["mlp"], {}),
    ],
)
def test_hidden_dropout_with_graphed_mlp_or_moe_recompute_rejected(scope, modules, moe):
    impl = "local" if scope == "full_iteration" else "transformer_engine"
    rejected(
        bridge(
            impl,
            scope,
            recompute_granularity="selective",
            recompute_modules=modules,
            hidden_dropout=0.1,
            **moe,
        ),
        fields=["model.hidden_dropout", "model.recompute_modules", "model.cuda_graph_scope"],
        value=repr((0.1, modules, scope)),
        phrase="hidden dropout is not supported with graphed MLP/MoE recomputation",
        fix="set model.hidden_dropout=0.0, or drop mlp/moe from model.recompute_modules",
    )


@pytest.mark.parametrize(
    "scope, modules, dropout",
    [("attn", ["mlp"], 0.1), ("attn,mlp", ["mlp"], 0.0), ("attn,mlp", ["core_attn"], 0.1)],
)
def test_hidden_dropout_accepted_when_not_graphed_with_recompute(scope, modules, dropout):
    accepted(
        bridge(
            scope=scope,
            recompute_granularity="selective",
            recompute_modules=modules,
            hidden_dropout=dropout,
        )
    )


def test_moe_input_jitter_with_graphed_moe_recompute_rejected():
    rejected(
        bridge(
            scope="attn,moe",
            recompute_granularity="selective",
            recompute_modules=["moe"],
            moe_input_jitter_eps=0.01,
            **DROP_PAD,
        ),
        fields=[
            "model.moe_input_jitter_eps",
            "model.recompute_modules",
            "model.cuda_graph_scope",
        ],
        value="(0.01, ['moe'], 'attn,moe')",
        phrase="moe_input_jitter_eps is not supported with graphed moe recomputation",
        fix="unset model.moe_input_jitter_eps, or drop moe from model.recompute_modules",
    )


def test_moe_input_jitter_accepted_without_graphed_moe_recompute():
    common = dict(recompute_granularity="selective", recompute_modules=["moe"], **DROP_PAD)
    accepted(bridge(scope="attn,moe", moe_input_jitter_eps=None, **common))
    accepted(bridge(scope="attn", moe_input_jitter_eps=0.01, **common))


# -- delayed weight gradients -----------------------------------------------------------------


@pytest.fixture
def te(monkeypatch):
    """Set the Transformer Engine version validation sees (None: not installed)."""

    def set_version(version):
        monkeypatch.setattr(
            environment,
            "installed_te_version",
            lambda: None if version is None else Version(version),
        )

    return set_version


def wgrad(scope="attn", **model):
    """Delayed weight gradients as megatron-core takes them: with expert-parallel overlap
    (which allows TE graphs of attn, moe_router and moe_preprocess only)."""
    fields = dict(
        delay_wgrad_compute=True,
        overlap_moe_expert_parallel_comm=True,
        gradient_accumulation_fusion=True,
        add_bias_linear=False,
    )
    fields.update(model)
    return bridge(scope=scope, **fields)


SHARED = dict(DROPLESS, moe_shared_expert_intermediate_size=512)


@pytest.mark.parametrize("version, shown", [("2.11.0", "2.11.0"), ("2.10.0", "2.10.0")])
def test_delay_wgrad_with_attn_needs_te_2_12(te, version, shown):
    te(version)
    err = rejected(
        wgrad(),
        fields=["model.delay_wgrad_compute", "model.cuda_graph_scope"],
        value="(True, 'attn')",
        phrase="delay_wgrad_compute with attn (or moe_router with shared experts) in the CUDA "
        "graph scope requires Transformer Engine >= 2.12.0 (installed: " + shown + ")",
        fix="or set model.delay_wgrad_compute=False",
    )
    assert "gradient_accumulation_fusion" not in err.violations[0].problem


def test_delay_wgrad_with_attn_accepted_on_te_2_12(te):
    te("2.12.0")
    accepted(wgrad())
    te("2.13.1")
    accepted(wgrad())


def test_delay_wgrad_with_attn_needs_gradient_accumulation_fusion(te):
    te("2.12.0")
    err = rejected(
        wgrad(gradient_accumulation_fusion=False),
        fields=["model.delay_wgrad_compute", "model.cuda_graph_scope"],
        value="(True, 'attn')",
        phrase="requires gradient_accumulation_fusion=True",
        fix="meet those requirements",
    )
    assert "Transformer Engine >=" not in str(err)


@pytest.mark.parametrize("bias", ["add_qkv_bias", "add_bias_linear"])
def test_delay_wgrad_with_attn_needs_no_attention_bias(te, bias):
    te("2.12.0")
    rejected(
        wgrad(**{bias: True}),
        fields=["model.delay_wgrad_compute", "model.cuda_graph_scope"],
        value="(True, 'attn')",
        phrase="requires no attention bias (add_qkv_bias=False, add_bias_linear=False)",
        fix="drop attn/moe_router from the scope",
    )


def test_delay_wgrad_all_requirements_in_one_violation(te):
    te("2.11.0")
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(wgrad(gradient_accumulation_fusion=False, add_qkv_bias=True)))
    (violation,) = info.value.violations
    assert violation.problem.count("; ") == 2
    assert "Transformer Engine >= 2.12.0 (installed: 2.11.0)" in violation.problem
    assert "gradient_accumulation_fusion=True" in violation.problem
    assert "no attention bias" in violation.problem


def test_delay_wgrad_with_moe_router_and_shared_experts_needs_te_2_12(te):
    te("2.11.0")
    rejected(
        wgrad("moe_router,moe_preprocess", **SHARED),
        fields=["model.delay_wgrad_compute", "model.cuda_graph_scope"],
        value="(True, 'moe_router,moe_preprocess')",
        phrase="requires Transformer Engine >= 2.12.0 (installed: 2.11.0)",
        fix="set model.delay_wgrad_compute=False",
    )
    te("2.12.0")
    accepted(wgrad("moe_router,moe_preprocess", **SHARED))


def test_delay_wgrad_with_moe_router_and_shared_experts_allows_linear_bias(te):
    # Megatron-LM (arguments.py, 0.19) asks for no attention bias only when attn is in the
    # scope: an attention bias does not matter when attention is not graphed.
    te("2.12.0")
    accepted(wgrad("moe_router,moe_preprocess", add_bias_linear=True, **SHARED))


@pytest.mark.parametrize("version", [None, "2.10.0", "2.11.0"])
def test_delay_wgrad_partial_graph_without_attn_accepted_from_te_2_10(te, version):
    te(version)
    accepted(wgrad("moe_router,moe_preprocess", gradient_accumulation_fusion=False, **DROPLESS))
    accepted(wgrad("moe_preprocess,moe_router", add_qkv_bias=True, **DROPLESS))


@pytest.mark.parametrize("version", ["2.9.0", "2.1.0"])
def test_delay_wgrad_partial_graph_needs_te_2_10(te, version):
    te(version)
    rejected(
        wgrad("moe_router,moe_preprocess", **DROPLESS),
        fields=["model.delay_wgrad_compute"],
        value="True",
        phrase="delay_wgrad_compute with per-layer (partial) CUDA graphs needs Transformer Engine "
        f'>= 2.10.0 (installed: {version}) (megatron-core: "TE version >= 2.10.0 is required '
        'for delay_wgrad_compute with partial cuda graph")',
        fix="upgrade Transformer Engine or set model.delay_wgrad_compute=False",
    )


def test_delay_wgrad_not_checked_for_local_or_off(te):
    te("2.0.0")
    # (full_iteration: megatron-core takes delay_wgrad_compute only with expert-parallel
    # overlap, which it allows with TE graphs only; refused for that, not for the TE version)
    violations = find_violations(read_settings(full_iteration(delay_wgrad_compute=True)))
    assert [v.fields for v in violations] == [
        ("model.delay_wgrad_compute", "overlap_moe_expert_parallel_comm")
    ]
    accepted(bridge("none", [], delay_wgrad_compute=True))
    accepted(wgrad(delay_wgrad_compute=False))


# -- all problems at once -----------------------------------------------------------------------


def test_three_problems_reported_in_one_error():
    config = bridge(scope="attn,bogus", cpu_offloading=True, variable_seq_lengths=True)
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(config))
    message = str(info.value)
    numbered = re.findall(r"^  (\d+)\. ", message, flags=re.MULTILINE)
    assert numbered == ["1", "2", "3"]
    assert message.splitlines()[0] == "3 problem(s) with the CUDA graph configuration:"
    assert message.count("\n     fix: ") == 3
    for field in ("model.cuda_graph_scope", "model.cpu_offloading", "model.variable_seq_lengths"):
        assert re.search(rf"^  \d\. {re.escape(field)} = ", message, flags=re.MULTILINE), field
    assert len(info.value.violations) == 3


def test_many_problems_all_reported():
    config = bridge(
        "transformer_engine",
        "full_iteration,moe_preprocess",
        cuda_graph_warmup_steps=-2,
        use_te_rng_tracker=False,
        cpu_offloading=True,
    )
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(config))
    problems = " | ".join(v.text for v in info.value.violations)
    for phrase in (
        "not supported for cuda_graph_impl=transformer_engine",
        "cannot be mixed",
        "non-negative integer",
        "TE RNG tracker",
        "CPU offloading",
        "only supported with moe_router",
    ):
        assert phrase in problems


# -- megatron-core agrees: same verdict, same key phrase --------------------------------------


def _mcore_config(**kwargs):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    base["bf16"] = not kwargs.get("fp16")  # (TE graphs need bf16 layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**base, **kwargs)


MOE_MCORE = dict(num_moe_experts=8, moe_router_topk=2)
FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)

MCORE_REJECTS = {
    "moe-and-router": (
        dict(cuda_graph_scope=["moe", "moe_router"], **MOE_MCORE),
        "cuda_graph_scope must not contain both moe and moe_router",
    ),
    "preprocess-alone": (
        dict(cuda_graph_scope=["attn", "moe_preprocess"], **MOE_MCORE),
        "moe_preprocess cuda graph is only supported with moe_router cuda graph",
    ),
    "moe-on-dense": (
        dict(cuda_graph_scope=["moe_router"]),
        "moe cuda graph is only supported for MoE",
    ),
    "mlp-on-all-moe": (
        dict(cuda_graph_scope=["attn", "mlp"], **MOE_MCORE),
        "mlp cuda graph is only supported for dense layers, but not found in the model",
    ),
    "moe-dropless": (
        dict(cuda_graph_scope=["moe"], **MOE_MCORE),
        "moe cuda graph is only supported with drop-padding MoE",
    ),
    "preprocess-dtoh": (
        dict(
            cuda_graph_scope=["moe_router", "moe_preprocess"],
            moe_token_dispatcher_type="alltoall",
            moe_expert_capacity_factor=1.0,
            **MOE_MCORE,
        ),
        "moe_preprocess cuda graph is not supported when there are DtoH copies",
    ),
    "full-recompute": (
        dict(cuda_graph_scope=["mlp"], **FULL_RECOMPUTE),
        "full recompute is only supported with full iteration CUDA graph",
    ),
    "moe-recompute-router": (
        dict(
            cuda_graph_scope=["moe_router"],
            recompute_granularity="selective",
            recompute_modules=["moe"],
            hidden_dropout=0.0,
            **MOE_MCORE,
        ),
        "moe recompute is not supported with moe_router CUDA graph",
    ),
    "moe-layer-recompute": (  # deprecated: megatron-core reads it as selective moe recompute
        dict(cuda_graph_scope=["moe_router"], moe_layer_recompute=True, **MOE_MCORE),
        "moe recompute is not supported with moe_router CUDA graph",
    ),
    "attention-dropout": (
        dict(cuda_graph_scope=["attn"], recompute_granularity="selective"),
        "attention dropout is not supported with graphed attention recomputation",
    ),
    "hidden-dropout": (
        dict(
            cuda_graph_scope=["mlp"], recompute_granularity="selective", recompute_modules=["mlp"]
        ),
        "hidden dropout is not supported with graphed MLP/MoE recomputation",
    ),
    "jitter": (
        dict(
            cuda_graph_scope=["moe"],
            recompute_granularity="selective",
            recompute_modules=["moe"],
            hidden_dropout=0.0,
            moe_input_jitter_eps=0.01,
            moe_expert_capacity_factor=1.0,
            moe_pad_expert_input_to_capacity=True,
            **MOE_MCORE,
        ),
        "moe_input_jitter_eps is not supported with graphed moe recomputation",
    ),
    "invalid-impl": (
        dict(cuda_graph_impl="bogus", cuda_graph_scope=["attn"]),
        "Invalid cuda graph implementation",
    ),
    "legacy-with-impl": (
        dict(external_cuda_graph=True, cuda_graph_impl="local", cuda_graph_scope=["attn"]),
        "Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl",
    ),
    "legacy-both": (
        dict(cuda_graph_impl="none", enable_cuda_graph=True, external_cuda_graph=True),
        "enable_cuda_graph and external_cuda_graph cannot be enabled at the same time",
    ),
    "cpu-offloading": (
        dict(cuda_graph_scope=["attn"], cpu_offloading=True, cpu_offloading_num_layers=1),
        "CUDA graphs not supported with CPU offloading",
    ),
}


@pytest.mark.parametrize("case", sorted(MCORE_REJECTS))
def test_megatron_core_rejects_the_same_configs_with_the_same_phrase(case):
    kwargs, phrase = MCORE_REJECTS[case]
    kwargs = {"cuda_graph_impl": "transformer_engine", **kwargs}
    with pytest.raises((AssertionError, ValueError)) as mcore:
        _mcore_config(**copy.deepcopy(kwargs))  # (its __post_init__ edits lists in place)
    assert phrase in str(mcore.value)
    # The plugin reads the very fields megatron-core was given: a field left out holds
    # megatron-core's default for both (dropout 0.1, linear biases on).
    plugin_view = NS(**{**kwargs, "use_te_rng_tracker": True})
    with pytest.raises(CudaGraphConfigError) as ours:
        validate(read_settings(plugin_view))
    assert phrase in str(ours.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "mlp"]),
        dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"], **FULL_RECOMPUTE),
        dict(
            cuda_graph_impl="transformer_engine",
            cuda_graph_scope=["attn", "moe_router", "moe_preprocess"],
            # alltoall needs TE's fused permutation (not on this CPU), see the rule
            moe_token_dispatcher_type="allgather",
            **MOE_MCORE,
        ),
        dict(
            cuda_graph_impl="transformer_engine",
            cuda_graph_scope=["attn", "moe"],
            moe_expert_capacity_factor=1.0,
            moe_pad_expert_input_to_capacity=True,
            **MOE_MCORE,
        ),
        dict(
            cuda_graph_impl="transformer_engine",
            cuda_graph_scope=["mlp"],
            recompute_granularity="selective",
        ),
        dict(  # [] stays empty (only None means core_attn): moe alone is recomputed
            cuda_graph_impl="transformer_engine",
            cuda_graph_scope=["attn"],
            moe_layer_recompute=True,
            recompute_modules=[],
            **MOE_MCORE,
        ),
    ],
    ids=[
        "dense-te",
        "full-iteration-full-recompute",
        "dropless",
        "drop-pad",
        "selective",
        "moe-layer-recompute-no-modules",
    ],
)
def test_megatron_core_and_plugin_accept_the_same_configs(kwargs):
    config = _mcore_config(**copy.deepcopy(kwargs), use_te_rng_tracker=True)
    accepted(config)
    # ... and the fields as given, before megatron-core's __post_init__ rewrote them (in
    # place too: it appends moe to the recompute_modules list it was given)
    accepted(NS(**kwargs, use_te_rng_tracker=True))


# -- advice -------------------------------------------------------------------------------------


def notes(config, environ=None):
    return advice(read_settings(config), environ={} if environ is None else environ)


def scope_notes(config):
    return [n for n in notes(config) if n.startswith("scope ")]


def test_advice_nothing_when_graphs_are_off():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert notes(bridge("none", [], cuda_graph_warmup_steps=0), env) == []


@pytest.mark.parametrize(
    "scope, moe",
    [
        ("attn,mlp", {}),
        ("attn,mlp,mamba", {}),
        ("attn,moe_router,moe_preprocess", DROPLESS),
        ("attn,moe", DROP_PAD),
    ],
)
def test_advice_recommended_scope_says_nothing(scope, moe):
    assert notes(bridge(scope=scope, **moe)) == []


@pytest.mark.parametrize(
    "scope, moe, kind, missing",
    [
        ("attn", {}, "dense", "mlp"),
        ("mlp", {}, "dense", "attn"),
        ("attn,moe_router", DROPLESS, "dropless MoE", "moe_preprocess"),
        ("moe_router,moe_preprocess", DROPLESS, "dropless MoE", "attn"),
        ("attn", DROP_PAD, "drop-and-pad MoE", "moe"),
    ],
)
def test_advice_narrower_than_recommended(scope, moe, kind, missing):
    (note,) = scope_notes(bridge(scope=scope, **moe))
    assert f"scope {scope} is narrower than recommended for a {kind} model" in note
    assert f"consider adding {missing}" in note


@pytest.mark.parametrize(
    "scope, moe, kind, extra",
    [
        ("attn,mlp,moe_router", dict(DROPLESS, moe_layer_freq=[0, 1]), "dropless MoE", "mlp"),
        (
            "attn,moe_router,moe_preprocess",
            DROP_PAD,
            "drop-and-pad MoE",
            "moe_preprocess,moe_router",
        ),
    ],
)
def test_advice_wider_than_recommended(scope, moe, kind, extra):
    (note,) = scope_notes(bridge(scope=scope, **moe))
    assert f"is wider than recommended for a {kind} model" in note
    assert f"{extra} adds memory" in note


@pytest.mark.parametrize("moe, kind", [({}, "dense"), (DROPLESS, "dropless MoE")])
def test_advice_full_iteration_is_wider_than_recommended(moe, kind):
    (note,) = scope_notes(full_iteration(**moe))
    assert f"scope full_iteration is wider than recommended for a first {kind} run" in note
    assert "1.5-2x" in note


def test_no_advice_against_full_iteration_where_buckets_need_it():
    """(review of 2026-12-05: a bucketed run, which only full_iteration serves, was told to
    start with TE attn,mlp.)"""
    assert scope_notes(full_iteration(cuda_graph_buckets="256,512")) == []
    assert scope_notes(full_iteration()) != []


@pytest.mark.parametrize("precision", [dict(bf16=False), dict(fp16=True)], ids=["fp32", "fp16"])
def test_no_advice_towards_te_scopes_that_the_layers_precision_would_refuse(precision):
    """(2026-12-05: an fp32 loop on full_iteration was told to start with TE attn,mlp, which
    the rules then refuse: megatron-core captures TE layer graphs with bf16 samples.)"""
    assert scope_notes(full_iteration(**precision)) == []
    # what the advice would have led to:
    (refused,) = find_violations(read_settings(bridge(**precision)))
    assert "bfloat16 sample inputs" in refused.text
    (note,) = scope_notes(full_iteration(bf16=True))
    assert "(start with TE attn,mlp):" in note
    (note,) = scope_notes(full_iteration())  # a config that does not say its precision
    assert "(start with TE attn,mlp on bf16 layers):" in note


def test_advice_towards_te_scopes_for_any_precision_where_megatron_core_takes_the_config_s(
    monkeypatch,
):
    monkeypatch.setattr(environment, "mcore_te_samples_in_bf16", lambda: False)
    (note,) = scope_notes(full_iteration(bf16=False))
    assert "(start with TE attn,mlp):" in note
    (note,) = scope_notes(full_iteration())
    assert "(start with TE attn,mlp):" in note


def test_advice_towards_te_scopes_for_local_spec_layers():
    """Layers built with the local spec are captured by TE graphs too (bf16, measured on an
    H100, 2026-12-05): the spec is no reason to keep quiet."""
    (note,) = scope_notes(full_iteration(bf16=True, transformer_impl="local"))
    assert "start with TE attn,mlp" in note


def test_advice_expandable_segments():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}
    (note,) = notes(bridge(), env)
    assert "expandable_segments:True" in note and "NCCL_GRAPH_REGISTER=0" in note
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert notes(bridge(), env) == []


def test_advice_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert any("NCCL_GRAPH_REGISTER" in n for n in advice(read_settings(bridge())))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert advice(read_settings(bridge())) == []


@pytest.mark.parametrize("steps", [0, 1])
def test_advice_few_warmup_steps(steps):
    (note,) = notes(bridge(cuda_graph_warmup_steps=steps))
    assert note.startswith(f"model.cuda_graph_warmup_steps={steps}: ")
    assert "at least 2 warm-up steps" in note


def test_advice_enough_warmup_steps_says_nothing():
    assert notes(bridge(cuda_graph_warmup_steps=2)) == []


def fallback_notes(baseline=None, **model):
    config = full_iteration(**model)
    config.cuda_graph_fallback_on_slowdown = True  # (the plugin's own fields: top level)
    config.cuda_graph_baseline_steps = baseline
    return [n for n in notes(config) if n.startswith("cuda_graph_fallback_on_slowdown")]


def test_advice_a_fallback_that_would_decide_from_too_few_eager_steps():
    """The fallback frees the graph for the rest of the run on its verdict: from the 2
    eager steps of the default warm-up, one noisy step decides it."""
    (note,) = fallback_notes()  # warm-up 3: steps 1 and 2 are the eager samples
    assert note.startswith("cuda_graph_fallback_on_slowdown decides from 2 eager step(s)")
    assert "--cuda-graph-baseline-steps 5" in note
    assert fallback_notes(baseline=5) == []
    assert fallback_notes(cuda_graph_warmup_steps=6) == []


@pytest.mark.parametrize(
    "config",
    [
        bridge("cuda", "attn"),
        bridge(scope="bogus,attn,attn"),
        bridge(scope=[]),
        bridge(cuda_graph_warmup_steps="x"),
        bridge(cuda_graph_warmup_steps=True),
        bridge(cuda_graph_warmup_steps=-5),
        bridge(scope="attn,moe_router"),  # MoE scope on a dense model
        bridge(scope="moe", num_moe_experts=0),
        bridge("local", "full_iteration,attn,moe", **DROPLESS),
        bridge(moe_layer_freq=[], **DROPLESS),
    ],
)
def test_advice_never_raises_even_for_invalid_configs(config):
    result = advice(read_settings(config), environ={"PYTORCH_CUDA_ALLOC_CONF": "x"})
    assert isinstance(result, list) and all(isinstance(n, str) for n in result)


# -- auto-fixes ---------------------------------------------------------------------------------


def _records(caplog):
    return [r for r in caplog.records if r.name == "cudagraph_plugin"]


def test_autofix_enables_every_te_rng_flag_with_one_log_line_each(caplog):
    config = bridge()
    config.model.use_te_rng_tracker = False
    config.rng.te_rng_tracker = False
    expected = copy.deepcopy(config)
    expected.model.use_te_rng_tracker = True
    expected.rng.te_rng_tracker = True
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_autofixes(config, read_settings(config))
    assert config == expected  # nothing else changed
    assert changes == [
        "CUDA graphs are on (TE RNG tracker): set model.use_te_rng_tracker=True",
        "CUDA graphs are on (TE RNG tracker): set rng.te_rng_tracker=True",
    ]
    records = _records(caplog)
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    assert [r.getMessage() for r in records] == [f"auto-fix: {c}" for c in changes]
    accepted(config)


def test_autofix_only_the_flag_that_is_off(caplog):
    config = bridge()
    config.rng.te_rng_tracker = False
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_autofixes(config, read_settings(config))
    assert changes == ["CUDA graphs are on (TE RNG tracker): set rng.te_rng_tracker=True"]
    assert len(_records(caplog)) == 1


def test_autofix_sets_none_flags_too():
    config = bridge()
    config.model.use_te_rng_tracker = None
    apply_autofixes(config, read_settings(config))
    assert config.model.use_te_rng_tracker is True


def test_autofix_nothing_to_do_logs_nothing(caplog):
    config = bridge()
    before = copy.deepcopy(config)
    with caplog.at_level(logging.DEBUG, logger="cudagraph_plugin"):
        assert apply_autofixes(config, read_settings(config)) == []
    assert config == before
    assert _records(caplog) == []


def test_autofix_does_not_create_missing_flags():
    config = NS(cuda_graph_impl="transformer_engine", cuda_graph_scope="attn")
    assert apply_autofixes(config, read_settings(config)) == []
    assert vars(config) == {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn"}


def test_autofix_on_a_megatron_lm_namespace_names_the_flag(caplog):
    args = argparse.Namespace(
        cuda_graph_impl="local", cuda_graph_scope="full_iteration", te_rng_tracker=False
    )
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_autofixes(args, read_settings(args))
    assert args.te_rng_tracker is True
    assert changes == [
        "CUDA graphs are on (TE RNG tracker): set te_rng_tracker=True (on the command line: "
        "pass --te-rng-tracker)"
    ]
    assert [r.getMessage() for r in _records(caplog)] == [f"auto-fix: {changes[0]}"]


def test_autofix_on_a_nested_dict():
    config = {
        "model": {
            "cuda_graph_impl": "transformer_engine",
            "cuda_graph_scope": ["attn"],
            "use_te_rng_tracker": False,
        },
        "rng": {"te_rng_tracker": False},
        "train": {"micro_batch_size": 1},
    }
    expected = copy.deepcopy(config)
    expected["model"]["use_te_rng_tracker"] = True
    expected["rng"]["te_rng_tracker"] = True
    assert len(apply_autofixes(config, read_settings(config))) == 2
    assert config == expected


def test_autofix_on_a_real_transformer_config_makes_it_valid():
    config = _mcore_config(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "mlp"])
    with pytest.raises(CudaGraphConfigError, match="use_te_rng_tracker"):
        validate(read_settings(config))
    changes = apply_autofixes(config, read_settings(config))
    assert changes == ["CUDA graphs are on (TE RNG tracker): set use_te_rng_tracker=True"]
    assert config.use_te_rng_tracker is True
    accepted(config)


def test_autofix_impl_none_clears_the_scope(caplog):
    config = bridge("none", ["attn", "mlp"])
    config.model.use_te_rng_tracker = False
    config.rng.te_rng_tracker = False
    expected = copy.deepcopy(config)
    expected.model.cuda_graph_scope = []
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_autofixes(config, read_settings(config))
    assert config == expected  # RNG flags untouched, nothing else changed
    assert changes == ["cuda_graph_impl is none: cleared model.cuda_graph_scope (was attn,mlp)"]
    assert [r.getMessage() for r in _records(caplog)] == [f"auto-fix: {changes[0]}"]
    assert [r.levelno for r in _records(caplog)] == [logging.WARNING]


def test_autofix_impl_none_clears_new_generation_modules():
    config = bridge("none", None, cuda_graph_modules=["attn"])
    changes = apply_autofixes(config, read_settings(config))
    assert config.model.cuda_graph_modules == []
    assert config.model.cuda_graph_scope is None
    assert changes == ["cuda_graph_impl is none: cleared model.cuda_graph_modules (was attn)"]


def test_autofix_impl_none_says_each_cleared_field_s_own_value():
    # both generations' fields set: each line names that field's value, not the merged scope
    config = bridge("none", ["mlp"], cuda_graph_modules="attn")
    changes = apply_autofixes(config, read_settings(config))
    assert config.model.cuda_graph_scope == []
    assert config.model.cuda_graph_modules == []
    assert sorted(changes) == [
        "cuda_graph_impl is none: cleared model.cuda_graph_modules (was attn)",
        "cuda_graph_impl is none: cleared model.cuda_graph_scope (was mlp)",
    ]


def test_autofix_impl_none_clears_a_namespace_scope():
    args = argparse.Namespace(cuda_graph_impl="none", cuda_graph_scope="attn,mlp")
    assert apply_autofixes(args, read_settings(args)) == [
        "cuda_graph_impl is none: cleared --cuda-graph-scope (was attn,mlp)"
    ]
    assert args.cuda_graph_scope == []


@pytest.mark.parametrize("scope", ["full", ["full"], [], None])
def test_autofix_impl_none_leaves_mcore_default_scope_alone(caplog, scope):
    config = bridge("none", scope)
    before = copy.deepcopy(config)
    with caplog.at_level(logging.DEBUG, logger="cudagraph_plugin"):
        assert apply_autofixes(config, read_settings(config)) == []
    assert config == before
    assert _records(caplog) == []


def test_autofix_leaves_every_other_problem_for_validation():
    config = bridge("local", "full_iteration", nan_loss=True, nan_grad=True, cpu_offloading=True)
    config.model.use_te_rng_tracker = False
    before = copy.deepcopy(config)
    apply_autofixes(config, read_settings(config))
    before.model.use_te_rng_tracker = True
    assert config == before
    assert config.rerun_state_machine.check_for_nan_in_loss is True
    assert config.ddp.check_for_nan_in_grad is True
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(config))
    # NaN loss check, NaN grad check (both off with full_iteration), CPU offloading
    assert len(info.value.violations) == 3


# -- values as launchers pass them ------------------------------------------------------------


def test_num_moe_experts_as_a_string_is_read_not_a_type_error():
    # Before: TypeError: '>' not supported between instances of 'str' and 'int'.
    rejected(
        bridge(scope="attn,moe", num_moe_experts="8"),
        # not in this config: shown by their plain names
        fields=[
            "model.cuda_graph_scope",
            "moe_expert_capacity_factor",
            "moe_pad_expert_input_to_capacity",
        ],
        value="('attn,moe', None, False)",
        phrase="moe cuda graph is only supported with drop-padding MoE",
        fix="use moe_router,moe_preprocess for dropless MoE",
    )
    accepted(bridge(scope="attn,moe_router,moe_preprocess", num_moe_experts="8"))


def test_recompute_modules_as_a_string_is_a_list_of_names_and_the_rules_fire():
    # Before: "core_attn" was read character by character, so the rule never fired.
    rejected(
        bridge(
            scope="attn",
            recompute_granularity="selective",
            recompute_modules="core_attn",
            attention_dropout="0.1",
        ),
        fields=["model.attention_dropout", "model.recompute_modules", "model.cuda_graph_scope"],
        value="(0.1, ['core_attn'], 'attn')",
        phrase="attention dropout is not supported with graphed attention recomputation",
        fix="set model.attention_dropout=0.0",
    )
    rejected(
        bridge(
            scope="attn,moe_router",
            recompute_granularity="selective",
            recompute_modules="moe,layernorm",
            **DROPLESS,
        ),
        fields=["model.recompute_modules", "model.cuda_graph_scope"],
        value="(['moe', 'layernorm'], 'attn,moe_router')",
        phrase="moe recompute is not supported with moe_router CUDA graph",
        fix="drop 'moe' from recompute_modules",
    )


@pytest.mark.parametrize("pattern", ["([1]*4)", "[1]*2+[1]*2", "1"])
def test_moe_layer_freq_pattern_without_dense_layers_rejects_mlp(pattern):
    # Before: a pattern string was neither 1 nor a list, so this rule was silently off.
    err = rejected(
        bridge(scope="attn,mlp,moe_router", moe_layer_freq=pattern, **DROPLESS),
        fields=["model.cuda_graph_scope", "model.moe_layer_freq"],
        value=repr(("attn,mlp,moe_router", 1 if pattern == "1" else [1, 1, 1, 1])),
        phrase="mlp cuda graph is only supported for dense layers, but not found in the model",
        fix="drop mlp from the scope",
    )
    assert len(err.violations) == 1


def test_moe_layer_freq_pattern_with_dense_layers_allows_mlp():
    accepted(bridge(scope="attn,mlp,moe_router", moe_layer_freq="([0]*1+[1]*3)", **DROPLESS))


@pytest.mark.parametrize("word, rejected_too", [("false", False), ("0", False), ("true", True)])
def test_boolean_words_are_read_not_taken_as_truthy_strings(word, rejected_too):
    # Before: bool("false") is True, so cpu_offloading="false" was refused.
    config = bridge(cpu_offloading=word)
    if rejected_too:
        rejected(
            config,
            fields=["model.cpu_offloading"],
            value="True",
            phrase="CUDA graphs not supported with CPU offloading",
            fix="set model.cpu_offloading=False",
        )
    else:
        accepted(config)


def test_te_rng_tracker_false_as_a_word_is_caught():
    config = bridge()
    config.model.use_te_rng_tracker = "false"
    rejected(
        config,
        fields=["model.use_te_rng_tracker"],
        value="False",
        phrase="CUDA graphs require the TE RNG tracker",
        fix="set model.use_te_rng_tracker=True",
    )


def test_unreadable_value_is_one_problem_not_a_cascade():
    # num_moe_experts cannot be read: the MoE rules must not add "not an MoE model" on top.
    err = rejected(
        bridge(scope="attn,moe_router", num_moe_experts="eight"),
        fields=["model.num_moe_experts"],
        value="'eight'",
        phrase="must be a non-negative integer",
        fix="give a whole number such as 8",
    )
    assert len(err.violations) == 1


@pytest.mark.parametrize("scope", ["attn,,mlp", "attn,mlp,", ",attn", ["attn", ""], ["attn", " "]])
def test_empty_scope_name_is_rejected_not_dropped(scope):
    # Before: "attn,,mlp" was accepted silently.
    err = rejected(
        bridge(scope=scope),
        fields=["model.cuda_graph_scope"],
        value=repr(
            ",".join(n.strip() for n in (scope.split(",") if isinstance(scope, str) else scope))
        ),
        phrase="an empty scope name (a doubled, leading or trailing comma)",
        fix="remove the extra comma",
    )
    assert len(err.violations) == 1


# -- deprecated megatron-core names ------------------------------------------------------------


@pytest.mark.parametrize("scope", ["full,attn", ["attn", "full"]])
def test_full_scope_with_others_is_called_deprecated_not_unknown(scope):
    err = rejected(
        bridge(scope=scope),
        fields=["model.cuda_graph_scope"],
        value=repr(",".join(scope.split(",") if isinstance(scope, str) else scope)),
        phrase="'full' is megatron-core's deprecated name for whole-layer capture",
        fix="drop 'full' and list only the parts to capture, e.g. attn,mlp",
    )
    message = str(err)
    assert 'megatron-core: "full scope is deprecated"' in message
    assert 'megatron-core: "full scope cannot be used with other scopes"' in message
    assert "unknown" not in message


def test_full_scope_alone_with_graphs_on_says_deprecated_whole_layer():
    err = rejected(
        bridge(scope="full"),
        fields=["model.cuda_graph_impl", "model.cuda_graph_scope"],
        value="('transformer_engine', '(empty)')",
        phrase="'full' is megatron-core's deprecated name for that whole-layer capture",
        fix="name the scope explicitly",
    )
    assert 'megatron-core: "full scope is deprecated"' in str(err)


def test_full_iteration_inference_is_called_deprecated():
    rejected(
        bridge("local", None, cuda_graph_modules=["full_iteration_inference"]),
        fields=["model.cuda_graph_modules"],
        value="'full_iteration_inference'",
        phrase="cuda_graph_modules 'full_iteration_inference' is deprecated",
        fix="drop it from the scope",
    )


def test_scope_and_modules_both_set_rejected():
    rejected(
        bridge(scope="attn", cuda_graph_modules=["attn", "mlp"]),
        fields=["model.cuda_graph_scope", "model.cuda_graph_modules"],
        value="('attn', ['attn', 'mlp'])",  # (each as written, quoted once)
        phrase="cuda_graph_scope and cuda_graph_modules cannot be set together",
        fix="keep one of them",
    )


@pytest.mark.parametrize(
    "flag, impl", [("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")]
)
def test_real_transformer_config_with_a_deprecated_flag_is_told_deprecated(flag, impl):
    # megatron-core's __post_init__ set cuda_graph_impl itself: the user must not be told
    # "Do not use ... with cuda_graph_impl".
    config = _mcore_config(**{flag: True}, use_te_rng_tracker=True)
    assert getattr(config, flag) is True and config.cuda_graph_impl == impl
    with pytest.raises(CudaGraphConfigError) as info:
        validate(read_settings(config))
    (violation,) = info.value.violations
    assert violation.fields == (flag,)
    assert f'megatron-core: "{flag} is deprecated, use cuda_graph_impl={impl} instead"' in (
        violation.text
    )
    assert "Do not use" not in str(info.value)
    assert f"drop {flag} and set cuda_graph_impl={impl}" in violation.fix


def test_deprecated_flag_with_a_command_line_impl_is_a_conflict():
    # On a (Megatron-LM) command line the impl flag is the user's own.
    args = argparse.Namespace(
        enable_cuda_graph=True,
        cuda_graph_impl="local",
        cuda_graph_scope="full_iteration",
        te_rng_tracker=True,
    )
    rejected(
        args,
        fields=["--enable-cuda-graph", "--cuda-graph-impl"],
        value="(True, 'local')",
        phrase="Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl",
        fix="drop the deprecated flag",
    )


# -- Transformer Engine version rules ------------------------------------------------------------


def test_delay_wgrad_with_attn_and_no_te_is_not_checked_here_and_says_so(te):
    te(None)
    s = read_settings(wgrad())
    violations, notes = evaluate(s)
    assert violations == []
    (note,) = notes
    assert "needs Transformer Engine >= 2.12.0: not checked here" in note
    assert "te_version=" in note and "--te-version" in note


def test_delay_wgrad_partial_graph_and_no_te_is_not_checked_here_and_says_so(te):
    # Before: this branch skipped the check silently while the attn branch failed.
    te(None)
    violations, notes = evaluate(read_settings(wgrad("moe_router,moe_preprocess", **DROPLESS)))
    assert violations == []
    (note,) = notes
    assert "needs Transformer Engine >= 2.10.0: not checked here" in note


def test_delay_wgrad_without_te_still_checks_the_other_requirements(te):
    te(None)
    err = rejected(
        wgrad(gradient_accumulation_fusion=False),
        fields=["model.delay_wgrad_compute", "model.cuda_graph_scope"],
        value="(True, 'attn')",
        phrase="CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion",
        fix="meet those requirements",
    )
    assert "Transformer Engine >=" not in err.violations[0].problem


@pytest.mark.parametrize(
    "version, ok", [("2.12", True), ("2.12.0", True), ("2.11.0", False), (Version("2.9"), False)]
)
def test_delay_wgrad_checked_against_a_given_te_version(te, version, ok):
    te(None)  # nothing installed here: the given version decides
    env = Environment.of(version)
    violations, notes = evaluate(read_settings(wgrad()), env)
    assert notes == []
    if ok:
        assert violations == []
    else:
        (violation,) = violations
        assert f"Transformer Engine >= 2.12.0 (given: {Version(str(version))})" in violation.problem


def test_given_te_version_must_be_a_version():
    with pytest.raises(ValueError, match=r"'two' is not a version number: give one such as 2\.12"):
        Environment.of("two")


def test_delay_wgrad_with_overlapped_shared_experts_needs_no_new_te(te):
    # As Megatron-LM: overlapped shared experts are outside the router graph.
    te("2.11.0")
    accepted(wgrad("moe_router,moe_preprocess", moe_shared_expert_overlap=True, **SHARED))
    with pytest.raises(CudaGraphConfigError):
        validate(read_settings(wgrad("moe_router,moe_preprocess", **SHARED)))


# -- the warm-up warning given at train start ----------------------------------------------------


@pytest.mark.parametrize(
    "warmup, start, iters, says",
    [
        (1000, 0, 10, "the capture step 1000 (start_step + warm-up) is never reached"),
        (10, 0, 10, "the capture step 10 (start_step + warm-up) is never reached"),
        (3, 8, 10, "the capture step 11 (start_step + warm-up) is never reached"),
        (9, 0, 10, "captured at the last step (9) and never replayed"),
    ],
)
def test_warmup_warning_with_the_numbers(warmup, start, iters, says):
    s = read_settings(bridge(cuda_graph_warmup_steps=warmup))
    warning = warmup_warning(s, start, iters)
    assert warning.startswith(
        f"model.cuda_graph_warmup_steps={warmup} and this run trains {iters - start} step(s) "
        f"(steps {start}..{iters - 1}: start_step={start}, train_iters={iters})"
    )
    assert says in warning


@pytest.mark.parametrize(
    "baseline, iters, says",
    [
        (10, 6, "the capture step 11 (start_step + warm-up) is never reached, so no CUDA graph "
         "will be captured; use at most 3 baseline step(s) (so that a step replays) or train "
         "longer"),
        (10, 12, "captured at the last step (11) and never replayed, so the run cannot show a "
         "speed-up; use at most 9 baseline step(s) (so that a step replays) or train longer"),
        # the warm-up given (3) is itself too long for 3 steps: both must come down
        (5, 3, "never reached, so no CUDA graph will be captured; use at most 0 baseline "
         "step(s) and at most 1 warm-up step(s) (so that a step replays) or train longer"),
        (5, 1, "never reached, so no CUDA graph will be captured; train longer"),
    ],
)  # fmt: skip
def test_a_warmup_the_baseline_raised_is_warned_about_as_the_baseline(baseline, iters, says):
    """The user set cuda_graph_baseline_steps, not the warm-up: the warning named the
    warm-up field (never given) and its fix did not help. The fix it gives now works."""

    def settings(baseline, warmup=3):
        config = bridge(cuda_graph_warmup_steps=warmup)
        config.cuda_graph_baseline_steps = baseline
        return read_settings(config)

    warning = warmup_warning(settings(baseline), 0, iters)
    assert warning.startswith(
        f"cuda_graph_baseline_steps={baseline} (the warm-up raised to {baseline + 1} from "
        f"model.cuda_graph_warmup_steps=3) and this run trains {iters} step(s)"
    ), warning
    assert warning.endswith(says), warning
    fixed = re.findall(r"at most (\d+) baseline step\(s\)(?: and at most (\d+) warm-up)?", says)
    if fixed:
        fewer_baseline, fewer_warmup = fixed[0]
        again = settings(int(fewer_baseline), int(fewer_warmup or 3))
        assert warmup_warning(again, 0, iters) is None, "the fix it gave did not work"


@pytest.mark.parametrize("warmup, start, iters", [(3, 0, 10), (8, 0, 10), (0, 5, 7)])
def test_no_warmup_warning_when_a_replay_step_follows_the_capture(warmup, start, iters):
    s = read_settings(bridge(cuda_graph_warmup_steps=warmup))
    assert warmup_warning(s, start, iters) is None


def test_buckets_too_many_for_the_run_s_steps_to_replay_each_are_said():
    """Each bucket is captured after its own warm-up and replays from the call after: a run
    of fewer than buckets x (warm-up + 2) steps cannot replay every bucket, whatever the
    lengths (user trial, 2026-12-05: the warm-up warning said nothing of it)."""
    s = read_settings(full_iteration(cuda_graph_buckets="16,32,48", cuda_graph_warmup_steps=3))
    warning = warmup_warning(s, 0, 14)
    assert warning.startswith("model.cuda_graph_buckets has 3 buckets, each captured after 3 ")
    assert "this run's 14 step(s) can replay at most 2 of them (3 x 5 = 15 steps" in warning
    assert warmup_warning(s, 0, 15) is None and warmup_warning(s, 5, 20) is None
    assert "8 step(s) can replay at most 1 of them" in warmup_warning(s, 12, 20)
    one = read_settings(full_iteration(cuda_graph_buckets="512", cuda_graph_warmup_steps=3))
    assert warmup_warning(one, 0, 6) is None  # (one bucket: the run's own warning covers it)
    # where the baseline raised the warm-up, the baseline is what to lower (review of
    # 2026-12-05: "fewer warm-up steps" named a knob that changes nothing there)
    config = full_iteration(cuda_graph_buckets="16,32,48", cuda_graph_warmup_steps=1)
    config.cuda_graph_baseline_steps = 10
    raised = warmup_warning(read_settings(config), 0, 30)
    assert raised.endswith(
        "or use fewer buckets or cuda_graph_baseline_steps below 10 (it raised the warm-up to 11)"
    )


def test_no_warmup_warning_with_graphs_off():
    s = read_settings(bridge("none", [], cuda_graph_warmup_steps=1000))
    assert warmup_warning(s, 0, 10) is None


# -- precision, warm-up, pipeline parallelism and the optimizer graph (issues 12, 15, 16) ------


def test_grad_nan_check_with_full_iteration_is_a_violation_not_advice():
    rejected(
        bridge("local", "full_iteration", nan_grad=True),
        fields=("ddp.check_for_nan_in_grad",),
        value="True",
        phrase="--no-check-for-nan-in-loss-and-grad should be set",
        fix="set ddp.check_for_nan_in_grad=False",
    )
    assert not any(
        "check_for_nan_in_grad" in note for note in advice(read_settings(full_iteration()))
    )


def test_megatron_lm_single_nan_flag_is_reported_once():
    args = NS(
        cuda_graph_impl="local",
        cuda_graph_scope=["full_iteration"],
        te_rng_tracker=True,
        check_for_nan_in_loss_and_grad=True,
    )
    problems = [v for v in find_violations(read_settings(args)) if "nan" in v.text.lower()]
    assert len(problems) == 1


def test_full_iteration_needs_a_warmup_step():
    rejected(
        full_iteration(cuda_graph_warmup_steps=0),
        fields=("model.cuda_graph_warmup_steps",),
        value="0",
        phrase="CUBLAS_STATUS_NOT_INITIALIZED",
        fix="set model.cuda_graph_warmup_steps to 1 or more",
    )
    accepted(full_iteration(cuda_graph_warmup_steps=1))
    accepted(bridge(scope="attn,mlp", cuda_graph_warmup_steps=0))  # TE warms up itself


def test_fp16_is_refused_with_full_iteration_only_when_its_loss_scale_is_dynamic():
    rejected(
        full_iteration(fp16=True),
        fields=("model.fp16", "loss_scale"),
        value="(True, None)",
        phrase="scales the loss dynamically",
        fix="set a constant loss_scale (e.g. 4096), or train in bf16 (set model.fp16=False, "
        "bf16 on; TE scopes such as attn,mlp then work too: they need bf16 layers)",
    )
    # (TE scopes: no full-iteration graph reads the scaler; their fp16 layers are refused by
    # another rule, _te_graphs_need_bf16_layers)
    assert not [
        problem
        for problem in find_violations(read_settings(bridge(scope="attn,mlp", fp16=True)))
        if "scales the loss" in problem.problem
    ]
    # one scale tensor for the run (ConstantGradScaler): the captured iteration may read it
    accepted(with_optimizer(full_iteration(fp16=True), loss_scale=4096.0))
    # megatron-core: `if config.loss_scale:` -- 0 is the dynamic scaler
    rejected(
        with_optimizer(full_iteration(fp16=True), loss_scale=0),
        fields=("model.fp16", "optimizer.loss_scale"),
        value="(True, 0.0)",
        phrase="scales the loss dynamically",
        fix="set a constant optimizer.loss_scale",
    )


@pytest.mark.parametrize(
    "fields,ok",
    [
        (dict(pipeline_model_parallel_size=2), False),
        (dict(pipeline_model_parallel_size="2", batch_p2p_comm="false"), True),
        (dict(pipeline_model_parallel_size=2, batch_p2p_sync=False), True),
        (dict(pipeline_model_parallel_size=1), True),
    ],
)
def test_full_iteration_with_pipeline_parallelism_needs_unsynchronised_p2p(fields, ok):
    config = full_iteration(**fields)
    if ok:
        accepted(config)
        return
    rejected(
        config,
        # the p2p flags are megatron-core defaults here: shown by their usual names
        fields=("model.pipeline_model_parallel_size", "batch_p2p_comm", "batch_p2p_sync"),
        value="(2, True, True)",
        phrase="To protect against race condition when using batch_isend_irecv()",
        fix="set batch_p2p_comm=False",
    )


@pytest.mark.parametrize(
    "fields, ok",
    [
        (dict(virtual_pipeline_model_parallel_size=2), True),  # overlapped: batch_p2p_comm=False
        (dict(virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=False), False),
        # read before validate_args, which turns the overlap off without virtual stages
        (dict(), False),
        (dict(pipeline_model_parallel_size=1), True),
        (dict(virtual_pipeline_model_parallel_size=2, batch_p2p_sync=False), True),
    ],
    ids=["interleaved", "no-overlap", "no-virtual-stages", "no-pipeline", "no-sync"],
)
def test_full_iteration_pipeline_check_reads_megatron_lm_s_overlap_flag(fields, ok):
    config = megatron_lm_args(**fields)
    if ok:
        accepted(config)
        return
    vpp = config.virtual_pipeline_model_parallel_size
    err = rejected(
        config,
        fields=(
            "--pipeline-model-parallel-size",
            "--virtual-pipeline-model-parallel-size",
            "overlap_p2p_comm (--no-overlap-p2p-communication)",
        ),
        value=repr((2, vpp, config.overlap_p2p_comm)),
        phrase="To protect against race condition when using batch_isend_irecv()",
        fix="use virtual pipeline stages (--num-layers-per-virtual-pipeline-stage or "
        "--num-virtual-stages-per-pipeline-rank) without --no-overlap-p2p-communication",
    )
    # the fix names only flags Megatron-LM has
    (violation,) = [v for v in err.violations if "batch_isend_irecv" in v.text]
    assert "batch_p2p" not in violation.fix


def test_te_scopes_with_pipeline_parallelism_are_fine():
    accepted(bridge(scope="attn,mlp", pipeline_model_parallel_size=2))


def test_param_gather_overlapped_with_the_optimizer_step_is_refused_with_full_iteration():
    config = with_optimizer(full_iteration(), overlap_param_gather_with_optimizer_step=True)
    rejected(
        config,
        fields=("optimizer.overlap_param_gather_with_optimizer_step",),
        value="True",
        phrase="dispatched from the preceding optimizer step",
        fix="optimizer.overlap_param_gather_with_optimizer_step=False",
    )
    accepted(with_optimizer(bridge(), overlap_param_gather_with_optimizer_step=True))


def test_optimizer_graph_on_megatron_core_016_names_the_release_that_has_it():
    err = rejected(
        with_optimizer(full_iteration(), optimizer_cuda_graph=True),
        fields=("optimizer.optimizer_cuda_graph",),
        value="True",
        phrase="OptimizerCudaGraphWrapper",
        fix="megatron-core >= 0.17.0",
    )
    assert "installed: 0.16.1" in str(err)


def test_optimizer_graph_argparse_spelling(monkeypatch):
    args = argparse.Namespace(cuda_graph_impl="none", optimizer_cuda_graph=True, optimizer="adam")
    [violation] = find_violations(read_settings(args))
    assert violation.fields == ("--optimizer-cuda-graph",)


@pytest.mark.parametrize(
    "fields,phrase",
    [
        (dict(optimizer="sgd"), "only Adam capturable"),
        (dict(optimizer="Adam"), "only Adam capturable"),  # megatron-core: == 'adam'
        (dict(optimizer_cpu_offload=True), "offloaded to the CPU"),
    ],
)
def test_optimizer_graph_constraints_where_megatron_core_has_it(monkeypatch, fields, phrase):
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: True)
    config = with_optimizer(full_iteration(), optimizer_cuda_graph=True, **fields)
    problems = find_violations(read_settings(config))
    assert [v for v in problems if phrase in v.text], problems
    accepted(with_optimizer(full_iteration(), optimizer_cuda_graph=True))


def test_optimizer_graph_needs_a_warmup_and_no_fp16(monkeypatch):
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: True)
    config = with_optimizer(
        bridge(scope="attn", cuda_graph_warmup_steps=0, fp16=True), optimizer_cuda_graph=True
    )
    texts = [v.text for v in find_violations(read_settings(config))]
    assert any("creates Adam's state" in t for t in texts), texts
    assert any("loss scaler" in t for t in texts), texts


def test_optimizer_graph_release_is_a_note_without_megatron_core(monkeypatch):
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: None)
    violations, notes = evaluate(
        read_settings(with_optimizer(full_iteration(), optimizer_cuda_graph=True))
    )
    assert violations == []
    assert any("not checked" in note for note in notes)


# What still reads the host (or is frozen) inside a captured optimizer step (issue 21): each
# refused with its field and the fix, in a Bridge-style optimizer section and on a command line.
OPTIMIZER_STEP_REFUSALS = [
    (dict(log_num_zeros_in_grad=True), "optimizer.log_num_zeros_in_grad", "count_zeros_fp32"),
    (dict(loss_scale=4096.0), "optimizer.loss_scale", "found_inf.item()"),
    (dict(grad_norm_skip_threshold="1e5"), "optimizer.grad_norm_skip_threshold", "on the host"),
    (
        dict(use_precision_aware_optimizer=True),  # store_param_remainders: True by default
        "store_param_remainders",
        "Capturable mode doesn't support storing param remainders",
    ),
    (
        dict(
            use_precision_aware_optimizer=True,
            store_param_remainders=False,
            main_params_dtype="torch.bfloat16",
        ),
        "optimizer.main_params_dtype",
        "Capturable mode only supports fp32 master weights",
    ),
    (
        dict(use_precision_aware_optimizer=True, store_param_remainders=False, exp_avg_dtype="fp8"),
        "optimizer.exp_avg_dtype",
        "Capturable mode only supports fp32 exp_avg",
    ),
    (
        dict(
            use_precision_aware_optimizer=True,
            store_param_remainders=False,
            exp_avg_sq_dtype="fp16",
        ),
        "optimizer.exp_avg_sq_dtype",
        "Capturable mode only supports fp32 exp_avg_sq",
    ),
]


@pytest.mark.parametrize(
    "fields,field,phrase", OPTIMIZER_STEP_REFUSALS, ids=[f for _, f, _ in OPTIMIZER_STEP_REFUSALS]
)
def test_what_reads_the_host_in_the_optimizer_step_is_refused(monkeypatch, fields, field, phrase):
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: True)
    config = with_optimizer(full_iteration(), optimizer_cuda_graph=True, **fields)
    problems = [v for v in find_violations(read_settings(config)) if phrase in v.text]
    assert len(problems) == 1, find_violations(read_settings(config))
    assert problems[0].fields[0] == field
    assert "turn the optimizer graph off" in problems[0].fix
    # the same values without the optimizer graph are nobody's business here
    accepted(with_optimizer(full_iteration(), optimizer_cuda_graph=False, **fields))


@pytest.mark.parametrize(
    "argv,field,phrase",
    [
        (["--timing-log-level", "1"], "--timing-log-level", "timers synchronise"),
        (["--weight-decay-incr-style", "linear"], "--weight-decay-incr-style", "frozen"),
        (["--fp8-param-gather"], "--fp8-param-gather", "FP8 model weights with capturable=True"),
        (["--num-experts", "8"], "--num-experts", "combines on the host"),
    ],
)
def test_megatron_lm_flags_that_break_the_optimizer_graph(monkeypatch, argv, field, phrase):
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: True)
    base = dict(
        cuda_graph_impl="local", cuda_graph_scope=["full_iteration"], optimizer="adam",
        optimizer_cuda_graph=True, check_for_nan_in_loss_and_grad=False, te_rng_tracker=True,
        timing_log_level=0, weight_decay_incr_style="constant", fp8_param_gather=False,
        num_experts=None, use_distributed_optimizer=False,
    )  # fmt: skip
    flag, *value = argv
    name = flag.removeprefix("--").replace("-", "_")
    given = {"fp8_param_gather": True} if name == "fp8_param_gather" else {name: value[0]}
    problems = find_violations(read_settings(argparse.Namespace(**{**base, **given})))
    matching = [v for v in problems if phrase in v.text]
    assert len(matching) == 1, problems
    assert field in matching[0].fields[0]
    assert find_violations(read_settings(argparse.Namespace(**base))) == []


@pytest.mark.parametrize(
    "config,value",
    [
        (bridge(), "(True, 'transformer_engine', 'attn,mlp')"),
        (bridge("local", "attn"), "(True, 'local', 'attn')"),
    ],
    ids=["te-scopes", "local-attn"],
)
def test_fallback_outside_full_iteration_is_refused(config, value):
    rejected(
        with_fallback(config),
        fields=[
            "cuda_graph_fallback_on_slowdown",
            "model.cuda_graph_impl",
            "model.cuda_graph_scope",
        ],
        value=value,
        phrase="without a full-iteration graph it does nothing",
        fix="use cuda_graph_impl=local with scope full_iteration, or drop "
        "cuda_graph_fallback_on_slowdown",
    )


@pytest.mark.parametrize("scope", [[], "attn"])
def test_fallback_with_graphs_off_is_said_not_refused(scope):
    """A recipe's default fallback must not refuse its eager baseline (impl none)."""
    violations, notes = evaluate(read_settings(with_fallback(bridge("none", scope))))
    assert violations == []
    assert "cuda_graph_fallback_on_slowdown has nothing to do with CUDA graphs off " in notes[0]


@pytest.mark.parametrize("value", [True, "yes"])
def test_fallback_with_full_iteration_is_accepted(value):
    accepted(with_fallback(full_iteration(), value))


@pytest.mark.parametrize("value", [False, "off", None])
def test_fallback_off_is_accepted_with_any_scope(value):
    accepted(with_fallback(bridge(), value))
    accepted(with_fallback(bridge("none", []), value))


@pytest.mark.parametrize(
    "top,model,phrase",
    [
        (dict(cuda_graph_fallback_on_slowdown=True), {}, "fallback policy decides for one graph"),
        ({}, dict(pipeline_model_parallel_size=2), "not served with pipeline parallelism"),
    ],
)
def test_buckets_refuse_what_they_do_not_serve(top, model, phrase):
    config = full_iteration(cuda_graph_buckets=[512, 256], **model)
    vars(config).update(top)
    [violation] = [v for v in find_violations(read_settings(config)) if phrase in v.text]
    assert violation.fields[0] == "model.cuda_graph_buckets"
    assert violation.value.startswith("('256,512', ")


@pytest.mark.parametrize(
    "impl, scope, said",
    [
        ("local", "full_iteraton", "did you mean full_iteration?"),
        ("lcoal", "full_iteration", "did you mean local?"),
    ],
)
def test_buckets_leave_a_misspelt_impl_or_scope_to_its_own_rule(impl, scope, said):
    """(user trial, 2026-12-05: a typo in the scope was first told "sequence-length buckets
    are full-iteration graphs ... use cuda_graph_impl=local with scope full_iteration", what
    the user had asked for.)"""
    config = bridge(impl, scope, cuda_graph_buckets="256,512")
    [violation] = find_violations(read_settings(config))
    assert said in violation.fix
    # a known scope that buckets do not serve is still refused by the bucket rule
    texts = [v.text for v in find_violations(read_settings(bridge(cuda_graph_buckets="256")))]
    assert any("buckets are full-iteration graphs" in text for text in texts), texts


def test_one_bucket_given_as_an_int_reads_as_its_string_does():
    """(user trial, 2026-12-05: YAML's `cuda_graph_buckets: 512` was refused while "512" was
    read.) pad_step's own argument stays a list (check_buckets names a lone int)."""
    from cudagraph_plugin.config.buckets import parse_buckets

    for one in (512, "512", [512]):
        assert read_settings(full_iteration(cuda_graph_buckets=one)).buckets == (512,)
    with pytest.raises(ValueError, match="not a list of sequence lengths"):
        parse_buckets(512)  # (pad_step's buckets: a list, as the review of 2026-12-05 said)
    [problem] = find_violations(read_settings(full_iteration(cuda_graph_buckets=True)))
    assert "model.cuda_graph_buckets" in problem.fields


def test_buckets_beyond_the_learned_position_embeddings_are_refused_where_the_config_says_them():
    """(user trial, 2026-12-05: check said OK for buckets 16,32,64 on a model of 48 learned
    positions, which the model build refuses on a GPU and the model itself fails at.)"""
    config = full_iteration(
        cuda_graph_buckets="16,32,64", seq_length=48, position_embedding_type="learned_absolute"
    )
    [violation] = find_violations(read_settings(config))
    assert violation.fields == (
        "model.cuda_graph_buckets",
        "model.seq_length",
        "model.position_embedding_type",
    )
    assert violation.value == "('16,32,64', 48, 'learned_absolute')"
    assert "learned position embeddings end at 48: a step padded to bucket(s) 64" in violation.text
    assert violation.fix.startswith("give buckets up to 48 (e.g. 16,32,48), or a model with ")
    assert "model.position_embedding_type=rope" in violation.fix
    # Megatron-LM's table ends at max_position_embeddings where it is given
    config.model.max_position_embeddings = 64
    accepted(config)
    config.model.max_position_embeddings = 60
    [violation] = find_violations(read_settings(config))
    assert violation.fields[1] == "model.max_position_embeddings" and "end at 60" in violation.text
    # a value that is no whole number leaves the limit unknown: it refuses nothing (review of
    # 2026-12-05: 4096.0 refused every run, graphs off too); a string of one is read
    for unknown in (4096.0, 0, "abc", True):
        config.model.max_position_embeddings = unknown
        accepted(config)
    for text in ("60", " +60 "):  # read as the plugin's own integer fields read it
        config.model.max_position_embeddings = text
        [violation] = find_violations(read_settings(config))
        assert "end at 60" in violation.text
    # rotary embeddings have no table to run past: neither a problem nor advice
    rope = full_iteration(
        cuda_graph_buckets="16,32,64", seq_length=48, position_embedding_type="rope"
    )
    accepted(rope)
    assert not [n for n in notes(rope) if "position" in n]
    # a config that does not say its position embeddings gets the advice only
    unsaid = full_iteration(cuda_graph_buckets="16,32,64", seq_length=48)
    accepted(unsaid)
    [note] = [n for n in notes(unsaid) if "go up to" in n]
    assert "cuda_graph_buckets go up to 64 but model.seq_length is 48" in note


@pytest.mark.parametrize(
    "model,multiple,fields",
    [
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), 2, 3),
        (dict(context_parallel_size=2), 4, 2),
        (dict(tensor_model_parallel_size=4, sequence_parallel=True, context_parallel_size=2), 8, 4),
    ],
    ids=["sequence-parallel", "context-parallel", "both"],
)
def test_buckets_the_parallel_layout_cannot_split_are_refused(model, multiple, fields):
    config = full_iteration(cuda_graph_buckets="250,512,1001", **model)
    [violation] = [v for v in find_violations(read_settings(config)) if "multiples" in v.text]
    assert f"not multiples of {multiple}" in violation.text
    assert len(violation.fields) == fields and violation.fields[0] == "model.cuda_graph_buckets"
    rounded = ",".join(str(-(-b // multiple) * multiple) for b in (250, 512, 1001))
    assert f"e.g. {rounded}" in violation.fix
    even = full_iteration(cuda_graph_buckets=rounded, **model)
    assert not [v for v in find_violations(read_settings(even)) if "multiples" in v.text]
    # two buckets rounding to one length are suggested once (review of 2026-12-04: "256,256",
    # itself refused as a length given twice)
    twice = full_iteration(cuda_graph_buckets="255,256", **model)
    [violation] = [v for v in find_violations(read_settings(twice)) if "multiples" in v.text]
    assert violation.fix.endswith("e.g. 256")
    # tensor parallelism alone (no sequence parallelism) splits no sequence
    plain = full_iteration(cuda_graph_buckets="250", tensor_model_parallel_size=2)
    assert not [v for v in find_violations(read_settings(plain)) if "multiples" in v.text]


def test_baseline_steps_raise_the_warmup_and_say_so():
    config = bridge(scope="attn", cuda_graph_warmup_steps=2)
    config.cuda_graph_baseline_steps = 6
    settings = read_settings(config)
    assert settings.warmup_steps == 7 and settings.warmup_from_baseline == 2
    [note] = [n for n in advice(settings, environ={}) if "baseline" in n]
    assert "capturing after 7 eager step(s) instead of 2" in note
    longer = bridge(cuda_graph_warmup_steps=9)
    longer.cuda_graph_baseline_steps = 6
    assert read_settings(longer).warmup_steps == 9


@pytest.mark.parametrize(
    "config, field",
    [
        (megatron_lm_args(pipeline_model_parallel_size=1, check_for_large_grads=True),
         "--check-for-large-grads"),
        (megatron_lm_args(pipeline_model_parallel_size=1, check_for_spiky_loss=True),
         "--check-for-spiky-loss"),
    ],
    ids=["large-grads", "spiky-loss"],
)  # fmt: skip
def test_full_iteration_refuses_the_checks_that_read_a_history_on_the_host(config, field):
    """Both run megatron-core's rerun state machine on a device value (a host read) inside
    the captured forward/backward, as the NaN checks do."""
    rejected(
        config,
        fields=(field,),
        value="True",
        phrase="with its history on the host",
        fix=f"drop {field}, or use TE scopes",
    )
    setattr(config, field[2:].replace("-", "_"), False)
    accepted(config)
    bridge_config = bridge(scope="attn,mlp")
    bridge_config.ddp.check_for_large_grads = True
    bridge_config.rerun_state_machine.check_for_spiky_loss = True
    accepted(bridge_config)  # per-layer graphs leave both outside


def test_a_zero_loss_scale_builds_no_scaler_for_bf16_and_the_optimizer_graph_takes_it(
    monkeypatch,
):
    """megatron-core tests ``if config.loss_scale:``: 0 (a common spelling of "dynamic")
    builds no scaler in bf16, so no found_inf.item() in the captured step."""
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: True)
    config = with_optimizer(full_iteration(), optimizer_cuda_graph=True, loss_scale=0)
    assert find_violations(read_settings(config)) == []


def test_an_optimizer_name_is_read_as_written_and_judged_only_by_the_optimizer_graph():
    """megatron-core compares ``config.optimizer == 'adam'``: "Adam" is kept as written;
    without the optimizer graph no rule reads it (megatron-core reports an unknown name)."""
    settings = read_settings(with_optimizer(full_iteration(), optimizer="Adam"))
    assert settings.optimizer == "Adam" and settings.input_problems == ()
    accepted(with_optimizer(bridge(scope="attn,mlp"), optimizer="AdamW"))


# -- the run report's JSON path -------------------------------------------------------------------

REPORT_FIX = (
    "point cuda_graph_report_json at a file in a writable directory (missing directories are "
    "created), or drop it"
)


@pytest.mark.parametrize("impl,scope", [("none", []), ("local", "full_iteration")])
def test_a_report_path_that_is_a_directory_is_refused_in_any_mode(tmp_path, impl, scope):
    rejected(
        with_report(bridge(impl, scope), str(tmp_path)),
        fields=["cuda_graph_report_json"],
        value=repr(str(tmp_path)),
        phrase="the run report cannot be written there (it is a directory); it is written at "
        "shutdown, so the run would fail after its last step",
        fix=REPORT_FIX,
    )


def test_a_rank_checks_the_report_file_it_writes(tmp_path, monkeypatch):
    """Rank N writes ``<stem>.rankN<suffix>`` (2026-12-05: the check looked at rank 0's path
    alone, and rank 1 failed at shutdown, after its last step, with IsADirectoryError)."""
    (tmp_path / "report.rank1.json").mkdir()
    config = with_report(bridge(), str(tmp_path / "report.json"))
    monkeypatch.setenv("RANK", "0")
    accepted(config)
    monkeypatch.setenv("RANK", "1")
    rejected(
        config,
        fields=["cuda_graph_report_json"],
        value=repr(str(tmp_path / "report.json")),
        phrase=f"the run report cannot be written to {str(tmp_path / 'report.rank1.json')!r}, "
        "rank 1's own file (it is a directory)",
        fix=REPORT_FIX,
    )
    monkeypatch.setenv("RANK", "2")
    accepted(config)


def test_a_report_path_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "sub" / "r.json"
    rejected(
        with_report(bridge(), path),  # a Path too, as a host may give it
        fields=["cuda_graph_report_json"],
        value=repr(str(path)),
        phrase=f"the run report cannot be written there ({str(tmp_path / 'file')!r} is not a "
        "directory)",
        fix=REPORT_FIX,
    )


def test_a_report_path_in_an_unwritable_directory_is_refused(tmp_path, monkeypatch):
    # (os.access, not chmod: the suite may run as root, for whom every directory is writable)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    for path in (locked / "r.json", locked / "missing" / "r.json"):
        rejected(
            with_report(bridge(), str(path)),
            fields=["cuda_graph_report_json"],
            value=repr(str(path)),
            phrase=f"(the directory {str(locked)!r} is not writable)",
            fix=REPORT_FIX,
        )


def test_a_report_file_that_is_not_writable_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("{}")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != path and real_access(p, mode))
    rejected(
        with_report(bridge(), str(path)),
        fields=["cuda_graph_report_json"],
        value=repr(str(path)),
        phrase="(the file exists and is not writable)",
        fix=REPORT_FIX,
    )


def test_a_report_path_the_filesystem_refuses_is_refused_where_the_permission_bits_allow_it(
    tmp_path, monkeypatch
):
    """Root passes every ``os.access`` check, also where the filesystem itself refuses a
    file (/proc, an NFS export that squashes root): the rule asks the filesystem, and leaves
    nothing behind where it accepts (a user's trial of 2026-12-05 as root: a report under
    /proc was accepted, and the run failed at shutdown after its last step)."""
    monkeypatch.setattr(os, "access", lambda p, mode: True)  # (what root is told)
    fifo = tmp_path / "fifo.json"  # (no reader: the report's write would wait for ever)
    os.mkfifo(fifo)
    cases = (
        ("/proc/mcgraph-nothing/r.json", "(no file can be created in the directory '/proc' ("),
        (str(fifo), "(the file exists and cannot be opened for writing (No such device or "),
    )
    for path, phrase in cases:
        rejected(
            with_report(bridge(), path),
            fields=["cuda_graph_report_json"],
            value=repr(path),
            phrase=phrase,
            fix=REPORT_FIX,
        )
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    for path in (existing, tmp_path / "new" / "r.json"):
        accepted(with_report(bridge(), str(path)))
    assert existing.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.json", "old.json"]  # (no probe)


def test_a_report_path_that_cannot_be_looked_at_is_refused_with_the_reason(tmp_path, monkeypatch):
    """A directory on the way that cannot be entered: is_dir() raises PermissionError, which
    the rule says rather than raise (sixth review: a traceback from the check, exit 1)."""
    real_is_dir = Path.is_dir

    def is_dir(self):
        if tmp_path / "private" in (self, *self.parents):
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir)
    path = tmp_path / "private" / "sub" / "r.json"
    rejected(
        with_report(bridge(), str(path)),
        fields=["cuda_graph_report_json"],
        value=repr(str(path)),
        phrase="the run report cannot be written there (Permission denied)",
        fix=REPORT_FIX,
    )


def test_a_report_path_that_is_a_link_to_nowhere_is_refused(tmp_path):
    link = tmp_path / "r.json"
    link.symlink_to(tmp_path / "gone" / "r.json")
    rejected(
        with_report(bridge(), str(link)),
        fields=["cuda_graph_report_json"],
        value=repr(str(link)),
        phrase=f"(it is a symbolic link to {str(tmp_path / 'gone' / 'r.json')!r}, whose "
        "directory does not exist)",
        fix=REPORT_FIX,
    )
    # a link to a file still to be written in a directory that exists is fine
    (tmp_path / "gone").mkdir()
    accepted(with_report(bridge(), str(link)))


def test_a_report_path_under_a_link_to_nowhere_or_through_a_loop_of_links_is_refused(tmp_path):
    (tmp_path / "outputs").symlink_to(tmp_path / "gone" / "job")
    path = tmp_path / "outputs" / "r.json"
    rejected(
        with_report(bridge(), str(path)),
        fields=["cuda_graph_report_json"],
        value=repr(str(path)),
        phrase=f"({str(tmp_path / 'outputs')!r} is a symbolic link to a directory that does "
        "not exist)",
        fix=REPORT_FIX,
    )
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    rejected(
        with_report(bridge(), str(loop)),
        fields=["cuda_graph_report_json"],
        value=repr(str(loop)),
        phrase="the run report cannot be written there (Too many levels of symbolic links)",
        fix=REPORT_FIX,
    )


def test_report_paths_are_not_checked_where_the_run_does_not_write(tmp_path):
    config = with_report(bridge(), str(tmp_path))  # a directory: refused where the run is
    elsewhere = Environment.of(None)
    violations, notes = evaluate(read_settings(config), replace(elsewhere, paths_here=False))
    assert violations == []
    assert notes == [
        f"cuda_graph_report_json={str(tmp_path)!r}: whether the run report can be written there "
        "is not checked here (the run's filesystem may not be mounted); the run checks it when "
        "it starts, before anything is built"
    ]


def test_report_paths_the_report_can_be_written_to_are_accepted(tmp_path, monkeypatch):
    (tmp_path / "old.json").write_text("{}")  # replaced at shutdown
    monkeypatch.chdir(tmp_path)
    for path in ("r.json", "old.json", str(tmp_path / "new" / "deeper" / "r.json"), None, ""):
        accepted(with_report(bridge(), path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # the check wrote nothing


def test_a_bridge_mixed_precision_recipe_leaves_the_layers_precision_to_the_build_check():
    """Megatron-Bridge's recipe sets model.bf16 when the config is finalised, which may come
    after the run's configure: ``model.bf16=False`` beside a recipe says nothing yet (the
    built model's parameters are checked at ``run.model_built()``)."""
    config = bridge(bf16=False)
    rejected(
        config,
        fields=["model.cuda_graph_impl", "model.bf16"],
        value="('transformer_engine', False)",
        phrase="layers whose parameters are fp32 fail at the capture step",
        fix='train in bf16 (set model.bf16=True, or mixed_precision="bf16_mixed", which sets '
        "the optimizer's too), or use model.cuda_graph_impl=local with "
        "model.cuda_graph_scope=full_iteration",
    )
    config.mixed_precision = "bf16_mixed"
    accepted(config)
    assert read_settings(config).mixed_precision == "bf16_mixed"
    # (Bridge's optimizer.bf16 is not the layers' precision: not read, so no disagreement)
    config.optimizer = NS(bf16=True)
    assert not read_settings(config).disagreements


def test_te_layer_precision_is_left_to_the_build_where_the_config_may_not_decide_it(
    monkeypatch,
):
    """A flat config holding a TransformerConfig's defaults (bf16 off, fp32) may belong to a
    host that casts the model itself (model.bfloat16()): the built model's parameters decide
    (review of 2026-12-05). A megatron-core that builds the sample inputs in the config's
    dtype (its development branch since mid-2026) refuses nothing."""
    from cudagraph_plugin.config import environment

    flat = {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn", "bf16": False}
    accepted({**flat, "params_dtype": "torch.float32"})
    rejected(
        {**flat, "fp16": True},
        fields=["cuda_graph_impl", "fp16"],
        value="('transformer_engine', True)",
        phrase="layers whose parameters are fp16 fail at the capture step",
        fix="train in bf16 (set bf16=True; set fp16=False), or use cuda_graph_impl=local",
    )
    monkeypatch.setattr(environment, "mcore_te_samples_in_bf16", lambda: False)
    accepted({**flat, "fp16": True})
    accepted(bridge(bf16=False))


def test_the_sample_inputs_dtype_is_read_from_the_installed_megatron_core(tmp_path, monkeypatch):
    """0.16.1 (installed here) builds them as bfloat16; a megatron-core whose
    ``get_layer_static_inputs`` takes the config's dtype (its development branch) does not
    (read from the module's text: no import, no GPU)."""
    from cudagraph_plugin.config import environment

    environment.mcore_te_samples_in_bf16.cache_clear()
    assert environment.mcore_te_samples_in_bf16() is True
    module = tmp_path / "module.py"
    module.write_text(
        "class GraphableMegatronModule:\n"
        "    def get_layer_static_inputs(self, seq_length, micro_batch_size):\n"
        "        dtype = self.config.params_dtype\n"
        "        return {'hidden_states': torch.ones((1,), dtype=dtype)}\n\n"
        "    def other(self):\n"
        "        return torch.ones((1,), dtype=torch.bfloat16)\n"
    )
    monkeypatch.setattr(environment, "_megatron_file", lambda *parts: module)
    environment.mcore_te_samples_in_bf16.cache_clear()
    try:
        assert environment.mcore_te_samples_in_bf16() is False
    finally:
        environment.mcore_te_samples_in_bf16.cache_clear()
