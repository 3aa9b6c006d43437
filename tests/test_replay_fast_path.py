"""The steady-state replay path (issue 21, item 3): after the first replay, the
forward/backward and ``optimizer.step`` the host calls remember what a replay needs and
check only what could have changed. Whatever changes after that (the host's invalidation, a
shape, a hyperparameter, megatron-core's own graph) must still be seen on the next step.

The host is the example loop on real megatron-core 0.16.1, on the CPU; graph capture is
faked (``tests/fakes.py``, ``tests/fake_optimizer_graph.py``).
"""

from __future__ import annotations

import pytest
from cpu_only import needs_mcore_on_cpu

# the optimizer-graph stand-in's fixtures (megatron-core 0.19's wrapper, a capturable host
# optimizer), as tests/test_optimizer_graph.py uses them
from test_optimizer_graph import OPTIM, capturable, graphs  # noqa: F401

from cudagraph_plugin import compat
from cudagraph_plugin.runtime import measurement
from cudagraph_plugin.runtime.guard import StaticShapeError
from hookspecs import hookimpl
from recording import FULL, InvalidateAt
from recording import run_recorded as run

pytestmark = needs_mcore_on_cpu


@pytest.mark.parametrize("replays_before", [1, 4])
def test_invalidation_after_replays_runs_the_plain_function_from_the_next_step(
    fake_graphs, replays_before
):
    """After ``replays_before`` replays (the remembered path taken from the second on), the
    host invalidates: no replay follows, the guard no longer checks (a new shape is fine
    eagerly), and the report counts exactly the replays that ran."""
    from test_plugin_lifecycle import ChangeInputs

    capture = 2
    invalidate = capture + replays_before + 1
    summary, rec = run(
        *FULL,
        "--cuda-graph-warmup-steps",
        str(capture),
        plugins=[InvalidateAt(invalidate, at="start"), ChangeInputs(invalidate + 1, seq=16)],
        steps=invalidate + 4,
    )
    [graph] = fake_graphs.graphs
    assert graph.replays == 1 + replays_before  # the capture call's replay, then the steps
    report = rec.report
    assert report.replays == {"training": replays_before}
    assert [e["graphs_freed"] for e in report.invalidations] == [1]
    assert len(summary["losses"]) == invalidate + 4


def test_a_graph_megatron_core_no_longer_holds_is_never_replayed_from_memory(fake_graphs):
    """The remembered replay is tied to the graph object megatron-core holds: once it holds
    none (freed behind the plugin's back), the next call goes the full way and megatron-core's
    wrapper runs the step eagerly, as it does without a graph."""

    class FreeAt:
        @hookimpl
        def mcgraph_train_step_start(self, step):
            if step == 6:
                compat.free_full_iteration_graph("training")

    run(*FULL, "--cuda-graph-warmup-steps", "2", plugins=[FreeAt()], steps=9)
    [graph] = fake_graphs.graphs
    assert graph.replays == 1 + 3  # steps 3-5 replayed; 6-8 ran eagerly in megatron-core


@pytest.mark.parametrize(
    "changed_at", [2, 9], ids=["first-replay", "many-replays-after-the-capture"]
)
def test_a_shape_change_is_refused_on_the_first_replay_and_on_remembered_ones(
    fake_graphs, changed_at
):
    """The first replay takes the full path, later ones the remembered one: the guard checks
    both (capture at step 1)."""
    from test_plugin_lifecycle import ChangeInputs

    with pytest.raises(StaticShapeError, match="stale buffers"):
        run(
            *FULL,
            "--cuda-graph-warmup-steps",
            "1",
            plugins=[ChangeInputs(changed_at, seq=16)],
            steps=12,
        )
    [graph] = fake_graphs.graphs
    assert graph.replays == changed_at - 1  # the capture call's replay, steps 2 to changed_at-1


def test_the_steps_timed_follow_timed_after_capture(fake_graphs):
    """``Measurement.times`` applies ``timed_after_capture`` once the capture step is known:
    both give the same answer for every step of a long run."""
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "2", steps=4)
    timing = rec.graph_plugin.measurement
    assert timing.times(3) and timing._capture_step == 2
    steps = range(3, 400)
    assert [timing.times(s) for s in steps] == [
        measurement.timed_after_capture(s, 2) for s in steps
    ]
    assert sum(timing.times(s) for s in steps) == measurement.DENSE_REPLAY_STEPS
    assert timing.timed_until() == 2 + measurement.DENSE_REPLAY_STEPS


def test_the_wiring_check_still_runs_up_to_the_capture_step(fake_graphs, monkeypatch):
    """The step-end wiring check runs on every step up to the capture step (where a missing
    capture is an error) and on none after it."""
    from cudagraph_plugin.runtime import wiring

    seen: list[int] = []
    checked = wiring.Wiring.capture_step_ended

    def spy(self, step):
        seen.append(step)
        return checked(self, step)

    monkeypatch.setattr(wiring.Wiring, "capture_step_ended", spy)
    run(*FULL, "--cuda-graph-warmup-steps", "3", steps=8)
    assert seen == [0, 1, 2, 3]


class WriteWeightDecayAt:
    """Writes a new weight decay into every param group at the start of ``step`` (a
    weight-decay schedule, which a captured optimizer step cannot follow)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.optimizer = None

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.optimizer = optimizer

    @hookimpl
    def mcgraph_train_step_start(self, step):
        if step == self.step:
            for group in self.optimizer.param_groups:
                group["weight_decay"] = 0.5


@pytest.mark.usefixtures("graphs", "capturable")
@pytest.mark.parametrize("written_at", [2, 7], ids=["first-replay", "remembered-replay"])
def test_a_hyperparameter_write_is_seen_before_any_optimizer_replay(written_at):
    """The optimizer step's first replay takes the full path, later ones the remembered
    one: both check the param groups before replaying (capture at step 1)."""
    import fake_optimizer_graph
    from cudagraph_plugin.runtime.optimizer_sync import HyperparameterChangedError

    with pytest.raises(HyperparameterChangedError, match=r"\['weight_decay'\] is now float 0.5"):
        run(
            *FULL,
            *OPTIM,
            "--cuda-graph-warmup-steps",
            "1",
            "--lr-decay-style",
            "constant",
            plugins=[WriteWeightDecayAt(written_at)],
            steps=10,
        )
    [step_graph] = fake_optimizer_graph.StepGraph.made
    assert step_graph.replays == written_at - 1  # the capture call's, then steps 2..written_at-1


class ResetMegatronCoreAt:
    """At the start of ``step``, drops megatron-core's class-level graph and step counters
    the way megatron-core 0.18+'s ``FullCudaGraphWrapper.reset_cuda_graph()`` does (``del``,
    then ``None``; no ``reset()``), or the optimizer graph's, behind the plugin's back; then
    megatron-core warms up and captures again. ``remembered`` records, at the start of each
    later step, whether the plugin's remembered replay still refers to the dropped graph."""

    def __init__(self, step: int, *, optimizer: bool = False) -> None:
        self.step, self.optimizer = step, optimizer
        self.dropped = None
        self.remembered: dict[int, bool] = {}

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    @hookimpl
    def mcgraph_train_step_start(self, step):
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        from cudagraph_plugin.entry import RUN_PLUGIN_NAME

        plugin = self.pm.get_plugin(RUN_PLUGIN_NAME)
        if step == self.step:
            if self.optimizer:
                holder = compat.optimizer_graph_holder()
                self.dropped, holder.cuda_graph = holder.cuda_graph, None
                holder.curr_iteration = 0
            else:
                self.dropped = FullCudaGraphWrapper.cuda_graph["training"]
                del FullCudaGraphWrapper.cuda_graph["training"]
                FullCudaGraphWrapper.cuda_graph["training"] = None
                FullCudaGraphWrapper.curr_iteration["training"] = 0
                FullCudaGraphWrapper.result["training"] = None
        if self.dropped is not None and step > self.step:
            step_hook = vars(plugin.state.optim.optimizer)["step"] if self.optimizer else None
            replay = step_hook._replay if self.optimizer else plugin.interceptor._replay
            self.remembered[step] = replay is not None and replay.graph is self.dropped


def test_a_graph_megatron_core_drops_is_forgotten_and_its_recapture_bracketed(fake_graphs):
    """megatron-core drops its graph and counters mid-run: the next call goes the full way
    (megatron-core warms up, then captures again, bracketed by the plugin's capture hooks
    and guard), and from then on nothing of the plugin's keeps the dropped graph alive."""
    reset = ResetMegatronCoreAt(6)
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "2", plugins=[reset], steps=12)
    captures = [e[1] for e in rec.events if e[0] == "before_capture"]
    assert captures == [2, 8]  # 6 and 7 warm megatron-core's counter up again
    assert len(fake_graphs.graphs) == 2
    assert reset.remembered == {s: False for s in range(7, 12)}


@pytest.mark.usefixtures("graphs", "capturable")
def test_an_optimizer_graph_megatron_core_drops_is_forgotten_and_its_recapture_bracketed():
    import fake_optimizer_graph

    reset = ResetMegatronCoreAt(6, optimizer=True)
    _, rec = run(
        *FULL,
        *OPTIM,
        "--cuda-graph-warmup-steps",
        "1",
        "--lr-decay-style",
        "constant",
        plugins=[reset],
        steps=10,
    )
    optimizer_captures = [
        e[1] for e in rec.events if e[0] == "before_capture" and e[3] == ("optimizer",)
    ]
    assert optimizer_captures == [1, 7]
    assert len(fake_optimizer_graph.StepGraph.made) == 2
    assert reset.remembered == {s: False for s in range(7, 10)}


@pytest.mark.usefixtures("graphs", "capturable")
def test_every_remembered_optimizer_replay_is_counted():
    _, rec = run(
        *FULL, *OPTIM, "--cuda-graph-warmup-steps", "1", "--lr-decay-style", "constant", steps=10
    )
    assert rec.report.replays == {"training": 8, "optimizer": 8}  # steps 2-9


def test_every_call_orders_the_input_copy_after_the_previous_replay(fake_graphs, monkeypatch):
    """megatron-core 0.16's loader copies the next micro-batch into the static buffers
    without waiting for the previous replay, which reads them: every call, the remembered
    replays too, orders the copy first (tests/test_compat.py checks what the ordering does)."""
    ordered = []
    monkeypatch.setattr(compat, "order_input_copy_after_replay", ordered.append)
    run(*FULL, "--cuda-graph-warmup-steps", "2", steps=9)
    assert len(ordered) == 9 and len(set(map(id, ordered))) == 1
