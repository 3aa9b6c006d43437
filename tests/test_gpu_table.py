"""``tests/gpu_table.py``: the BENCHMARKS.md tables from the GPU suite's results file."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_table import main

LINE = {
    "scenario": "tp2_sp_te_attn",
    "role": "graphed",
    "test": "tests/test_gpu.py::test_scenario[tp2_sp_te_attn]@eager-0123456789",
    "command": "torchrun --standalone --nproc-per-node 2 examples/train_gpt.py ...",
    "argv": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "nproc": 2,
    "rc": 0,
    "wall_s": 31.25,
    "timed_out": False,
    "mcore": "0.19.2",
    "te": "2.11.0",
    "capture_step": 3,
    "speedup": 1.734,
    "memory_before_mib": 128.0,
    "memory_after_mib": 130.4,
    "ranks": {"0": {"shutdown_reason": "completed"}, "1": {"shutdown_reason": "completed"}},
}
FAULT = {
    **LINE,
    "scenario": "dp2_raise_rank1_full_iteration",
    "role": "fault",
    "test": "tests/test_gpu.py::test_failure_scenario_ends_the_job[dp2_raise_rank1_full_iteration]",
    "argv": [],
    "rc": 1,
    "wall_s": 41.0,
    "speedup": None,
    "ranks": {"1": {"shutdown_reason": "exception"}},
}
HUNG = {**FAULT, "scenario": "hung", "test": None, "timed_out": True, "rc": -9, "wall_s": 90.2}
EAGER = {**LINE, "role": "eager"}
IN_PROCESS = {**LINE, "scenario": "two_runs_1", "role": "in-process", "rc": None, "wall_s": None}

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.test_gpu" name="test_scenario[tp2_sp_te_attn]" time="40"/>
<testcase classname="tests.test_gpu"
  name="test_failure_scenario_ends_the_job[dp2_raise_rank1_full_iteration]" time="41">
  <failure message="took too long"/></testcase>
</testsuite></testsuites>"""


def test_rows_for_runs_failures_and_hangs(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text(
        "".join(json.dumps(x) + "\n" for x in (LINE, EAGER, FAULT, HUNG, IN_PROCESS))
    )
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "table.md"
    assert main([str(results), "--junit", str(junit), "--out", str(out)]) == 0
    table = out.read_text()
    first, second = table.split("\n\n")
    scenario_rows = {row.split(" | ")[0][2:]: row for row in first.splitlines()[2:]}
    good = scenario_rows["tp2_sp_te_attn"]
    assert "| 0.19.2 / 2.11.0 | 2 | 1 / 2 |" in good
    assert "**passed**; rc 0, completed, 31.2 s" in good
    assert "| 3 | 1.73x | 128 → 130 (+2) |" in good
    assert "(eager twin)" not in table
    fault = scenario_rows["dp2_raise_rank1_full_iteration"]
    assert "**failed**; rc 1, exception, 41.0 s" in fault
    assert "TIMED OUT, killed after 90 s" in scenario_rows["hung"]
    assert "in-process run" in scenario_rows["two_runs_1"]
    # the failure jobs again, with the time each took to end
    assert second.splitlines()[2:] == [
        "| dp2_raise_rank1_full_iteration | 2 | 0.19.2 / 2.11.0 | 1 | 41.0 | 1: exception |",
        "| hung | 2 | 0.19.2 / 2.11.0 | -9 | TIMED OUT 90.2 | 1: exception |",
    ]
    assert main([str(results), "--all", "--out", str(out)]) == 0
    assert "tp2_sp_te_attn (eager twin)" in out.read_text()
