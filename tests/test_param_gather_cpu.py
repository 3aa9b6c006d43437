"""Full-iteration graphs with the distributed optimizer's overlapped parameter all-gather,
over real gloo ranks (DP=2): the graphed run's losses equal the eager run's, with
evaluations and RL rollouts (forward-only calls) between the training steps.

megatron-core's DDP forward pre-hooks all-gather a bucket only while its
``param_gather_dispatched`` flag is false, and only ``finish_grad_sync`` (the end of an
eager training iteration) clears it. Two ways the graphs went wrong without a word:

* a forward-only call before the capture left the flag set: the capture recorded no
  all-gather, and every replay trained on the other rank's stale shards;
* a replay runs no Python: the flag stayed set after it, and the next eager forward-only
  call (an evaluation before its graph, a rollout) ran on the shards gathered before the
  last optimizer step.

At DP=1 there is nothing to gather, so only a multi-rank run shows either. Each job is
``tests/fake_graph_job.py`` under torchrun; the fake capture replays the real aten ops and
gloo collectives it recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

from jobs import run_cpu_ranks

JOB = Path(__file__).resolve().parent / "fake_graph_job.py"
OVERLAP = ("--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce")
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
FULL = ("--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration")

pytestmark = [pytest.mark.slow, needs_mcore_on_cpu]


def _summary(tmp_path: Path, name: str, loop: str, mode: str, args: tuple[str, ...]) -> dict:
    out = tmp_path / f"{name}-{mode}"
    run_cpu_ranks(
        2, JOB, str(out / "summary.json"), loop, mode, "--", *args,
        log_dir=out, name=f"{name}-{mode}", timeout_s=240,
    )  # fmt: skip
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(
    "interval, iters, warmup",
    [("3", "2", "3"), ("4", "2", "3"), ("2", "1", "4")],
    # (evaluations follow steps 2, 5, 8 / 3, 7 / 1, 3, 5, 7, 9; training captured at step 3
    # / 3 / 4, validation at its 4th / 4th / 5th call): an evaluation right before the
    # capture; one right after it; an eager one after replays the fast path remembered
    ids=["before-the-capture", "after-the-capture", "eager-after-remembered-replays"],
)
def test_evaluations_between_steps_keep_graphed_losses_equal_to_eager(
    tmp_path, interval, iters, warmup
):
    args = ("--train-iters", "10", "--log-interval", "0", "--cuda-graph-warmup-steps", warmup,
            *NO_DROPOUT, *OVERLAP, "--eval-interval", interval, "--eval-iters", iters)  # fmt: skip
    eager = _summary(tmp_path, "eval", "train_gpt", "eager", (*args, "--cuda-graph-impl", "none"))
    graphed = _summary(tmp_path, "eval", "train_gpt", "graphs", (*args, *FULL))
    assert graphed["losses"] == eager["losses"]
    assert graphed["eval_losses"] == eager["eval_losses"] and len(eager["eval_losses"]) >= 2


def test_rl_rollouts_between_bucketed_steps_keep_graphed_losses_equal_to_eager(tmp_path):
    args = ("--seq-length", "48", "--min-length", "4", "--max-length", "48",
            "--train-iters", "10", "--steps-per-round", "2", "--rollout-batches", "1",
            "--log-interval", "0", "--cuda-graph-warmup-steps", "1",
            *NO_DROPOUT, *OVERLAP)  # fmt: skip
    eager = _summary(
        tmp_path, "rl", "rl_loop", "eager",
        (*args, "--cuda-graph-impl", "none", "--pad-to-buckets", "16,32,48"),
    )  # fmt: skip
    graphed = _summary(
        tmp_path, "rl", "rl_loop", "graphs", (*args, *FULL, "--cuda-graph-buckets", "16,32,48")
    )
    assert graphed["losses"] == eager["losses"]
    assert graphed["rollout_losses"] == eager["rollout_losses"]
