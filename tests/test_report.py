"""The run report: verdict, timing without steady-state syncs, table and JSON."""

from __future__ import annotations

import json

import pytest

from cudagraph_plugin.runtime.report import RunReport, verdict
from cudagraph_plugin.runtime.timing import MemorySnapshot, StepTimer
from fakes import FakeDevice


@pytest.mark.parametrize(
    "eager,replay,expected",
    [
        ([10.0, 10.1, 9.9], [2.0, 2.1, 2.0], "faster"),
        ([10.0, 10.0, 10.0], [10.1, 10.0, 10.1], "no_gain"),
        ([10.0, 10.0], [10.19, 10.2], "no_gain"),  # inside the 2% noise floor
        ([41.36, 41.36], [42.0, 42.0], "no_gain"),  # the Qwen3 case: 1.5% slower is noise
        ([10.0, 10.0, 10.0], [12.0, 12.0, 12.1], "slower"),
    ],
)
def test_verdict(eager, replay, expected):
    result, speedup, noise, text = verdict(eager, replay)
    assert result == expected
    assert speedup == pytest.approx(
        sorted(eager)[len(eager) // 2] / sorted(replay)[len(replay) // 2], rel=0.02
    )
    assert noise >= 0.02
    if expected == "slower":
        assert "SLOWER" in text
    if expected == "no_gain":
        assert "NOT faster" in text


def test_noisy_samples_widen_the_noise():
    result, _, noise, _ = verdict([10.0, 14.0, 6.0, 10.0], [9.0, 9.0, 9.0])
    assert noise > 0.1
    assert result == "no_gain"


@pytest.mark.parametrize(
    "eager,replay,hint", [([], [1.0], "warmup_steps >= 2"), ([1.0], [], "no step ran after")]
)
def test_unknown_verdict_says_what_is_missing(eager, replay, hint):
    result, speedup, _, text = verdict(eager, replay)
    assert result == "unknown" and speedup is None and hint in text


def test_cpu_timer_measures_each_step():
    timer = StepTimer(use_cuda=False)
    for step in range(3):
        timer.start(step)
        sum(range(10000))
        timer.stop(step)
    timer.start(3)  # never stopped: a step that raised
    timer.discard(3)
    durations = timer.durations_ms()
    assert sorted(durations) == [0, 1, 2]
    assert all(value > 0 for value in durations.values())


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    import torch

    fake = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", fake.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def test_cuda_timer_never_waits_in_the_steady_state_and_holds_few_events(device):
    timer = StepTimer(use_cuda=True)
    for step in range(1000):
        timer.start(step)
        device.advance(2.0 + step % 3)
        timer.stop(step)
        assert timer.in_flight <= 1  # earlier steps are already milliseconds
        device.pass_all()  # the device finishes the step while the host goes on
    assert device.synchronize_calls == 0
    durations = timer.durations_ms()
    assert device.synchronize_calls == 0  # the last step's events were passed already
    assert len(durations) == 1000
    assert durations[0] == 2.0 and durations[1] == 3.0 and durations[999] == 2.0 + 999 % 3


def test_cuda_timer_records_read_events_again_instead_of_creating_new_ones(device):
    import torch

    created = []
    event_class = torch.cuda.Event

    class Counting(event_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    torch.cuda.Event = Counting  # the fixture's monkeypatch restores it
    timer = StepTimer(use_cuda=True)
    for step in range(200):
        timer.start(step)
        device.advance(1.0)
        timer.stop(step)
        device.pass_all()
    assert len(created) <= 4  # two pairs at most: one in flight, one being reused
    assert timer.durations_ms() == {step: 1.0 for step in range(200)}


def test_cuda_timer_records_on_the_current_stream_without_a_new_stream_object_per_step(
    device, monkeypatch
):
    device.install_stream_bindings(monkeypatch)
    timer = StepTimer(use_cuda=True)
    for step in range(50):
        if step == 30:
            device.current_stream = (7, 0, 1)  # the host switched to another stream
        timer.start(step)
        device.advance(1.0)
        timer.stop(step)
        device.pass_all()
    recorded = device.recorded_on
    assert len(recorded) == 100 and all(stream is not None for stream in recorded)
    # one Stream object per stream seen, not one per record (torch.cuda.current_stream()
    # builds a new one on every call)
    assert len(device.streams_made) == 2
    assert {stream.stream_id for stream in recorded[:60]} == {0}
    assert {stream.stream_id for stream in recorded[60:]} == {7}
    assert timer.durations_ms() == {step: 1.0 for step in range(50)}


def test_cuda_timer_waits_once_for_steps_still_in_flight(device):
    timer = StepTimer(use_cuda=True)
    for step in range(5):  # the host runs ahead: the device has passed nothing
        timer.start(step)
        device.advance(4.0)
        timer.stop(step)
    assert timer.in_flight == 5
    durations = timer.durations_ms()
    assert device.synchronize_calls == 1
    assert durations == {step: 4.0 for step in range(5)}
    assert timer.in_flight == 0


def test_cuda_timer_collects_in_order_once_the_device_catches_up(device):
    timer = StepTimer(use_cuda=True)
    for step in range(3):
        timer.start(step)
        device.advance(1.0)
        timer.stop(step)
    device.pass_all()
    timer.start(3)
    timer.stop(3)  # collects steps 0-2; step 3 is still in flight
    assert timer.in_flight == 1
    timer.start(4)
    timer.discard(4)  # a step that raised is never timed
    assert sorted(timer.durations_ms()) == [0, 1, 2, 3]
    assert device.synchronize_calls == 1


def make_report(**overrides) -> RunReport:
    fields = dict(
        impl="local",
        scope=["full_iteration"],
        graphs_captured=True,
        no_graph_reason=None,
        warmup_steps=3,
        start_step=0,
        capture_step=3,
        capture_seconds=0.5,
        capture_cost_seconds=0.45,
        graph_count=1,
        steps_timed=10,
        eager_steps=[1, 2],
        eager_step_ms=20.0,
        replay_steps=[4, 5, 6],
        replay_step_ms=4.0,
        speedup=5.0,
        verdict="faster",
        verdict_text="replay is 5.00x faster than eager",
        noise=0.02,
        memory_before_capture=MemorySnapshot(1000.0, 1200.0, 1500.0),
        memory_after_capture=MemorySnapshot(1064.0, 1300.0, 1520.0),
        peak_allocated_at_end_mib=1600.0,
        fallback_step=None,
        graphs_held=1,
        replays={"training": 16},
        notes=[],
        thin_sample=False,
        break_even_steps=None,
        pays_off=None,
        buckets=[],
        invalidations=[],
        captures=[{"stage": "training", "step": 3, "seconds": 0.5, "mib": 64.0}],
        shutdown_reason="completed",
        device="NVIDIA H200",
        versions={"torch": "2.11", "megatron-core": "0.16.1", "transformer-engine": None},
    )
    fields.update(overrides)
    return RunReport(**fields)


UNCAPTURED = dict(  # what a run that captured nothing reports
    graphs_captured=False,
    no_graph_reason="no CUDA device (CUDA graphs need one; the run was eager)",
    capture_step=None,
    capture_seconds=None,
    capture_cost_seconds=None,
    graph_count=0,
    eager_steps=[1, 2, 3],
    replay_steps=[],
    replay_step_ms=None,
    speedup=None,
    verdict="unknown",
    noise=0.0,
    memory_before_capture=None,
    memory_after_capture=None,
    peak_allocated_at_end_mib=None,
    graphs_held=0,
    replays={},
    notes=[],
    thin_sample=False,
    break_even_steps=None,
    pays_off=None,
    buckets=[],
    invalidations=[],
    captures=[],
    device="cpu",
)


def test_report_memory_overheads():
    data = make_report().to_dict()
    assert data["memory_overhead_mib"] == pytest.approx(64.0)
    assert data["memory_overhead_pct"] == pytest.approx(6.4)
    assert data["peak_overhead_mib"] == pytest.approx(100.0)
    assert data["peak_overhead_pct"] == pytest.approx(100 / 15)


def test_report_json_round_trip(tmp_path):
    path = make_report().write_json(tmp_path / "sub" / "report.json")
    data = json.loads(path.read_text())
    assert data["speedup"] == 5.0
    assert data["memory_before_capture"]["allocated_mib"] == 1000.0
    assert data["versions"]["megatron-core"] == "0.16.1"


def test_table_for_a_captured_run():
    table = make_report().format_table()
    assert "impl=local scope=full_iteration on NVIDIA H200" in table
    assert "1 graph(s) at step 3 in 0.500 s" in table
    assert "20.000 ms (median of 2, steps 1-2)" in table
    assert "4.000 ms (median of 3, steps 4-6)" in table
    assert "+64 MiB, +6.4%" in table
    assert "1 graph(s), freed right after this" in table


def test_table_when_nothing_was_captured():
    table = make_report(**UNCAPTURED).format_table()
    assert "NO GRAPH CAPTURED: no CUDA device" in table
    assert "replay step" not in table and "memory" not in table


def test_a_bucket_has_paid_off_only_after_enough_replayed_steps():
    """A bucket's capture (10 ms) is earned back after 2 steps saving 5 ms each: one
    replayed step is not enough (the capture call's own replay saves nothing and is not
    counted)."""
    from cudagraph_plugin.runtime.payoff import bucket_rows

    row = {
        "seq_length": 16, "in_bucket": True, "capture_steps": [2], "capture_seconds": [0.01],
        "eager_step_ms": 10.0, "replay_step_ms": 5.0, "eager_steps": [0, 1],
    }  # fmt: skip
    once, twice = (
        bucket_rows([{**row, "replay_steps": steps, "replays": len(steps)}], [])[0]
        for steps in ([3], [3, 4])
    )
    assert once["break_even_steps"] == twice["break_even_steps"] == 2
    assert (once["paid_off"], twice["paid_off"]) == (False, True)


def test_a_recaptured_buckets_pool_memory_is_its_last_captures():
    """A bucket captured, invalidated (its graph freed) and captured again holds one
    capture's memory, not the sum of both (review finding); both captures' seconds count
    towards its break-even."""
    from cudagraph_plugin.runtime.payoff import bucket_rows

    row = {
        "seq_length": 16, "in_bucket": True, "capture_steps": [3, 11],
        "capture_seconds": [1.0, 1.0], "eager_step_ms": 10.0, "replay_step_ms": 5.0,
        "eager_steps": [0, 1, 8, 9], "replay_steps": [4, 5, 12], "replays": 5,
    }  # fmt: skip
    captures = [
        {"stage": "training", "step": 11, "mib": 90.0},
        {"stage": "optimizer", "step": 11, "mib": 7.0},
        {"stage": "training", "step": 3, "mib": 100.0},
    ]
    [out] = bucket_rows([row], captures)
    assert out["pool_mib"] == 90.0
    assert out["capture_seconds"] == 2.0
