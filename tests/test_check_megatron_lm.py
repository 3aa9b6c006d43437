"""The check command on Megatron-LM command lines as its ``validate_args`` reads them.

(2026-12-05, a review against Megatron-LM 0.19.2's ``arguments.py`` and megatron-core's
``TransformerConfig``: the check read the flags without what ``validate_args`` derives from
them, said OK for jobs megatron-core refuses, FAILED for valid interleaved pipelines, named
flags Megatron-LM does not have and wrote ``--flag=True`` for switches that take no value.)
"""

from __future__ import annotations

import argparse
import io
from types import SimpleNamespace as NS

import pytest

from cudagraph_plugin.cli import megatron_lm as check_cli
from cudagraph_plugin.cli.check import run_check
from cudagraph_plugin.config import environment
from cudagraph_plugin.config.check import check_config

FULL = [
    "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
    "--no-check-for-nan-in-loss-and-grad",
]  # fmt: skip
PP2 = ["--pipeline-model-parallel-size", "2"]
PIPELINE_REFUSED = "full_iteration with pipeline parallelism"


def check(argv):
    out = io.StringIO()
    code = run_check(argv, out=out)
    return code, out.getvalue()


def derived(out):
    return [line for line in out.splitlines() if "derived as Megatron-LM's validate_args" in line]


# -- virtual pipeline stages, derived as validate_args derives them -----------------------------


@pytest.mark.parametrize(
    "stages",
    [
        ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"],
        ["--pipeline-model-parallel-layout", "Et*2|t*2|t*2|t*2L"],
        ["--pipeline-model-parallel-layout", "E|(t|)*2L"],
        ["--num-virtual-stages-per-pipeline-rank", "2"],
        # (Megatron-LM counts the embedding and the loss as a layer each with these: 8)
        [
            "--num-layers",
            "6",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
        ],
    ],
)
def test_interleaved_pipeline_from_any_of_its_flags_is_ok(stages):
    # before: the first two exited 1 with a fix naming the very flag given
    code, out = check([*FULL, *PP2, *stages])
    assert code == 0, out
    assert PIPELINE_REFUSED not in out
    (line,) = derived(out)
    flag = next(s for s in stages if "virtual" in s or "layout" in s)
    assert f"{flag}: 2 virtual stage(s) per pipeline rank" in line


def test_one_virtual_stage_per_rank_is_none_and_batches_p2p():
    # before: OK, and the capture failed on the GPU ("operation not permitted when stream is
    # capturing"): Megatron-LM turns one virtual stage into none, and batches the exchanges
    code, out = check([*FULL, *PP2, "--num-virtual-stages-per-pipeline-rank", "1"])
    assert code == 1, out
    assert PIPELINE_REFUSED in out
    (line,) = derived(out)
    assert "1 virtual stage(s) per pipeline rank (one is none" in line
    code, out = check(
        [*FULL, *PP2, "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "2"]
    )
    assert (code, PIPELINE_REFUSED in out) == (1, True)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--num-layers", "7", "--num-layers-per-virtual-pipeline-stage", "2"], "whole divisions"),
        (["--num-layers-per-virtual-pipeline-stage", "2"], "needs the layers and whole"),
        (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "0"], "number >= 1"),
        (
            [
                "--num-layers",
                "8",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--decoder-first-pipeline-num-layers",
                "3",
            ],
            "please use --num-virtual-stages-per-pipeline-rank",
        ),
        (["--pipeline-model-parallel-layout", "Et|t|tL"], "do not divide among 2"),
        (
            [
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--pipeline-model-parallel-layout",
                "E|t|t|L",
            ],
            "one of them at most",
        ),
        (
            ["--num-layers-per-virtual-pipeline-stage", "two", "--num-layers", "8"],
            "not a whole number",
        ),
    ],
)
def test_bad_virtual_stage_flags_are_problems(flags, said):
    code, out = check([*FULL, *PP2, *flags])
    assert code == 1, out
    assert said in out


@pytest.mark.parametrize(
    "layout",
    ["Et*2|t*2|t*2|t*2L", "E|(t|)*6L", "Ettt|(tt|)*29,m|L", "(|ab)*2", "t", "Et,t|t,tL"],
)
def test_layout_stages_count_as_megatron_core_counts(layout):
    # (the check imports no megatron-core: the count is its own, compared here with the real one)
    pytest.importorskip("torch")
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    text = layout.replace("a", "t").replace("b", "t")
    counted = PipelineParallelLayerLayout.get_num_stages_from_str(text)
    assert check_cli.layout_stages(text) == counted


# -- other settings validate_args derives -------------------------------------------------------


def test_recompute_activations_is_selective_recompute():
    # before: skipped as unknown (or exit 2) and OK; megatron-core refuses graphed attention
    # recomputed with dropout ("attention dropout is not supported with graphed attention
    # recomputation")
    code, out = check([*FULL, "--recompute-activations"])
    assert code == 1, out
    assert "--recompute-activations: --recompute-granularity selective" in derived(out)[0]
    assert "attention dropout is not supported with graphed attention recomputation" in out
    assert check([*FULL, "--recompute-activations", "--attention-dropout", "0"])[0] == 0


def test_cpu_offloading_num_layers_turns_offloading_on():
    # before: OK; megatron-core raises "CUDA graphs not supported with CPU offloading"
    te = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"]
    code, out = check([*te, "--cpu-offloading-num-layers", "2"])
    assert code == 1, out
    assert "--cpu-offloading-num-layers 2: --cpu-offloading" in derived(out)[0]
    assert "CUDA graphs not supported with CPU offloading" in out
    assert check([*te, "--cpu-offloading-num-layers", "0"])[0] == 0


# -- what Megatron-LM's launcher refuses before any plugin runs ----------------------------------


def test_full_iteration_with_the_nan_check_on_names_megatron_lm_flag():
    code, out = check(["--cuda-graph-impl", "full_iteration"])
    assert code == 0, out
    assert "pass --no-check-for-nan-in-loss-and-grad" in out
    assert "--no-check-for-nan-in-loss)" not in out  # (no such Megatron-LM flag)
    (note,) = [line for line in out.splitlines() if "validate_args refuses full-iteration" in line]
    assert "--no-check-for-nan-in-loss-and-grad on its command line" in note
    _, out = check(FULL)
    assert "validate_args refuses" not in out


def test_te_graphs_with_expandable_segments_say_megatron_lm_refuses_them(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    code, out = check(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"])
    assert code == 0, out
    assert "a Megatron-LM launcher needs NCCL_GRAPH_REGISTER=0 in its environment" in out
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert (
        "NCCL_GRAPH_REGISTER=0 in its environment"
        not in check(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"])[1]
    )


# -- full_iteration in the scope with graphs off ------------------------------------------------


@pytest.mark.parametrize(
    "flag, newer_installed",
    [("--cuda-graph-modules", False), ("--cuda-graph-modules", True), ("--cuda-graph-scope", True)],
)
def test_full_iteration_scope_without_impl_is_a_problem_where_it_means_graphs(
    monkeypatch, flag, newer_installed
):
    # before: "auto-fix: cuda_graph_impl is none: cleared --cuda-graph-modules" and OK, a job
    # megatron-core 0.18+ runs with graphs (its migration of this deprecated spelling) ran
    # eagerly
    monkeypatch.setattr(environment, "mcore_spells_modules", lambda: newer_installed)
    code, out = check([flag, "full_iteration"])
    assert code == 1, out
    assert "cleared" not in out
    assert (
        "megatron-core 0.18+ reads this deprecated spelling as cuda_graph_impl=full_iteration"
        in out
    )
    assert "set --cuda-graph-impl=full_iteration (megatron-core 0.18+)" in out


def test_full_iteration_scope_without_impl_on_0_16_in_its_spelling_is_graphs_off(monkeypatch):
    """megatron-core 0.16 runs ``--cuda-graph-impl none --cuda-graph-scope full_iteration``
    eagerly: cleared with its log line, as any scope with graphs off."""
    monkeypatch.setattr(environment, "mcore_spells_modules", lambda: False)
    for argv in (
        ["--cuda-graph-scope", "full_iteration"],
        ["--cuda-graph-impl", "none", "--cuda-graph-scope", "attn"],
    ):
        code, out = check(argv)
        assert code == 0 and "cleared --cuda-graph-scope (was " in out, out


@pytest.mark.parametrize("newer_installed", [False, True])
def test_the_harness_override_to_none_clears_a_full_iteration_scope(monkeypatch, newer_installed):
    """The harness override ``--cuda-graph-impl none`` on a full-iteration recipe asks for
    graphs off: its scope is cleared (review of 2026-12-05: it was refused with the problem
    above, and the eager baseline of a full-iteration recipe could not be made)."""
    from cudagraph_plugin.cli.overrides import apply_overrides

    monkeypatch.setattr(environment, "mcore_spells_modules", lambda: newer_installed)
    recipe = NS(model=NS(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]))
    changes = apply_overrides(recipe, cuda_graph_impl="none")
    assert recipe.model.cuda_graph_scope == []
    assert any("cuda_graph_scope" in change for change in changes), changes
    assert check_config(recipe, environ={}).ok


def test_full_iteration_scope_without_impl_is_refused_in_a_bridge_config():
    config = NS(model=NS(cuda_graph_impl="none", cuda_graph_modules=["full_iteration"]))
    result = check_config(config, environ={})
    assert not result.ok
    assert result.problems[0].fields == ("model.cuda_graph_impl", "model.cuda_graph_modules")
    assert result.autofixes == ()


# -- CPU offloading with the full-iteration graph on megatron-core 0.19 --------------------------


def test_cpu_offloading_with_full_iteration_follows_the_installed_megatron_core(monkeypatch):
    args = [*FULL, "--cpu-offloading"]
    # megatron-core 0.16.1 (installed here) refuses offloading with any graph
    assert environment.mcore_offloads_with_full_iteration() is False
    code, out = check(args)
    assert code == 1 and "megatron-core 0.19 accepts offloading with the full-iteration" in out
    # megatron-core 0.19.2's condition, read from its source as the check reads it
    source = 'if self.cpu_offloading and self.cuda_graph_impl != "full_iteration":\n'
    monkeypatch.setattr(environment, "_transformer_config_source", lambda: source)
    environment.mcore_offloads_with_full_iteration.cache_clear()
    try:
        code, out = check(args)
        assert code == 0, out
        assert "note: CPU offloading with the full-iteration graph: megatron-core" in out
        # per-layer graphs: refused by 0.19 as well
        te = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"]
        assert check([*te, "--cpu-offloading"])[0] == 1
    finally:
        environment.mcore_offloads_with_full_iteration.cache_clear()


# -- fixes that can be typed ---------------------------------------------------------------------


def test_switch_fixes_say_pass_or_drop_not_equals_true():
    # before: "set --overlap-param-gather-with-optimizer-step=False", which argparse refuses
    code, out = check([*FULL, "--overlap-param-gather-with-optimizer-step"])
    assert code == 1
    assert "fix: drop --overlap-param-gather-with-optimizer-step, or use TE scopes" in out
    assert "=False" not in out.split("problem(s)")[1]


def test_train_gpt_pipeline_fix_names_its_negative_flag():
    # before: "set --batch-p2p-comm=False" ("ignored explicit argument 'False'")
    args = argparse.Namespace(
        cuda_graph_impl="local",
        cuda_graph_scope=["full_iteration"],
        pipeline_model_parallel_size=2,
        batch_p2p_comm=True,
        te_rng_tracker=True,
    )
    result = check_config(args, environ={})
    (problem,) = [p for p in result.problems if "pipeline" in p.problem]
    assert problem.fix.startswith("pass --no-batch-p2p-comm or set batch_p2p_sync=False")


def test_a_config_object_fix_keeps_field_equals_value():
    config = NS(
        model=NS(cuda_graph_impl="local", cuda_graph_scope="full_iteration", cpu_offloading=True)
    )
    (problem,) = [p for p in check_config(config, environ={}).problems if "offload" in p.problem]
    assert problem.fix.startswith("set model.cpu_offloading=False")


# -- hints ----------------------------------------------------------------------------------------


def test_a_real_megatron_lm_flag_gets_no_did_you_mean(capsys):
    # before: "--inference-rng-tracker: did you mean --te-rng-tracker?" (another setting)
    with pytest.raises(SystemExit):
        check([*FULL, "--inference-rng-tracker"])
    err = capsys.readouterr().err
    assert "did you mean" not in err
    with pytest.raises(SystemExit):
        check([*FULL, "--te-rng-trackr"])
    assert "--te-rng-trackr: did you mean --te-rng-tracker?" in capsys.readouterr().err


def test_delay_wgrad_without_ep_overlap_is_refused_with_its_fix():
    code, out = check(
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp",
         "--delay-wgrad-compute", "--disable-bias-linear", "--te-version", "2.12"]
    )  # fmt: skip
    # before: OK; megatron-core asserts "overlap_moe_expert_parallel_comm must be enabled when
    # enabling delay_wgrad_compute"
    assert code == 1
    assert "fix: pass --overlap-moe-expert-parallel-comm" in out
    assert "or drop --delay-wgrad-compute" in out


@pytest.mark.parametrize(
    "pp, overlap, ok",
    [("1", [], False), ("2", [], True), ("2", ["--no-overlap-p2p-communication"], False),
     ("3", ["--no-overlap-p2p-communication"], True)],
)  # fmt: skip
def test_virtual_stages_need_the_pipeline_ranks_megatron_lm_asserts(pp, overlap, ok):
    # before: OK for each; Megatron-LM asserts more than 1 pipeline rank (2 without overlap)
    te = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"]
    code, out = check(
        [
            *te,
            "--pipeline-model-parallel-size",
            pp,
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            *overlap,
        ]
    )
    assert (code == 0) == ok, out
    assert ("the interleaved schedule needs at least" in out) == (not ok)


def test_a_bad_pipeline_size_is_said_once():
    code, out = check([*FULL, "--pipeline-model-parallel-size", "two"])
    assert code == 1
    assert out.count("'two'") == 1, out


def test_offloading_from_its_layer_count_is_turned_off_through_that_flag():
    te = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"]
    _, out = check([*te, "--cpu-offloading-num-layers", "2"])
    assert "fix: set --cpu-offloading-num-layers 0, or turn CUDA graphs off" in out


def test_an_inverted_switch_fix_names_the_flag_that_turns_it_off():
    # before: "drop --store-param-remainders", a flag that does not exist (the check's own and
    # Megatron-LM's is --no-store-param-remainders)
    code, out = check(
        [
            *FULL,
            "--optimizer-cuda-graph",
            "--use-precision-aware-optimizer",
            "--use-distributed-optimizer",
        ]
    )
    assert code == 1
    assert "fix: pass --no-store-param-remainders, or turn the optimizer graph off" in out


def test_a_flag_cut_short_gets_the_flag_it_starts(capsys):
    with pytest.raises(SystemExit):
        check([*FULL, "--delay-wgrad", "--micro-batch", "2"])
    err = capsys.readouterr().err
    assert "--delay-wgrad: did you mean --delay-wgrad-compute?" in err
    assert "--micro-batch: did you mean --micro-batch-size?" in err


def test_bridge_comm_overlap_settings_are_read_over_the_model_ones():
    """Megatron-Bridge's CommOverlapConfig holds delay_wgrad_compute and the expert-parallel
    overlap (None: the model's); a value there is written over the model's."""
    model = NS(
        cuda_graph_impl="transformer_engine", cuda_graph_scope="moe_router,moe_preprocess",
        num_moe_experts=8, delay_wgrad_compute=True, overlap_moe_expert_parallel_comm=False,
        use_te_rng_tracker=True, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    config = NS(
        model=model,
        comm_overlap=NS(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=None),
    )
    assert not [p for p in check_config(config, environ={}).problems if "overlap" in p.problem]
    config.comm_overlap.overlap_moe_expert_parallel_comm = None
    (problem,) = [p for p in check_config(config, environ={}).problems if "overlap" in p.problem]
    assert problem.fields == ("model.delay_wgrad_compute", "model.overlap_moe_expert_parallel_comm")


def test_megatron_core_0_19_source_has_the_offloading_condition_read():
    """The condition :func:`environment.mcore_offloads_with_full_iteration` looks for, in the
    real megatron-core 0.19 ``TransformerConfig`` where its sources are here (the test
    above patches it in; this one says when 0.19 reworded it)."""
    from test_fakes import _mcore_019_sources

    root = _mcore_019_sources()
    if root is None:
        pytest.skip("megatron-core 0.19 sources not here (MCORE_019_SRC)")
    text = (root / "megatron/core/transformer/transformer_config.py").read_text()
    environment._transformer_config_source.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(environment, "_transformer_config_source", lambda: text)
            environment.mcore_offloads_with_full_iteration.cache_clear()
            assert environment.mcore_offloads_with_full_iteration() is True
    finally:
        environment.mcore_offloads_with_full_iteration.cache_clear()
