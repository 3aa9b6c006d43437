"""benchmarks/hook_overhead.py runs every variant, hot and with the cache sweep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import hook_overhead


@pytest.mark.parametrize("sweep_mib", [0, 1])
def test_every_variant_is_timed_and_the_sweep_is_recorded(sweep_mib, monkeypatch):
    swept = []
    original = hook_overhead.CacheSweep.__call__
    monkeypatch.setattr(
        hook_overhead.CacheSweep, "__call__", lambda self: swept.append(original(self))
    )
    data = hook_overhead.run_benchmark(steps=50, repeats=1, sweep_mib=sweep_mib)
    assert data["cache_sweep_mib"] == sweep_mib
    assert set(data["results"]) == set(hook_overhead.VARIANTS)
    assert all(r["us_per_step_median"] > 0 for r in data["results"].values())
    # the sweep runs before every step of every timed loop (warm-up loops included), or never
    loops = len(hook_overhead.VARIANTS) * 2
    assert len(swept) == (loops * 50 if sweep_mib else 0)
