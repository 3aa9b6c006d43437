"""Every rank of a job runs the same CUDA graph settings (``runtime.agreement``).

(2026-12-05, a review of multi-rank failure paths on gloo: a launcher giving rank 1
``--cuda-graph-warmup-steps 5`` and rank 0 the default 3 passed every rank's own check; with
graphs, rank 0 captured at step 3 and waited in the capture's barrier while rank 1 ran its
eager all-reduce: no word, until torchrun killed both.)
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.runtime import agreement
from jobs import CPU_RANKS, run_job, torchrun_command

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

HOST = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {examples!r})
    import train_gpt
    per_rank = {per_rank!r}[int(os.environ["RANK"])]
    sys.argv = ["train_gpt.py", "--train-iters", "4", "--log-interval", "0",
                "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", *per_rank]
    sys.exit(train_gpt.main())
    """
)


def _job(tmp_path: Path, per_rank: list[list[str]]):
    script = tmp_path / "host.py"
    script.write_text(HOST.format(examples=str(EXAMPLES), per_rank=per_rank))
    job = run_job(
        torchrun_command(2, script),
        log_dir=tmp_path / "job",
        timeout_s=150,
        env={**os.environ, **CPU_RANKS},
        name="agreement",
    )
    assert not job.timed_out and not job.leftovers, job.tail()
    return job, job.output()


@needs_mcore_on_cpu
@pytest.mark.slow
def test_ranks_with_different_warmups_refuse_the_run_naming_the_setting(tmp_path):
    job, output = _job(tmp_path, [[], ["--cuda-graph-warmup-steps", "5"]])
    assert job.rc != 0, output[-4000:]
    assert "--cuda-graph-warmup-steps = " in output, output[-4000:]
    # which rank holds which value, in the one refusal the job prints
    assert "differs between the ranks of this job (3 on rank 0; 5 on rank 1)" in output
    # refused where the process group first exists, before any training step, exit 2
    assert "0 step(s) timed" in output
    assert "exitcode  : 2" in output


@needs_mcore_on_cpu
@pytest.mark.slow
def test_ranks_with_different_train_iters_refuse_the_run_at_the_training_start(tmp_path):
    """(A rank that completes its run first marks no failure: the others waited in a
    collective no peer joins, over NCCL until its timeout.)"""
    job, output = _job(tmp_path, [[], ["--train-iters", "6"]])
    assert job.rc != 0, output[-4000:]
    assert "TrainingRun(train_iters=...) = " in output, output[-4000:]
    assert "0 step(s) timed" in output and "exitcode  : 2" in output


@needs_mcore_on_cpu
@pytest.mark.slow
def test_ranks_with_the_same_settings_train(tmp_path):
    job, output = _job(tmp_path, [["--cuda-graph-warmup-steps", "2"]] * 2)
    assert job.rc == 0, output[-4000:]
    assert "differs between the ranks" not in output


def test_differing_settings_are_found_from_the_folded_digests(monkeypatch):
    """The fold itself, with a stand-in for the all-reduce that holds another rank's
    settings: the element-wise maximum of both ranks' values, as the real one gives."""
    mine = read_settings({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})
    other = read_settings(
        {
            "cuda_graph_impl": "local",
            "cuda_graph_scope": "full_iteration",
            "cuda_graph_warmup_steps": 5,
        }
    )

    def other_rank_holds(settings):
        def all_reduce_max(values):
            names = agreement.compared_fields()
            theirs = [agreement._digest(getattr(settings, name)) for name in names]
            theirs += [-d for d in theirs]
            return [max(a, b) for a, b in zip(values, theirs, strict=True)]

        return all_reduce_max

    monkeypatch.setattr(agreement.compat, "max_across_ranks", other_rank_holds(other))
    assert agreement.differing_settings(mine) == ["warmup_steps"]
    monkeypatch.setattr(agreement.compat, "max_across_ranks", other_rank_holds(mine))
    assert agreement.differing_settings(other) == ["warmup_steps"]
    assert agreement.differing_settings(mine) == []
    monkeypatch.setattr(agreement.compat, "max_across_ranks", lambda values: values)
    assert agreement.differing_settings(mine) == []


def test_a_rank_own_report_path_is_not_compared():
    assert "report_json" not in agreement.compared_fields()
    assert {"impl", "scope", "warmup_steps", "buckets"} <= set(agreement.compared_fields())


def test_a_set_read_in_another_hash_order_is_the_same_setting(monkeypatch):
    """(review of 2026-12-05: a recompute_modules set is read in the process's hash order,
    which differs by rank; the job was refused with identical configs)"""
    modules = {"core_attn", "mlp", "layernorm"}
    mine = read_settings({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn",
                          "recompute_modules": modules})  # fmt: skip
    other = dataclasses.replace(mine, recompute_modules=tuple(reversed(mine.recompute_modules)))
    assert other.recompute_modules != mine.recompute_modules
    names = agreement.compared_fields()
    assert [agreement._digest(getattr(mine, n)) for n in names] == [
        agreement._digest(getattr(other, n)) for n in names
    ]


def test_graphs_off_on_every_rank_is_never_refused(monkeypatch):
    off = read_settings({"cuda_graph_impl": "none", "cuda_graph_warmup_steps": 3})
    monkeypatch.setattr(agreement, "differing_settings", lambda settings: ["warmup_steps"])
    agreement.check_settings_agree(off)  # (no error)
    on = read_settings({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})
    monkeypatch.setattr(agreement, "differing_settings", lambda settings: ["impl"])
    with pytest.raises(CudaGraphConfigError, match="differs between the ranks"):
        agreement.check_settings_agree(off)
    with pytest.raises(CudaGraphConfigError, match="differs between the ranks"):
        agreement.check_settings_agree(on)


def test_a_refusal_says_which_ranks_hold_which_value(monkeypatch):
    """(2026-12-05, a review: rank 2 of 3 given --cuda-graph-warmup-steps 5 was refused as
    "--cuda-graph-warmup-steps = 3: differs ... (the value is rank 1's)": the refusal said
    by the first rank to mark it named its own value, never the odd rank's)"""
    from cudagraph_plugin import compat

    settings = read_settings({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})
    monkeypatch.setattr(agreement, "differing_settings", lambda settings: ["warmup_steps"])
    monkeypatch.setattr(
        compat, "gather_across_ranks", lambda mine: [mine, mine, [("5", "5")], mine]
    )
    with pytest.raises(CudaGraphConfigError) as refused:
        agreement.check_settings_agree(settings)
    assert "differs between the ranks of this job (3 on ranks 0-1, 3; 5 on rank 2)" in str(
        refused.value
    )


@pytest.mark.parametrize(
    ("values", "said"),
    [
        (["3", "3", "5", "3"], "3 on ranks 0-1, 3; 5 on rank 2"),
        (["a", "b"], "a on rank 0; b on rank 1"),
        (["x"] * 5 + ["y"] * 6, "y on ranks 5-10; x on ranks 0-4"),
        # (one set in two hash orders is one value: as the digest compares it)
        (
            [("attn", "mlp")] * 2 + [("mlp", "attn"), ("moe",)],
            "('attn', 'mlp') on ranks 0-2; ('moe',) on rank 3",
        ),
        (
            [str(v) for v in range(7)],
            "0 on rank 0; 1 on rank 1; 2 on rank 2; 3 on rank 3; 3 more value(s)",
        ),
    ],
)
def test_the_spread_of_values_over_ranks(values, said):
    pairs = [(agreement._canonical(v), repr(v) if isinstance(v, tuple) else v) for v in values]
    assert agreement._spread(pairs) == said
