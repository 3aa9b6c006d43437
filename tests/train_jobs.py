"""Training jobs as users start them: ``examples/train_gpt.py`` in a fresh process (or under
torchrun), the probe plugin installed, each rank's record read back afterwards.

This module owns what the subprocess tests share (the CPU ones and ``tests/test_gpu.py``):
the job's environment (the probe's folder on ``PYTHONPATH`` for the job only, so it is
discovered through its ``.dist-info`` like any installed plugin), the command line, loading
the probe's per-rank records, the results file the GPU suite fills
(``MCGRAPH_GPU_RESULTS``), and which GPU a single-GPU job of a pytest-xdist worker gets.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jobs import JobResult, run_job, torchrun_command

REPO = Path(__file__).resolve().parent.parent
TRAIN_GPT = REPO / "examples" / "train_gpt.py"
RL_LOOP = REPO / "examples" / "rl_loop.py"
PROBE_PATH = Path(__file__).resolve().parent / "probe"
RESULTS_VAR = "MCGRAPH_GPU_RESULTS"
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
TE_SPEC = ("--transformer-impl", "transformer_engine")
"""The example hosts' Transformer Engine layer spec (jobs that need ``HAS_TE``)."""


def job_env(
    probe_dir: Path | None,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a launched job: ``base`` (this one by default), the probe and the
    project tree first on ``PYTHONPATH``, unbuffered output, then ``extra``."""
    env = dict(os.environ if base is None else base)
    paths = [str(PROBE_PATH), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    if probe_dir is not None:
        env["MCGRAPH_PROBE_DIR"] = str(probe_dir)
    env.update(extra or {})
    return env


def train_command(argv: Sequence[str], nproc: int = 1, script: Path = TRAIN_GPT) -> list[str]:
    """``python examples/train_gpt.py ARGV`` (or another example ``script``), or the same
    under torchrun for ``nproc`` > 1."""
    if nproc == 1:
        return [sys.executable, str(script), *argv]
    return torchrun_command(nproc, script, *argv)


def display_command(argv: Sequence[str], nproc: int = 1, script: Path = TRAIN_GPT) -> str:
    """The command as a user would type it (for tables and messages)."""
    launcher = "python" if nproc == 1 else f"torchrun --standalone --nproc-per-node {nproc}"
    return " ".join([launcher, f"examples/{script.name}", *argv])


@dataclasses.dataclass
class TrainJob:
    """One launched training job and the probe records its ranks wrote."""

    name: str
    argv: list[str]
    nproc: int
    result: JobResult
    records: dict[int, dict[str, Any]]
    script: Path = TRAIN_GPT

    def context(self) -> str:
        """For assertion messages: what ran, how it ended, the logs' tails."""
        reasons = {rank: rec.get("shutdown_reason") for rank, rec in sorted(self.records.items())}
        return f"{self.result.describe()}\nshutdown per rank: {reasons}\n{self.result.tail()}"

    def record(self, rank: int = 0) -> dict[str, Any]:
        assert rank in self.records, f"rank {rank} wrote no probe record\n{self.context()}"
        return self.records[rank]

    def losses(self, rank: int = 0) -> list[float]:
        losses = self.record(rank)["losses"]
        assert losses is not None, f"rank {rank} recorded no losses\n{self.context()}"
        return losses


def check_job_ended_cleanly(job: TrainJob) -> None:
    """The launcher's end of a job: no timeout, no process left behind or surviving."""
    result = job.result
    assert not result.timed_out, f"HANG: killed at the timeout\n{job.context()}"
    assert result.leftovers == [], f"processes left behind: {result.leftovers}\n{job.context()}"
    assert result.survivors == [], f"processes that would not die: {result.survivors}"


def probe_refusal_said(rank: int, step: int) -> str:
    """The one line a job says of the probe's refusal on ``rank`` at ``step``
    (``MCGRAPH_PROBE_REFUSE``): ``print_refusal``'s, naming the rank unless it is rank 0."""
    refusal = (
        f"mcgraph probe: rank {rank} refuses the run at step {step}. Fix: unset "
        "MCGRAPH_PROBE_REFUSE"
    )
    return f"error: rank {rank} refused the run: {refusal}" if rank else f"error: {refusal}"


def load_records(probe_dir: Path) -> dict[int, dict[str, Any]]:
    records = {}
    for path in sorted(probe_dir.glob("rank*.json")):
        record = json.loads(path.read_text())
        records[int(record["rank"])] = record
    return records


def launch(
    name: str,
    argv: Sequence[str],
    *,
    job_dir: Path,
    timeout_s: float,
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
    base_env: Mapping[str, str] | None = None,
    dump_signal: int | None = None,
    script: Path = TRAIN_GPT,
) -> TrainJob:
    """Run ``train_gpt.py argv`` (or ``script``) as a job in ``job_dir`` (logs, and the
    probe's records in ``job_dir/probe``), with ``env`` added to the job's environment."""
    probe_dir = job_dir / "probe"
    result = run_job(
        train_command(argv, nproc, script),
        log_dir=job_dir,
        timeout_s=timeout_s,
        name=name,
        env=job_env(probe_dir, extra=env, base=base_env),
        cwd=REPO,
        dump_signal=dump_signal,
    )
    return TrainJob(name, list(argv), nproc, result, load_records(probe_dir), script)


# -------------------------------------------------------------------------------------------
# The GPU suite's results file and GPU pinning.
# -------------------------------------------------------------------------------------------


def _rank_summary(record: dict[str, Any]) -> dict[str, Any]:
    report = record.get("report") or {}
    facts = record.get("graph_plugin") or {}
    return {
        "shutdown_reason": record.get("shutdown_reason"),
        "capture_step": report.get("capture_step"),
        "graph_count": report.get("graph_count"),
        "graphs_freed": facts.get("graphs_freed"),
        "allocated_after_free_mib": facts.get("allocated_after_free_mib"),
        "exception": record.get("exception"),
    }


def end_after_fault_s(job: TrainJob) -> float | None:
    """Seconds from the first injected fault (any rank) until the job's first process ended;
    None without a fault."""
    faults = [rec["fault_at"] for rec in job.records.values() if rec.get("fault_at")]
    if not faults or not job.result.ended_at:
        return None
    return job.result.ended_at - min(faults)


def report_fields(report: dict[str, Any] | None) -> dict[str, Any]:
    """The results-file fields taken from a run report (``RunReport.to_dict()``)."""
    report = report or {}
    versions = report.get("versions") or {}
    before = report.get("memory_before_capture") or {}
    after = report.get("memory_after_capture") or {}
    return {
        "torch": versions.get("torch"),
        "mcore": versions.get("megatron-core"),
        "te": versions.get("transformer-engine"),
        "device": report.get("device"),
        "impl": report.get("impl"),
        "scope": report.get("scope"),
        "capture_step": report.get("capture_step"),
        "speedup": report.get("speedup"),
        "verdict": report.get("verdict"),
        "eager_step_ms": report.get("eager_step_ms"),
        "replay_step_ms": report.get("replay_step_ms"),
        "capture_seconds": report.get("capture_seconds"),
        "graph_count": report.get("graph_count"),
        "memory_before_mib": before.get("allocated_mib"),
        "memory_after_mib": after.get("allocated_mib"),
        "buckets": [
            {name: row.get(name) for name in BUCKET_FIELDS} for row in report.get("buckets") or []
        ],
    }


BUCKET_FIELDS = (
    "seq_length",
    "capture_steps",
    "replays",
    "capture_seconds",
    "eager_step_ms",
    "replay_step_ms",
    "speedup",
    "padding_waste_percent",
    "pool_mib",
)


def result_line(job: TrainJob, scenario: str, role: str, test: str | None = None) -> dict[str, Any]:
    """One line of the results file: the job and rank 0's report (another rank's where rank
    0 wrote none), with every rank's outcome summarised."""
    records = job.records
    main = records.get(0) or next(iter(records.values()), {})
    return {
        "scenario": scenario,
        "role": role,
        "test": test,
        "command": display_command(job.argv, job.nproc, job.script),
        "argv": job.argv,
        "nproc": job.nproc,
        "rc": job.result.rc,
        "wall_s": round(job.result.wall_s, 3),
        "end_after_fault_s": _rounded(end_after_fault_s(job)),
        "timed_out": job.result.timed_out,
        "leftovers": job.result.leftovers,
        **report_fields(main.get("report")),
        "ranks": {str(rank): _rank_summary(rec) for rank, rec in sorted(records.items())},
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def append_result(line: dict[str, Any], path: str | os.PathLike[str] | None = None) -> None:
    """Append ``line`` to the results file (``MCGRAPH_GPU_RESULTS``) if one is set; safe
    when several pytest-xdist workers append at once."""
    path = path if path is not None else os.environ.get(RESULTS_VAR)
    if not path:
        return
    data = (json.dumps(line, sort_keys=True) + "\n").encode()
    with open(path, "ab") as sink:
        fcntl.flock(sink, fcntl.LOCK_EX)
        try:
            sink.write(data)
            sink.flush()
        finally:
            fcntl.flock(sink, fcntl.LOCK_UN)


def pinned_device(worker: str | None, visible: str | None, device_count: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a single-GPU job started by pytest-xdist worker
    ``worker`` (``gw0``, ``gw1``, ...): worker ``gwN`` gets the N-th visible GPU (modulo
    their number), so two workers run their jobs on two GPUs. ``None`` outside xdist:
    the job sees what this process sees."""
    if not worker or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    devices = (
        [d.strip() for d in visible.split(",") if d.strip()]
        if visible
        else [str(i) for i in range(device_count)]
    )
    if not devices:
        return None
    return devices[int(worker[2:]) % len(devices)]


def single_gpu_env(device_count: int) -> dict[str, str]:
    """The environment a single-GPU job of this pytest(-xdist) worker adds: its pinned
    ``CUDA_VISIBLE_DEVICES`` (see :func:`pinned_device`), or nothing outside xdist."""
    device = pinned_device(
        os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("CUDA_VISIBLE_DEVICES"), device_count
    )
    return {} if device is None else {"CUDA_VISIBLE_DEVICES": device}
