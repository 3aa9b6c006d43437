"""benchmarks/plugin_host_time.py on the fake capture: its instrumentation must time the
plugin as it runs, not change what the plugin does.

Its first version handed the plugin a new timed stand-in of the host's forward/backward
function on every call; the plugin keys megatron-core's wrapper by that function, so it
built a new ``FullCudaGraphWrapper`` (with a new CUDA stream) on every step and the
benchmark counted that as the plugin's host time.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import plugin_host_time

pytestmark = needs_mcore_on_cpu


@pytest.mark.parametrize("breakdown", [False, True], ids=["lean", "breakdown"])
def test_the_instrumented_run_builds_one_wrapper_and_reports_each_piece(
    fake_graphs, monkeypatch, breakdown
):
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    built = []
    init, call = FullCudaGraphWrapper.__init__, FullCudaGraphWrapper.__call__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(FullCudaGraphWrapper, "__init__", counting_init)
    monkeypatch.setattr(plugin_host_time, "SIZE", plugin_host_time.gpu_modes.Size("t", 1, 16, 2))
    # the plugin's step timer: every step up to 3 after the capture, none after
    from cudagraph_plugin.runtime import measurement, timing

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 3)
    timer_start = timing.StepTimer.start
    span_clock = plugin_host_time._Span.__dict__["cpu_clock"]
    # (the breakdown run also meters the CPU's speed before each step)
    args = argparse.Namespace(
        steps=8, warmup=2, cpu=True, breakdown=breakdown, speed_meter=breakdown
    )
    result = plugin_host_time.measure("full_iteration", args)
    assert len(built) == 1
    assert result["capture_step"] == 2 and result["steady_steps"] == 5
    pieces = result["us_per_step"]
    assert pieces["hooks"] > 0 and pieces["forward_backward"] > 0 and pieces["guard"] > 0
    assert pieces["optimizer"] == 0  # no optimizer graph in this mode
    # steps 3-7 after the capture at 2: 3, 4 and 5 timed by the plugin, 6 and 7 not
    assert result["timed_steps"]["count"] == 3 and result["untimed_steps"]["count"] == 2
    assert result["untimed_steps"]["total_us_per_step"] > 0
    if breakdown:  # the metered steady steps: the two the plugin does not time
        assert result["per_step"]["step"] == [6, 7]
        assert all(ns > 0 for ns in result["per_step"]["meter_ns"])
        meter = result["speed_meter"]
        assert meter["full_speed_steps"]["count"] + meter["slower_steps"]["count"] == 2
    else:
        assert "speed_meter" not in result and "per_step" not in result
    cpu = result["cpu_us_per_step"]
    if breakdown:
        # the plugin's step hooks are timed inside the dispatch, so part of it
        assert 0 < pieces["plugin_hooks"] < pieces["hooks"]
        assert result["plugin_code_us_per_step"] < result["total_us_per_step"]
        # the median step's timer share: 3 of 5 steps ran it
        assert 0 < pieces["timer"] < pieces["plugin_hooks"]
        assert cpu["hooks"] > 0 and cpu["forward_backward"] > 0
    else:
        # nothing timed inside the hooks, no CPU clock read: the totals carry no such cost
        assert pieces["plugin_hooks"] == pieces["timer"] == 0
        assert result["plugin_code_us_per_step"] is None
        assert all(value == 0 for value in cpu.values())
    if sys.platform == "linux":  # the main thread, as the report saw it
        main = [t for t in result["threads"] if t["tid"] == threading.get_native_id()]
        assert len(main) == 1 and main[0]["cpu_ticks"] > 0
        assert main[0]["cpu"] in range(os.cpu_count() or 1)
    # one step's start to the next: at least the plugin's and the host's time in it
    assert result["step_period_us"] > result["total_us_per_step"]
    assert FullCudaGraphWrapper.__call__ is call  # the benchmark's patches are undone
    assert timing.StepTimer.start is timer_start
    assert plugin_host_time._Span.__dict__["cpu_clock"] is span_clock


def test_summary_splits_timed_steps_and_keeps_cpu_time_apart():
    clock = plugin_host_time.StepClock()
    rows = {  # step: (hooks, plugin_hooks, timer, forward_backward, guard, optimizer) in ns
        3: (9_000, 5_000, 2_000, 4_000, 1_000, 0),
        4: (50_000, 9_000, 3_000, 6_000, 2_000, 0),
        5: (7_000, 3_000, 0, 4_000, 1_000, 0),
        6: (8_000, 4_000, 0, 5_000, 1_000, 1_000),
        2: (1_000_000, 0, 0, 0, 0, 0),  # before the first steady step: left out
    }
    for step, row in rows.items():
        clock.step = step
        for piece, ns in zip(plugin_host_time.PIECES, row, strict=True):
            clock.add(piece, ns, ns // 2)
    clock.timed.update({2, 3, 4})
    # the loop's period: 20, 30 and 70 µs from steps 3, 4 and 5 (6 has no successor; from 2,
    # before the first steady step, it is left out): median 30, mean 40
    clock.starts = {2: 0, 3: 100_000, 4: 120_000, 5: 150_000, 6: 220_000}
    summary = plugin_host_time.summarise(clock, first=3)
    assert summary["step_period_us"] == 30.0
    assert summary["steady_steps"] == 4
    # totals (hooks + forward_backward + optimizer; the guard is inside forward_backward):
    # 13, 56, 11 and 14 µs
    assert summary["total_us_per_step"] == 13.5
    assert summary["timed_steps"] == {"count": 2, "total_us_per_step": 34.5}
    assert summary["untimed_steps"] == {"count": 2, "total_us_per_step": 12.5}
    assert summary["total_cpu_us_per_step"] == 6.75
    assert summary["us_per_step"]["timer"] == 1.0
    assert summary["cpu_us_per_step"]["hooks"] == 4.25
    assert summary["total_us_p90"] == 14.0


def test_the_steps_the_plugin_times_follow_its_sampling_rule(monkeypatch):
    from cudagraph_plugin.runtime import measurement

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 1)
    # capture at 2: every step up to 1 after it, none after; before the capture, all
    assert plugin_host_time.timed_by_the_plugin(range(10), 2) == {0, 1, 2, 3}
    assert plugin_host_time.timed_by_the_plugin(range(4), None) == {0, 1, 2, 3}


@pytest.mark.parametrize("breakdown", [False, True], ids=["lean", "breakdown"])
def test_megatron_cores_time_is_left_out_and_the_guard_counted(fake_graphs, monkeypatch, breakdown):
    import time

    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from cudagraph_plugin.runtime import guard

    call, see = FullCudaGraphWrapper.__call__, guard.ShapeGuard._see

    def slow_call(self, *args, **kwargs):
        time.sleep(0.05)  # megatron-core's share: never the plugin's
        return call(self, *args, **kwargs)

    def slow_see(self, *args, **kwargs):
        time.sleep(0.01)  # the guard runs inside megatron-core's call and is the plugin's
        return see(self, *args, **kwargs)

    monkeypatch.setattr(FullCudaGraphWrapper, "__call__", slow_call)
    monkeypatch.setattr(guard.ShapeGuard, "_see", slow_see)
    monkeypatch.setattr(plugin_host_time, "SIZE", plugin_host_time.gpu_modes.Size("t", 1, 16, 2))
    args = argparse.Namespace(steps=6, warmup=2, cpu=True, breakdown=breakdown)
    pieces = plugin_host_time.measure("full_iteration", args)["us_per_step"]
    assert pieces["guard"] >= 10_000
    assert 10_000 <= pieces["forward_backward"] < 50_000


def test_the_hosts_own_draw_is_not_counted_as_the_guard(fake_graphs, monkeypatch):
    """The guard's iterator draws the micro-batch from the host's data iterator, which may
    build it (the example's does): that draw is the host's time, left out of ``guard`` and
    of ``forward_backward``."""
    import time

    import train_gpt

    real = train_gpt.synthetic_batches

    def slow_batches(**kwargs):
        for batch in real(**kwargs):
            time.sleep(0.02)  # the host building its micro-batch
            yield batch

    monkeypatch.setattr(train_gpt, "synthetic_batches", slow_batches)
    monkeypatch.setattr(plugin_host_time, "SIZE", plugin_host_time.gpu_modes.Size("t", 1, 16, 2))
    args = argparse.Namespace(steps=6, warmup=2, cpu=True, breakdown=False)
    pieces = plugin_host_time.measure("full_iteration", args)["us_per_step"]
    assert 0 < pieces["guard"] < 10_000
    assert pieces["forward_backward"] < 10_000


def test_the_thread_snapshot_reads_each_threads_cpu_and_switches(tmp_path):
    # /proc's layout: a comm with spaces and a ")" must not shift the fields after it
    task = tmp_path / "41"
    task.mkdir()
    (task / "comm").write_text("pt (main)\n")
    after_comm = ["S", *map(str, range(4, 14)), "7", "5", *map(str, range(16, 39)), "3", "0"]
    (task / "stat").write_text("41 (pt (main)) " + " ".join(after_comm) + "\n")
    (task / "status").write_text(
        "Name:\tpt\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t4\n"
    )
    gone = tmp_path / "42"  # a thread that ended while being read: left out
    gone.mkdir()
    (thread,) = plugin_host_time.thread_snapshot(tmp_path)
    assert thread["tid"] == 41 and thread["name"] == "pt (main)"
    assert thread["cpu"] == 3 and thread["cpu_ticks"] == 12
    assert thread["voluntary_switches"] == 12 and thread["involuntary_switches"] == 4
    assert plugin_host_time.thread_snapshot(tmp_path / "absent") == []


def test_the_probes_chase_visits_every_entry_before_it_repeats():
    # one cycle through all entries: a chase of a short cycle would stay in the cache and
    # measure the CPU where it claims to measure the memory
    cycle = plugin_host_time.chase_cycle(1000, seed=3)
    seen, index = set(), 0
    for _ in range(1000):
        seen.add(index)
        index = cycle[index]
    assert len(seen) == 1000 and index == 0
    assert sorted(cycle) == list(range(1000))
    probe = plugin_host_time.host_probe(large=1 << 14, small=64, steps=1 << 12)
    assert probe["l1_chase_ns"] > 0 and probe["memory_chase_ns"] > 0
    assert probe["large_entries"] == 1 << 14


def test_the_speed_meter_splits_the_steady_steps_by_the_cpus_speed():
    clock = plugin_host_time.StepClock()
    # step: (hooks ns, meter ns per load); step 4 is one the plugin times: left out, its
    # meter too (else 30 and 35 would count as slower than its 10)
    rows = {
        3: (10_000, 30.0),
        4: (90_000, 10.0),
        5: (12_000, 35.0),
        6: (20_000, 60.0),
        7: (14_000, 36.0),  # exactly 1.2x the fastest: full speed
    }
    for step, (hooks, meter) in rows.items():
        clock.step = step
        clock.add("hooks", hooks)
        clock.meter[step] = meter
    clock.timed.add(4)
    summary = plugin_host_time.summarise(clock, first=3)
    meter = summary["speed_meter"]
    assert meter["fastest_ns"] == 30.0
    # 35 and 36 ns are within 1.2x of 30 (full speed), 60 is not
    assert meter["full_speed_steps"] == {"count": 3, "total_us_per_step": 12.0}
    assert meter["slower_steps"] == {"count": 1, "total_us_per_step": 20.0}
    assert summary["per_step"] == {
        "step": [3, 5, 6, 7],
        "meter_ns": [30.0, 35.0, 60.0, 36.0],
        "total_us": [10.0, 12.0, 20.0, 14.0],
    }
    # without the meter: no such keys
    assert "speed_meter" not in plugin_host_time.summarise(plugin_host_time.StepClock(), 0)


def test_the_speed_meter_runs_outside_every_timed_piece(fake_graphs, monkeypatch):
    import time

    metered = []

    def slow_meter(cycle, loads):
        metered.append(loads)
        time.sleep(0.02)  # the meter's time: never the plugin's, in no piece
        return 1.0

    monkeypatch.setattr(plugin_host_time, "_chase_ns", slow_meter)
    monkeypatch.setattr(plugin_host_time, "SIZE", plugin_host_time.gpu_modes.Size("t", 1, 16, 2))
    args = argparse.Namespace(steps=6, warmup=2, cpu=True, speed_meter=True)
    result = plugin_host_time.measure("full_iteration", args)
    assert metered == [plugin_host_time.METER_STEPS] * 6  # once before each step
    assert all(us < 20_000 for us in result["us_per_step"].values())
    assert result["total_us_per_step"] < 20_000


def test_the_process_facts_say_whether_addresses_are_randomised(tmp_path, monkeypatch):
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "self").mkdir()
    (tmp_path / "sys/kernel/randomize_va_space").write_text("2\n")
    (tmp_path / "self/personality").write_text("00040000\n")  # setarch -R
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    facts = plugin_host_time.process_facts(tmp_path)
    assert facts["addresses_randomised"] is False and facts["pythonhashseed"] == "0"
    (tmp_path / "self/personality").write_text("00000000\n")
    assert plugin_host_time.process_facts(tmp_path)["addresses_randomised"] is True
    (tmp_path / "sys/kernel/randomize_va_space").write_text("0\n")  # off for every process
    assert plugin_host_time.process_facts(tmp_path)["addresses_randomised"] is False
    assert plugin_host_time.process_facts(tmp_path / "absent")["addresses_randomised"] is None
