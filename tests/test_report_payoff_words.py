"""What the report says about the capture's payoff, where its figures used to contradict
each other or the run (review of 2026-12-04): the capture cost the warning quotes is the one
break-even uses; a bucketed run in which no bucket replayed says so (not "needs warm-up");
a speed-up resting on one bucket's single eager step is flagged as thin; a bucket that did
not earn its capture back says so in its row and in a warning.

Step durations are fixed (the CPU has no device to time): the figures are the report's
arithmetic on them.
"""

from __future__ import annotations

import logging

import pytest
from cpu_only import needs_mcore_on_cpu
from test_report_accounting import RL_LOOP, WARMUP, _optimizer_graph_stand_ins, step_times

from cudagraph_plugin.runtime import capture as capture_module
from cudagraph_plugin.runtime import timing
from cudagraph_plugin.runtime.payoff import fewest_eager_samples, thin_sample_note
from recording import FULL, Recorder, run_recorded

pytestmark = needs_mcore_on_cpu


def test_the_did_not_pay_off_warning_quotes_the_cost_break_even_is_computed_from(
    fake_graphs, monkeypatch, caplog
):
    """Capture step 110 ms against 10 ms replays: the capture cost 100 ms beyond a replayed
    step, earned back after 10 steps of 10 ms saved; its bracket's wall time (118 ms: the
    capture, megatron-core's replay right after it, the syncs) is quoted as the wall time."""
    step_times(monkeypatch, 110.0)
    bracket = capture_module.Captures.bracket

    def wall_118_ms(self, stage, capture):
        result = bracket(self, stage, capture)
        self.records[-1]["seconds"] = 0.118
        return result

    monkeypatch.setattr(capture_module.Captures, "bracket", wall_118_ms)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        _, rec = run_recorded(*FULL, *WARMUP, steps=8)
    report = rec.report
    assert report.break_even_steps == 10
    assert report.capture_cost_seconds == pytest.approx(0.1)
    assert report.to_dict()["capture_cost_seconds"] == pytest.approx(0.1)
    [warning] = [r.getMessage() for r in caplog.records if "within this run" in r.getMessage()]
    assert "the capture cost 0.100 s beyond a replayed step (0.118 s wall)" in warning
    [row] = [line for line in report.format_table().splitlines() if "break-even" in line]
    assert row.endswith(
        "after 10 replayed step(s) NOT paid off in this run (the capture cost 0.100 s beyond "
        "a replayed step (0.118 s wall))"
    )


def test_a_bucketed_run_whose_only_bucket_never_replayed_says_so_not_needs_warm_up(
    fake_graphs, bucket_fakes
):
    _, rec = run_recorded(
        *FULL, "--cuda-graph-warmup-steps", "3", "--cuda-graph-buckets", "32", steps=4
    )
    report = rec.report
    [row] = report.buckets
    assert row["capture_steps"] == [3] and row["replay_steps"] == []
    assert report.verdict == "unknown"
    assert report.verdict_text == (
        "no bucket graph replayed (a bucket replays on its steps after the one that captured "
        "it): nothing to compare like for like"
    )


def test_where_no_bucket_replayed_the_optimizer_graphs_replays_are_compared(
    fake_graphs, bucket_fakes, monkeypatch
):
    """Buckets captured, then freed by each reload's invalidation before their length came
    again; the optimizer graph replayed for many steps: its steps are compared with the same
    shapes' eager ones (the report used to compare nothing, blaming the warm-up)."""
    import rl_loop

    _optimizer_graph_stand_ins(fake_graphs, monkeypatch)
    recorder = Recorder()
    argv = [
        *RL_LOOP, "--seed", "6", "--train-iters", "23", "--steps-per-round", "6",
        "--offload-interval", "6", "--invalidate-after-reload", "--min-length", "4",
    ]  # fmt: skip
    rl_loop.run(argv, plugins=[recorder])
    report = recorder.report
    assert any(row["capture_steps"] for row in report.buckets)
    assert not any(row["replay_steps"] for row in report.buckets)
    assert report.replays["optimizer"] > 0
    assert report.replay_steps, report.verdict_text
    assert "needs cuda_graph_warmup_steps" not in report.verdict_text
    assert "no bucket graph replayed: each shape's steps whose optimizer graph replayed" in (
        report.verdict_text
    )


def _bucket(first: int, eager_ms: float, replays: int) -> tuple[dict, dict[int, float]]:
    """A bucket with warm-up 2: its first step (no sample) and one eager sample, a capture,
    then ``replays`` replays of 10 ms."""
    replay_steps = list(range(first + 3, first + 3 + replays))
    row = {
        "in_bucket": True,
        "eager_steps": [first, first + 1],
        "capture_steps": [first + 2],
        "replay_steps": replay_steps,
        "capture_seconds": [0.05],
        "eager_step_ms": eager_ms,
        "replay_step_ms": 10.0,
    }
    return row, {first + 1: eager_ms, **dict.fromkeys(replay_steps, 10.0)}


def test_a_speed_up_resting_on_one_eager_step_per_bucket_is_thin():
    """Five buckets of one eager sample each pooled to five samples, so the thin-sample
    check passed although each bucket's speed-up rested on a single step (and a single
    sample, divided by its own median, is exactly 1: no spread to see)."""
    rows, durations = [], {}
    for i in range(5):
        row, durs = _bucket(30 * i, 13.0, 20)
        rows.append(row)
        durations.update(durs)
    assert fewest_eager_samples(rows, durations) == 1
    note = thin_sample_note(1, 100, per_bucket=True)
    assert note is not None and note.startswith(
        "measured on 1 eager step(s) in a bucket and 100 replayed step(s): too few"
    )
    assert "before each capture" in note
    # a bucket that never replayed does not count; no bucket that replayed: nothing known
    never, durs = _bucket(500, 13.0, 0)
    assert fewest_eager_samples([*rows, never], {**durations, **durs}) == 1
    assert fewest_eager_samples([never], durs) is None


def test_a_bucketed_run_reports_its_thinnest_bucket(fake_graphs, bucket_fakes, monkeypatch):
    import rl_loop

    _optimizer_graph_stand_ins(fake_graphs, monkeypatch)
    timed = timing.StepTimer.durations_ms
    monkeypatch.setattr(
        timing.StepTimer, "durations_ms", lambda self, sync=True: dict.fromkeys(timed(self), 10.0)
    )
    recorder = Recorder()
    rl_loop.run([*RL_LOOP, "--seed", "3", "--train-iters", "30"], plugins=[recorder])
    report = recorder.report
    replayed = [row for row in report.buckets if row["replay_steps"]]
    assert replayed
    assert report.thin_sample
    assert "eager step(s) in a bucket" in report.verdict_text


def test_a_bucket_that_did_not_earn_its_capture_back_says_so(
    fake_graphs, bucket_fakes, monkeypatch, caplog
):
    """Every step takes 10 ms, graph or not: no bucket saves anything, so none pays off;
    each row says so, and one warning names them."""
    import rl_loop

    _optimizer_graph_stand_ins(fake_graphs, monkeypatch)
    timed = timing.StepTimer.durations_ms
    monkeypatch.setattr(
        timing.StepTimer, "durations_ms", lambda self, sync=True: dict.fromkeys(timed(self), 10.0)
    )
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        rl_loop.run([*RL_LOOP, "--seed", "3", "--train-iters", "30"], plugins=[recorder])
    report = recorder.report
    unpaid = [row for row in report.buckets if row["paid_off"] is False]
    assert unpaid
    lines = [line for line in report.format_table().splitlines() if "NOT paid off" in line]
    assert len(lines) == len(unpaid)
    assert all("(no saving beyond noise)" in line for line in lines)
    [warning] = [r.getMessage() for r in caplog.records if "captured bucket(s)" in r.getMessage()]
    assert f"did not pay off within this run for {len(unpaid)} of " in warning


def test_a_bucket_captured_and_never_replayed_did_not_pay_off():
    """(review of 2026-12-04: such a bucket's row said ``paid_off: None``, so the "did not
    pay off" warning left it out: an RL run that captured again and again and never
    replayed was told nothing.)"""
    from cudagraph_plugin.runtime.payoff import bucket_rows
    from cudagraph_plugin.runtime.report import _bucket_line

    row = {
        "seq_length": 16, "micro_batch_size": 2, "num_microbatches": 1, "in_bucket": True,
        "eager_steps": [0, 1, 5], "capture_steps": [3, 20], "replay_steps": [],
        "capture_seconds": [0.4, 0.4], "replays": 0, "graph_held": False,
        "eager_step_ms": 12.0, "replay_step_ms": None, "padding_waste_percent": 20.0,
    }  # fmt: skip
    [out] = bucket_rows([row], [{"stage": "training", "step": 20, "mib": 300.0}])
    assert out["paid_off"] is False and out["break_even_steps"] is None
    assert _bucket_line(out).endswith("NOT paid off in this run (never replayed)")
    [not_captured] = bucket_rows([{**row, "capture_steps": [], "capture_seconds": []}], [])
    assert not_captured["paid_off"] is None  # nothing was spent
