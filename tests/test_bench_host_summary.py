"""benchmarks/host_summary.py: groups plugin_host_time results by mode and side and gives
each process's pieces and their shares of its plugin time."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_summary


def _result(mode: str, hooks: float, fb: float, guard: float, opt: float, steady: float):
    return {
        "mode": mode,
        "us_per_step": {
            "hooks": hooks,
            "forward_backward": fb,
            "guard": guard,
            "optimizer": opt,
            "plugin_hooks": 0.0,
            "timer": 0.0,
        },
        "untimed_steps": {"count": 246, "total_us_per_step": steady},
    }


def test_the_side_is_the_tag_without_its_run_number():
    assert host_summary.side_of("full_iteration_base2.json", "full_iteration") == "base"
    mode = "full_iteration_optimizer"
    assert host_summary.side_of("full_iteration_optimizer_new13.json", mode) == "new"
    assert host_summary.side_of("full_iteration.json", "full_iteration") == "-"
    assert host_summary.side_of("guard_floor_base.json", "full_iteration") is None


def test_shares_add_up_to_the_plugins_time_and_leave_the_guard_out_of_the_shortcut():
    shares = host_summary.shares(_result("full_iteration_optimizer", 2.0, 10.0, 4.0, 4.0, 16.0))
    # hooks 2, shortcut 10 - 4 = 6, guard 4, optimizer 4: 16 in all
    assert shares == {"hooks": 0.125, "shortcut": 0.375, "guard": 0.25, "optimizer": 0.25}
    assert (
        host_summary.shares(_result("full_iteration", 2.0, 6.0, 2.0, 0.0, 8.0))["optimizer"] is None
    )


def test_the_table_groups_an_archive_by_mode_and_side(tmp_path):
    runs = {
        "host-19/full_iteration_optimizer_base1.json": _result(
            "full_iteration_optimizer", 2.0, 10.0, 4.0, 4.0, 30.0
        ),
        "host-19/full_iteration_optimizer_base2.json": _result(
            "full_iteration_optimizer", 4.0, 20.0, 8.0, 8.0, 50.0
        ),
        "host-19/full_iteration_optimizer_new1.json": {
            **_result("full_iteration_optimizer", 2.0, 10.0, 4.0, 2.0, 20.0),
            "step_period_us": 2461.4,
            "host_probe_before": {"l1_chase_ns": 31.2, "memory_chase_ns": 142.7},
        },
        "host-19/guard_floor_base.json": {"floor_us": 3.0},
    }
    archive = tmp_path / "host-19.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in runs.items():
            raw = json.dumps(data).encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))

    rows = host_summary.table([archive]).splitlines()[2:]

    assert len(rows) == 2
    base, new = rows
    assert "| base | 2 | **40.0** (30.0, 50.0) |" in base
    assert "| 0.25, 0.25 |" in base  # the optimizer's share in both base runs
    assert "| new | 1 | **20.0** (20.0) |" in new
    # 2 of 2 + 6 + 4 + 2; then its step period and its probe
    assert new.endswith("| 0.14 | 2461 | 31 / 143 |")
    assert base.endswith("| -, - | -, - |")  # results from before the harness recorded the period
