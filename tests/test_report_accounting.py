"""What the run report counts: which steps are eager and replayed samples, whether the capture
paid off, whose memory the overhead is, and what it says when no graph exists, through the
example loops on the CPU with fake graphs.

Step times on the CPU say nothing about graphs (the fake replay runs the work in Python), so
the tests that need a saving give the step timer fixed durations (the capture step's too:
a capture costs what its step takes beyond a replayed one); the others assert which steps
are counted, never how long they took.
"""

from __future__ import annotations

import contextlib
import logging
import statistics

import pytest
from cpu_only import needs_mcore_on_cpu
from test_report import make_report

import fake_optimizer_graph
import train_gpt
from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from cudagraph_plugin.runtime import capture as capture_module
from cudagraph_plugin.runtime import state as state_module
from cudagraph_plugin.runtime import timing
from cudagraph_plugin.runtime.payoff import (
    bucket_rows,
    bucket_samples,
    capture_cost_seconds,
    key_samples,
    pays_off,
)
from cudagraph_plugin.runtime.report import verdict
from cudagraph_plugin.runtime.timing import MemorySnapshot, split_samples
from hookspecs.report_schema import schema_problems
from recording import FULL, InvalidateAt, RaiseAt, Recorder, run_recorded

pytestmark = needs_mcore_on_cpu

CAPTURE = 2  # the capture step with --cuda-graph-warmup-steps 2
WARMUP = ["--cuda-graph-warmup-steps", str(CAPTURE)]


def step_times(monkeypatch, capture_step_ms: float) -> None:
    """Eager steps of 20 ms, replayed ones of 10 ms, and the capture step's time: a capture
    costs what its step takes beyond a replayed one."""
    timed = timing.StepTimer.durations_ms

    def durations_ms(self, sync=True):
        return {
            s: 20.0 if s < CAPTURE else capture_step_ms if s == CAPTURE else 10.0
            for s in timed(self, sync)
        }

    monkeypatch.setattr(timing.StepTimer, "durations_ms", durations_ms)


@pytest.fixture
def saving(monkeypatch):
    """A capture step of 110 ms, 100 ms beyond a replayed step (megatron-core replays the
    graph right after capturing it: the step's own work): earned back after 10 replayed
    steps of 10 ms saved each."""
    step_times(monkeypatch, 110.0)


# -- eager steps after an invalidation are no replays -------------------------------------


def test_steps_after_an_invalidation_without_buckets_are_no_replay_samples(fake_graphs):
    _, rec = run_recorded(*FULL, *WARMUP, plugins=[InvalidateAt(4)], steps=12)
    report = rec.report
    [graph] = fake_graphs.graphs
    assert graph.replays == 1 + 2  # the capture call's, steps 3 and 4; 5-11 ran eagerly
    assert report.replay_steps == [3, 4]
    assert report.eager_steps == [1]  # the warm-up's: the steps after are on neither side
    assert report.replays == {"training": 2}
    assert report.invalidations[0]["step"] == 4


def test_a_step_invalidated_at_its_start_ran_eagerly_and_is_no_replay(fake_graphs):
    """Invalidated at the start of step 5, before its forward/backward: step 5 ran eagerly
    (its span holds the release, too); replays end at step 4 (third review: step 5 was
    counted as a replay sample and a replayed step)."""
    _, rec = run_recorded(*FULL, *WARMUP, plugins=[InvalidateAt(5, at="start")], steps=10)
    [graph] = fake_graphs.graphs
    assert graph.replays == 1 + 2  # the capture call's, steps 3 and 4
    assert rec.report.replay_steps == [3, 4]
    assert rec.report.replays == {"training": 2}
    assert rec.graph_plugin.measurement.steps_replayed() == 2


# -- paid off by the steps that replayed, not the ones planned ----------------------------


@pytest.mark.parametrize(
    "argv,plugins,replayed,timed",
    [
        (["--exit-interval", "7"], [], 4, [3, 4, 5, 6]),  # then the host exits early
        # step 5 raised at its end, after its replay: counted, but not timed
        ([], [RaiseAt(5, RuntimeError("boom"))], 3, [3, 4]),
        ([], [InvalidateAt(6)], 4, [3, 4, 5, 6]),  # then eager
    ],
    ids=["early-exit", "exception", "invalidated"],
)
def test_a_run_that_replayed_fewer_steps_than_break_even_did_not_pay_off(
    fake_graphs, saving, caplog, argv, plugins, replayed, timed
):
    recorder = Recorder()
    raises = any(isinstance(plugin, RaiseAt) for plugin in plugins)
    with (
        caplog.at_level(logging.WARNING, logger="cudagraph_plugin"),
        pytest.raises(RuntimeError, match="boom") if raises else contextlib.nullcontext(),
    ):
        train_gpt.run(
            ["--train-iters", "400", "--log-interval", "0", *FULL, *WARMUP, *argv],
            plugins=[recorder, *plugins],
        )
    report = recorder.report
    assert report.break_even_steps == 10 and report.replay_steps == timed
    assert report.pays_off is False  # the 397 steps train_iters planned would have paid off
    [warning] = [r.getMessage() for r in caplog.records if "within this run" in r.getMessage()]
    assert "earned back after 10 replayed step(s)" in warning
    assert f"this run replayed {replayed} step(s)" in warning


def test_a_run_longer_than_its_timed_steps_counts_every_replayed_step(fake_graphs, monkeypatch):
    """Only 50 steps after the capture are timed; the steps that replayed are counted from
    the step numbers: 77 here, beyond a break-even of 60 timed steps could not reach."""
    step_times(monkeypatch, 610.0)
    _, rec = run_recorded(*FULL, *WARMUP, steps=80)
    report = rec.report
    assert report.break_even_steps == 60 and len(report.replay_steps) == 50
    assert report.pays_off is True


# -- unknown, not False, without an eager median ------------------------------------------


def test_without_an_eager_median_whether_it_paid_off_is_unknown(fake_graphs, caplog):
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        _, rec = run_recorded(*FULL, "--cuda-graph-warmup-steps", "1", steps=12)
    report = rec.report
    assert report.eager_step_ms is None and report.replay_step_ms is not None
    assert report.verdict == "unknown" and report.break_even_steps is None
    assert report.pays_off is None
    assert not [r for r in caplog.records if "did not pay off" in r.getMessage()]


def test_pays_off_is_unknown_when_a_median_is_missing_and_false_without_a_saving():
    assert pays_off(None, 10.0, None, 100) is None
    assert pays_off(20.0, None, None, 100) is None
    assert pays_off(20.0, 10.0, 5, None) is None
    assert pays_off(10.0, 20.0, None, 100) is False  # replay saves nothing
    assert (pays_off(20.0, 10.0, 5, 4), pays_off(20.0, 10.0, 5, 5)) == (False, True)


# -- the memory overhead is the training graph's ------------------------------------------


def test_memory_figures_are_the_training_captures_when_evaluation_captured_first(
    fake_graphs, monkeypatch
):
    """An evaluation after step 0 captures the validation graph (10 MiB) before the training
    graph (500 MiB) is captured at step 3: the report's memory is the training graph's."""
    allocated = [1000.0]
    adds = {"training": 500.0, "validation": 10.0}
    monkeypatch.setattr(
        capture_module.MemorySnapshot,
        "take",
        staticmethod(lambda: MemorySnapshot(allocated[0], allocated[0], allocated[0])),
    )
    bracket = capture_module.Captures.bracket

    def allocating(self, stage, capture):
        def body():
            result = capture()
            allocated[0] += adds[stage]
            return result

        return bracket(self, stage, body)

    monkeypatch.setattr(capture_module.Captures, "bracket", allocating)
    _, rec = run_recorded(
        *FULL, "--cuda-graph-warmup-steps", "3", "--eval-interval", "1", "--eval-iters", "4",
        steps=8,
    )  # fmt: skip
    stages = [(c["stage"], c["step"]) for c in rec.graph_plugin.capture.records]
    assert stages == [("validation", 0), ("training", 3)]
    data = rec.report.to_dict()
    assert data["capture_step"] == 3
    assert data["memory_before_capture"]["allocated_mib"] == 1010.0
    assert data["memory_after_capture"]["allocated_mib"] == 1510.0
    assert data["memory_overhead_mib"] == 500.0


def test_a_validation_capture_in_an_evaluation_leaves_its_step_a_replay_sample(fake_graphs):
    """The evaluation that captures the validation graph runs after its training step was
    timed (the GPU suite's full_iteration_eval): that step stays a replay sample."""
    _, rec = run_recorded(*FULL, "--eval-interval", "4", "--eval-iters", "2", steps=12)
    stages = [(c["stage"], c["step"]) for c in rec.graph_plugin.capture.records]
    assert stages == [("training", 3), ("validation", 7)]
    data = rec.report.to_dict()
    assert (data["eager_steps"], data["replay_steps"]) == ([1, 2], list(range(4, 12)))
    assert [(c["stage"], c["step"]) for c in data["captures"]] == stages
    assert [set(c) for c in data["captures"]] == [{"stage", "step", "seconds", "mib", "graphs"}] * 2
    assert [c["graphs"] for c in data["captures"]] == [1, 1]
    # the table's row says which capture ran when (it read "2 graph(s) at step 3")
    total = sum(c["seconds"] for c in data["captures"])
    assert (
        f"2 graph(s) at most at once; 2 capture(s) in {total:.3f} s: training at step 3; "
        "validation at step 7"
    ) in rec.report.format_table()


def test_a_run_that_captured_only_for_evaluation_says_so(fake_graphs):
    """An evaluation captured the validation graph; the run ended before the training
    capture step: no capture step, nothing replayed in training, and the table says why."""
    _, rec = run_recorded(
        *FULL, "--cuda-graph-warmup-steps", "3", "--eval-interval", "1", "--eval-iters", "4",
        steps=2,
    )  # fmt: skip
    assert [c["stage"] for c in rec.graph_plugin.capture.records] == ["validation"]
    report = rec.report
    assert report.graphs_captured and report.capture_step is None
    assert "graph(s) for evaluation only (the run ended before the training capture) in " in (
        report.format_table()
    )
    assert "verdict      no training step ran on a graph (only evaluations did)" in (
        report.format_table()
    )  # (it said "no step ran after the capture step", of a capture step it has not)
    # the evaluation after step 0 (eval-interval 1): 3 warm-up calls, the capture at its 4th
    assert "s: validation at step 0" in report.format_table()
    assert "step None" not in report.format_table()


@pytest.mark.parametrize(
    "buckets, warmup, reason",
    [
        ("16", "3", "no training step fit a CUDA graph bucket (16): every step came at a "
         "length outside them (32) and ran eagerly; add a bucket that fits them"),
        ("32,64", "9", "no bucket got past its warm-up (9 step(s) of its own before its "
         "capture): the most any saw was 8 (seq_length 32)"),
        # (review of 2026-12-05: steps that were not padded, shorter than a bucket, were told
        # to add a bucket, where each step's own warning said to pad)
        ("16,64", "3", "no training step fit a CUDA graph bucket (16, 64): every step came at "
         "a length outside them (32) and ran eagerly; pad each step to its bucket (pad_step) "
         "and pass that length as seq_length"),
    ],
)  # fmt: skip
def test_a_bucketed_run_that_captured_nothing_says_why(bucket_fakes, buckets, warmup, reason):
    """A run whose steps (all at --seq-length 32) fit no bucket said it "ended (after step
    7) before the capture step (start_step + 3)": the wrong reason (a user review)."""
    _, rec = run_recorded(
        *FULL, "--cuda-graph-buckets", buckets, "--cuda-graph-warmup-steps", warmup,
        # (rotary: a bucket above --seq-length 32 is refused over learned embeddings)
        "--position-embedding-type", "rope", steps=8,
    )  # fmt: skip
    data = rec.report.to_dict()
    assert data["graphs_captured"] is False
    assert data["no_graph_reason"] == reason


def test_warmups_started_over_are_said_with_the_bucket_reason() -> None:
    """(a review: "the most any saw was 60" with a warm-up of 5 read as a contradiction where
    invalidations had started the warm-ups over)"""
    from types import SimpleNamespace

    from cudagraph_plugin.runtime.bucket_keys import (
        Action,
        BucketKey,
        BucketStats,
        no_capture_reason,
    )

    key = BucketKey(32, 2, 1)
    stats = BucketStats(key, True, calls=[(n, Action.WARMUP) for n in range(12)])
    graphs = SimpleNamespace(stats={key: stats}, buckets=(32,))
    said = no_capture_reason(graphs, 5, invalidations=3)
    assert said.endswith(
        "the most any saw was 12 in all, 3 invalidation(s) starting the warm-ups over "
        "(seq_length 32)"
    ), said
    assert "invalidation" not in no_capture_reason(graphs, 20)
    # unpadded steps, some longer than every bucket: both fixes
    outside = {BucketKey(n, 2, 1): BucketStats(BucketKey(n, 2, 1), False) for n in (20, 70)}
    graphs = SimpleNamespace(stats=outside, buckets=(16, 64))
    assert no_capture_reason(graphs, 5).endswith(
        "(20, 70) and ran eagerly; pad each step to its bucket (pad_step) and pass that length "
        "as seq_length, and add a bucket for the longer ones (70)"
    )


# -- a capture that produced no graph is no capture ---------------------------------------


def test_a_capture_that_produced_no_graph_is_reported_as_no_capture(fake_graphs):
    _, rec = run_recorded(
        "--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "mamba",
        "--cuda-graph-accept-eager", "--bf16", *WARMUP, steps=10,
    )  # fmt: skip
    data = rec.report.to_dict()
    assert data["graphs_captured"] is False
    assert (
        "no layer of the model is graphable for scope mamba on any rank"
        in (data["no_graph_reason"])
    )
    for key in (
        "capture_step", "capture_seconds", "replay_step_ms", "memory_before_capture",
        "memory_after_capture", "memory_overhead_mib", "peak_allocated_at_end_mib",
        "break_even_steps", "pays_off", "speedup",
    ):  # fmt: skip
        assert data[key] is None, key
    assert (data["replay_steps"], data["replays"], data["graph_count"]) == ([], {}, 0)
    # every step ran eagerly (all but the first are samples): no rank had a layer to
    # capture, so the capture step held no capture
    assert data["eager_steps"] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert schema_problems(data) == []
    table = rec.report.format_table()
    assert "NO GRAPH CAPTURED" in table and "replays" not in table


# -- why no graph ------------------------------------------------------------------


def test_a_capture_that_raised_is_reported_as_failed_and_the_error_still_ends_the_run(
    fake_graphs, monkeypatch
):
    import torch

    @contextlib.contextmanager
    def failing_graph(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        yield

    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="stream is capturing"):
        train_gpt.run(
            ["--train-iters", "8", "--log-interval", "0", *FULL, "--cuda-graph-warmup-steps", "3"],
            plugins=[recorder],
        )
    report = recorder.report
    assert report.shutdown_reason == "exception" and not report.graphs_captured
    assert report.no_graph_reason == (
        "the training capture at step 3 failed (RuntimeError: CUDA error: operation not "
        "permitted when stream is capturing)"
    )


def test_a_run_without_a_training_step_says_so(fake_graphs):
    _, rec = run_recorded(*FULL, steps=0)
    assert rec.report.no_graph_reason == "the run ended before its first training step"


# -- the table --------------------------------------------------------------------


def test_each_ranks_table_is_headed_with_its_own_rank(fake_graphs, monkeypatch, caplog):
    monkeypatch.setattr(state_module.RunState, "rank_and_world", lambda self: (2, 4))
    with caplog.at_level(logging.DEBUG, logger="cudagraph_plugin"):
        run_recorded(*FULL, *WARMUP, steps=6)
    [header] = [
        r.getMessage().splitlines()[0]
        for r in caplog.records
        if r.getMessage().startswith("CUDA graph report")
    ]
    assert header == "CUDA graph report (rank 2 of 4):"


def test_memory_that_went_down_is_printed_with_one_sign():
    report = make_report(
        memory_before_capture=MemorySnapshot(1000.0, 1200.0, 1500.0),
        memory_after_capture=MemorySnapshot(976.0, 1200.0, 1500.0),
        peak_allocated_at_end_mib=1400.0,
    )
    [line] = [row for row in report.format_table().splitlines() if "memory" in row]
    assert "(-24 MiB, -2.4%)" in line and "(-100 MiB, -6.7%)" in line
    assert "+-" not in line


# -- bucketed graphs -------------------------------------------------------------


def test_buckets_with_warmup_1_keep_their_replays_and_count_them_as_the_report(bucket_fakes):
    """Warm-up 1: a bucket's only warm-up step is its first, no eager sample; its replayed
    steps still count, and its row counts the replays the report counts (not the capture
    call's own)."""
    _, rec = run_recorded(*FULL, "--cuda-graph-warmup-steps", "1", "--cuda-graph-buckets", "32",
                          steps=10)  # fmt: skip
    data = rec.report.to_dict()
    [row] = data["buckets"]
    assert row["capture_steps"] == [1]
    assert data["replay_steps"] == row["replay_steps"] == list(range(2, 10))
    assert data["replay_step_ms"] is not None and data["eager_steps"] == []
    assert data["replays"]["training"] == row["replays"] == 8
    assert data["verdict"] == "unknown" and data["thin_sample"] is True
    # (the buckets did replay: what is missing is the eager side)
    assert data["verdict_text"].startswith("no eager step time measured (needs ")


def test_split_samples_leaves_out_every_step_that_held_a_capture():
    steps = list(range(12))
    eager, replay = split_samples(steps, 0, 5, None, holding_captures={3, 5, 8})
    assert (eager, replay) == ([1, 2, 4], [6, 7, 9, 10, 11])
    assert split_samples(steps, 0, 5, 7) == ([1, 2, 3, 4], [6, 7])  # replays ended at 7
    assert split_samples(steps, 0, None, None, {4}) == ([1, 2, 3, *range(5, 12)], [])


def test_bucket_samples_keep_a_bucket_without_eager_median_and_drop_capture_steps():
    durations = {step: 10.0 for step in range(10)}
    rows = [
        {"in_bucket": True, "eager_step_ms": 10.0, "eager_steps": [0, 2, 4],
         "replay_steps": [6, 7, 8]},
        {"in_bucket": True, "eager_step_ms": None, "eager_steps": [1], "replay_steps": [5, 9]},
        {"in_bucket": False, "eager_step_ms": 10.0, "eager_steps": [3], "replay_steps": []},
    ]  # fmt: skip
    eager, replay, eager_samples, replay_samples = bucket_samples(rows, durations, {4, 7})
    assert eager == [2] and replay == [5, 6, 8, 9]
    assert eager_samples == [1.0] and replay_samples == [1.0, 1.0]  # the first bucket's only


RL_LOOP = [
    "--seq-length", "48", "--min-length", "4", "--max-length", "48", "--train-iters", "12",
    "--steps-per-round", "4", "--rollout-batches", "2", "--log-interval", "0",
    "--cuda-graph-warmup-steps", "2", "--lr-decay-style", "constant",
    "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
    "--cuda-graph-buckets", "16,32,48", "--optimizer-cuda-graph",
]  # fmt: skip
SEED_WITH_OPTIMIZER_CAPTURE_IN_A_WARMUP = "6"  # bucket 48 warms up at steps 1 and 2


def test_a_step_that_held_the_optimizer_capture_is_no_buckets_sample(
    fake_graphs, bucket_fakes, monkeypatch
):
    """The optimizer graph is captured after its own warm-up, whatever bucket the step is
    in: with this seed, in a bucket's warm-up step. That step's time includes the capture:
    it is neither an eager nor a replayed sample, in the report or in its bucket's row."""
    import rl_loop

    _optimizer_graph_stand_ins(fake_graphs, monkeypatch)
    recorder = Recorder()
    rl_loop.run([*RL_LOOP, "--seed", SEED_WITH_OPTIMIZER_CAPTURE_IN_A_WARMUP], plugins=[recorder])
    plugin = recorder.graph_plugin
    [held] = [c["step"] for c in plugin.capture.records if c["stage"] == "optimizer"]
    data = recorder.report.to_dict()
    [row] = [r for r in data["buckets"] if held in r["eager_steps"] + r["replay_steps"]]
    assert held in row["eager_steps"][1:], "the seed no longer puts the capture in a warm-up"
    assert held not in data["eager_steps"] and held not in data["replay_steps"]
    durations = plugin.measurement.timer.durations_ms()
    own = [s for s in row["eager_steps"][1:] if s != held]
    expected = statistics.median(durations[s] for s in own) if own else None
    assert row["eager_step_ms"] == expected


def _optimizer_graph_stand_ins(fake_graphs, monkeypatch) -> None:
    """The optimizer graph's stand-ins, as tests/test_optimizer_graph.py sets them up."""
    from test_optimizer_graph import _clip_grads

    fake_graphs.wrapper = fake_optimizer_graph.install(monkeypatch)
    monkeypatch.setattr(_clip_grads(), "multi_tensor_scale_tensor_impl", None, raising=False)
    build = fake_optimizer_graph.capturable_build(train_gpt._build_optimizer)
    monkeypatch.setattr(train_gpt, "_build_optimizer", build)


def test_with_buckets_and_only_the_optimizer_graph_no_length_is_set_against_another(
    fake_graphs, bucket_fakes, monkeypatch
):
    """No bucket is captured (a bucket of 8 that this seed's lengths never fit), the
    optimizer graph is: each step costs its length in milliseconds, graph or not. The
    verdict compares each shape with itself, so it finds no speed-up (third review: steps
    of one length before the optimizer capture were set against shorter ones after it,
    'replay is 2.00x faster')."""
    import rl_loop

    _optimizer_graph_stand_ins(fake_graphs, monkeypatch)
    recorder = Recorder()
    timed = timing.StepTimer.durations_ms

    def by_length(self, sync=True):
        buckets = recorder.pm.get_plugin(RUN_PLUGIN_NAME).state.buckets
        length = {s: key.seq_length for key, st in buckets.stats.items() for s, _ in st.calls}
        return {s: float(length[s]) for s in timed(self, sync)}

    monkeypatch.setattr(timing.StepTimer, "durations_ms", by_length)
    argv = [*RL_LOOP, "--train-iters", "14", "--cuda-graph-buckets", "8", "--seed", "6"]
    rl_loop.run([*argv, "--cuda-graph-accept-eager"], plugins=[recorder])
    records = recorder.graph_plugin.capture.records
    assert [c["stage"] for c in records] == ["optimizer"]
    report = recorder.report
    assert report.verdict != "faster", report.verdict_text
    assert report.verdict_text == (
        "no bucket was captured, and no shape ran both with the optimizer graph replayed and "
        "without it: nothing to compare like for like"
    )


def test_a_capture_costs_what_its_step_takes_beyond_a_replayed_one():
    """The training and optimizer captures of step 3 cost what step 3 took beyond a
    replayed step (their own times hold the replay megatron-core runs after capturing); a
    validation capture (in an evaluation, no timed step) and one in a step that was not
    timed cost their own time."""
    records = [
        {"stage": "training", "step": 3, "seconds": 0.5},
        {"stage": "optimizer", "step": 3, "seconds": 0.2},
        {"stage": "validation", "step": 3, "seconds": 0.25},
        {"stage": "optimizer", "step": 9, "seconds": 0.125},  # step 9 not timed
    ]
    durations = {2: 100.0, 3: 640.0, 4: 40.0}
    assert capture_cost_seconds(records, durations, 40.0) == pytest.approx(0.6 + 0.25 + 0.125)
    assert capture_cost_seconds(records, durations, None) == pytest.approx(1.075)
    assert capture_cost_seconds([], durations, 40.0) is None


def test_key_samples_compare_each_shape_with_itself_around_the_capture():
    rows = [
        # (its first step, 1, is no sample; 9 ran eagerly again, after an invalidation)
        {"eager_steps": [1, 2, 3, 5, 6, 9], "capture_steps": [], "replay_steps": []},
        {"eager_steps": [4, 7], "capture_steps": [], "replay_steps": []},  # 4: its first
        {"eager_steps": [8], "capture_steps": [], "replay_steps": []},
    ]
    durations = {1: 99.0, 2: 10.0, 3: 30.0, 4: 50.0, 5: 10.0, 6: 40.0, 7: 60.0, 8: 5.0, 9: 20.0}
    eager, replay, eager_rel, replay_rel = key_samples(rows, durations, {3}, {5, 6, 7, 8})
    assert (eager, replay) == ([2, 9], [5, 6])  # step 3 held a capture
    assert eager_rel == [2 / 3, 4 / 3] and replay_rel == [2 / 3, 8 / 3]


def test_with_only_the_optimizer_graph_its_warm_up_again_after_an_invalidation_is_eager(
    fake_graphs, bucket_fakes, monkeypatch
):
    """Steps whose optimizer graph replayed take 10 ms, the others 20 ms: a real 2x. After
    each reload's invalidation the optimizer graph warms up again, eagerly (review of
    2026-12-04: those steps counted as replays, and the report said 'no_gain')."""
    import rl_loop

    from cudagraph_plugin.runtime import interceptor

    _optimizer_graph_stand_ins(fake_graphs, monkeypatch)
    replayed_at: set[int] = set()
    call = interceptor.OptimizerStep.__call__

    def spied(self):
        before = self._captures.replays.get("optimizer", 0)
        result = call(self)
        if self._captures.replays.get("optimizer", 0) > before:
            replayed_at.add(self._captures.state.step)
        return result

    monkeypatch.setattr(interceptor.OptimizerStep, "__call__", spied)
    timed = timing.StepTimer.durations_ms
    monkeypatch.setattr(
        timing.StepTimer,
        "durations_ms",
        lambda self, sync=True: {s: 10.0 if s in replayed_at else 20.0 for s in timed(self, sync)},
    )
    recorder = Recorder()
    argv = [
        *RL_LOOP, "--cuda-graph-buckets", "8", "--seed", "6", "--min-length", "48",
        "--train-iters", "20", "--steps-per-round", "6", "--offload-interval", "6",
        "--invalidate-after-reload", "--cuda-graph-warmup-steps", "3",
    ]  # fmt: skip
    rl_loop.run([*argv, "--cuda-graph-accept-eager"], plugins=[recorder])
    report = recorder.report
    assert len(report.invalidations) >= 2
    assert report.replay_steps and set(report.replay_steps) <= replayed_at
    assert report.eager_steps and not set(report.eager_steps) & replayed_at
    assert report.verdict == "faster", report.verdict_text


def test_a_saving_within_the_noise_earns_no_capture_back(fake_graphs, monkeypatch, caplog):
    """Replay 1% faster, within the verdict's 2% noise floor: no break-even, not paid
    off, one warning (third review: the same report said 'did not pay off' and 'paid off
    after 100 replayed steps')."""
    timed = timing.StepTimer.durations_ms
    monkeypatch.setattr(
        timing.StepTimer,
        "durations_ms",
        lambda self, sync=True: {s: 100.0 if s < 4 else 99.0 for s in timed(self, sync)},
    )
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        _, rec = run_recorded(*FULL, "--cuda-graph-warmup-steps", "4", steps=120)
    report = rec.report
    assert report.verdict == "no_gain"
    assert report.break_even_steps is None and report.pays_off is False
    assert "paid off" not in report.format_table()
    assert len([r for r in caplog.records if "did not pay off" in r.getMessage()]) == 1


def test_a_bucket_whose_saving_is_within_the_noise_has_no_break_even():
    row = {
        "in_bucket": True,
        "eager_steps": [1, 2, 3, 4],
        "capture_steps": [5],
        "replay_steps": [6, 7, 8],
        "capture_seconds": [0.1],
        "eager_step_ms": 100.0,
        "replay_step_ms": 99.0,
    }
    durations = {1: 100.0, 2: 100.0, 3: 100.0, 4: 100.0, 6: 99.0, 7: 99.0, 8: 99.0}
    judge = lambda eager, replay: verdict(eager, replay, relative=True)[0]  # noqa: E731
    [judged] = bucket_rows([row], [], durations, judge=judge)
    assert judged["break_even_steps"] is None and judged["paid_off"] is False
    [unjudged] = bucket_rows([row], [])  # (without the durations: the medians alone)
    assert unjudged["break_even_steps"] == 100


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_that_measured_no_gain_says_so_under_its_rank(
    fake_graphs, monkeypatch, caplog, rank
):
    """The verdict is each rank's own measurement (pipeline stages differ): every rank
    that measured a slowdown warns, its rank named (third review: rank 0 alone warned, as
    if for the job, and a slower rank 1 said nothing)."""
    from cudagraph_plugin.runtime import ranklog

    timed = timing.StepTimer.durations_ms
    monkeypatch.setattr(
        timing.StepTimer,
        "durations_ms",
        lambda self, sync=True: {s: 10.0 if s <= CAPTURE else 20.0 for s in timed(self, sync)},
    )
    monkeypatch.setattr(state_module.RunState, "rank_and_world", lambda self: (rank, 4))
    monkeypatch.setattr(ranklog, "rank_and_world", lambda: (rank, 4))
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        _, rec = run_recorded(*FULL, *WARMUP, steps=12)
    assert rec.report.verdict == "slower"
    [line] = [r.getMessage() for r in caplog.records if "did not pay off" in r.getMessage()]
    assert line.startswith(f"[rank {rank}] CUDA graphs did not pay off: replay is SLOWER")
