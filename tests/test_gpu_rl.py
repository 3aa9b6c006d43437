"""Bucketed full-iteration graphs in the RL-style host (``examples/rl_loop.py``) on GPUs,
each run its own process, as users start it (issue 23).

* three buckets, 60 training steps at random lengths: every step after its bucket's capture
  replays, the losses equal the eager run with the same padding (``--pad-to-buckets``
  without graphs; relative 1e-5: the graph replays the same kernels, a capture may pick
  other cuBLAS workspaces), and the three graphs together take at most 1.5x the memory of
  the largest bucket's alone (one pool);
* the training state offloaded and brought back every 10 steps: recaptured after each reload,
  told by the host (``--invalidate-after-reload``) or seen by the plugin's address check
  (fp32: megatron-core's ``restore_from_cpu`` gives the parameters new memory), no illegal
  memory access, losses equal the eager run with the same offloads;
* RoPE, with rollouts at so many lengths that megatron-core's cache of rotary tables drops
  the buckets' ones: the graphs keep theirs, losses equal the eager run;
* DP=2 (two GPUs): the same on both ranks.

The results go to the suite's results file with per-bucket speed-ups, capture times,
padding waste and pool memory (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from bucket_schedule import expected_schedule, lengths_of, schedule_of

from cudagraph_plugin import compat
from train_jobs import (
    HAS_TE,
    RL_LOOP,
    TE_SPEC,
    TrainJob,
    append_result,
    check_job_ended_cleanly,
    launch,
    result_line,
    single_gpu_env,
)

CUDA = torch.cuda.is_available()
DEVICE_COUNT = torch.cuda.device_count() if CUDA else 0
TIMEOUT_S = float(os.environ.get("MCGRAPH_GPU_JOB_TIMEOUT", "180"))
STEPS = 60
WARMUP = 2
OFFLOAD_EVERY = 10
BUCKETS = "128,256,512"
GRAPHS = ("--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration")
LOOP = (
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
    "--vocab-size", "1024", "--seq-length", "512", "--min-length", "32",
    "--micro-batch-size", "2", "--num-microbatches", "1", "--train-iters", str(STEPS),
    "--steps-per-round", "5", "--rollout-batches", "2", "--log-interval", "0",
    "--cuda-graph-warmup-steps", str(WARMUP), "--pad-to-buckets", BUCKETS,
)  # fmt: skip
BF16 = ("--bf16",)
OFFLOAD = ("--offload-interval", str(OFFLOAD_EVERY))
RELOADS_BEFORE = set(range(OFFLOAD_EVERY, STEPS, OFFLOAD_EVERY))
RTOL = 1e-5

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device"),
    # up to three jobs a test, each ended by its own timeout: pytest's (300 s, thread
    # method: it ends the whole session) only as a backstop beyond them
    pytest.mark.timeout(3 * TIMEOUT_S + 60),
]


def _job(name: str, role: str, argv: tuple[str, ...], jobs_root: Path, nproc: int = 1) -> TrainJob:
    env = single_gpu_env(DEVICE_COUNT) if nproc == 1 else {}
    job = launch(
        f"{name}/{role}",
        list(argv),
        job_dir=jobs_root / f"{name}-{role}-{uuid.uuid4().hex[:6]}",
        timeout_s=TIMEOUT_S,
        nproc=nproc,
        env=env,
        script=RL_LOOP,
        dump_signal=signal.SIGUSR1 if nproc > 1 else None,  # a hang's stacks (the probe's)
    )
    append_result(result_line(job, name, role, test=os.environ.get("PYTEST_CURRENT_TEST")))
    check_job_ended_cleanly(job)
    assert job.result.rc == 0, job.context()
    for rank in range(nproc):
        assert job.record(rank)["shutdown_reason"] == "completed", job.context()
    return job


def _same_losses(graphed: TrainJob, eager: TrainJob, rank: int = 0) -> None:
    mine, theirs = graphed.losses(rank), eager.losses(rank)
    assert len(mine) == len(theirs) == STEPS, (len(mine), len(theirs))
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=RTOL, atol=0.0)
    assert mine[-1] < mine[0], mine  # it trains


def _check_schedule(
    report: dict[str, Any], resets_before: set[int] = frozenset(), every_bucket: bool = True
) -> None:
    lengths = lengths_of(report)
    assert len(lengths) == STEPS, report["buckets"]
    buckets = {int(b) for b in BUCKETS.split(",")}
    # (with two ranks each step takes the longer of two draws: the smallest bucket is rare)
    assert set(lengths) == buckets if every_bucket else set(lengths) <= buckets, set(lengths)
    assert schedule_of(report) == expected_schedule(lengths, buckets, WARMUP, resets_before)


@pytest.mark.xdist_group("rl_buckets")
def test_three_buckets_replay_after_capture_train_as_eager_and_share_one_pool(jobs_root):
    graphed = _job(
        "rl_buckets", "graphed", (*LOOP, *BF16, *GRAPHS, "--cuda-graph-buckets", BUCKETS), jobs_root
    )
    eager = _job("rl_buckets", "eager", (*LOOP, *BF16), jobs_root)
    alone = _job(
        "rl_buckets",
        "largest-alone",
        (*LOOP, *BF16, *GRAPHS, "--cuda-graph-buckets", "512"),
        jobs_root,
    )
    report = graphed.record(0)["report"]
    _check_schedule(report)
    # after each bucket's warm-up and capture step (the capture call's replay not counted)
    assert sum(row["replays"] for row in report["buckets"]) == STEPS - 3 * (WARMUP + 1)
    _same_losses(graphed, eager)
    pools = {row["seq_length"]: row["pool_mib"] for row in report["buckets"]}
    [largest] = [
        row["pool_mib"] for row in alone.record(0)["report"]["buckets"] if row["seq_length"] == 512
    ]
    assert largest and largest > 0, alone.record(0)["report"]["buckets"]
    assert sum(pools.values()) <= 1.5 * largest, (pools, largest)


INVALIDATED = "CUDA graph buckets: gradient buffers and optimizer state reloaded after the rollout"
MOVED = "CUDA graph buckets: memory the graphs point at moved"
AT_NEW_ADDRESSES = "training state reloaded, gradient buffers at new addresses"


ROPE = ("--position-embedding-type", "rope", "--rollout-batches", "40")


@pytest.mark.xdist_group("rl_rope")
def test_rope_tables_outlive_megatron_cores_cache_through_rollouts_at_many_lengths(jobs_root):
    """RoPE: a bucket graph reads its length's rotary table from megatron-core's cache
    (``RotaryEmbedding.forward``, ``lru_cache(maxsize=32)``); replays never touch the cache,
    and each round's 40 rollouts at random lengths evict the table. The graphs keep the
    tables they read: every step after its bucket's capture replays, and the losses equal
    the eager twin's."""
    argv = (*LOOP, *BF16, *ROPE)
    graphed = _job(
        "rl_rope", "graphed", (*argv, *GRAPHS, "--cuda-graph-buckets", BUCKETS), jobs_root
    )
    eager = _job("rl_rope", "eager", argv, jobs_root)
    assert "illegal memory access" not in graphed.result.output()
    _check_schedule(graphed.record(0)["report"])
    _same_losses(graphed, eager)


@pytest.mark.parametrize("explicit", [True, False], ids=["host-invalidates", "address-check"])
def test_offload_and_reload_recapture_and_train_as_eager(explicit, jobs_root):
    """Told by the host, every reload frees the graphs; left to the plugin's address check,
    exactly the reloads that put the gradient buffers at new addresses do (the host logs
    which: the allocator may hand the same block back, and then the graphs stay valid)."""
    name = "rl_offload_" + ("invalidate" if explicit else "address_check")
    extra = ("--invalidate-after-reload",) if explicit else ()
    argv = (*LOOP, *BF16, *OFFLOAD, *extra)
    graphed = _job(name, "graphed", (*argv, *GRAPHS, "--cuda-graph-buckets", BUCKETS), jobs_root)
    eager = _job(name, "eager", argv, jobs_root)
    output = graphed.result.output()
    assert "illegal memory access" not in output
    moved = output.count(AT_NEW_ADDRESSES)
    if explicit:
        assert output.count(INVALIDATED) == len(RELOADS_BEFORE), graphed.context()
        assert MOVED not in output, graphed.context()
        resets = RELOADS_BEFORE
    else:
        assert output.count(MOVED) == moved, graphed.context()
        resets = {
            int(line.split("step ")[1].split(":")[0]) + 1
            for line in output.splitlines()
            if AT_NEW_ADDRESSES in line
        }
    _check_schedule(graphed.record(0)["report"], resets)
    _same_losses(graphed, eager)


OPTIMIZER_CAPTURED = "CUDA graph(s) for optimizer at step"
OFFLOAD_SEEN = "MegatronOptimizer.restore_from_cpu() ran"


@pytest.mark.skipif(
    not compat.has_optimizer_graph(), reason="megatron-core < 0.17 has no optimizer graph"
)
@pytest.mark.parametrize(
    "layers",
    [
        (),
        # TE's layers inside the bucket graphs (where TE is installed, megatron-core's Adam
        # is TE's FusedAdam whatever the layer spec)
        pytest.param(
            TE_SPEC,
            marks=pytest.mark.skipif(not HAS_TE, reason="needs Transformer Engine"),
        ),
    ],
    ids=["local-layers", "te-layers"],
)
@pytest.mark.parametrize("explicit", [True, False], ids=["host-invalidates", "address-check"])
def test_offload_and_reload_recapture_the_optimizer_graph_too(explicit, layers, jobs_root):
    """With the optimizer graph as well: megatron-core's ``restore_from_cpu`` gives the main
    parameters and Adam's state new memory, so each reload frees the optimizer graph with
    the bucket graphs, and it is captured again after its own warm-up (a replay of the old
    one would read freed memory). The twin is the same graphed run without offloading,
    which captures each graph once: offloading moves the state and brings it back
    unchanged, so the losses must not change. (An eager twin differs by design: without
    TE, megatron-core's capturable torch Adam takes the eager step's learning rate as a
    Python float, the captured step's as a float32 tensor; 1.6e-4 relative apart after 60
    steps on the H200.) Left to the plugin, every reload recaptures too: megatron-core's
    offload API is watched, since it moves the state one tensor at a time and an address
    sample can come back unchanged (seen here: NaN losses from step 41 before that).
    With Transformer Engine installed the optimizer is TE's capturable FusedAdam (its state
    moves at each reload too), with or without TE's layers inside the bucket graphs."""
    graphs = (*GRAPHS, "--cuda-graph-buckets", BUCKETS, "--optimizer-cuda-graph")
    name = "rl_offload_optimizer_graph" + ("" if explicit else "_address_check")
    name += "_te_layers" if layers else ""
    extra = ("--invalidate-after-reload",) if explicit else ()
    offloaded = (*LOOP, *BF16, *layers, *OFFLOAD, *extra, *graphs)
    graphed = _job(name, "graphed", offloaded, jobs_root)
    eager = _job(name, "never-offloaded", (*LOOP, *BF16, *layers, *graphs), jobs_root)
    _check_schedule(eager.record(0)["report"])  # each bucket captured once
    assert eager.record(0)["report"]["replays"]["optimizer"] == STEPS - (WARMUP + 1)
    output = graphed.result.output()
    assert "illegal memory access" not in output
    report = graphed.record(0)["report"]
    resets = {e["step"] + (1 if explicit else 0) for e in report["invalidations"]}
    assert resets == RELOADS_BEFORE, report["invalidations"]
    if not explicit:
        assert all(OFFLOAD_SEEN in e["reason"] for e in report["invalidations"])
    captures = [line for line in output.splitlines() if OPTIMIZER_CAPTURED in line]
    assert len(captures) == 1 + len(resets), graphed.context()
    assert output.count("each bucket and the optimizer step is captured again") == len(resets), (
        graphed.context()
    )
    # per segment between reloads: WARMUP eager optimizer steps, the capture, then replays
    assert report["replays"]["optimizer"] == STEPS - (1 + len(resets)) * (WARMUP + 1)
    _check_schedule(report, resets)
    _same_losses(graphed, eager)


@pytest.mark.multigpu
@pytest.mark.skipif(DEVICE_COUNT < 2, reason="needs 2 GPUs")
def test_two_data_parallel_ranks_with_buckets_and_offload(jobs_root):
    argv = (*LOOP, *BF16, *OFFLOAD, "--invalidate-after-reload")
    graphed = _job(
        "rl_dp2", "graphed", (*argv, *GRAPHS, "--cuda-graph-buckets", BUCKETS), jobs_root, nproc=2
    )
    eager = _job("rl_dp2", "eager", argv, jobs_root, nproc=2)
    for rank in (0, 1):
        report = graphed.record(rank)["report"]
        _check_schedule(report, RELOADS_BEFORE, every_bucket=False)
        _same_losses(graphed, eager, rank)
    assert lengths_of(graphed.record(0)["report"]) == lengths_of(graphed.record(1)["report"])
    assert "illegal memory access" not in graphed.result.output()


@pytest.mark.multigpu
@pytest.mark.skipif(DEVICE_COUNT < 2, reason="needs 2 GPUs")
def test_two_data_parallel_ranks_with_the_overlapped_param_all_gather(jobs_root):
    """The distributed optimizer's all-gather in the DDP forward pre-hooks: each rollout (a
    forward-only pass) leaves it done, so a bucket captured after one recorded none and
    every replay trained on the other rank's stale shards (tests/test_param_gather_cpu.py
    shows it over gloo); the losses must equal the eager twin's."""
    argv = (*LOOP, *BF16, "--use-distributed-optimizer", "--overlap-param-gather",
            "--overlap-grad-reduce")  # fmt: skip
    graphed = _job(
        "rl_dp2_overlap", "graphed", (*argv, *GRAPHS, "--cuda-graph-buckets", BUCKETS),
        jobs_root, nproc=2,
    )  # fmt: skip
    eager = _job("rl_dp2_overlap", "eager", argv, jobs_root, nproc=2)
    for rank in (0, 1):
        _check_schedule(graphed.record(rank)["report"], every_bucket=False)
        _same_losses(graphed, eager, rank)
