"""The optimizer CUDA graph (megatron-core 0.17+), through the example loop on the CPU.

megatron-core 0.16.1 has no ``OptimizerCudaGraphWrapper``: these tests install a stand-in
that follows 0.19.2's class (``tests/fake_optimizer_graph.py``) and the fake graph capture
of ``tests/fakes.py``; the model, DDP, the optimizer and its step are megatron-core's own.
0.16.1's ``OptimizerConfig`` has no ``optimizer_cuda_graph`` field either, so the host's
optimizer is marked capturable on its config, as 0.17+ would build it.
"""

from __future__ import annotations

import logging

import pytest
from cpu_only import needs_mcore_on_cpu

import fake_optimizer_graph
import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError
from recording import RaiseAt, Recorder

pytestmark = needs_mcore_on_cpu

REAL_GRAD_NORM_ON_DEVICE = compat.grad_norm_on_device

FULL = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
OPTIM = ["--optimizer-cuda-graph"]


@pytest.fixture
def graphs(fake_graphs, monkeypatch):
    fake_graphs.wrapper = fake_optimizer_graph.install(monkeypatch)
    # Where megatron-core has fused multi-tensor kernels (TE or Apex), as a GPU machine
    # should: here on the CPU it has only its host-reading fallback (tested below).
    monkeypatch.setattr(compat, "grad_norm_on_device", lambda: True)
    yield fake_graphs
    assert not compat.optimizer_graph_state_dirty(), "a run left optimizer graph state"


@pytest.fixture
def capturable(monkeypatch):
    """Build the host's optimizer as megatron-core 0.17+ does for optimizer_cuda_graph."""
    built = []
    original = train_gpt._build_optimizer

    # 0.16.1's OptimizerConfig has no such field: build without it, then mark it
    def without_flag(args, model):
        flag = args.optimizer_cuda_graph
        args.optimizer_cuda_graph = False
        try:
            optimizer = original(args, model)
        finally:
            args.optimizer_cuda_graph = flag
        optimizer.config.optimizer_cuda_graph = flag
        built.append(optimizer)
        return optimizer

    monkeypatch.setattr(train_gpt, "_build_optimizer", without_flag)
    return built


def run(*argv, plugins=(), steps=8):
    recorder = Recorder()
    summary = train_gpt.run(
        ["--train-iters", str(steps), "--log-interval", "0", *argv], plugins=[recorder, *plugins]
    )
    return summary, recorder


@pytest.mark.parametrize("warmup,start", [(1, 0), (3, 0), (2, 5)])
def test_full_iteration_and_optimizer_graphs_capture_in_the_same_step(
    graphs, capturable, warmup, start
):
    steps = start + 8
    _, rec = run(
        *FULL, *OPTIM, "--cuda-graph-warmup-steps", str(warmup), "--start-step", str(start),
        steps=steps,
    )  # fmt: skip
    capture = start + warmup
    stages = [(c["stage"], c["step"]) for c in rec.graph_plugin.capture.records]
    assert stages == [("training", capture), ("optimizer", capture)]
    captures = [e for e in rec.events if e[0] == "before_capture"]
    assert captures == [
        ("before_capture", capture, "local", ("full_iteration",)),
        ("before_capture", capture, "local", ("optimizer",)),
    ]
    [full] = graphs.graphs
    [optimizer] = fake_optimizer_graph.StepGraph.made
    assert optimizer.replays == steps - capture  # the capture call replays once too
    assert full.resets == optimizer.resets == 1
    report = rec.report
    assert report.graph_count == 2 and report.capture_step == capture
    assert report.replay_steps == list(range(capture + 1, steps))
    assert rec.graph_plugin.graphs_freed == 2


def test_the_hosts_optimizer_step_is_restored_at_shutdown(graphs, capturable):
    run(*FULL, *OPTIM, steps=5)
    [optimizer] = capturable
    assert "step" not in vars(optimizer)  # the class's own method again
    assert graphs.wrapper.cuda_graph is None and graphs.wrapper.curr_iteration == 0


def test_optimizer_graph_alone(graphs, capturable):
    _, rec = run(*OPTIM, "--cuda-graph-warmup-steps", "2", steps=6)
    assert [(c["stage"], c["step"]) for c in rec.graph_plugin.capture.records] == [("optimizer", 2)]
    assert rec.report.graphs_captured and rec.report.graph_count == 1
    assert rec.report.capture_step == 2


def test_exception_after_capture_frees_the_optimizer_graph_and_restores_step(graphs, capturable):
    with pytest.raises(RuntimeError, match="boom"):
        run(
            *FULL,
            *OPTIM,
            "--cuda-graph-warmup-steps",
            "1",
            plugins=[RaiseAt(4, RuntimeError("boom"))],
        )
    [optimizer] = capturable
    assert "step" not in vars(optimizer)
    assert [g.resets for g in graphs.graphs + fake_optimizer_graph.StepGraph.made] == [1, 1]


def test_an_optimizer_built_without_the_flag_is_refused_with_the_fix(graphs, monkeypatch):
    original = train_gpt._build_optimizer

    def forgetful(args, model):  # a host that ignores the plugin's flag
        args.optimizer_cuda_graph = False
        optimizer = original(args, model)
        optimizer.config.optimizer_cuda_graph = False
        return optimizer

    monkeypatch.setattr(train_gpt, "_build_optimizer", forgetful)
    with pytest.raises(CudaGraphConfigError) as info:
        run(*FULL, *OPTIM)
    message = str(info.value)
    assert "OptimizerConfig.optimizer_cuda_graph = False" in message
    assert "OptimizerConfig(..., optimizer_cuda_graph=True)" in message


def test_state_left_by_an_earlier_run_is_reset_with_a_warning(graphs, capturable, caplog):
    graphs.wrapper.curr_iteration = 7
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        _, rec = run(*OPTIM, "--cuda-graph-warmup-steps", "1", steps=4)
    assert "OptimizerCudaGraphWrapper holds state from an earlier run" in caplog.text
    assert rec.report.capture_step == 1


def test_megatron_core_016_refuses_the_request_naming_the_release():
    with pytest.raises(CudaGraphConfigError, match=r"first released in megatron-core 0\.17\.0"):
        run(*FULL, *OPTIM, steps=2)


def test_a_gradient_norm_read_on_the_host_is_refused_with_the_fix(graphs, capturable, monkeypatch):
    """megatron-core without TE's or Apex's kernels (this CPU machine, and the H200 with
    megatron-core 0.19.2 + TE 2.11) computes the norm with a host read: the capture would
    fail with "operation not permitted when stream is capturing"."""
    monkeypatch.setattr(compat, "grad_norm_on_device", REAL_GRAD_NORM_ON_DEVICE)
    assert compat.grad_norm_on_device() is False  # megatron-core's local fallback here
    with pytest.raises(CudaGraphConfigError) as info:
        run(*FULL, *OPTIM, steps=4)
    message = str(info.value)
    assert "local_multi_tensor_l2_norm" in message
    assert "Falling back to local implementations of multi_tensor_applier" in message
    assert graphs.graphs == fake_optimizer_graph.StepGraph.made == []  # refused before capture
