"""One name per plugin: objects a plugin registers count as that plugin, in the registry,
in error notes and in the manager's log lines (hookspecs/manager.py)."""

from __future__ import annotations

import logging

import pytest

from hookspecs import (
    McgraphPluginManager,
    TrainingRun,
    call_hook,
    get_plugin_manager,
    hookimpl,
    plugin_name,
)


class PerRun:
    def __init__(self, fail_at: str | None = None) -> None:
        self.fail_at = fail_at

    @hookimpl
    def mcgraph_train_step_end(self, step):
        if self.fail_at == "mcgraph_train_step_end":
            raise RuntimeError("per-run object failed")


class Helper:
    @hookimpl
    def mcgraph_train_step_start(self, step):
        raise RuntimeError("helper failed")


class Owner:
    """A plugin that registers its per-run object from configure, without a name."""

    def __init__(self, per_run: object) -> None:
        self.per_run = per_run

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        pluginmanager.register(self.per_run)


@pytest.fixture
def pm() -> McgraphPluginManager:
    return get_plugin_manager(load_entrypoints=False)


def blame_notes(exc: BaseException) -> list[str]:
    return [note for note in getattr(exc, "__notes__", []) if note.startswith("raised by plugin")]


def test_an_object_registered_from_a_plugins_hook_is_named_after_that_plugin(pm):
    per_run = PerRun()
    pm.register(Owner(per_run), name="steptimer")
    with TrainingRun(pm, None, train_iters=0, handle_signals=()):
        pass

    assert pm.get_name(per_run) == "steptimer:PerRun"
    assert pm.plugin_name("steptimer:PerRun") == "steptimer"
    assert plugin_name(pm, "steptimer:PerRun") == "steptimer"
    assert pm.plugin_name("steptimer") == "steptimer"


def test_its_errors_name_the_plugin_not_the_object(pm):
    pm.register(Owner(PerRun(fail_at="mcgraph_train_step_end")), name="steptimer")
    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(pm, None, train_iters=1, handle_signals=()) as run:
            with run.train_step(0):
                pass
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'steptimer' in its mcgraph_train_step_end implementation"
    ]


def test_ownership_is_transitive(pm):
    class Registrar:
        @hookimpl
        def mcgraph_train_start(self, start_step, train_iters):
            pm.register(Helper())

    pm.register(Owner(Registrar()), name="steptimer")
    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(pm, None, train_iters=1, handle_signals=()) as run:
            with run.train_step(0):
                pass
    assert "steptimer:Helper" in dict(pm.list_name_plugin())
    assert blame_notes(excinfo.value) == [
        "raised by plugin 'steptimer' in its mcgraph_train_step_start implementation"
    ]


def test_an_explicit_name_is_kept_and_still_counts_as_the_owner(pm):
    class NamesIt:
        @hookimpl
        def mcgraph_configure(self, pluginmanager):
            pluginmanager.register(Helper(), name="steptimer-helper")

    pm.register(NamesIt(), name="steptimer")
    with TrainingRun(pm, None, train_iters=0, handle_signals=()):
        with pytest.raises(RuntimeError) as excinfo:
            call_hook(pm, "mcgraph_train_step_start", step=0)
    assert pm.plugin_name("steptimer-helper") == "steptimer"
    assert "'steptimer'" in blame_notes(excinfo.value)[0]


def test_objects_registered_by_the_host_get_their_class_name_not_a_number(pm):
    first, second = PerRun(), PerRun()
    assert pm.register(first) == "PerRun"
    assert pm.register(second) == "PerRun-2"
    assert pm.plugin_name("PerRun-2") == "PerRun-2"
    with pytest.raises(ValueError, match="already registered"):
        pm.register(first)


def test_two_objects_of_one_class_registered_by_one_plugin_get_distinct_names(pm):
    class TwoOfThem:
        @hookimpl
        def mcgraph_configure(self, pluginmanager):
            pluginmanager.register(PerRun())
            pluginmanager.register(PerRun())

    pm.register(TwoOfThem(), name="steptimer")
    with TrainingRun(pm, None, train_iters=0, handle_signals=()):
        pass
    names = [name for name, _ in pm.list_name_plugin()]
    assert {"steptimer:PerRun", "steptimer:PerRun-2"} <= set(names)


def test_unregistering_forgets_the_owner(pm):
    per_run = PerRun()
    pm.register(Owner(per_run), name="steptimer")
    with TrainingRun(pm, None, train_iters=0, handle_signals=()):
        pass
    pm.unregister(per_run)
    assert pm.plugin_name("steptimer:PerRun") == "steptimer:PerRun"


def test_a_blocked_name_stays_blocked_for_unnamed_registrations(pm):
    pm.set_blocked("PerRun")
    assert pm.register(PerRun()) is None
    assert pm.get_plugin("PerRun") is None


def test_the_manager_logs_the_plugins_it_loaded(caplog):
    with caplog.at_level(logging.INFO, logger="hookspecs.manager"):
        get_plugin_manager()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mcgraph")]
    assert line.startswith("mcgraph plugins: ")
    # The project's own plugin, by its one name and its distribution.
    assert "cudagraph (megatron-cudagraph-plugin " in line


class _Wraps:
    """A ``tryfirst`` shutdown wrapper that records when it is entered and left."""

    def __init__(self, label: str, seen: list[str], outermost: bool = False) -> None:
        self.label, self.seen = label, seen
        if outermost:
            self.mcgraph_outermost = True

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason, exception):
        self.seen.append(f"enter {self.label}")
        try:
            return (yield)
        finally:
            self.seen.append(f"leave {self.label}")


def test_an_outermost_object_stays_outside_tryfirst_wrappers_registered_after_it(pm):
    """(review of 2026-12-04: the CUDA graph plugin's shutdown guard is a ``tryfirst``
    wrapper; pluggy puts the one registered last outermost, so a third party's registered
    later sat outside it.) Registered again after each registration, with its name and
    owner; one registered from another plugin's hook keeps that owner."""
    seen: list[str] = []
    guard = _Wraps("guard", seen, outermost=True)
    pm.register(Owner(guard), name="cudagraph")
    with TrainingRun(pm, None, train_iters=0, handle_signals=()):
        pm.register(_Wraps("later", seen))
        pm.register(_Wraps("later still", seen), name="other")
    assert seen == [
        "enter guard",
        "enter later still",
        "enter later",
        "leave later",
        "leave later still",
        "leave guard",
    ]
    assert pm.get_plugin("cudagraph:_Wraps") is guard
    assert pm.plugin_name("cudagraph:_Wraps") == "cudagraph"
    assert [name for name, _ in pm.list_name_plugin()][-1] == "cudagraph:_Wraps"


def test_without_the_attribute_pluggy_s_order_holds(pm):
    seen: list[str] = []
    pm.register(_Wraps("first", seen))
    pm.register(_Wraps("second", seen), name="second")
    with TrainingRun(pm, None, train_iters=0, handle_signals=()):
        pass
    assert seen[:2] == ["enter second", "enter first"]


def test_an_outermost_object_with_a_historic_hook_is_refused(pm):
    """(review of today's diff: registered again after every registration, its
    ``mcgraph_configure`` was replayed each time.)"""

    class Configures:
        mcgraph_outermost = True

        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            pass

    with pytest.raises(ValueError, match=r"implements mcgraph_configure, a historic hook"):
        pm.register(Configures(), name="configures")
    assert pm.get_plugin("configures") is None
