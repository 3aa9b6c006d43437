"""Shared test set-up for the whole suite.

This module owns what every test relies on:

* ``examples/`` on ``sys.path``, so tests import the example host (``train_gpt``) and the
  CUDA-to-CPU redirect (``cpu_redirect``) the way the example script itself does;
* blocking the ``cudagraph`` entry point while its module does not exist yet: the
  distribution declares ``cudagraph = cudagraph_plugin.entry``, and loading a missing module
  would fail every plugin manager. Once ``cudagraph_plugin.entry`` exists this does nothing;
* the check that no test leaves process state behind (at the end of this module);
* a frozen garbage collector baseline (``gc.freeze``), so that the ``gc.collect()`` calls a
  run makes (megatron-core's capture, the plugin's shutdown) cost milliseconds, not 0.25 s;
* under pytest-xdist's ``--dist loadgroup``, a test that ends its worker (pytest-timeout's
  thread method does, after 300 s) fails once and the others still run
  (``tests/xdist_loadgroup.py``).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xdist_loadgroup

from hookspecs import BLOCK_ENV_VAR

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"

if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))


def _cudagraph_entry_missing() -> bool:
    try:
        return importlib.util.find_spec("cudagraph_plugin.entry") is None
    except ModuleNotFoundError:
        return True


# Plugins installed in this environment besides the project's own (the guide's NVTX plugin,
# say): the suite asserts what the project's plugin alone does, so they are blocked (their
# own tests unblock them). Read once, before any test puts a plugin of its own on the path.
_THIRD_PARTY = sorted(
    {ep.name for ep in importlib.metadata.entry_points(group="mcgraph")} - {"cudagraph"}
)


def _blocked_value(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The block list with ``cudagraph`` added while its module is missing and the
    third-party plugins installed here added, else ``None`` (nothing to add)."""
    blocked = [name.strip() for name in environ.get(BLOCK_ENV_VAR, "").split(",") if name.strip()]
    extra = [*_THIRD_PARTY, *(["cudagraph"] if _cudagraph_entry_missing() else [])]
    extra = [name for name in extra if name not in blocked]
    return ",".join([*blocked, *extra]) if extra else None


@pytest.fixture(autouse=True)
def _block_other_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    value = _blocked_value(os.environ)
    if value is not None:
        monkeypatch.setenv(BLOCK_ENV_VAR, value)


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A CUDA device as far as the plugin can tell, with the fake graph capture and TE of
    ``tests/fakes.py``; no run may leave full-iteration state behind."""
    from cudagraph_plugin import compat
    from fakes import install_fake_cuda_graphs

    log = install_fake_cuda_graphs(monkeypatch)
    yield log
    assert not compat.full_iteration_state_dirty(), "a run left FullCudaGraphWrapper state"


@pytest.fixture
def bucket_fakes(fake_graphs: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake capture, with pool handles that are new on every call, as torch's are
    (``torch.cuda.graph_pool_handle`` returns a fresh id each time): bucketed graphs must
    keep one pool."""
    import itertools

    import cpu_redirect

    handles = itertools.count(1)
    monkeypatch.setitem(
        cpu_redirect._CUDA_STAND_INS, "graph_pool_handle", lambda: (0, next(handles))
    )
    return fake_graphs


@pytest.fixture(scope="session")
def jobs_root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Where the GPU jobs' logs and probe records go: ``MCGRAPH_GPU_LOGS`` (the suite driver
    tars it) or a pytest temporary folder."""
    from pathlib import Path

    logs = os.environ.get("MCGRAPH_GPU_LOGS")
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        return Path(logs)
    return tmp_path_factory.mktemp("gpu-jobs")


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for a child Python: this one, with the same plugin blocking."""
    env = dict(os.environ)
    value = _blocked_value(env)
    if value is not None:
        env[BLOCK_ENV_VAR] = value
    return env


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed")
        terminalreporter.write_line(f"random test order: --randomly-seed={seed} repeats it")


# -- a cheap gc.collect() ------------------------------------------------------------------
#
# Once torch and megatron-core are imported the process holds ~400,000 objects that live until
# it exits, and every full gc.collect() walks them all: 0.25 s each, several per training run
# (the fake and real TE capture, the plugin's release steps), a third of the suite's time.
# Frozen (gc.freeze: the permanent generation) they are no longer walked; what a test creates
# is collected exactly as before. Collection (which imports them) runs without the collector,
# whose automatic passes would walk them over and over, then the baseline is frozen once.
# It is taken again, after a collection, whenever the oldest generation has grown past
# _REFREEZE_AT objects: what tests keep alive piles up there (a few hundred objects a test),
# and gc.unfreeze() puts the whole baseline back there (megatron-core's capture with
# FREEZE_GC does, and the plugin's end of a stuck capture). Listing that generation costs
# about a millisecond (gc.get_freeze_count() would walk the 400,000 frozen objects).

_REFREEZE_AT = 10_000


def _freeze_the_baseline() -> None:
    gc.collect()
    gc.freeze()


class _FrozenBaseline:
    """Registered as a plugin, not a conftest hook: conftest hooks see only the tests under
    tests/, this one also the example plugin's tests (testpaths)."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> Iterator[None]:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return (yield)
        finally:
            if was_enabled:
                gc.enable()
            _freeze_the_baseline()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if len(gc.get_objects(generation=2)) > _REFREEZE_AT:
            _freeze_the_baseline()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_FrozenBaseline(), "mcgraph-frozen-gc-baseline")
    # Only pytest-xdist's controller asks it for a scheduler.
    config.pluginmanager.register(xdist_loadgroup, "mcgraph-xdist-loadgroup")


# -- no test leaves state behind -------------------------------------------------------------
#
# The suite runs in random order, so a test must not depend on what another left in the
# process. Each test is checked for the process-wide state this project's tests touch; one
# that leaves any of it behind fails, naming it (fix the test or the code it drives).


def _fake_te(module: Any) -> Any:
    """The ``transformer_engine`` module if it is not an installed package (a fake has no
    file), else None."""
    return module if module is not None and getattr(module, "__file__", None) is None else None


def _process_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        # A fake TE left behind (tests/fakes.py) would fool later tests; the real one,
        # imported by a run on a GPU machine, is supposed to stay.
        "fake transformer_engine module": _fake_te(sys.modules.get("transformer_engine")),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "cudagraph_plugin logger filters": tuple(logging.getLogger("cudagraph_plugin").filters),
    }
    if "hookspecs.run_signals" in sys.modules:  # (a plugin's hand-over of the process's end)
        state["stuck-signal exit bounded elsewhere"] = sys.modules[
            "hookspecs.run_signals"
        ]._BOUNDED_ELSEWHERE
        state["stuck-signal release offered"] = sys.modules["hookspecs.run_signals"]._RELEASE
    if "torch" in sys.modules:
        import torch

        state["torch.distributed initialised"] = torch.distributed.is_initialized()
        state["torch.cuda.is_available"] = torch.cuda.is_available
        state["torch.cuda.CUDAGraph"] = torch.cuda.CUDAGraph
    if "cpu_redirect" in sys.modules:
        state["cpu_redirect active"] = sys.modules["cpu_redirect"].is_active()
    if "megatron.core.parallel_state" in sys.modules:
        state["megatron-core model parallel initialised"] = sys.modules[
            "megatron.core.parallel_state"
        ].model_parallel_is_initialized()
    if "megatron.core.num_microbatches_calculator" in sys.modules:
        calculator = sys.modules["megatron.core.num_microbatches_calculator"]
        state["megatron-core micro-batch calculator"] = (
            calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None
        )
    if "megatron.core.full_cuda_graph" in sys.modules:
        from cudagraph_plugin import compat

        state["FullCudaGraphWrapper class state"] = compat.full_iteration_state_dirty()
    if "megatron.core.transformer.cuda_graphs" in sys.modules:
        cuda_graphs = sys.modules["megatron.core.transformer.cuda_graphs"]
        state["megatron-core capture flag"] = cuda_graphs.is_graph_capturing()
        state["megatron-core TECudaGraphHelper"] = cuda_graphs.TECudaGraphHelper
    return state


_STATE_BEFORE = pytest.StashKey[dict[str, Any]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_STATE_BEFORE] = _process_state()  # before any fixture is set up
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield  # every fixture of the test is finalised (monkeypatch undone) by now
    before = item.stash.get(_STATE_BEFORE, None)
    if before is not None:
        after = _process_state()
        left = [name for name in before if name in after and after[name] != before[name]]
        assert not left, f"the test left process state behind: {', '.join(left)}"
    return result


@pytest.fixture
def host_sigterm() -> Iterator[list[int]]:
    """The host's own SIGTERM handler, recording what reaches it (it returns: the program
    continues after a run's shutdown); the handler before it comes back afterwards."""
    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGTERM, before)
