"""call_hook / blame: a plugin's exception propagates unchanged, with a note naming the plugin."""

from __future__ import annotations

import textwrap
import types

import pytest

from hookspecs import ShutdownReason, TrainingRun, call_hook, get_plugin_manager, hookimpl


@pytest.fixture
def pm():
    return get_plugin_manager(load_entrypoints=False)


def blame_notes(exc: BaseException) -> list[str]:
    return [note for note in getattr(exc, "__notes__", []) if note.startswith("raised by plugin")]


def test_call_hook_returns_the_hook_result(pm):
    class Contributor:
        @hookimpl
        def mcgraph_rng_options(self, config):
            return {"seed": config}

    pm.register(Contributor())
    assert call_hook(pm, "mcgraph_rng_options", config=7) == [{"seed": 7}]
    assert call_hook(pm, "mcgraph_forward_backward_func", forward_backward_func=len) is len


def test_plugin_exception_propagates_with_a_note_naming_the_plugin(pm):
    error = RuntimeError("boom")

    class Healthy:
        @hookimpl
        def mcgraph_train_step_start(self, step):
            pass

    class Failing:
        @hookimpl
        def mcgraph_train_step_start(self, step):
            raise error

    pm.register(Failing(), name="failing-plugin")
    pm.register(Healthy(), name="healthy-plugin")
    with pytest.raises(RuntimeError) as excinfo:
        call_hook(pm, "mcgraph_train_step_start", step=0)
    assert excinfo.value is error
    assert blame_notes(error) == [
        "raised by plugin 'failing-plugin' in its mcgraph_train_step_start implementation"
    ]


def test_module_plugin_is_blamed_by_its_name(pm):
    plugin = types.ModuleType("fake_module_plugin")
    exec(
        textwrap.dedent(
            """
            from hookspecs import hookimpl

            @hookimpl
            def mcgraph_rng_initialized(config):
                raise ValueError("the RNG tracker is not CUDA-graph safe")
            """
        ),
        plugin.__dict__,
    )
    pm.register(plugin, name="rng-checker")
    with pytest.raises(ValueError) as excinfo:
        call_hook(pm, "mcgraph_rng_initialized", config=None)
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'rng-checker' in its mcgraph_rng_initialized implementation"
    ]


def test_exception_through_a_wrapper_blames_the_inner_plugin(pm):
    class Around:
        @hookimpl(wrapper=True)
        def mcgraph_model_built(self):
            try:
                return (yield)
            finally:
                pass

    class Failing:
        @hookimpl
        def mcgraph_model_built(self, model):
            raise RuntimeError("no DDP chunk")

    pm.register(Failing(), name="inner")
    pm.register(Around(), name="wrapper")
    kwargs = dict(model=[], optimizer=None, model_config=None, seq_length=8, micro_batch_size=2)
    with pytest.raises(RuntimeError) as excinfo:
        call_hook(pm, "mcgraph_model_built", **kwargs)
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'inner' in its mcgraph_model_built implementation"
    ]


def test_nested_hook_calls_add_one_note_for_the_innermost_plugin(pm):
    class Caller:
        @hookimpl
        def mcgraph_post_warmup_step(self, step):
            call_hook(pm, "mcgraph_before_capture", step=step, impl="local", scope=["attn"])

    class Refuses:
        @hookimpl
        def mcgraph_before_capture(self, step):
            raise RuntimeError("capture refused")

    pm.register(Caller(), name="caller")
    pm.register(Refuses(), name="refuses")
    with pytest.raises(RuntimeError) as excinfo:
        call_hook(pm, "mcgraph_post_warmup_step", step=3, start_step=0)
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'refuses' in its mcgraph_before_capture implementation"
    ]


def test_two_instances_of_one_plugin_class_blame_the_one_that_raised(pm):
    """Both instances share the method's code object, so the code alone cannot tell
    them apart (hookspecs/run.py, ``blame``: ``owners`` is keyed by ``__code__``)."""

    class PerChunk:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        @hookimpl
        def mcgraph_train_step_start(self, step):
            if self.fail:
                raise RuntimeError("chunk 0 failed")

    pm.register(PerChunk(fail=True), name="chunk0-helper")
    pm.register(PerChunk(fail=False), name="chunk1-helper")
    with pytest.raises(RuntimeError) as excinfo:
        call_hook(pm, "mcgraph_train_step_start", step=0)
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'chunk0-helper' in its mcgraph_train_step_start implementation"
    ]


def test_base_exceptions_and_host_errors_get_no_note(pm):
    class Interrupts:
        @hookimpl
        def mcgraph_train_step_start(self, step):
            raise KeyboardInterrupt

    pm.register(Interrupts())
    with pytest.raises(KeyboardInterrupt) as excinfo:
        call_hook(pm, "mcgraph_train_step_start", step=0)
    assert blame_notes(excinfo.value) == []

    host_error = RuntimeError("host failed")
    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(get_plugin_manager(load_entrypoints=False), None, train_iters=2) as run:
            with run.train_step(0):
                raise host_error
    assert blame_notes(host_error) == []


def test_training_run_blames_the_plugin_and_shutdown_sees_the_note(pm):
    seen = []

    class Failing:
        @hookimpl
        def mcgraph_train_step_end(self, step):
            if step == 1:
                raise RuntimeError("metrics failed")

    class Watcher:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            seen.append((reason, blame_notes(exception)))

    pm.register(Failing(), name="metrics")
    pm.register(Watcher())
    with pytest.raises(RuntimeError):
        with TrainingRun(pm, None, train_iters=3) as run:
            for step in range(3):
                with run.train_step(step):
                    pass
    assert seen == [
        (
            ShutdownReason.EXCEPTION,
            ["raised by plugin 'metrics' in its mcgraph_train_step_end implementation"],
        )
    ]


def test_configure_error_is_blamed(pm):
    class Validator:
        @hookimpl
        def mcgraph_configure(self, config):
            raise ValueError("full_iteration requires cuda_graph_impl='local'")

    pm.register(Validator(), name="validator")
    with pytest.raises(ValueError) as excinfo:
        with TrainingRun(pm, None, train_iters=1):
            pass
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'validator' in its mcgraph_configure implementation"
    ]


def test_the_note_names_the_raising_plugin_wherever_it_was_registered():
    pm = get_plugin_manager(load_entrypoints=False)

    class Fine:
        @hookimpl
        def mcgraph_train_step_end(self, step, metrics):
            pass

    class Raising:
        @hookimpl
        def mcgraph_train_step_end(self, step, metrics):
            raise RuntimeError("boom")

    pm.register(Fine(), name="fine")
    pm.register(Raising(), name="raising")
    with pytest.raises(RuntimeError) as info:
        call_hook(pm, "mcgraph_train_step_end", step=0, metrics={})
    assert info.value.__notes__ == [
        "raised by plugin 'raising' in its mcgraph_train_step_end implementation"
    ]
