"""A warm-up that reaches the run's last step is warned about when training starts."""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import pytest
from cpu_only import needs_mcore_on_cpu

import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin.runtime import ranklog
from cudagraph_plugin.runtime.plugin import CudaGraphPlugin
from cudagraph_plugin.runtime.state import Phase
from hookspecs import StepProgress, get_plugin_manager, hookimpl

LOGGER = "cudagraph_plugin"


def _warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "this run trains" in r.getMessage()
    ]


@pytest.mark.parametrize("cuda", [False, True])
def test_train_start_warns_with_the_numbers(monkeypatch, caplog, cuda):
    monkeypatch.setattr(compat, "cuda_available", lambda: cuda)
    monkeypatch.setattr(compat, "te_available", lambda: True)
    config = NS(
        cuda_graph_impl="local",
        cuda_graph_scope="full_iteration",
        cuda_graph_warmup_steps=1000,
        use_te_rng_tracker=True,
    )
    plugin = CudaGraphPlugin.configure(config, get_plugin_manager(load_entrypoints=False))
    # as if the host had called run.model_built(): training before it is refused on a GPU
    plugin.state.advance((Phase.CONFIGURED,), Phase.BUILT)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            plugin.mcgraph_train_start(start_step=0, train_iters=10, progress=StepProgress())
    finally:
        # a plugin outside a run is never shut down: take its rank filter off the logger
        ranklog.remove(plugin.log_filter)
    (warning,) = _warnings(caplog)
    assert warning == (
        "cuda_graph_warmup_steps=1000 and this run trains 10 step(s) (steps 0..9: "
        "start_step=0, train_iters=10): the capture step 1000 (start_step + warm-up) is never "
        "reached, so no CUDA graph will be captured; use at most 8 warm-up step(s) (so that a "
        "step replays) or train longer"
    )


class _StepLog:
    @hookimpl
    def mcgraph_train_step_start(self, step):
        logging.getLogger(LOGGER).warning("step %d starts", step)


@needs_mcore_on_cpu
@pytest.mark.parametrize(
    "warmup, iters, warned",
    [("20", "5", True), ("4", "5", True), ("3", "5", False)],
    ids=["never-captured", "never-replayed", "fine"],
)
def test_the_example_loop_warns_before_the_first_step(caplog, warmup, iters, warned):
    argv = [
        "--cuda-graph-impl",
        "local",
        "--cuda-graph-scope",
        "full_iteration",
        "--cuda-graph-warmup-steps",
        warmup,
        "--train-iters",
        iters,
        "--log-interval",
        "0",
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        train_gpt.run(argv, plugins=[_StepLog()])
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    warnings = _warnings(caplog)
    if not warned:
        assert warnings == []
        return
    (warning,) = warnings
    assert warning.startswith(
        f"--cuda-graph-warmup-steps={warmup} and this run trains {iters} step(s) "
        f"(steps 0..{int(iters) - 1}: start_step=0, train_iters={iters})"
    )
    assert messages.index(warning) < messages.index("step 0 starts")
