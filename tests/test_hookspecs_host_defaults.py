"""The host's default "perform" hooks, and how plugins take over or wrap them."""

from __future__ import annotations

import pytest

from hookspecs import TrainingRun, get_plugin_manager, hookimpl
from hookspecs.manager import HOST_DEFAULTS_NAME


@pytest.fixture
def pm():
    return get_plugin_manager(load_entrypoints=False)


class FakeDDPChunk:
    """Duck-types megatron-core DistributedDataParallel's forward pre-hook API."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name = name
        self.events = events

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.events.append(f"{self.name}.disable(param_sync={param_sync})")

    def enable_forward_pre_hook(self) -> None:
        self.events.append(f"{self.name}.enable()")


@pytest.fixture
def events():
    return []


@pytest.fixture
def model(events):
    return [FakeDDPChunk("chunk0", events), FakeDDPChunk("chunk1", events)]


def test_host_defaults_are_registered_last(pm):
    assert pm.has_plugin(HOST_DEFAULTS_NAME)
    for name in (
        "mcgraph_forward_backward_func",
        "mcgraph_disable_forward_pre_hook",
        "mcgraph_enable_forward_pre_hook",
    ):
        impls = getattr(pm.hook, name).get_hookimpls()
        assert [impl.plugin_name for impl in impls] == [HOST_DEFAULTS_NAME]
        assert impls[0].trylast


@pytest.mark.parametrize("param_sync", [False, True])
def test_default_disable_calls_every_chunk(pm, model, events, param_sync):
    result = pm.hook.mcgraph_disable_forward_pre_hook(model=model, param_sync=param_sync)
    assert result is True
    assert events == [
        f"chunk0.disable(param_sync={param_sync})",
        f"chunk1.disable(param_sync={param_sync})",
    ]


def test_default_enable_calls_every_chunk(pm, model, events):
    assert pm.hook.mcgraph_enable_forward_pre_hook(model=model) is True
    assert events == ["chunk0.enable()", "chunk1.enable()"]


def test_training_run_toggles_through_the_perform_hooks(pm, model, events):
    with TrainingRun(pm, None, train_iters=0) as run:
        run.disable_forward_pre_hook(model, param_sync=False)
        run.enable_forward_pre_hook(model)
    assert events == [
        "chunk0.disable(param_sync=False)",
        "chunk1.disable(param_sync=False)",
        "chunk0.enable()",
        "chunk1.enable()",
    ]


def test_plugin_returning_true_takes_over(pm, model, events):
    class TakeOver:
        @hookimpl
        def mcgraph_disable_forward_pre_hook(self, model, param_sync):
            events.append(f"plugin disables {len(model)} chunks, param_sync={param_sync}")
            return True

        @hookimpl
        def mcgraph_enable_forward_pre_hook(self, model):
            events.append("plugin enables")
            return True

    # Registered before the defaults would not matter: they are trylast.
    pm.register(TakeOver())
    assert pm.hook.mcgraph_disable_forward_pre_hook(model=model, param_sync=False) is True
    assert pm.hook.mcgraph_enable_forward_pre_hook(model=model) is True
    assert events == ["plugin disables 2 chunks, param_sync=False", "plugin enables"]


def test_plugin_returning_none_leaves_the_default_to_perform(pm, model, events):
    class Observer:
        @hookimpl
        def mcgraph_enable_forward_pre_hook(self, model):
            events.append("observer")

    pm.register(Observer())
    assert pm.hook.mcgraph_enable_forward_pre_hook(model=model) is True
    assert events == ["observer", "chunk0.enable()", "chunk1.enable()"]


def test_wrapper_sees_the_call_around_the_default(pm, model, events):
    class Around:
        @hookimpl(wrapper=True)
        def mcgraph_disable_forward_pre_hook(self, param_sync):
            events.append(f"before param_sync={param_sync}")
            try:
                result = yield
                events.append(f"after result={result}")
                return result
            finally:
                events.append("finally")

    pm.register(Around())
    assert pm.hook.mcgraph_disable_forward_pre_hook(model=model, param_sync=True) is True
    assert events == [
        "before param_sync=True",
        "chunk0.disable(param_sync=True)",
        "chunk1.disable(param_sync=True)",
        "after result=True",
        "finally",
    ]


def test_wrapper_cleanup_runs_when_the_default_raises(pm, events):
    class Broken:
        def enable_forward_pre_hook(self):
            raise RuntimeError("param all-gather failed")

    class Around:
        @hookimpl(wrapper=True)
        def mcgraph_enable_forward_pre_hook(self):
            try:
                return (yield)
            finally:
                events.append("finally")

    pm.register(Around())
    with pytest.raises(RuntimeError, match="all-gather"):
        pm.hook.mcgraph_enable_forward_pre_hook(model=[Broken()])
    assert events == ["finally"]


def fake_forward_backward(**kwargs):
    return [{"loss": kwargs["num_microbatches"]}]


def test_forward_backward_func_default_returns_it_unchanged(pm):
    assert (
        pm.hook.mcgraph_forward_backward_func(forward_backward_func=fake_forward_backward)
        is fake_forward_backward
    )
    with TrainingRun(pm, None, train_iters=0) as run:
        assert run.forward_backward_func(fake_forward_backward) is fake_forward_backward


def test_forward_backward_func_wrapper_wraps_it(pm):
    calls = []

    class GraphWrapper:
        @hookimpl(wrapper=True)
        def mcgraph_forward_backward_func(self):
            func = yield

            def wrapped(**kwargs):
                calls.append(sorted(kwargs))
                return func(**kwargs)

            wrapped.inner = func
            return wrapped

    pm.register(GraphWrapper())
    with TrainingRun(pm, None, train_iters=0) as run:
        fwd_bwd = run.forward_backward_func(fake_forward_backward)
    assert fwd_bwd is not fake_forward_backward
    assert fwd_bwd.inner is fake_forward_backward
    assert fwd_bwd(num_microbatches=4, forward_only=False) == [{"loss": 4}]
    assert calls == [["forward_only", "num_microbatches"]]


def test_two_wrappers_nest_in_registration_order(pm):
    def wrapper_plugin(label):
        class Wrap:
            @hookimpl(wrapper=True)
            def mcgraph_forward_backward_func(self):
                func = yield
                return lambda **kw: f"{label}({func(**kw)})"

        return Wrap()

    pm.register(wrapper_plugin("first"))
    pm.register(wrapper_plugin("second"))

    def base(**kw):
        return "fb"

    fwd_bwd = pm.hook.mcgraph_forward_backward_func(forward_backward_func=base)
    # pluggy calls the last registered wrapper first, so it wraps the other's result.
    assert fwd_bwd() == "second(first(fb))"
