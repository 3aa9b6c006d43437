"""``benchmarks/pairs.py``: plugin vs hand-written loop in pairs of fresh processes.

The runner end to end on the CPU (each run its own process, records and summary written,
losses equal, skipped modes with their reason, ``--resume``), the profiled runs (in-process:
the CPU operators of both sides), the verdict on synthetic numbers, and the timeout that
ends a child's whole process group.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_modes
import pairs

# -- the runner, end to end ------------------------------------------------------------------


@needs_mcore_on_cpu
@pytest.mark.slow
def test_smoke_runs_each_side_in_its_own_process_and_summarises(tmp_path: Path) -> None:
    out = tmp_path / "pairs"
    argv = [
        "--cpu", "--smoke", "--pairs", "1", "--profile-steps", "0", "--out", str(out),
        "--modes", "eager,full_iteration,full_iteration_optimizer,te_attn_mlp",
    ]  # fmt: skip
    assert pairs.main(argv) == 0

    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    assert sorted(runs) == [
        "pair01-eager-handwritten",
        "pair01-eager-plugin",
        "pair01-full_iteration-handwritten",
        "pair01-full_iteration-plugin",
    ]
    pids = [run["pid"] for run in runs.values()]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    assert all(run["ppid"] == os.getpid() for run in runs.values())
    for name, run in runs.items():
        assert run["ok"], (name, run.get("error"), run.get("log_tail"))
        assert run["rc"] == 0 and not run["timed_out"]
        assert len(run["step_ms"]) == 8 and len(run["steady_step_ms"]) == 3
        assert (out / "logs" / f"{name}.log").exists()
    assert "cudagraph" in runs["pair01-eager-plugin"]["plugins"]

    summary = json.loads((out / "summary.json").read_text())
    rows = {row["mode"]: row for row in summary["results"]}
    for mode in ("eager", "full_iteration"):
        row = rows[mode]
        assert row["pairs_complete"] == 1 and len(row["ratios"]) == 1
        assert row["median_ratio"] == pytest.approx(
            runs[f"pair01-{mode}-plugin"]["median_step_ms"]
            / runs[f"pair01-{mode}-handwritten"]["median_step_ms"]
        )
        assert row["losses"]["identical"] and row["losses"]["steps_compared"] == 8
        assert row["verdict"] == pairs.NOT_APPLICABLE  # CPU timings decide nothing
        assert row["rule"]["verdict"] in (pairs.PASS, pairs.FAIL, pairs.INCOMPLETE)
    assert "optimizer graph" in rows["full_iteration_optimizer"]["skipped"]
    assert "CUDA" in rows["te_attn_mlp"]["skipped"]
    assert summary["done_when"]["verdict"] == pairs.NOT_APPLICABLE
    assert sorted(summary["processes"]) == sorted(pids)
    text = (out / "summary.md").read_text()
    assert "skipped: " in text and "median ratio" in text

    # Nothing is missing: a second call makes no run; a call without --resume is refused.
    assert pairs.main([*argv, "--resume"]) == 0
    again = {p.stem: json.loads(p.read_text())["pid"] for p in (out / "runs").glob("*.json")}
    assert again == {name: run["pid"] for name, run in runs.items()}
    with pytest.raises(SystemExit, match="--resume"):
        pairs.main(argv)


def test_plan_is_pair_major_and_alternates_the_first_side() -> None:
    order = pairs.plan(["eager", "full_iteration"], pairs=2, profile=True)
    assert order[:8] == [
        (0, "eager", "plugin"),
        (0, "eager", "handwritten"),
        (0, "full_iteration", "handwritten"),
        (0, "full_iteration", "plugin"),
        (1, "eager", "handwritten"),
        (1, "eager", "plugin"),
        (1, "full_iteration", "plugin"),
        (1, "full_iteration", "handwritten"),
    ]
    assert [item[0] for item in order[8:]] == [pairs.PROFILE] * 4


def test_modes_known_to_be_impossible_are_skipped_with_a_reason() -> None:
    optimizer = gpu_modes.MODES["full_iteration_optimizer"]
    assert "0.16.1 has no optimizer graph" in pairs.known_skip(optimizer, False, "0.16.1")
    assert pairs.known_skip(optimizer, False, "0.19.2") is None
    assert "CUDA" in pairs.known_skip(optimizer, True, "0.19.2")
    assert "CUDA" in pairs.known_skip(gpu_modes.MODES["te_attn_mlp"], True, "0.19.2")
    assert pairs.known_skip(gpu_modes.MODES["full_iteration"], True, "0.16.1") is None


# -- the profiled runs -----------------------------------------------------------------------


@needs_mcore_on_cpu
def test_profiled_eager_runs_of_both_sides_count_the_same_cpu_operators(tmp_path: Path) -> None:
    ps = pairs.PairSettings(
        size="smoke-2L-64H",
        steps=8,
        warmup=3,
        seq_length=32,
        micro_batch_size=2,
        vocab_size=128,
        bf16=False,
        cpu=True,
        smoke=True,
        profile_skip=1,
        profile_steps=2,
    )
    mode = gpu_modes.MODES["eager"]
    records = {}
    for side in pairs.SIDES:
        record = pairs.run_side(side, mode, ps, tmp_path / f"{side}.json")
        assert record["ok"], record.get("traceback")
        record["pair"] = pairs.PROFILE
        records[side] = record
    plugin, hand = records["plugin"]["profile"], records["handwritten"]["profile"]
    assert plugin["unit"].startswith("CPU operators") and plugin["profiled_steps"] == 2
    assert plugin["count_total"] > 100
    assert plugin["names"] == hand["names"]  # the plugin adds no operator to an eager step
    assert records["plugin"]["losses"] == records["handwritten"]["losses"]
    assert len(records["plugin"]["steady_step_ms"]) == ps.profile_skip

    row = pairs.summarise(list(records.values()), ["eager"], {}, 1)["results"][0]
    assert row["kernel_counts_equal"] is True and row["kernel_unit"] == plugin["unit"]
    assert row["kernel_count_diff"] == {}
    assert row["rule"]["verdict"] == pairs.INCOMPLETE  # profiles, but no timed pair


def _trace(path: Path, kernels: int) -> Path:
    """A Chrome trace as torch.profiler writes it: CUDA runtime calls, and a kernel event
    (category "kernel", microseconds) for each kernel the GPU ran."""
    events: list[dict] = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10 * i, "dur": 3}
        for i in range(kernels + 2)
    ]
    events += [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10 * i + 5, "dur": 100}
        for i in range(kernels)
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_gpu_profile_counts_kernels_and_one_without_any_is_an_error(tmp_path: Path) -> None:
    counted = pairs.profile_counts(_trace(tmp_path / "k.json", 20), steps=10, use_cuda=True)
    assert counted["count_per_step"] == 2.0 and counted["time_ms_per_step"] == 0.2
    # No CUDA activity recorded on either side would read as identical (zero) kernel counts,
    # a PASS on step time alone: the run fails instead.
    with pytest.raises(RuntimeError, match="no GPU kernel"):
        pairs.profile_counts(_trace(tmp_path / "none.json", 0), steps=10, use_cuda=True)


# -- the verdict -----------------------------------------------------------------------------

EQUAL_KERNELS = (500.0, 500.0)
EQUAL_TIME = (2.0, 2.0)


def test_a_median_ratio_within_3_percent_passes() -> None:
    decision = pairs.decide([1.02, 1.021, 1.019, 1.02, 1.025], EQUAL_KERNELS, EQUAL_TIME, 5)
    assert decision["verdict"] == pairs.PASS and decision["decided_by"] == "step time"


def test_a_median_ratio_of_1_05_fails() -> None:
    decision = pairs.decide([1.05, 1.051, 1.049, 1.05, 1.052], EQUAL_KERNELS, EQUAL_TIME, 5)
    assert decision["verdict"] == pairs.FAIL and "1.050 > 1.03" in decision["reason"]


def test_a_spread_above_3_percent_lets_kernel_time_decide() -> None:
    noisy = [0.98, 1.03, 1.0, 1.01, 1.05]  # max/min - 1 = 7%: the step ratio decides nothing
    decision = pairs.decide(noisy, EQUAL_KERNELS, (2.05, 2.0), 5)
    assert decision["verdict"] == pairs.PASS and decision["decided_by"] == "kernel time"
    assert decision["reason"].startswith("spread above 3%: kernel-time equality decides")
    slower = pairs.decide(noisy, EQUAL_KERNELS, (2.2, 2.0), 5)
    assert slower["verdict"] == pairs.FAIL and "1.100 > 1.03" in slower["reason"]
    # Even a median ratio far above the limit is left to the kernels when pairs spread so.
    wide = pairs.decide([1.0, 1.2, 1.1, 1.15, 1.12], EQUAL_KERNELS, EQUAL_TIME, 5)
    assert wide["verdict"] == pairs.PASS and wide["decided_by"] == "kernel time"
    assert pairs.decide(noisy, (None, None), (None, None), 5)["verdict"] == pairs.INCOMPLETE


def test_unequal_kernel_counts_fail_whatever_the_times() -> None:
    for ratios in ([1.0] * 5, [0.98, 1.03, 1.0, 1.01, 1.05]):
        decision = pairs.decide(ratios, (500.0, 501.0), EQUAL_TIME, 5)
        assert decision["verdict"] == pairs.FAIL and decision["decided_by"] == "kernel counts"


def test_fewer_pairs_than_asked_or_no_profile_is_incomplete() -> None:
    short = pairs.decide([1.0, 1.0], EQUAL_KERNELS, EQUAL_TIME, 5)
    assert short["verdict"] == pairs.INCOMPLETE and short["so_far"]["verdict"] == pairs.PASS
    unprofiled = pairs.decide([1.0] * 5, (None, None), (None, None), 5)
    assert unprofiled["verdict"] == pairs.INCOMPLETE
    assert pairs.decide([], EQUAL_KERNELS, EQUAL_TIME, 5)["verdict"] == pairs.INCOMPLETE


def _gpu_runs(mode: str, plugin_ms: float, kernels: tuple[int, int]) -> list[dict]:
    runs = []
    for pair in range(5):
        for side, ms in (("plugin", plugin_ms), ("handwritten", 5.0)):
            runs.append(
                {
                    "side": side,
                    "mode": mode,
                    "pair": pair,
                    "pid": 1000 + len(runs),
                    "ok": True,
                    "device": "cuda",
                    "median_step_ms": ms,
                    "losses": [4.0, 3.5],
                }
            )
    for side, count in zip(pairs.SIDES, kernels, strict=True):
        profile = {
            "unit": "GPU kernels",
            "count_per_step": float(count),
            "time_ms_per_step": 2.0,
            "names": {"gemm": count},
        }
        runs.append(
            {
                "side": side,
                "mode": mode,
                "pair": pairs.PROFILE,
                "ok": True,
                "device": "cuda",
                "median_step_ms": 5.0,
                "profile": profile,
            }
        )
    return runs


def test_the_done_when_needs_both_criterion_modes() -> None:
    modes = ["eager", "full_iteration", "full_iteration_optimizer"]
    good = _gpu_runs("full_iteration", 5.1, (497, 497)) + _gpu_runs(
        "full_iteration_optimizer", 5.05, (460, 460)
    )
    eager = _gpu_runs("eager", 9.0, (487, 487))  # 1.8x slower: not a criterion mode
    summary = pairs.summarise(good + eager, modes, {}, 5)
    assert summary["done_when"]["verdict"] == pairs.PASS
    rows = {row["mode"]: row for row in summary["results"]}
    assert rows["eager"]["verdict"] == pairs.FAIL and not rows["eager"]["criterion"]
    assert rows["full_iteration"]["spread"] == 0.0
    assert rows["full_iteration"]["losses"]["identical"]

    bad = _gpu_runs("full_iteration", 5.1, (497, 499)) + good[len(good) // 2 :]
    summary = pairs.summarise(bad, modes[1:], {}, 5)
    assert summary["done_when"]["verdict"] == pairs.FAIL
    diff = {row["mode"]: row.get("kernel_count_diff") for row in summary["results"]}
    assert diff["full_iteration"] == {"gemm": [497, 499]}

    skipped = pairs.summarise(
        good[: len(good) // 2], modes[1:], {"full_iteration_optimizer": "0.16"}, 5
    )
    assert skipped["done_when"]["verdict"] == pairs.INCOMPLETE
    data = {"settings": {}, **skipped}
    assert "skipped: 0.16" in pairs.tables.pairs_table(data)


# -- the timeout -----------------------------------------------------------------------------

_SPAWNER = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(f"{grandchild.pid}\\n")
time.sleep(float(sys.argv[2]))
"""


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (killed, not yet reaped by its new parent) is not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize(
    ("child_sleeps", "timed_out"), [(60.0, True), (0.0, False)], ids=["timeout", "normal end"]
)
def test_the_whole_process_group_ends(tmp_path: Path, child_sleeps: float, timed_out: bool) -> None:
    pid_file = tmp_path / "grandchild.pid"
    cmd = [sys.executable, "-c", _SPAWNER, str(pid_file), str(child_sleeps)]
    start = time.monotonic()
    result = pairs.run_child(cmd, tmp_path / "child.log", timeout=2.0)
    assert time.monotonic() - start < 15
    assert result.timed_out is timed_out
    assert (result.rc != 0) is timed_out
    grandchild = int(pid_file.read_text())
    assert _gone(result.pid) and _gone(grandchild)
