"""Per-step hooks that nobody implements cost nothing, and the CUDA graph plugin implements
them only while a step needs them (hookspecs.TrainingRun, cudagraph_plugin/runtime/steps.py).

The host side on a torch-free loop; the plugin side on the example loop with megatron-core
0.16.1 and the fake capture (tests/fakes.py).
"""

from __future__ import annotations

from typing import Any

import pluggy
import pytest
from cpu_only import needs_mcore_on_cpu

import train_gpt
from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from hookspecs import StepProgress, TrainingRun, get_plugin_manager, hookimpl, spec
from recording import FULL

STEP_HOOKS = ("mcgraph_train_step_start", "mcgraph_train_step_end")


def _monitor(pm: pluggy.PluginManager) -> list[tuple[str, Any]]:
    """Every step hook call pm dispatches: (hook, step)."""
    calls: list[tuple[str, Any]] = []

    def before(hook_name: str, hook_impls: Any, kwargs: dict[str, Any]) -> None:
        if hook_name in STEP_HOOKS:
            calls.append((hook_name, kwargs["step"]))

    pm.add_hookcall_monitoring(before, lambda *args: None)
    return calls


class _StepStart:
    def __init__(self) -> None:
        self.steps: list[int] = []

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        self.steps.append(step)


# -- the host side ----------------------------------------------------------------------------


def test_step_hooks_that_nobody_implements_are_not_dispatched_and_a_late_plugin_is_heard():
    pm = get_plugin_manager(load_entrypoints=False)
    calls = _monitor(pm)
    late = _StepStart()
    with TrainingRun(pm, None, train_iters=6, handle_signals=()) as run:
        for step in range(6):
            with run.train_step(step):
                if step == 1:
                    pm.register(late)  # heard from the next step on
                if step == 3:
                    pm.unregister(late)  # its step-end hook was never there
    assert late.steps == [2, 3]
    assert calls == [("mcgraph_train_step_start", 2), ("mcgraph_train_step_start", 3)]


def test_a_plugin_unregistering_inside_the_step_end_hook_is_not_called_again():
    pm = get_plugin_manager(load_entrypoints=False)
    calls = _monitor(pm)

    class Once:
        @hookimpl
        def mcgraph_train_step_end(self, step: int) -> None:
            pm.unregister(self)

    pm.register(Once())
    with TrainingRun(pm, None, train_iters=3, handle_signals=()) as run:
        for step in range(3):
            with run.train_step(step):
                pass
    assert calls == [("mcgraph_train_step_end", 0)]


def test_a_manager_that_does_not_count_registrations_dispatches_every_step_hook():
    pm = pluggy.PluginManager("mcgraph")
    pm.add_hookspecs(spec)
    calls = _monitor(pm)
    with TrainingRun(pm, None, train_iters=2, handle_signals=()) as run:
        for step in range(2):
            with run.train_step(step):
                pass
    assert calls == [(hook, step) for step in range(2) for hook in STEP_HOOKS]


def test_progress_says_the_step_before_any_hook_and_is_given_at_train_start():
    pm = get_plugin_manager(load_entrypoints=False)
    seen: list[Any] = []

    class Reader:
        @hookimpl
        def mcgraph_train_start(self, progress: StepProgress) -> None:
            self.progress = progress
            seen.append(("start", progress.step))

    reader = Reader()
    pm.register(reader)
    with TrainingRun(pm, None, train_iters=3, start_step=1, handle_signals=()) as run:
        assert run.progress.step is None
        for step in range(1, 3):
            with run.train_step(step):
                seen.append(("body", reader.progress.step))
    assert reader.progress is run.progress
    assert seen == [("start", 1), ("body", 1), ("body", 2)]
    assert repr(run.progress) == "StepProgress(step=2)"


# -- the plugin side --------------------------------------------------------------------------


class _Watch:
    """Sees the plugin manager and the step hooks it dispatches; with :meth:`spy_on_steps`,
    on every forward/backward call (replays included: the static-shape guard checks each),
    what the CUDA graph plugin knows of the step and whether its listener is registered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.listening: list[bool] = []
        self.steps_seen_by_plugin: list[Any] = []

    @hookimpl
    def mcgraph_configure(self, config: Any, pluginmanager: Any) -> None:
        self.pm = pluginmanager
        self.calls = _monitor(pluginmanager)

    @property
    def plugin(self) -> Any:
        return self.pm.get_plugin(RUN_PLUGIN_NAME)

    def spy_on_steps(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cudagraph_plugin.runtime.guard import ShapeGuard

        check_call, check_replay = ShapeGuard.check_call, ShapeGuard.check_replay
        watch = self

        def see() -> None:
            plugin = watch.plugin
            watch.steps_seen_by_plugin.append(plugin.state.step)
            watch.listening.append(plugin.steps.registered)

        def spy_call(guard: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
            if stage == "training":
                see()
            return check_call(guard, stage, *args, **kwargs)

        def spy_replay(guard: Any, kwargs: dict[str, Any]) -> Any:
            see()
            return check_replay(guard, kwargs)

        monkeypatch.setattr(ShapeGuard, "check_call", spy_call)
        monkeypatch.setattr(ShapeGuard, "check_replay", spy_replay)


@needs_mcore_on_cpu
def test_the_plugin_stops_listening_after_the_timed_window(fake_graphs, monkeypatch):
    from cudagraph_plugin.runtime import measurement

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 3)
    watch = _Watch()
    watch.spy_on_steps(monkeypatch)
    train_gpt.run(
        ["--train-iters", "12", "--log-interval", "0", *FULL, "--cuda-graph-warmup-steps", "2"],
        plugins=[watch],
    )
    plugin = watch.plugin
    # capture at step 2, timed up to step 5: listening through step 5's end, then not
    assert watch.listening == [True] * 6 + [False] * 6
    assert plugin.steps.stopped_after == 5
    assert watch.calls == [(hook, step) for step in range(6) for hook in STEP_HOOKS]
    assert sorted(plugin.measurement.timer.durations_ms()) == list(range(6))
    # the step is right on the steps it no longer hears
    assert watch.steps_seen_by_plugin == list(range(12))
    [graph] = fake_graphs.graphs
    assert graph.replays == 10  # steps 2-11: megatron-core replays its capture call too


@needs_mcore_on_cpu
def test_the_plugin_keeps_listening_while_the_fallback_has_to_decide(fake_graphs, monkeypatch):
    from cudagraph_plugin.runtime import fallback, measurement

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 1)
    watch = _Watch()
    watch.spy_on_steps(monkeypatch)
    argv = [*FULL, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown"]
    train_gpt.run(["--train-iters", "12", "--log-interval", "0", *argv], plugins=[watch])
    decided_at = 2 + fallback.FALLBACK_REPLAY_STEPS  # later than the timed window's end, 3
    assert watch.plugin.fallback.decided
    assert watch.plugin.steps.stopped_after == decided_at
    # (whatever it decided: after a fallback the plain function runs, unguarded)
    assert watch.listening[: decided_at + 1] == [True] * (decided_at + 1)
    assert watch.calls == [(hook, step) for step in range(decided_at + 1) for hook in STEP_HOOKS]


@needs_mcore_on_cpu
def test_a_run_without_a_capture_listens_to_every_step():
    watch = _Watch()
    train_gpt.run(["--train-iters", "6", "--log-interval", "0", "--cpu"], plugins=[watch])
    assert watch.calls == [(hook, step) for step in range(6) for hook in STEP_HOOKS]


def test_the_plugin_step_hooks_are_on_the_listener_only():
    """The run plugin itself implements no per-step hook (else they are dispatched on every
    step); the listener implements both, with the spec's arguments."""
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin
    from cudagraph_plugin.runtime.steps import StepListener

    for name in STEP_HOOKS:
        assert not hasattr(CudaGraphPlugin, name)
        assert hasattr(getattr(StepListener, name), "mcgraph_impl")


@pytest.mark.parametrize("registered", [True, False])
def test_stop_unregisters_once(registered):
    from types import SimpleNamespace as NS

    from cudagraph_plugin.runtime.steps import StepListener

    pm = get_plugin_manager(load_entrypoints=False)
    listener = StepListener(NS(pm=pm), None, None, None)  # type: ignore[arg-type]
    if registered:
        listener.start()
        listener.start()  # once
        assert pm.is_registered(listener)
    listener.stop()
    listener.stop()
    assert not pm.is_registered(listener) and not listener.registered


@needs_mcore_on_cpu
def test_a_host_without_progress_is_heard_on_every_step(fake_graphs, monkeypatch):
    """A host firing the hooks itself may pass ``progress=None``: the plugin then keeps
    listening, as the step hooks are its only source of the step."""
    from cudagraph_plugin.runtime import measurement
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    monkeypatch.setattr(measurement, "DENSE_REPLAY_STEPS", 1)
    train_start = CudaGraphPlugin.mcgraph_train_start

    @hookimpl
    def without_progress(plugin: Any, start_step: int, train_iters: int, progress: Any) -> None:
        train_start(plugin, start_step, train_iters, None)

    monkeypatch.setattr(CudaGraphPlugin, "mcgraph_train_start", without_progress)
    watch = _Watch()
    watch.spy_on_steps(monkeypatch)
    train_gpt.run(
        ["--train-iters", "8", "--log-interval", "0", *FULL, "--cuda-graph-warmup-steps", "2"],
        plugins=[watch],
    )
    assert watch.listening == [True] * 8
    assert watch.steps_seen_by_plugin == list(range(8))
    assert watch.plugin.steps.stopped_after is None


@needs_mcore_on_cpu
def test_the_timed_step_includes_other_plugins_step_hooks(fake_graphs, monkeypatch):
    """The plugin's timer starts before any other plugin's step-start work and stops after
    any step-end work, whatever the registration order (tryfirst/trylast)."""
    from cudagraph_plugin.runtime import timing

    order: list[str] = []
    start, stop = timing.StepTimer.start, timing.StepTimer.stop

    def spy_start(timer: Any, step: int) -> None:
        order.append(f"timer start {step}")
        start(timer, step)

    def spy_stop(timer: Any, step: int) -> None:
        order.append(f"timer stop {step}")
        stop(timer, step)

    monkeypatch.setattr(timing.StepTimer, "start", spy_start)
    monkeypatch.setattr(timing.StepTimer, "stop", spy_stop)

    class Other:
        @hookimpl
        def mcgraph_train_start(self) -> None:
            pass  # registered before the plugin's listener (which registers at train start)

        @hookimpl
        def mcgraph_train_step_start(self, step: int) -> None:
            order.append(f"other start {step}")

        @hookimpl
        def mcgraph_train_step_end(self, step: int) -> None:
            order.append(f"other end {step}")

    train_gpt.run(["--train-iters", "1", "--log-interval", "0", *FULL], plugins=[Other()])
    assert order == ["timer start 0", "other start 0", "other end 0", "timer stop 0"]
