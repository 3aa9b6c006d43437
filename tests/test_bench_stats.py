"""The benchmark's "plugin vs hand-written within 2%" verdict (benchmarks/gpu_modes.py).

Synthetic runs with known spreads: the verdict must say PASS only when the intervals are
tight inside the band, FAIL when a difference is real, and "unresolved" when the noise is
wider than the band, whatever the point estimate happens to be.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_modes

SIZE = gpu_modes.Size("t", 1, 8, 1)
MODE = gpu_modes.MODES["eager"]
CHECK = "plugin vs hand-written loop within 2% for every mode (timed step)"


def _runs(kind: str, level_ms: float, run_spread: float, seed: int, pairs: int = 8) -> list:
    """Runs whose speed shifts from run to run by up to ``run_spread`` (relative)."""
    rng = random.Random(seed)
    runs = []
    for repeat in range(pairs):
        base = level_ms * (1 + rng.uniform(-run_spread, run_spread))
        steps = [base * (1 + rng.uniform(-0.002, 0.002)) for _ in range(40)]
        runs.append(
            {
                "kind": kind,
                "size": SIZE.name,
                "mode": MODE.name,
                "repeat": repeat,
                "ok": True,
                "steady_step_ms": steps,
                "steady_iteration_ms": steps,
                "median_step_ms": sorted(steps)[20],
                "losses": [],
            }
        )
    return runs


def _verdict(plugin_ms: float, baseline_ms: float, spread: float) -> object:
    runs = _runs("plugin", plugin_ms, spread, 1) + _runs("baseline", baseline_ms, spread, 2)
    results = gpu_modes.aggregate(runs, [SIZE], [MODE], {})
    return gpu_modes.checks(results, SIZE.name)[CHECK], results[0]


def test_tight_and_equal_passes() -> None:
    verdict, row = _verdict(10.0, 10.0, spread=0.003)
    assert verdict is True
    assert 0.98 <= row["ratio_ci_check"][0] <= row["ratio_ci_check"][1] <= 1.02


def test_tight_and_five_percent_slower_fails() -> None:
    verdict, row = _verdict(10.5, 10.0, spread=0.003)
    assert verdict is False
    assert row["ratio_ci_check"][0] > 1.02


def test_noise_wider_than_the_band_is_unresolved_not_a_pass() -> None:
    verdict, row = _verdict(10.0, 10.0, spread=0.25)
    assert verdict == gpu_modes.UNRESOLVED
    low, high = row["ratio_ci95"]
    assert low < 0.98 and high > 1.02


def test_the_check_interval_is_wider_than_the_95_percent_one_with_several_modes() -> None:
    modes = [gpu_modes.MODES[name] for name in ("eager", "full_iteration")]
    runs = []
    for index, mode in enumerate(modes):
        for run in _runs("plugin", 10, 0.05, 3 + index) + _runs("baseline", 10, 0.05, 5 + index):
            run["mode"] = mode.name
            runs.append(run)
    row = gpu_modes.aggregate(runs, [SIZE], modes, {})[0]
    assert row["check_confidence"] == pytest.approx(0.975)
    assert row["ratio_ci_check"][0] <= row["ratio_ci95"][0]
    assert row["ratio_ci_check"][1] >= row["ratio_ci95"][1]


def test_too_few_pairs_give_no_interval_and_no_pass() -> None:
    runs = _runs("plugin", 10, 0.0, 1, pairs=2) + _runs("baseline", 10, 0.0, 2, pairs=2)
    results = gpu_modes.aggregate(runs, [SIZE], [MODE], {})
    assert results[0]["ratio_ci95"] is None
    assert gpu_modes.checks(results, SIZE.name)[CHECK] == gpu_modes.UNRESOLVED


def test_cpu_timings_prove_nothing() -> None:
    runs = _runs("plugin", 10, 0.003, 1) + _runs("baseline", 10, 0.003, 2)
    results = gpu_modes.aggregate(runs, [SIZE], [MODE], {})
    assert gpu_modes.checks(results, SIZE.name, timed_on_gpu=False)[CHECK] is None
