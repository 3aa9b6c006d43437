"""The CUDA graph plugin's whole lifecycle on real megatron-core 0.16.1, on the CPU.

The host is the example loop (``train_gpt.run``); only graph capture and Transformer
Engine are faked (``tests/fakes.py``, mirroring the real APIs), so everything else — model,
DDP with its forward pre-hooks, the distributed optimizer, ``get_forward_backward_func()``,
``FullCudaGraphWrapper``'s warm-up, capture and replay calls — is megatron-core's own code.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import weakref

import pytest
import torch
from cpu_only import needs_mcore_on_cpu

import train_gpt
from cpu_redirect import cpu_redirect
from cudagraph_plugin import compat
from cudagraph_plugin.runtime import fallback
from cudagraph_plugin.runtime.guard import StaticShapeError
from cudagraph_plugin.runtime.state import Phase
from fakes import FakeTECudaGraphHelper, install_fake_cuda_graphs
from hookspecs import ConfigurationError, ShutdownReason, hookimpl
from recording import FULL, OVERLAP, TE, RaiseAt, Recorder
from recording import run_recorded as run

pytestmark = needs_mcore_on_cpu


# -- full-iteration graphs --------------------------------------------------------------------


# (warm-up 0 is refused for full_iteration: tests/test_validation.py)
@pytest.mark.parametrize("warmup,start", [(1, 0), (3, 0), (2, 5), (3, 4)])
def test_full_iteration_captures_after_warmup_counted_from_the_start_step(
    fake_graphs, warmup, start
):
    summary, rec = run(
        *FULL, "--cuda-graph-warmup-steps", str(warmup), "--start-step", str(start), steps=10
    )
    capture_step = start + warmup
    assert ("before_capture", capture_step, "local", ("full_iteration",)) in rec.events
    assert ("after_capture", capture_step, 1) in rec.events
    before = rec.events.index(("before_capture", capture_step, "local", ("full_iteration",)))
    # post-warmup fires first; full-iteration graphs are then captured inside the step's
    # forward_backward_func
    assert rec.events[before - 2 : before] == [
        ("step", capture_step),
        ("post_warmup", capture_step, start),
    ]
    assert [e for e in rec.events if e[0] == "post_warmup"] == [
        ("post_warmup", capture_step, start)
    ]
    [graph] = fake_graphs.graphs
    assert graph.replays == 10 - start - warmup  # the capture call replays once too
    assert graph.resets == 1  # freed at shutdown
    assert summary["shutdown_reason"] == "completed"
    report = rec.report
    assert report.graphs_captured and report.capture_step == capture_step
    # the capture is timed inside its step
    capture_ms = rec.graph_plugin.measurement.timer.durations_ms()[capture_step]
    assert 0 < report.capture_seconds * 1000 <= capture_ms
    assert report.replay_steps == list(range(capture_step + 1, 10))
    assert report.eager_steps == list(range(start + 1, capture_step))
    assert rec.graph_plugin.graphs_freed == 1


def test_steps_long_after_the_capture_are_not_timed(fake_graphs, monkeypatch):
    """Every step up to DENSE_REPLAY_STEPS after the capture is timed, then none (the
    plugin stops listening to the step hooks: tests/test_step_listener.py)."""
    from cudagraph_plugin.runtime import measurement

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 4)
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "2", steps=20)
    report = rec.report
    assert report.capture_step == 2
    assert report.eager_steps == [1]
    assert report.replay_steps == [3, 4, 5, 6]
    assert report.steps_timed == 3 + len(report.replay_steps)
    assert "(median of 4, steps 3-6)" in report.format_table()
    assert sorted(rec.graph_plugin.measurement.timer.durations_ms()) == list(range(7))


def test_bucketed_runs_time_every_step(bucket_fakes, monkeypatch):
    from cudagraph_plugin.runtime import measurement

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 1)
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "1", "--cuda-graph-buckets", "32", steps=8)
    assert rec.report.buckets  # the run was bucketed
    assert sorted(rec.graph_plugin.measurement.timer.durations_ms()) == list(range(8))


def test_full_iteration_validation_gets_its_own_graph(fake_graphs):
    _, rec = run(
        *FULL,
        "--cuda-graph-warmup-steps",
        "1",
        "--eval-interval",
        "3",
        "--eval-iters",
        "2",
        steps=9,
    )
    stages = [c["stage"] for c in rec.graph_plugin.capture.records]
    assert stages == ["training", "validation"]
    training, validation = fake_graphs.graphs
    # evaluations at steps 3, 6, 9 with 2 iterations each: call 1 captures (warm-up 1)
    assert validation.replays == 6 - 1
    assert training.resets == validation.resets == 1
    assert rec.report.graph_count == 2
    assert rec.graph_plugin.graphs_freed == 2


def test_two_runs_in_one_process_capture_again_at_the_right_step(fake_graphs):
    _, first = run(*FULL, "--cuda-graph-warmup-steps", "2", steps=5)
    _, second = run(*FULL, "--cuda-graph-warmup-steps", "3", "--start-step", "10", steps=15)
    assert first.report.capture_step == 2
    assert second.report.capture_step == 13
    assert [g.resets for g in fake_graphs.graphs] == [1, 1]
    assert fake_graphs.graphs[1].replays == 15 - 13


def test_full_iteration_plugin_reports_json(fake_graphs, tmp_path):
    path = tmp_path / "report.json"
    run(*FULL, "--cuda-graph-report-json", str(path), steps=6)
    data = json.loads(path.read_text())
    assert data["graphs_captured"] is True and data["capture_step"] == 3
    # the memory around the (first) capture, in MiB (zeros on the CPU)
    assert data["memory_before_capture"] is not None and data["memory_after_capture"] is not None
    assert data["device"] == "fake CUDA device (CPU)"
    assert data["versions"]["megatron-core"] == "0.16.1"


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("--num-microbatches", "2"),
        ("--eval-interval", "2", "--eval-iters", "2"),
        OVERLAP,  # collectives inside the graph, the distributed optimizer around it
    ],
    ids=["plain", "two-microbatches", "with-evaluation", "distributed-optimizer-overlap"],
)
def test_full_iteration_graphs_train_exactly_as_eager(fake_graphs, extra):
    """The fake graph replays the captured work on the static buffers (a replay that missed
    an input copy, a gradient or an update would change the losses); step for step the
    losses are those of the eager run."""
    argv = ("--cuda-graph-warmup-steps", "2", *extra)
    graphs, _ = run(*FULL, *argv, steps=7)
    eager, _ = run("--cuda-graph-impl", "none", *argv, steps=7)
    training = fake_graphs.graphs[0]
    assert training.replays == 7 - 2
    assert graphs["losses"] == eager["losses"]
    assert graphs["eval_losses"] == eager["eval_losses"]
    assert graphs["losses"][-1] < graphs["losses"][2]  # replays train


def test_a_capture_changes_nothing_and_reads_nothing_on_the_host(fake_graphs):
    """Like a real capture, the fake one leaves every existing tensor as it was (the replay
    right after it does the work once) and refuses host reads."""
    parameter = torch.ones(3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parameter.add_(1.0)
        doubled = parameter * 2
    assert parameter.tolist() == [1.0, 1.0, 1.0]
    graph.replay()
    assert parameter.tolist() == [2.0, 2.0, 2.0] and doubled.tolist() == [4.0, 4.0, 4.0]
    graph.replay()
    assert parameter.tolist() == [3.0, 3.0, 3.0] and doubled.tolist() == [6.0, 6.0, 6.0]
    with pytest.raises(RuntimeError, match="stream is capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            parameter.sum().item()


# -- cleanup on every exit path -------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,plugins,reason",
    [
        ((), (), "completed"),
        (("--exit-interval", "6"), (), "early_exit"),
        ((), (RaiseAt(5, RuntimeError("boom")),), "exception"),
        ((), (RaiseAt(5, KeyboardInterrupt()),), "interrupted"),
    ],
)
@pytest.mark.parametrize("mode", ["full", "te"])
def test_graphs_are_freed_once_on_every_exit_path(fake_graphs, extra, plugins, reason, mode):
    recorder = Recorder()
    argv = ["--train-iters", "8", "--log-interval", "0", *(FULL if mode == "full" else TE), *extra]
    try:
        train_gpt.run(argv, plugins=[recorder, *plugins])
    except (RuntimeError, KeyboardInterrupt) as exc:
        assert reason in ("exception", "interrupted"), exc
    assert recorder.events[-1] == ("shutdown", reason)
    assert recorder.names().count("report") == 1
    if mode == "full":
        assert [g.resets for g in fake_graphs.graphs] == [1]
    else:
        assert [e for e, _ in fake_graphs.events].count("delete_cuda_graphs") == 1
        [helper] = fake_graphs.helpers
        assert not helper.graphs_created()
        assert all(layer.cuda_graphs == [] for layer in helper.flattened_callables)
    assert recorder.graph_plugin.phase is Phase.SHUT_DOWN


class KeepsWeakRefs:
    """Weak references to what the run built, to see what outlives its shutdown."""

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.model = [weakref.ref(chunk) for chunk in model]
        self.optimizer = weakref.ref(optimizer)


@pytest.mark.parametrize("mode", ["full", "te"])
def test_shutdown_releases_every_resource_the_run_held(fake_graphs, monkeypatch, mode):
    """Each resource of the run, one by one: nothing is held once shutdown returns."""
    from megatron.core import full_cuda_graph
    from megatron.core.transformer import cuda_graphs

    # 0.18+'s process-wide graph pool handle of full-iteration graphs (0.16 has none)
    monkeypatch.setattr(full_cuda_graph, "_shared_graph_pool", (0, 7), raising=False)
    refs = KeepsWeakRefs()
    argv = (*TE, *OVERLAP) if mode == "te" else FULL
    _, rec = run(*argv, "--cuda-graph-warmup-steps", "2", plugins=[refs], steps=5)
    plugin = rec.graph_plugin
    assert plugin.phase is Phase.SHUT_DOWN
    assert plugin.state.te is None and plugin.state.full is None
    assert not plugin.guard.is_armed("training") and not plugin.te_capture.manual_hooks_pending
    assert plugin.state.model is None and plugin.state.model_config is None
    assert not plugin.interceptor.wrapped
    assert ("clear_cublas_workspaces", None) in fake_graphs.events
    assert not compat.full_iteration_state_dirty()
    assert not cuda_graphs.is_graph_capturing()
    if mode == "te":
        [helper] = fake_graphs.helpers
        assert not helper.graphs_created()
        assert all(
            layer.cuda_graphs == []
            and layer.cuda_graph_manual_hooks == []
            and layer._graph_seen.was_reset
            for layer in helper.flattened_callables
        )
        assert plugin.graphs_freed == 2
        return
    assert [(g.resets, g.captured) for g in fake_graphs.graphs] == [(1, False)]
    assert plugin.graphs_freed == 1
    assert full_cuda_graph._shared_graph_pool is None
    # Nothing keeps the model or the optimizer alive (the graph's recording referenced every
    # parameter; megatron-core's distributed optimizer, used in the TE case, would).
    gc.collect()
    assert [ref() for ref in refs.model] == [None] and refs.optimizer() is None


def test_exception_before_capture_frees_nothing_and_resets_state(fake_graphs):
    with pytest.raises(RuntimeError, match="early"):
        train_gpt.run(
            ["--train-iters", "8", "--log-interval", "0", *FULL],
            plugins=[RaiseAt(1, RuntimeError("early"))],
        )
    assert fake_graphs.graphs == []


# -- Transformer Engine scopes --------------------------------------------------------------------


@pytest.mark.parametrize("warmup,start", [(0, 0), (2, 0), (3, 6)])
def test_te_captures_once_at_the_post_warmup_step(fake_graphs, warmup, start):
    summary, rec = run(
        *TE, "--cuda-graph-warmup-steps", str(warmup), "--start-step", str(start), steps=start + 6
    )
    capture = start + warmup
    # Both at the capture step, once; the capture runs inside the post-warmup hook (pluggy
    # calls the later-registered run plugin first, so its capture events come first).
    assert sorted(e for e in rec.events if e[0] in ("post_warmup", "before_capture")) == [
        ("before_capture", capture, "transformer_engine", ("attn", "mlp")),
        ("post_warmup", capture, start),
    ]
    assert [e for e, _ in fake_graphs.events] == [
        "init",
        "create_cudagraphs",
        "delete_cuda_graphs",
        "clear_cublas_workspaces",  # after the graphs, once
    ]
    [helper] = fake_graphs.helpers
    assert len(helper.flattened_callables) == 2  # both layers have attention and an MLP
    calls = [g.calls for layer in helper.flattened_callables for g in [layer._graph_seen]]
    assert calls == [start + 6 - capture] * 2  # each step after capture replays each layer
    # the fake graphs compute the eager layer, so training carries on normally
    assert summary["last_loss"] < summary["first_loss"]


@pytest.fixture(autouse=True)
def _remember_te_graphs(monkeypatch):
    """Keep a handle on each layer's fake graph (delete_cuda_graphs empties the list)."""
    original = FakeTECudaGraphHelper.create_cudagraphs

    def create(self):
        original(self)
        for layer in self.flattened_callables:
            layer._graph_seen = layer.cuda_graphs[0]

    monkeypatch.setattr(FakeTECudaGraphHelper, "create_cudagraphs", create)


def test_te_pre_hooks_toggled_around_capture_then_manual_hooks(fake_graphs):
    _, rec = run(*TE, *OVERLAP, "--cuda-graph-warmup-steps", "2", steps=5)
    toggles = [
        e
        for e in rec.events
        if e[0] in ("disable_pre_hook", "enable_pre_hook", "before_capture", "after_capture")
    ]
    assert toggles == [
        ("disable_pre_hook", False),  # the host, before step 0 (Megatron-LM's habit)
        ("enable_pre_hook",),  # the host, after step 0
        ("disable_pre_hook", False),  # the plugin, before the capture at step 2
        ("before_capture", 2, "transformer_engine", ("attn", "mlp")),
        ("after_capture", 2, 2),  # two layers, one micro-batch graph each
        ("enable_pre_hook",),  # the plugin, after the capture
    ]
    # capture with the pre-hooks off, manual hooks set once they are back on
    assert fake_graphs.events[1:3] == [("create_cudagraphs", False), ("set_manual_hooks", True)]
    [helper] = fake_graphs.helpers
    assert all(layer.cuda_graph_manual_hooks == [] for layer in helper.flattened_callables)


def test_te_warmup_zero_sets_manual_hooks_when_the_host_enables_the_pre_hooks(fake_graphs):
    _, rec = run(*TE, *OVERLAP, "--cuda-graph-warmup-steps", "0", steps=3)
    # the host disabled the pre-hooks before step 0, so the plugin captures as they are
    assert [e for e in rec.events if e[0] in ("disable_pre_hook", "enable_pre_hook")] == [
        ("disable_pre_hook", False),
        ("enable_pre_hook",),
    ]
    assert fake_graphs.events[1:3] == [("create_cudagraphs", False), ("set_manual_hooks", True)]


@pytest.fixture
def bucket_per_layer(monkeypatch):
    """DDP buckets small enough that each layer's parameters have their own all-gather (as
    in any model of real size): a layer then gets its parameters only through its own
    forward pre-hook, never as a side effect of another module's."""
    from megatron.core import distributed

    config_class = distributed.DistributedDataParallelConfig
    monkeypatch.setattr(
        distributed,
        "DistributedDataParallelConfig",
        lambda **kwargs: config_class(**kwargs, bucket_size=1000),
    )


def test_te_replay_gets_the_param_all_gather_through_the_manual_hooks(
    fake_graphs, bucket_per_layer, monkeypatch
):
    """A replayed TE graph runs no Python: the DDP forward pre-hooks of its modules do not
    fire, and only megatron-core's manual hooks (set after the capture) finish the layer's
    parameter all-gather before the graph reads the parameters."""
    from fakes import FakeGraphedCallable

    replays = []
    replay = FakeGraphedCallable.__call__

    def checked(self, *args, **kwargs):
        [ddp] = fake_graphs.helpers[0].model
        groups = {ddp.param_to_bucket_group[p] for p in self.layer.parameters()}
        gathered = all(g.param_gather_dispatched and g.param_gather_handle is None for g in groups)
        replays.append((len(groups), gathered))
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(FakeGraphedCallable, "__call__", checked)
    summary, _ = run(*TE, *OVERLAP, "--cuda-graph-warmup-steps", "1", steps=5)
    assert summary["steps"] == 5
    assert len(replays) == 2 * (5 - 1)  # two graphed layers, replayed from step 1 on
    assert all(groups > 0 for groups, _ in replays)
    assert [gathered for _, gathered in replays] == [True] * len(replays)


def test_te_replay_fires_no_module_hook_of_a_graphed_layer(fake_graphs, monkeypatch):
    """Only the manual hooks reach a graphed layer's modules on replay: one call per module
    with parameters, per layer and replay."""
    from megatron.core.distributed import DistributedDataParallel

    calls = []
    original = DistributedDataParallel._make_forward_pre_hook

    def counting(self):
        hook = original(self)

        def wrapped(module, *args):
            calls.append(module)
            return hook(module, *args)

        return wrapped

    monkeypatch.setattr(DistributedDataParallel, "_make_forward_pre_hook", counting)
    # step 0: pre-hooks off (the host); step 1: eager with pre-hooks; steps 2-4: replays
    run(*TE, *OVERLAP, "--cuda-graph-warmup-steps", "2", steps=5)
    [helper] = fake_graphs.helpers
    graphed = {
        id(module)
        for layer in helper.flattened_callables
        for module in layer.modules()
        if next(module.parameters(recurse=False), None) is not None
    }
    assert [layer._graph_seen.calls for layer in helper.flattened_callables] == [3, 3]
    on_graphed = [module for module in calls if id(module) in graphed]
    assert len(on_graphed) == len(graphed) * (1 + 3)


@pytest.mark.parametrize("generation", ["0.16", "0.19"])
def test_te_helper_is_made_by_compat_for_either_generation(monkeypatch, generation):
    """megatron-core's helper class is the fake of either generation; the plugin builds it
    through compat (0.19's with the model's process groups) and drives it to the end."""
    from fakes import FakeTECudaGraphHelper019

    helper_class = FakeTECudaGraphHelper019 if generation == "0.19" else FakeTECudaGraphHelper
    log = install_fake_cuda_graphs(monkeypatch, te_helper=helper_class)
    _, rec = run(*TE, *OVERLAP, "--cuda-graph-warmup-steps", "2", steps=5)
    [helper] = log.helpers
    assert type(helper) is helper_class
    assert rec.report.capture_step == 2 and rec.report.graph_count == 2
    assert [event for event, _ in log.events] == [
        "init",
        "create_cudagraphs",
        "set_manual_hooks",
        "delete_cuda_graphs",
        "clear_cublas_workspaces",
    ]
    if generation == "0.19":
        [ddp] = helper.model
        assert helper.capture_finished() and helper.pg_collection is ddp.module.pg_collection


def test_te_without_pre_hooks_never_toggles(fake_graphs):
    _, rec = run(*TE, "--cuda-graph-warmup-steps", "1", steps=3)
    assert "disable_pre_hook" not in rec.names()
    assert [e for e, _ in fake_graphs.events] == [
        "init",
        "create_cudagraphs",
        "delete_cuda_graphs",
        "clear_cublas_workspaces",
    ]


# -- static-shape guard ---------------------------------------------------------------------------


class WrapsForwardBackward:
    """A host plugin that wraps the run's forward/backward (outermost) and knows the step
    running: each call goes through :meth:`call`."""

    current: int | None = None

    @hookimpl
    def mcgraph_train_step_start(self, step):
        self.current = step

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_forward_backward_func(self, forward_backward_func):
        inner = yield
        return lambda **kwargs: self.call(inner, kwargs)

    def call(self, inner, kwargs):
        return inner(**kwargs)


class ChangeInputs(WrapsForwardBackward):
    """From ``step`` on, hand the forward/backward a changed batch or micro-batch count."""

    def __init__(
        self,
        step: int,
        *,
        seq: int | None = None,
        microbatches: int | None = None,
        stage: str = "training",
    ):
        self.step, self.seq, self.microbatches = step, seq, microbatches
        self.forward_only = stage == "validation"

    def call(self, inner, kwargs):
        if (
            self.current is not None
            and self.current >= self.step
            and kwargs["forward_only"] == self.forward_only
        ):
            if self.microbatches is not None:
                kwargs["num_microbatches"] = self.microbatches
            if self.seq is not None:
                original = kwargs["data_iterator"]
                kwargs["data_iterator"] = (
                    {
                        k: (
                            v[:, : self.seq].contiguous()
                            if torch.is_tensor(v) and v.dim() == 2
                            else v
                        )
                        for k, v in batch.items()
                    }
                    for batch in original
                )
        return inner(**kwargs)


@pytest.mark.parametrize("mode", ["full", "te"])
def test_shape_change_after_capture_raises_instead_of_replaying(fake_graphs, mode):
    rec = Recorder()
    with pytest.raises(StaticShapeError, match="stale buffers") as info:
        train_gpt.run(
            [
                "--train-iters",
                "8",
                "--log-interval",
                "0",
                *(FULL if mode == "full" else TE),
                "--cuda-graph-warmup-steps",
                "2",
            ],
            plugins=[rec, ChangeInputs(5, seq=16)],
        )
    assert "(2, 32)" in str(info.value) and "(2, 16)" in str(info.value)
    assert rec.events[-1] == ("shutdown", "exception")
    if mode == "full":
        assert fake_graphs.graphs[0].replays == 5 - 2  # steps 2-4 replayed, 5 refused


def test_microbatch_count_change_after_capture_raises(fake_graphs):
    """Refused at the step whose count changed (4), before that step replays."""
    with pytest.raises(StaticShapeError, match="num_microbatches=2"):
        train_gpt.run(
            ["--train-iters", "6", "--log-interval", "0", *FULL, "--cuda-graph-warmup-steps", "3"],
            plugins=[ChangeInputs(4, microbatches=2)],
        )
    [graph] = fake_graphs.graphs
    assert graph.replays == 1  # the capture call's own replay (step 3); step 4 never replayed


def test_te_graphs_leave_evaluation_free_to_change_shape(fake_graphs):
    """megatron-core replays TE graphs in training mode only: evaluation batches may change
    shape after the capture (the guard watches training alone)."""
    summary, _ = run(
        *TE,
        "--cuda-graph-warmup-steps",
        "1",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        plugins=[ChangeInputs(4, seq=16, stage="validation")],
        steps=6,
    )
    assert summary["steps"] == 6 and len(summary["eval_losses"]) == 3


class SeqLengthArgument:
    """Hands every training forward/backward call another ``seq_length`` than the model's."""

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_forward_backward_func(self, forward_backward_func):
        inner = yield

        def call(**kwargs):
            if not kwargs["forward_only"]:
                kwargs["seq_length"] = 16
            return inner(**kwargs)

        return call


def test_te_calls_must_keep_the_shapes_the_graphs_were_captured_for(fake_graphs):
    """The guard compares later calls with the first one after the capture; the TE graphs
    were captured for the model_built() shapes, which the first call must match too."""
    # one call after the capture: that first call is the one checked
    with pytest.raises(StaticShapeError, match="captured for seq_length=32"):
        run(*TE, "--cuda-graph-warmup-steps", "1", plugins=[SeqLengthArgument()], steps=2)


@pytest.mark.parametrize("captured", [4, 1])
def test_te_calls_must_run_the_micro_batches_the_graphs_were_captured_for(
    fake_graphs, monkeypatch, captured
):
    """With pipeline parallelism megatron-core captures one TE graph per micro-batch, as many
    as its calculator counts; a training call with another count would replay them mixed
    (fifth review: only the sequence length and micro-batch size were checked). Here the
    helper is taken as pipelined (PP > 1 cannot run in this process)."""
    from cudagraph_plugin import compat

    monkeypatch.setattr(compat, "te_captured_microbatches", lambda helper: captured)
    argv = (*TE, "--num-microbatches", "4", "--cuda-graph-warmup-steps", "1")
    if captured == 4:
        summary, _ = run(*argv, steps=3)
        assert summary["steps"] == 3
    else:
        with pytest.raises(StaticShapeError, match=r"num_microbatches=4 but megatron-core cap"):
            run(*argv, steps=3)


def test_a_forward_only_call_in_training_mode_may_run_another_count_of_micro_batches(
    fake_graphs, monkeypatch
):
    """An RL host's log-probs (forward-only, training mode, the captured shape) with one
    micro-batch where the pipelined graphs were captured for two: each graph's output is used
    before it replays again, so the count is not held against it (seventh review)."""
    from cudagraph_plugin import compat

    monkeypatch.setattr(compat, "te_captured_microbatches", lambda helper: 2)
    argv = (*TE, "--num-microbatches", "2", "--cuda-graph-warmup-steps", "1")
    summary, _ = run(*argv, plugins=[ForwardOnlyAt(3, 32)], steps=5)
    assert summary["shutdown_reason"] == "completed"


def test_te_graphs_count_micro_batches_only_when_pipelined(monkeypatch):
    """megatron-core's helper captures one graph per layer without pipeline parallelism,
    reused for every micro-batch: no count to keep then."""
    from megatron.core import parallel_state

    from cudagraph_plugin import compat

    class Helper:  # the TECudaGraphHelper attributes read: num_microbatches, config
        num_microbatches = 3
        config = argparse.Namespace(overlap_moe_expert_parallel_comm=False)

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 1)
    assert compat.te_captured_microbatches(Helper()) is None
    Helper.config.overlap_moe_expert_parallel_comm = True
    assert compat.te_captured_microbatches(Helper()) == 3
    Helper.config.overlap_moe_expert_parallel_comm = False
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    assert compat.te_captured_microbatches(Helper()) == 3
    Helper.num_microbatches = None  # (before its capture)
    assert compat.te_captured_microbatches(Helper()) is None


def test_a_shape_set_from_the_first_step_on_is_fine(fake_graphs):
    """A host's own shape (not the example's), the same at every step: nothing to refuse."""
    summary, _ = run(
        *FULL, "--cuda-graph-warmup-steps", "3", plugins=[ChangeInputs(0, seq=16)], steps=6
    )
    assert summary["steps"] == 6


@pytest.mark.parametrize(
    "seq, warmup, change_at, call",
    [(16, 3, 1, "a warm-up call"), (1, 3, 1, "a warm-up call"), (16, 2, 2, "the capture call")],
    ids=["warm-up", "broadcastable", "capture"],
)
def test_a_shape_change_between_warm_up_calls_is_refused_before_megatron_core_copies_it(
    fake_graphs, seq, warmup, change_at, call
):
    """megatron-core's full-iteration wrapper copies every call before the capture into the
    static buffers its first call made: another shape failed inside its copy (a raw
    RuntimeError), or, broadcastable (``[2, 1]`` into ``[2, 32]``), trained on the wrong
    data and captured the graph on it without a word."""
    rec = Recorder()
    with pytest.raises(StaticShapeError, match=rf"at step {change_at} \({call}\)") as info:
        train_gpt.run(
            ["--train-iters", "6", "--log-interval", "0", *FULL,
             "--cuda-graph-warmup-steps", str(warmup)],
            plugins=[rec, ChangeInputs(change_at, seq=seq)],
        )  # fmt: skip
    assert f"shape (2, 32) dtype torch.int64 in the buffer, now shape (2, {seq})" in str(info.value)
    assert fake_graphs.graphs == []  # nothing captured on the wrong data
    assert rec.events[-1] == ("shutdown", "exception")


# -- fallback policy, CPU message, configuration errors -----------------------------------------


def test_fallback_frees_the_graph_when_replay_loses(fake_graphs, monkeypatch, caplog):
    monkeypatch.setattr(
        fallback, "verdict", lambda eager, replay: ("slower", 0.8, 0.02, "replay is SLOWER")
    )
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        summary, rec = run(
            *FULL, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown", steps=12
        )
    fallback_step = 2 + fallback.FALLBACK_REPLAY_STEPS
    assert rec.report.fallback_step == fallback_step
    [graph] = fake_graphs.graphs
    assert graph.resets == 1 and graph.replays == fallback_step - 2 + 1
    assert "freeing the full-iteration graph" in caplog.text
    # eager again after the fallback: the fake replay cannot train, the real function does
    losses = summary["losses"]
    assert losses[fallback_step + 1] != losses[fallback_step + 2]


def test_fallback_keeps_graphs_that_win(fake_graphs, monkeypatch):
    # The verdict is given: the fake replay does the work in Python, its timing means nothing.
    monkeypatch.setattr(
        fallback, "verdict", lambda eager, replay: ("faster", 1.5, 0.02, "replay is faster")
    )
    _, rec = run(
        *FULL, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown", steps=10
    )
    assert rec.report.fallback_step is None
    assert fake_graphs.graphs[0].replays == 8


def test_cpu_run_validates_says_so_once_and_reports_no_graph(caplog):
    with caplog.at_level(logging.INFO):
        summary, rec = run(*FULL, steps=4)
    assert summary["device"] == "cpu"
    assert caplog.text.count("CUDA graphs need a CUDA device") == 1
    assert rec.report.graphs_captured is False
    assert "no CUDA device" in rec.report.no_graph_reason
    assert "NO GRAPH CAPTURED" in rec.report.format_table()
    assert rec.report.eager_steps == [1, 2, 3]


def test_invalid_configuration_fails_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(train_gpt, "_build_model", lambda *a, **k: built.append(1))
    rec = Recorder()
    with pytest.raises(ValueError, match="full_iteration cuda graph is not supported"):
        train_gpt.run(
            ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "full_iteration"],
            plugins=[rec],
        )
    assert built == []
    assert rec.events == [("shutdown", "exception")]


def test_rng_tracker_that_is_not_graph_safe_is_refused(fake_graphs):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from cudagraph_plugin.config.errors import CudaGraphConfigError
    from cudagraph_plugin.config.settings import read_settings
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    settings = read_settings({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})
    plugin = CudaGraphPlugin(settings, pluginmanager=None, cuda=True)
    with cpu_redirect():
        model_parallel_cuda_manual_seed(
            7, te_rng_tracker=True, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
    with pytest.raises(CudaGraphConfigError, match="graph-safe RNG tracker") as info:
        plugin.mcgraph_rng_initialized(config=None)
    assert "use_cudagraphable_rng=True" in str(info.value)
    # megatron-core's own phrase, as the configure-time refusal quotes it (issue 22)
    assert 'megatron-core: "RNG tracker does not support cudagraphs"' in str(info.value)


def test_model_config_built_without_the_plugin_kwargs_is_refused():
    from types import SimpleNamespace

    from cudagraph_plugin.config.errors import CudaGraphConfigError
    from cudagraph_plugin.config.settings import read_settings
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    settings = read_settings(
        {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration", "seq_length": 32}
    )
    plugin = CudaGraphPlugin(settings, pluginmanager=None, cuda=True)
    with pytest.raises(CudaGraphConfigError) as info:
        plugin.mcgraph_model_built(
            model=[],
            optimizer=None,
            model_config=SimpleNamespace(cuda_graph_impl="none"),
            seq_length=64,
            micro_batch_size=2,
        )
    message = str(info.value)
    assert "run.model_config_kwargs" in message and "seq_length=32" in message


def test_a_report_json_that_cannot_be_written_is_refused_before_anything_is_built(
    monkeypatch, tmp_path
):
    # graphs off: the report (and its JSON) is written in every mode, at shutdown
    built = []
    monkeypatch.setattr(train_gpt, "_build_model", lambda *a, **k: built.append(1))
    rec = Recorder()
    with pytest.raises(ConfigurationError) as info:
        train_gpt.run(["--cuda-graph-report-json", str(tmp_path)], plugins=[rec])
    assert f"--cuda-graph-report-json = {str(tmp_path)!r}: " in str(info.value)
    assert "(it is a directory)" in str(info.value)
    assert built == []
    assert rec.events == [("shutdown", "exception")]
    assert rec.report is None  # refused in configure: no report written or sent


class ChangesDirectory:
    """A host's plugin that moves into its output directory during the run."""

    def __init__(self, to) -> None:
        self.to = to

    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        if step == 1:
            os.chdir(self.to)


def test_a_relative_report_path_is_where_it_was_checked_even_if_the_host_moves(
    fake_graphs, monkeypatch, tmp_path
):
    launch, elsewhere = tmp_path / "launch", tmp_path / "ckpt"
    launch.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(launch)
    run(*FULL, "--cuda-graph-report-json", "r.json", plugins=[ChangesDirectory(elsewhere)])
    assert os.getcwd() == str(elsewhere)
    assert json.loads((launch / "r.json").read_text())["graphs_captured"]
    assert list(elsewhere.iterdir()) == []


def test_shutdown_reason_enum_is_what_plugins_see(fake_graphs):
    _, rec = run(*FULL, steps=4)
    assert rec.report.shutdown_reason == ShutdownReason.COMPLETED.value


def test_failed_te_capture_clears_megatron_cores_capture_flag(fake_graphs, monkeypatch, caplog):
    """A create_cudagraphs() that fails after megatron-core set its global "capturing" flag
    must not leave every later forward on the capture path (seen on the H200)."""
    from megatron.core.transformer import cuda_graphs

    def failing(self):
        cuda_graphs._set_capture_start()
        raise RuntimeError("capture failed")

    monkeypatch.setattr(FakeTECudaGraphHelper, "create_cudagraphs", failing)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        with pytest.raises(RuntimeError, match="capture failed"):
            run(*TE, steps=6)
    assert not cuda_graphs.is_graph_capturing()
    assert caplog.text.count("the TE capture failed midway") == 1
    caplog.clear()
    monkeypatch.undo()  # the real fakes again, and the next run trains normally
    install_fake_cuda_graphs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        summary, rec = run(*TE, steps=5)
    assert rec.report.graphs_captured and summary["steps"] == 5
    assert "the TE capture failed midway" not in caplog.text


def test_a_forward_backward_func_asked_before_model_built_gets_the_model_s_settings(
    monkeypatch,
):
    """(review of 2026-12-05: asked first, the full-iteration wrapper was made from
    model_config=None, dropping its memory-pool setting, cuda_graph_use_single_mempool, which
    the optimizer graph built later did get.) It is made at model_built then."""
    from cudagraph_plugin import compat
    from cudagraph_plugin.config.settings import read_settings
    from cudagraph_plugin.runtime import build
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    settings = read_settings({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})
    plugin = CudaGraphPlugin(settings, pluginmanager=None, cuda=True)
    monkeypatch.setattr(build, "build_model_graphs", lambda *args, **kwargs: None)
    read = []
    monkeypatch.setattr(compat, "single_mempool", lambda config: read.append(config) or True)
    plugin.interceptor.wrap(lambda **kwargs: None)
    assert plugin.state.full is None and read == []
    config = object()
    plugin.mcgraph_model_built(
        model=[], optimizer=None, model_config=config, seq_length=8, micro_batch_size=1
    )
    assert read == [config] and plugin.state.full.use_single_mempool is True


def test_te_needs_the_micro_batch_calculator():
    from types import SimpleNamespace

    from cudagraph_plugin.config.errors import CudaGraphConfigError
    from cudagraph_plugin.config.settings import read_settings
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    settings = read_settings({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn"})
    plugin = CudaGraphPlugin(settings, pluginmanager=None, cuda=True)
    config = SimpleNamespace(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"])
    with pytest.raises(CudaGraphConfigError, match="init_num_microbatches_calculator"):
        plugin.mcgraph_model_built(
            model=[], optimizer=None, model_config=config, seq_length=8, micro_batch_size=1
        )


def test_a_plugin_firing_mcgraph_shutdown_itself_gets_one_report_and_one_release(
    fake_graphs, caplog
):
    """(review of 2026-12-04: a plugin that fired ``mcgraph_shutdown`` itself mid-run made the
    CUDA graph plugin report twice, the second time counting eager steps as replays and a
    freed graph as held.) The second shutdown is said once and does nothing more."""
    from hookspecs import ShutdownReason

    class StopsEarly:
        reports = 0

        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            self.pm = pluginmanager

        @hookimpl
        def mcgraph_train_step_end(self, step):
            if step == 3:
                self.pm.hook.mcgraph_shutdown(reason=ShutdownReason.EARLY_EXIT, exception=None)

        @hookimpl
        def mcgraph_report(self):
            StopsEarly.reports += 1

    caplog.set_level(logging.WARNING, "cudagraph_plugin")
    summary = train_gpt.run(
        ["--train-iters", "6", "--log-interval", "0", "--cuda-graph-warmup-steps", "2", *FULL],
        plugins=[StopsEarly()],
    )
    assert summary["shutdown_reason"] == "completed"
    assert StopsEarly.reports == 1
    assert [g.resets for g in fake_graphs.graphs] == [1]
    [again] = [r.getMessage() for r in caplog.records if "fired again" in r.getMessage()]
    assert "mcgraph_shutdown fired again (reason completed) after this run's shutdown " in again
    assert "(reason early_exit)" in again and "a plugin must not fire it" in again


class RegistersAtModelBuilt:
    """Registers ``make()`` from the run's ``mcgraph_model_built``: after the CUDA graph
    plugin, where pluggy would put a ``tryfirst`` implementation first."""

    def __init__(self, make) -> None:
        self.make = make

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.pm.register(self.make())


def test_the_configured_warm_up_is_the_answer_whatever_registers_later(fake_graphs):
    """(review of 2026-12-04: a ``tryfirst`` answer to ``mcgraph_warmup_steps`` registered
    after the run plugin won: TE graphs were captured at step 1 while the report said
    ``warmup_steps=3``.) The CUDA graph plugin's answer comes first; a wrapper sees it."""

    class AnswersOne:
        @hookimpl(tryfirst=True)
        def mcgraph_warmup_steps(self, config):
            return 1

    answers, post_warmup = [], []

    class Watches(RegistersAtModelBuilt):
        @hookimpl(wrapper=True)
        def mcgraph_warmup_steps(self, config):
            answer = yield
            answers.append(answer)
            return answer

        @hookimpl
        def mcgraph_post_warmup_step(self, step, start_step):
            post_warmup.append(step)

    _, rec = run(*TE, "--cuda-graph-warmup-steps", "3", steps=6, plugins=[Watches(AnswersOne)])
    assert answers == [3] and post_warmup == [3]
    assert rec.report.to_dict()["warmup_steps"] == 3


@pytest.mark.parametrize(
    "scope, warmup", [("full", 1), ("full", 2), ("full", 3), ("te", 3)], ids=str
)
def test_a_host_s_own_full_cuda_graph_wrapper_around_the_run_s_function_is_refused(
    fake_graphs, scope, warmup
):
    """(review of 2026-12-05: porting Megatron-LM's train(), ``FullCudaGraphWrapper(fwd)`` on
    the function the run returned was not refused: megatron-core's shared counter moved twice
    a step, and the run captured at the wrong step, failed with a bare AssertionError or a
    wiring error blaming the wrong cause; with TE scopes megatron-core captured a graph of
    its own that nobody freed.)"""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from cudagraph_plugin.runtime.wiring import CudaGraphWiringError

    class WrapsItsOwn:
        @hookimpl(wrapper=True, tryfirst=True)  # (outside the CUDA graph plugin's wrapper)
        def mcgraph_forward_backward_func(self, forward_backward_func):
            func = yield
            return FullCudaGraphWrapper(func, cuda_graph_warmup_steps=warmup)

    with pytest.raises(CudaGraphWiringError, match="a FullCudaGraphWrapper of the host's own"):
        run(*(FULL if scope == "full" else TE), "--cuda-graph-warmup-steps", str(warmup),
            steps=8, plugins=[WrapsItsOwn()])  # fmt: skip
    assert all(g.resets == 1 for g in fake_graphs.graphs)  # whatever was captured is freed
    assert FullCudaGraphWrapper.cuda_graph["training"] is None


def test_a_counter_left_by_an_earlier_wrapper_is_no_alarm_for_te_scopes(fake_graphs):
    """The check counts from the run's first call: megatron-core's counter as another user
    of the wrapper class left it is no call of this run's."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    FullCudaGraphWrapper.curr_iteration["training"] = 5
    try:
        summary, rec = run(*TE, steps=6)
    finally:
        FullCudaGraphWrapper.curr_iteration["training"] = 0
    assert summary["steps"] == 6 and rec.report.graphs_captured


def test_a_shutdown_fired_inside_the_shutdown_waits_for_the_first_one(fake_graphs, caplog):
    """(review of today's diff: fired from a plain ``mcgraph_shutdown`` implementation, the
    second call said the graphs were freed while they were still held, and its guard waited
    for the peers before the first one freed them.)"""
    from hookspecs import ShutdownReason

    seen = []

    class FiresAgain:
        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            self.pm = pluginmanager

        @hookimpl
        def mcgraph_shutdown(self, reason):
            if str(reason) == "completed":
                self.pm.hook.mcgraph_shutdown(reason=ShutdownReason.EXCEPTION, exception=None)
                seen.append([g.resets for g in fake_graphs.graphs])

    caplog.set_level(logging.WARNING, "cudagraph_plugin")
    summary, _ = run(*FULL, "--cuda-graph-warmup-steps", "1", steps=4, plugins=[FiresAgain()])
    assert summary["shutdown_reason"] == "completed"
    assert seen == [[0]] and [g.resets for g in fake_graphs.graphs] == [1]
    [again] = [r.getMessage() for r in caplog.records if "fired again" in r.getMessage()]
    assert "(reason exception) during this run's shutdown (reason completed)" in again
    assert "which reports the run and frees its CUDA graphs once it ends" in again


def test_a_shutdown_fired_after_the_guard_s_own_release_reports_nothing_more(fake_graphs):
    """The guard's path (a wrapper raising before its yield skipped the plugin's) counts as
    the run's shutdown too: a later one reports and frees nothing more."""
    from hookspecs import ShutdownReason

    reports = []

    class Rude:
        @hookimpl(wrapper=True)
        def mcgraph_shutdown(self, reason, exception):
            raise RuntimeError("rude wrapper")
            yield  # pragma: no cover

    class Late(RegistersAtModelBuilt):
        @hookimpl
        def mcgraph_report(self, report):
            reports.append(report)

    late = Late(Rude)
    with pytest.raises(RuntimeError, match="rude wrapper"):
        run(*FULL, "--cuda-graph-warmup-steps", "1", steps=4, plugins=[late])
    assert len(reports) == 1 and [g.resets for g in fake_graphs.graphs] == [1]
    late.pm.unregister(name=late.pm.get_name(next(
        p for p in late.pm.get_plugins() if isinstance(p, Rude))))  # fmt: skip
    late.pm.hook.mcgraph_shutdown(reason=ShutdownReason.EXCEPTION, exception=None)
    assert len(reports) == 1 and [g.resets for g in fake_graphs.graphs] == [1]


@pytest.mark.parametrize("mark", ["plain", "tryfirst", "trylast"])
@pytest.mark.parametrize("when", ["model_built", "train_start"])
def test_cleanup_runs_even_if_another_shutdown_wrapper_raises_before_its_yield(
    fake_graphs, mark, when
):
    """(review of 2026-12-04: a ``tryfirst`` wrapper registered after the run plugin, as the
    guide's example is marked, sat outside the guard, and its raise before the yield left
    the graphs alive and the report unsent; the guard is now kept outermost.)"""

    class Rude:
        @hookimpl(wrapper=True, **({} if mark == "plain" else {mark: True}))
        def mcgraph_shutdown(self, reason, exception):
            raise RuntimeError("rude wrapper")
            yield  # pragma: no cover

    class RegistersLate:
        """Registers the rude wrapper after the run plugin, which pluggy would put outside."""

        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            self.pm = pluginmanager

        @hookimpl
        def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
            if when == "model_built":
                self.pm.register(Rude())

        @hookimpl
        def mcgraph_train_start(self, start_step, train_iters):
            if when == "train_start":
                self.pm.register(Rude())

    rec = Recorder()
    with pytest.raises(RuntimeError, match="rude wrapper"):
        train_gpt.run(
            ["--train-iters", "5", "--log-interval", "0", *FULL],
            plugins=[rec, RegistersLate()],
        )
    assert [g.resets for g in fake_graphs.graphs] == [1]
    assert rec.report is not None


def test_fallback_policy_reads_the_timings_once_to_decide(fake_graphs, monkeypatch):
    """Reading the step timings synchronises the device: once for the decision, once for
    the report, never on each replay step before the decision."""
    from cudagraph_plugin.runtime.timing import StepTimer

    reads = []
    original = StepTimer.durations_ms

    def counting(self, sync=True):
        reads.append(sync)
        return original(self, sync=sync)

    monkeypatch.setattr(StepTimer, "durations_ms", counting)
    run(*FULL, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown", steps=12)
    assert len(reads) == 2


# -- wrapping twice, counting replays, invalidations around the capture step ----------------


def test_asking_again_with_the_returned_callable_gives_it_back(fake_graphs, monkeypatch):
    # a nested wrapper would count each call twice: the capture a step early, then
    # megatron-core's "cuda_graph[stage] is None" assertion
    from hookspecs import TrainingRun

    original = TrainingRun.forward_backward_func
    same = []

    def twice(self, func):
        once = original(self, func)
        again = original(self, once)
        same.append(again is once)
        return again

    monkeypatch.setattr(TrainingRun, "forward_backward_func", twice)
    for argv in (FULL, TE):
        _, rec = run(*argv, "--cuda-graph-warmup-steps", "2", steps=5)
        assert [e[1] for e in rec.events if e[0] == "before_capture"] == [2]
    assert same == [True, True]


def test_megatron_core_s_own_full_iteration_wrapper_is_refused_with_the_fix(
    fake_graphs, monkeypatch
):
    # Megatron-LM's train() wraps get_forward_backward_func() itself for local full_iteration
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from cudagraph_plugin.runtime.wiring import CudaGraphWiringError
    from hookspecs import TrainingRun

    original = TrainingRun.forward_backward_func
    monkeypatch.setattr(
        TrainingRun,
        "forward_backward_func",
        lambda self, func: original(self, FullCudaGraphWrapper(func, cuda_graph_warmup_steps=2)),
    )
    with pytest.raises(CudaGraphWiringError, match=r"FullCudaGraphWrapper.*Fix: pass the plain"):
        run(*FULL, "--cuda-graph-warmup-steps", "2", steps=5)


@pytest.mark.parametrize("changed_at", [2, 6], ids=["at-the-first-replay", "on-the-fast-path"])
def test_a_call_the_guard_refuses_is_not_counted_as_a_replay(fake_graphs, changed_at):
    rec = Recorder()
    with pytest.raises(StaticShapeError):
        train_gpt.run(
            ["--train-iters", "10", "--log-interval", "0", *FULL, "--cuda-graph-warmup-steps", "1"],
            plugins=[rec, ChangeInputs(changed_at, seq=16)],
        )
    [graph] = fake_graphs.graphs
    assert rec.report.replays["training"] == graph.replays - 1  # not the capture call's


def test_an_invalidation_after_an_evaluation_s_capture_goes_eager_without_a_wiring_error(
    fake_graphs, caplog
):
    # the evaluation during the warm-up captured the validation graph; the host's
    # invalidation frees it and the run goes on eagerly, as it says: the training capture
    # that never came is no wiring mistake
    from recording import InvalidateAt

    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        summary, rec = run(
            *FULL, "--cuda-graph-warmup-steps", "2", "--eval-interval", "1", "--eval-iters", "3",
            plugins=[InvalidateAt(1, at="start")], steps=6,
        )  # fmt: skip
    assert summary["steps"] == 6
    assert [e["graphs_freed"] for e in rec.report.invalidations] == [1]
    assert "the run goes on eagerly" in caplog.text
    # (the run went on past its capture step: it did not end before the training capture)
    captured = rec.report.format_table()
    assert "for evaluation only (invalidated before the training capture: eager" in captured


def test_te_graphs_invalidated_at_the_end_of_their_capture_step_are_no_wiring_error(fake_graphs):
    from recording import InvalidateAt

    summary, rec = run(
        *TE, "--cuda-graph-warmup-steps", "2", plugins=[InvalidateAt(2, at="end")], steps=6
    )
    assert summary["steps"] == 6
    assert rec.report.invalidations[0]["graphs_freed"] > 0


def test_a_te_capture_that_made_no_graph_guards_no_shape(fake_graphs, monkeypatch):
    # megatron-core 0.19 with no graphable layer, the user accepted eager: a later shape
    # change is an eager run's business, not a StaticShapeError
    from megatron.core.transformer import cuda_graphs

    from fakes import FakeTECudaGraphHelper019

    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", FakeTECudaGraphHelper019)
    monkeypatch.setattr(cuda_graphs, "_layer_is_graphable", lambda layer, config: False)
    summary, rec = run(
        *TE, "--cuda-graph-accept-eager", "--cuda-graph-warmup-steps", "2",
        plugins=[ChangeInputs(4, seq=16)], steps=6,
    )  # fmt: skip
    assert summary["steps"] == 6 and rec.report.graphs_captured is False


class ForwardOnlyAt(WrapsForwardBackward):
    """At ``step``, before its training call, one forward-only call (an RL host's log-probs)
    with ``seq_length=seq`` (the example's: 32) with the model chunks in training mode, or in
    eval mode (``eval_mode``)."""

    def __init__(self, step: int, seq: int, *, eval_mode: bool = False):
        self.step, self.seq, self.eval_mode = step, seq, eval_mode
        self.model = None

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.model = model

    def call(self, inner, kwargs):
        import itertools

        if self.current == self.step and not kwargs["forward_only"]:
            first = next(kwargs["data_iterator"])
            kwargs["data_iterator"] = itertools.chain([first], kwargs["data_iterator"])
            if self.eval_mode:
                for chunk in self.model:
                    chunk.eval()
            only = {"forward_only": True, "num_microbatches": 1, "seq_length": self.seq}
            inner(**{**kwargs, **only, "data_iterator": iter([first])})
            for chunk in self.model:
                chunk.train()
        return inner(**kwargs)


def test_a_forward_only_call_in_training_mode_at_another_shape_is_refused_with_the_fix(
    fake_graphs,
):
    # megatron-core replays the TE layer graphs for any call in training mode
    with pytest.raises(StaticShapeError, match=r"forward-only \(in training mode\).*eval mode"):
        run(*TE, "--cuda-graph-warmup-steps", "1", plugins=[ForwardOnlyAt(3, 16)], steps=5)


@pytest.mark.parametrize(
    "plugin",
    [ForwardOnlyAt(3, 16, eval_mode=True), ForwardOnlyAt(3, 32)],
    ids=["eval-mode", "captured-shape"],
)
def test_a_forward_only_call_in_eval_mode_or_at_the_captured_shape_passes(fake_graphs, plugin):
    summary, _ = run(*TE, "--cuda-graph-warmup-steps", "1", plugins=[plugin], steps=5)
    assert summary["shutdown_reason"] == "completed"


@needs_mcore_on_cpu
@pytest.mark.parametrize("part", ["cudagraph:CudaGraphPlugin", "cudagraph:OutermostHooks"])
def test_blocking_a_part_of_the_plugin_is_refused_not_a_run_without_graphs(monkeypatch, part):
    """(review of 2026-12-05: ``MCGRAPH_BLOCK_PLUGINS=cudagraph:CudaGraphPlugin`` with
    full_iteration asked for ran to the end, exit 0, with no graphs, no report and no
    shutdown line: the manager refused the per-run plugin without a word.)"""
    blocked = os.environ.get("MCGRAPH_BLOCK_PLUGINS", "")
    monkeypatch.setenv("MCGRAPH_BLOCK_PLUGINS", f"{part},{blocked}")
    with pytest.raises(ConfigurationError) as refused:
        train_gpt.run(["--cpu", *FULL, "--train-iters", "2"])
    assert str(refused.value).startswith(
        f"MCGRAPH_BLOCK_PLUGINS blocks {part!r}, a part of the CUDA graph plugin: the run "
        "would check its CUDA graph flags and then ignore them"
    )
    assert "Fix: block 'cudagraph' to run without the plugin" in str(refused.value)


class ChangesTheWarmup:
    def __init__(self, answer: int | None) -> None:
        self.answer = answer

    @hookimpl(wrapper=True)
    def mcgraph_warmup_steps(self, config):
        yield
        return self.answer


@pytest.mark.parametrize("answer", [1, 4])
def test_a_wrapper_that_changes_the_warmup_answer_is_refused_at_the_post_warmup_step(
    fake_graphs, answer
):
    """(review of 2026-12-05: a wrapper answering 1 where the plugin answered 3 moved the
    post-warmup step (where TE graphs are captured) to step 1, while megatron-core's
    full-iteration capture stayed at step 3 and the report said warm-up 3.)"""
    argv = [*FULL, "--cuda-graph-warmup-steps", "3"]
    with pytest.raises(ValueError) as raised:
        run(*argv, plugins=[ChangesTheWarmup(answer)], steps=6)
    assert str(raised.value).startswith(
        f"the run's post-warmup step is step {answer}, {answer} step(s) after its start, but "
        "the CUDA graph plugin answered mcgraph_warmup_steps with 3: another plugin changed "
        "the answer (a wrapper of the hook, or an implementation called before the plugin's)"
    )
    # a wrapper that reads the answer and keeps it is the documented use
    run(*argv, plugins=[ChangesTheWarmup(3)], steps=6)


@needs_mcore_on_cpu
def test_with_graphs_off_another_warmup_answer_is_no_concern():
    """(review of this session's diff: the refusal fired in runs that capture nothing, the
    plugin merely installed.)"""
    summary, _ = run("--cpu", *FULL, plugins=[ChangesTheWarmup(1)], steps=4)
    assert summary["shutdown_reason"] == "completed"


def test_a_warmup_answer_of_none_says_the_te_capture_never_came(fake_graphs):
    """(review of this session's diff: it said "the TE capture at step 2 produced no graph.
    Fix: check that the scope matches layers", of a capture that never ran.)"""
    from cudagraph_plugin.runtime.wiring import CudaGraphWiringError

    with pytest.raises(CudaGraphWiringError) as raised:
        run(*TE, "--cuda-graph-warmup-steps", "2", plugins=[ChangesTheWarmup(None)], steps=4)
    assert "the run's post-warmup step, where TE graphs are captured, did not come by step 2: " in (
        str(raised.value)
    )


@needs_mcore_on_cpu
def test_buckets_longer_than_the_learned_position_embeddings_are_refused_at_the_build(
    bucket_fakes, monkeypatch
):
    """(review of 2026-12-05: a bucket of 128 over a model of max_sequence_length 64 was
    accepted; the first step padded to it failed in the embedding, "index out of range in
    self", on a GPU a device-side assert.) Rotary embeddings take any length. A config that
    says its position embeddings is refused at configure already (the example's args do);
    the build check serves those that do not (a TransformerConfig host's), seen here by
    hiding the field from the configuration's reading."""
    from cudagraph_plugin.config.errors import CudaGraphConfigError
    from cudagraph_plugin.config.fields import FIELD_PATHS

    argv = [*FULL, "--seq-length", "32", "--cuda-graph-buckets", "16,32,48,64"]
    with pytest.raises(CudaGraphConfigError) as refused:
        run(*argv, steps=2)  # (at configure: the args say learned_absolute and 32)
    assert "--cuda-graph-buckets, --seq-length, --position-embedding-type = " in str(refused.value)
    monkeypatch.setitem(FIELD_PATHS, "position_embedding_type", ("model.nowhere",))
    with pytest.raises(CudaGraphConfigError) as refused:
        run(*argv, steps=2)
    assert "  1. --cuda-graph-buckets = 48,64: longer than model chunk 0's learned position " in (
        str(refused.value)
    )
    assert (
        "fix: drop the buckets above 32, or build the model with max_sequence_length >= 64 "
        "(or position_embedding_type='rope')"
    ) in str(refused.value)
    run(*argv, "--position-embedding-type", "rope", steps=2)


class CountsCalls:
    """A forward/backward wrapper counting the calls of the callable it returns."""

    def __init__(self) -> None:
        self.calls = 0

    def _counted(self, inner):
        def counted(**kwargs):
            self.calls += 1
            return inner(**kwargs)

        return counted

    @hookimpl(wrapper=True)
    def mcgraph_forward_backward_func(self, forward_backward_func):
        return self._counted((yield))


class CountsCallsFirst(CountsCalls):
    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_forward_backward_func(self, forward_backward_func):
        return self._counted((yield))


def test_a_tryfirst_forward_backward_wrapper_runs_every_step_a_plain_one_inside_is_captured(
    fake_graphs,
):
    """What the spec says of where a wrapper lands (review of 2026-12-05: the order of two
    plain wrappers followed sys.path): a plain wrapper registered before the run is inside
    the CUDA graph plugin's, in the captured iteration, so its Python runs in the warm-up
    and capture steps only; ``tryfirst=True`` keeps one outside, on every step."""
    outside, inside = CountsCallsFirst(), CountsCalls()
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "3", plugins=(outside, inside), steps=8)
    assert rec.report.capture_step == 3 and rec.report.replays == {"training": 4}
    assert (outside.calls, inside.calls) == (8, 4)  # steps 0-2 warm up, 3 captures
