"""benchmarks/guard_floor.py times the real guard, armed as after a capture: a guard that
checked nothing would make the comparison with the floor meaningless."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import guard_floor

from cudagraph_plugin.runtime.guard import StaticShapeError


def test_the_guard_it_times_refuses_a_changed_micro_batch():
    batch = guard_floor.micro_batch("cpu")
    guard = guard_floor.armed_guard(batch)
    same = guard.check_replay({**guard_floor.CALL, "data_iterator": iter([batch])})
    assert next(same) is batch
    changed = {**batch, "tokens": torch.zeros(2, 256, dtype=torch.long)}
    checked = guard.check_replay({**guard_floor.CALL, "data_iterator": iter([changed])})
    with pytest.raises(StaticShapeError, match="tokens"):
        next(checked)


def test_it_reports_each_piece_and_the_differences(tmp_path):
    out = tmp_path / "floor.json"
    assert guard_floor.main(["--number", "50", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for piece in ("draw", "floor", "guard"):
        assert result[f"{piece}_us"] > 0
    assert result["guard_minus_floor_us"] == pytest.approx(result["guard_us"] - result["floor_us"])
    assert result["floor_minus_draw_us"] == pytest.approx(result["floor_us"] - result["draw_us"])
