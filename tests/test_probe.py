"""The probe plugin's parts, in this process: its fault specs, the one function that reads
the CUDA graph plugin's internals, the capture fault, and that its shutdown wrapper writes
the record outside (after) the CUDA graph plugin's cleanup, also when a shutdown hook raises.

The probe's module is loaded from its file here, never put on ``sys.path``: this process must
not discover its ``.dist-info`` (``tests/test_probe_jobs_cpu.py`` runs it in real jobs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from hookspecs import get_plugin_manager, hookimpl
from train_jobs import PROBE_PATH


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("mcgraph_probe", PROBE_PATH / "mcgraph_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Not in this process: exit handlers and a SIGUSR1 stack dump belong to launched jobs.
    monkeypatch.setattr(module, "_install_exit_hooks", lambda run: None)
    for var in (*module.PROBE_VARS, module.FAIL_CAPTURE_AT_VAR):
        monkeypatch.delenv(var, raising=False)
    return module


def test_the_dist_info_declares_the_entry_point() -> None:
    (dist_info,) = PROBE_PATH.glob("*.dist-info")
    assert "Name: mcgraph_probe" in (dist_info / "METADATA").read_text()
    assert (dist_info / "entry_points.txt").read_text().split() == [
        "[mcgraph]",
        "probe",
        "=",
        "mcgraph_probe",
    ]


def test_fault_specs(probe: ModuleType) -> None:
    assert probe.parse_step_rank("6:1", "X") == (6, "1")
    assert probe.parse_step_rank("0:all", "X") == (0, "all")
    for bad in ("6", "a:1", "6:", "6:first", ":1"):
        with pytest.raises(ValueError, match="X="):
            probe.parse_step_rank(bad, "X")
    with pytest.raises(ValueError, match="MCGRAPH_PROBE_FAIL_CAPTURE"):
        probe.Probe(get_plugin_manager(load_entrypoints=False), {"MCGRAPH_PROBE_FAIL_CAPTURE": "x"})


@dataclasses.dataclass
class _Snapshot:
    allocated_mib: float


def test_graph_plugin_facts_take_what_they_find(probe: ModuleType) -> None:
    pm = get_plugin_manager(load_entrypoints=False)
    assert probe.graph_plugin_facts(pm) is None
    pm.register(SimpleNamespace(), name=RUN_PLUGIN_NAME)
    assert probe.graph_plugin_facts(pm) == {
        "graphs_freed": None,
        "allocated_after_free_mib": None,
        "memory_before": None,
        "captures": None,
    }
    pm2 = get_plugin_manager(load_entrypoints=False)
    full = SimpleNamespace(
        graphs_freed=2,
        allocated_after_free_mib=10.0,
        capture=SimpleNamespace(
            memory_before=_Snapshot(12.0),
            records=[{"stage": "training", "step": 3, "seconds": 0.5}],
        ),
    )
    pm2.register(full, name=RUN_PLUGIN_NAME)
    assert probe.graph_plugin_facts(pm2) == {
        "graphs_freed": 2,
        "allocated_after_free_mib": 10.0,
        "memory_before": {"allocated_mib": 12.0},
        "captures": [{"stage": "training", "step": 3, "seconds": 0.5}],
    }


def test_graph_plugin_facts_read_the_real_plugin(probe: ModuleType) -> None:
    """The attributes the probe reads exist on the plugin itself (a rename would make the
    GPU suite's facts silently ``None``)."""
    from cudagraph_plugin.runtime import ranklog
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    pm = get_plugin_manager(load_entrypoints=False)
    plugin = CudaGraphPlugin.configure({"cuda_graph_impl": "none"}, pm)
    ranklog.remove(plugin.log_filter)  # a plugin outside a run is never shut down
    pm.register(plugin, name=RUN_PLUGIN_NAME)
    assert probe.graph_plugin_facts(pm) == {
        "graphs_freed": 0,
        "allocated_after_free_mib": None,
        "memory_before": None,
        "captures": [],
    }


def test_the_capture_fault_hits_only_its_rank(probe: ModuleType) -> None:
    pm = get_plugin_manager(load_entrypoints=False)
    env = {"MCGRAPH_PROBE_FAIL_CAPTURE": "1"}
    healthy = probe.Probe(pm, {**env, "RANK": "0"})
    healthy.mcgraph_before_capture(step=3, impl="local", scope=["full_iteration"])
    failing = probe.Probe(pm, {**env, "RANK": "1"})
    with pytest.raises(RuntimeError, match="injected capture failure on rank 1"):
        failing.mcgraph_before_capture(step=3, impl="local", scope=["full_iteration"])
    assert failing.events[-1] == ["fault", "fail_capture", 3]


class _FakeGraphPlugin:
    """Stands in for the CUDA graph plugin's run plugin: frees its graphs in the ``finally``
    of an outermost-first shutdown wrapper, as the real one does."""

    graphs_freed = 0

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        try:
            return (yield)
        finally:
            self.graphs_freed = 2


class _FakeEntry:
    @hookimpl
    def mcgraph_configure(self, config: Any, pluginmanager: Any) -> None:
        pluginmanager.register(_FakeGraphPlugin(), name=RUN_PLUGIN_NAME)


class _RaisingShutdown:
    @hookimpl
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> None:
        raise RuntimeError("a shutdown hook fails")


@pytest.mark.parametrize("probe_first", [True, False])
def test_the_record_is_written_after_the_graph_plugin_freed_its_graphs(
    probe: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_first: bool
) -> None:
    monkeypatch.setenv("MCGRAPH_PROBE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    pm = get_plugin_manager(load_entrypoints=False)
    # Entry points load in sys.path order; the probe must not depend on it.
    plugins = [(probe, "probe"), (_FakeEntry(), "cudagraph")]
    for plugin, name in plugins if probe_first else reversed(plugins):
        pm.register(plugin, name=name)
    pm.register(_RaisingShutdown())
    pm.hook.mcgraph_configure.call_historic(kwargs={"config": None, "pluginmanager": pm})
    pm.hook.mcgraph_train_step_end(step=0, metrics={"loss": 2.5})
    with pytest.raises(RuntimeError, match="a shutdown hook fails"):
        pm.hook.mcgraph_shutdown(reason="completed", exception=None)
    record = json.loads((tmp_path / "rank3.json").read_text())
    assert record["rank"] == 3
    assert record["graph_plugin"]["graphs_freed"] == 2
    assert record["events"] == [["step_end", 0], ["shutdown", "completed"]]
    assert record["losses"] == [2.5]


def test_inert_without_its_variables(probe: ModuleType) -> None:
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(probe, name="probe")
    pm.hook.mcgraph_configure.call_historic(kwargs={"config": None, "pluginmanager": pm})
    assert pm.get_plugin(probe.RUN_NAME) is None
