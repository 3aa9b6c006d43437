"""The probe plugin in real training jobs on the CPU: ``python examples/train_gpt.py`` and a
2-rank gloo torchrun, launched through ``tests/jobs.py`` as the GPU suite launches them.

The probe is found through its ``.dist-info`` on the job's ``PYTHONPATH`` (never in this
process), writes each rank's record on every exit path, and injects the faults the GPU
failure scenarios use: a raise and a SIGTERM at a step. Megatron-core trains on the CPU here
through ``examples/cpu_redirect.py`` (skipped where it cannot, as ``tests/cpu_only.py`` says).
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from jobs import first_failure
from train_jobs import REPO, TrainJob, append_result, launch, probe_refusal_said, result_line

# One pytest-xdist worker takes the module (make test runs --dist loadgroup), so the jobs
# fixture runs its jobs once, not once on each worker.
pytestmark = [needs_mcore_on_cpu, pytest.mark.slow, pytest.mark.xdist_group("probe_jobs_cpu")]

CPU = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
SHORT = ["--train-iters", "6", "--log-interval", "0"]
FULL = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
TIMEOUT_S = 120


# The three single-process jobs, run side by side (two cores): each test reads its own.
JOBS = {
    # a completed run with evaluation and the distributed optimizer's pre-hook toggling
    "completed": (
        [*SHORT, *FULL, "--cuda-graph-warmup-steps", "2", "--eval-interval", "3", *OVERLAP],
        {},
    ),
    "raise": ([*SHORT, *FULL], {"MCGRAPH_PROBE_RAISE": "3:0"}),
    "sigterm": ([*SHORT, *FULL], {"MCGRAPH_PROBE_SIGTERM": "3:0"}),
    "sigint": ([*SHORT, *FULL], {"MCGRAPH_PROBE_SIGINT": "3:0"}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainJob]:
    # Made before the threads: the first mktemp of a pytest-xdist worker empties its base
    # directory, which would race with another thread's first mktemp.
    job_dirs = {name: tmp_path_factory.mktemp(name) for name in JOBS}

    def one(name: str) -> TrainJob:
        argv, env = JOBS[name]
        return launch(name, argv, job_dir=job_dirs[name], timeout_s=TIMEOUT_S, env={**CPU, **env})

    with concurrent.futures.ThreadPoolExecutor(len(JOBS)) as pool:
        return dict(zip(JOBS, pool.map(one, JOBS), strict=True))


@pytest.fixture
def completed(jobs: dict[str, TrainJob]) -> TrainJob:
    return jobs["completed"]


def test_the_probe_is_not_installed_in_this_process() -> None:
    names = {ep.name for ep in importlib.metadata.entry_points(group="mcgraph")}
    assert "probe" not in names


def test_a_completed_run_is_recorded_through_the_dist_info(completed: TrainJob) -> None:
    result = completed.result
    assert result.rc == 0 and not result.timed_out, completed.context()
    assert result.leftovers == []
    record = completed.record(0)
    assert record["distributions"]["probe"] == "mcgraph_probe"
    # registered after the CUDA graph plugin's run plugin: its shutdown wrapper is outermost
    plugins = record["plugins"]
    assert plugins.index(RUN_PLUGIN_NAME) < plugins.index("mcgraph-probe-run")
    steps = [e for s in range(6) for e in (["step", s], ["step_end", s])]
    expected = [
        ["disable_pre_hook", False],
        ["train_start", 0, 6],
        *steps[:2],
        ["enable_pre_hook"],
        *steps[2:4],
        ["step", 2],
        ["post_warmup", 2, 0],  # fires on the CPU too (warm-up 2)
        ["step_end", 2],
        ["evaluation_start", 2],
        ["evaluation_end", 2],
        *steps[6:],
        ["evaluation_start", 5],
        ["evaluation_end", 5],
        ["report"],
        ["shutdown", "completed"],
    ]
    assert record["events"] == expected
    assert (record["shutdown_reason"], record["exception"]) == ("completed", None)
    assert record["loss_steps"] == list(range(6))
    assert len(record["losses"]) == 6 and all(math.isfinite(x) for x in record["losses"])
    assert len(record["eval_losses"]) == 2 and all(math.isfinite(x) for x in record["eval_losses"])
    report = record["report"]
    assert report["device"] == "cpu" and not report["graphs_captured"]
    assert report["versions"]["megatron-core"]
    assert record["graph_plugin"]["graphs_freed"] == 0
    assert record["at_exit"] == {"process_group_initialized": False}
    assert "shutdown: completed" in result.stdout.read_text()


def test_a_results_line_and_its_table_row(completed: TrainJob, tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    append_result(result_line(completed, "cpu_completed", "graphed", test="t[cpu]"), results)
    append_result(result_line(completed, "cpu_completed", "eager", test="t[cpu]"), results)
    table = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu_table.py"), str(results)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rows = [line for line in table.splitlines() if line.startswith("| cpu_completed")]
    assert len(rows) == 1, table  # eager twins are left out
    assert "0.16.1" in rows[0] and "rc 0" in rows[0] and "completed" in rows[0]
    assert "--eval-interval 3" in rows[0]


def test_a_raise_at_a_step_ends_the_job_non_zero_with_the_reason_recorded(
    jobs: dict[str, TrainJob],
) -> None:
    job = jobs["raise"]
    assert job.result.rc == 1 and not job.result.timed_out, job.context()
    assert job.result.leftovers == []
    record = job.record(0)
    assert record["shutdown_reason"] == "exception"
    assert "injected failure at step 3 on rank 0" in record["exception"]
    assert record["events"][-6:] == [
        ["step", 3],
        ["post_warmup", 3, 0],  # the default warm-up is 3
        ["step_end", 3],
        ["fault", "raise", 3],
        ["report"],
        ["shutdown", "exception"],
    ]
    assert record["losses"] is None and record["loss_steps"] == [0, 1, 2, 3]
    assert record["report"]["shutdown_reason"] == "exception"
    # an uncaught exception still runs the interpreter's exit handlers
    assert record["at_exit"] == {"process_group_initialized": False}
    assert "RuntimeError: mcgraph probe: injected failure" in job.result.stderr.read_text()


def test_sigterm_at_a_step_ends_the_job_by_the_signal_with_the_reason_recorded(
    jobs: dict[str, TrainJob],
) -> None:
    job = jobs["sigterm"]
    assert job.result.signal == signal.SIGTERM and not job.result.timed_out, job.context()
    assert job.result.leftovers == []
    record = job.record(0)
    assert record["shutdown_reason"] == "signal"
    assert record["events"][-3:] == [["fault", "sigterm", 3], ["report"], ["shutdown", "signal"]]
    assert record["losses"] is None
    assert "at_exit" not in record  # the process ended by the signal: no exit handlers


def test_a_ctrl_c_ends_the_run_with_one_line_and_by_sigint_without_a_traceback(
    jobs: dict[str, TrainJob],
) -> None:
    """(Before: the KeyboardInterrupt's traceback, through the loop and megatron-core.) The
    process still ends by SIGINT, so that a shell script running the job stops too: by
    the quiet excepthook's own signal, as after the run's SIGTERM (no exit handlers; once
    megatron-core 0.19 or Transformer Engine is imported, Python's own death by SIGINT is
    lost: exit status 1 on an H100)."""
    job = jobs["sigint"]
    assert job.result.signal == signal.SIGINT and not job.result.timed_out, job.context()
    assert job.result.leftovers == []
    record = job.record(0)
    assert record["shutdown_reason"] == "interrupted"
    assert record["events"][-3:] == [
        ["fault", "sigint", 3],
        ["report"],
        ["shutdown", "interrupted"],
    ]
    assert "at_exit" not in record  # (ended by the signal: no exit handlers)
    stderr = job.result.stderr.read_text()
    assert "Traceback" not in stderr and "KeyboardInterrupt\n" not in stderr, job.context()
    said = [line for line in stderr.splitlines() if "interrupted (KeyboardInterrupt" in line]
    assert said == ["interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)"], job.context()


def _failing_gloo_job(name: str, tmp_path: Path, probe: dict[str, str]) -> TrainJob:
    """A 2-rank gloo torchrun of the example with the probe's fault ``probe``: it must end,
    non-zero and in time, with no process left."""
    job = launch(
        name,
        [*SHORT, *FULL],
        nproc=2,
        job_dir=tmp_path,
        timeout_s=90,
        env={**CPU, **probe},
        dump_signal=signal.SIGUSR1,
    )
    result = job.result
    assert not result.timed_out, f"HANG\n{job.context()}"
    assert result.rc != 0 and result.wall_s < 60, job.context()
    assert result.leftovers == [] and result.survivors == []
    return job


def test_two_gloo_ranks_end_non_zero_in_time_when_rank_1_raises(tmp_path: Path) -> None:
    job = _failing_gloo_job("gloo-raise", tmp_path, {"MCGRAPH_PROBE_RAISE": "2:1"})
    result = job.result
    failing = job.record(1)
    assert failing["shutdown_reason"] == "exception"
    assert "on rank 1" in failing["exception"]
    assert failing["world_size"] == 2
    # rank 0 cannot complete without rank 1: its watch of the job ends it (issue 22)
    assert job.records[0]["shutdown_reason"] == "peer_failed", job.context()
    # and says so in one line, with no traceback of its own: the one traceback from a
    # worker is rank 1's (torchrun's ChildFailedError comes on top, and its summary of the
    # failed job shows rank 1's again, from the error file the example's @record writes)
    output = result.output()
    ended = [line for line in output.splitlines() if "run ended: rank 1 " in line]
    assert len(ended) == 1 and ended[0].startswith("[rank 0] run ended: rank 1 ("), output
    assert "injected" in output or "on rank 1" in output
    head, summary = output.split("ChildFailedError:", 1)
    assert head.count("Traceback") == 2 and "PeerFailed" not in head, job.context()
    assert summary.count("Traceback") == 1, job.context()
    assert "RuntimeError: mcgraph probe: injected failure at step 2 on rank 1" in summary


def test_a_told_rank_says_its_line_when_torchruns_sigterm_comes_during_its_shutdown(
    tmp_path: Path,
) -> None:
    """(2026-12-05, a review: SIGTERM on rank 1 at step 2; rank 1 exits once rank 0 began its
    shutdown, torchrun then sends rank 0 a SIGTERM, held until rank 0's shutdown ends and
    then ending it by the signal: the host's line was never said, 3 runs of 3.) The told
    rank says its line whether the host or the held signal ends it."""
    job = _failing_gloo_job("gloo-sigterm", tmp_path, {"MCGRAPH_PROBE_SIGTERM": "2:1"})
    result = job.result
    assert job.record(1)["shutdown_reason"] == "signal", job.context()
    assert job.records[0]["shutdown_reason"] == "peer_failed", job.context()
    said = [line for line in result.output().splitlines() if " run ended: " in line]
    assert said == [said[0]] and said[0].startswith("[rank 0] run ended: rank 1 ("), job.context()
    assert "was stopped: signal" in said[0]
    # and left for torchrun's summary of the failed job, whichever of the two said it
    summary = result.output().split("ChildFailedError:", 1)[-1]
    assert "this rank's run ended because of another rank: rank 1 (" in summary, job.context()


def test_a_rank_killed_without_a_word_over_gloo_leaves_the_other_to_its_shutdown(
    tmp_path: Path,
) -> None:
    """The probe's SIGKILL fault over gloo: rank 1's record is written first and says the
    fault with no shutdown; rank 1 marks nothing. Rank 0's next gloo collective fails at once
    on the closed connection (or torchrun's SIGTERM ends it), so its shutdown runs without
    the stuck-signal watch ever acting: this job does not reach the peer watch's release
    (offered over NCCL only, whose abort ends a blocked collective: the 2-GPU test
    ``test_a_rank_killed_without_a_word_leaves_the_other_to_its_shutdown``; the release's
    logic is tested in ``test_peer_deadline.py`` and ``test_hookspecs_stuck_signal.py``)."""
    job = _failing_gloo_job("gloo-sigkill", tmp_path, {"MCGRAPH_PROBE_SIGKILL": "2:1"})
    killed = job.record(1)
    assert killed["events"][-1] == ["fault", "sigkill", 2] and killed["fault_at"], job.context()
    assert killed["shutdown_reason"] is None  # (nothing ran after the kill)
    assert first_failure(-9, 1) in job.result.output(), job.context()
    survivor = job.record(0)
    assert survivor["shutdown_reason"] in ("exception", "signal"), job.context()
    assert "has not come back to Python" not in job.result.output(), job.context()


# what the job says of each refusal at step 2: rank 1's names it, rank 0's is rank 0's own
SAID = {rank: probe_refusal_said(rank, 2) for rank in (0, 1)}


@pytest.mark.parametrize("refusing", ["1", "0", "all"])
def test_two_gloo_ranks_say_a_refusal_once_by_the_rank_that_refused_first(
    tmp_path: Path, refusing: str
) -> None:
    # A check of step 2 refuses the run on rank 1, rank 0 or both at once, while the other
    # rank waits in a gloo all-reduce, which neither rank's abort of its process groups
    # releases: only the refusing rank's exit does. So the rank whose refusal came first
    # (the job's failure mark says which; both at once: whichever claimed it) says it,
    # naming itself unless it is rank 0, and exits 2; the other is told by its watch
    # (PeerRefused), or finds its own refusal second, runs its shutdown and says nothing
    # (issue 22). Before: for rank 1's refusal, rank 1 waited 30 s for rank 0 to say it,
    # rank 0 stayed in the all-reduce until its exit deadline (status 70), and nobody said
    # the refusal.
    job = _failing_gloo_job(
        f"gloo-refuse-{refusing}", tmp_path, {"MCGRAPH_PROBE_REFUSE": f"2:{refusing}"}
    )
    result = job.result
    output = result.output()
    said = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0] in SAID.values(), job.context()
    speaker = 1 if said[0] == SAID[1] else 0
    if refusing != "all":
        assert speaker == int(refusing), job.context()
    for rank in (0, 1):
        record = job.record(rank)  # every rank's shutdown ran
        if rank == speaker:
            assert record["shutdown_reason"] == "exception", job.context()
            assert "ConfigurationError" in record["exception"], record["exception"]
        elif refusing == "all":  # its own refusal second, or told of the first
            assert record["shutdown_reason"] in ("exception", "peer_failed"), job.context()
        else:
            assert record["shutdown_reason"] == "peer_failed", job.context()
            assert "PeerRefused" in record["exception"], record["exception"]
    assert first_failure(2, speaker) in output, job.context()
    assert "cuda_graph_peer_exit_deadline" not in output, job.context()  # no rank timed out
    # the one traceback is torchrun's own ChildFailedError; none from a worker
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.context()


def _interrupted_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "interrupted (KeyboardInterrupt" in line]


def test_a_ctrl_c_passed_to_every_rank_is_said_once_per_job_without_a_traceback(
    tmp_path: Path,
) -> None:
    """torchrun passes a Ctrl-C on to every worker (the probe sends each rank a SIGINT at
    the end of step 2): one rank says it for the job, the rank whose interrupt was the job's
    first failure, and no rank prints a KeyboardInterrupt traceback (before: one per rank).
    The one traceback left is torchrun's own ChildFailedError."""
    job = _failing_gloo_job("gloo-sigint-all", tmp_path, {"MCGRAPH_PROBE_SIGINT": "2:all"})
    output = job.result.output()
    said = _interrupted_lines(output)
    assert len(said) == 1 and said[0].startswith("[rank "), job.context()
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.context()
    reasons = {job.record(rank)["shutdown_reason"] for rank in (0, 1)}
    assert reasons <= {"interrupted", "peer_failed"} and "interrupted" in reasons, job.context()
    assert "Signal 2 (SIGINT)" in output, job.context()  # (each rank ended by the signal)


def test_a_ctrl_c_on_one_rank_is_said_by_that_rank_and_named_by_the_other(
    tmp_path: Path,
) -> None:
    """A SIGINT to rank 1 alone (``kill -INT`` of one worker): rank 1, whose interrupt was
    the job's first failure, names itself (rank 0 would not know to speak for it), and
    rank 0, told by its watch, says its one line naming rank 1."""
    job = _failing_gloo_job("gloo-sigint-1", tmp_path, {"MCGRAPH_PROBE_SIGINT": "2:1"})
    output = job.result.output()
    assert job.record(1)["shutdown_reason"] == "interrupted", job.context()
    assert job.records[0]["shutdown_reason"] == "peer_failed", job.context()
    assert _interrupted_lines(output) == [
        "[rank 1] interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)"
    ], job.context()
    ended = [line for line in output.splitlines() if " run ended: " in line]
    assert len(ended) == 1 and ended[0].startswith("[rank 0] run ended: rank 1 ("), job.context()
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.context()
