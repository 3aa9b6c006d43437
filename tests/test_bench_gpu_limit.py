"""benchmarks/gpu_limit.py's summary: issue 21's two figures for the graphed step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_limit


def run(mode: str, step_ms: float, kernel_ms: float | None) -> dict:
    return {"mode": mode, "step_ms": step_ms, "kernel_ms_per_step": kernel_ms}


def test_the_optimizer_graph_is_measured_against_its_own_kernels_and_the_device_norm_eager():
    summary = gpu_limit.summarise(
        [
            run("eager", 19.0, 2.11),
            run("eager_device_norm", 16.0, 2.05),
            run("full_iteration", 5.2, 2.13),
            run("full_iteration_optimizer", 2.4, 2.0),
        ]
    )
    assert summary["graphed_step_ms"] == 2.4  # the optimizer graph, when it ran
    assert summary["graphed_over_own_kernel"] == 2.4 / 2.0
    assert summary["eager_device_norm_step_ms"] == 16.0
    assert summary["speedup_vs_eager_device_norm"] == 16.0 / 2.4
    # the eager run's kernel time stays the reference of the older ratios
    assert summary["kernel_time_from"] == "eager"
    assert summary["graphed_over_kernel"] == 2.4 / 2.11


def test_without_the_device_norm_run_there_is_no_speed_up_figure():
    summary = gpu_limit.summarise([run("eager", 19.0, 2.1), run("full_iteration", 5.2, 2.1)])
    assert summary["speedup_vs_eager_device_norm"] is None
    assert summary["graphed_over_own_kernel"] == 5.2 / 2.1
