"""The optimizer CUDA graph (megatron-core 0.17+), through the example loop on the CPU.

megatron-core 0.16.1 has no ``OptimizerCudaGraphWrapper``: these tests install a stand-in
that follows 0.19.2's class (``tests/fake_optimizer_graph.py``) and the fake graph capture
of ``tests/fakes.py``; the model, DDP, the optimizer and its step are megatron-core's own.
0.16.1's ``OptimizerConfig`` has no ``optimizer_cuda_graph`` field either, so the host's
optimizer is marked capturable on its config, as 0.17+ would build it.
"""

from __future__ import annotations

import logging
import math

import pytest
from cpu_only import needs_mcore_on_cpu

import fake_optimizer_graph
import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.runtime.wiring import CudaGraphWiringError
from hookspecs import hookimpl
from recording import FULL, RaiseAt, run_recorded

pytestmark = needs_mcore_on_cpu

OPTIM = ["--optimizer-cuda-graph"]


def _clip_grads():
    from megatron.core.optimizer import clip_grads

    return clip_grads


@pytest.fixture
def graphs(fake_graphs, monkeypatch):
    fake_graphs.wrapper = fake_optimizer_graph.install(monkeypatch)
    # megatron-core 0.17+'s clip_grads has a tensor-scale global, None without TE 2.14's or
    # Apex's kernels (the H200's 0.19.2 + TE 2.11): the plugin supplies device-side kernels.
    # 0.16.1's (tested below) has none, and then reads the norm on the host whatever runs.
    monkeypatch.setattr(_clip_grads(), "multi_tensor_scale_tensor_impl", None, raising=False)
    yield fake_graphs
    assert not compat.optimizer_graph_state_dirty(), "a run left optimizer graph state"


@pytest.fixture
def capturable(monkeypatch):
    """Build the host's optimizer as megatron-core 0.17+ does for optimizer_cuda_graph."""
    built: list = []
    build = fake_optimizer_graph.capturable_build(train_gpt._build_optimizer, built)
    monkeypatch.setattr(train_gpt, "_build_optimizer", build)
    return built


def run(*argv, plugins=(), steps=8, schedule=("--lr-decay-style", "constant")):
    """The example loop; ``schedule=()`` leaves its default (cosine)."""
    # A constant learning rate by default: this CPU stand-in's Adam keeps it as a Python
    # float (a capturable Adam on the GPU holds a device tensor the schedule fills).
    return run_recorded(*schedule, *argv, plugins=plugins, steps=steps)


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


def test_a_gradient_norm_read_on_the_host_is_refused_with_the_fix(
    fake_graphs, monkeypatch, capturable
):
    """megatron-core 0.16's layout (no tensor-scale global): get_grad_norm_fp32 reads the
    norm with .item() whatever kernels run, so the capture would fail with "operation not
    permitted when stream is capturing"; megatron-core's own kernels are put back."""
    fake_graphs.wrapper = fake_optimizer_graph.install(monkeypatch)
    clip_grads = _clip_grads()
    before = dict(vars(clip_grads))
    assert not hasattr(clip_grads, "multi_tensor_scale_tensor_impl")
    with pytest.raises(CudaGraphConfigError) as info:
        run(*FULL, *OPTIM, steps=4)
    message = str(info.value)
    assert "megatron.core.optimizer.clip_grads" in message
    assert "get_grad_norm_fp32 calls .item()" in message
    assert "multi_tensor_scale_tensor_impl (0.17+" in message
    assert fake_graphs.graphs == fake_optimizer_graph.StepGraph.made == []  # before capture
    assert dict(vars(clip_grads)) == before


def test_device_side_gradient_norm_kernels_are_supplied_and_put_back(graphs, capturable):
    """Where megatron-core's clip-grad path would read the host (its local fallback), the
    plugin puts torch-foreach kernels in its place for the run, says so in the report, and
    puts megatron-core's own back at shutdown."""
    from megatron.core import utils

    from cudagraph_plugin.compat import grad_norm

    clip_grads = _clip_grads()
    seen = {}

    class Look:
        @hookimpl
        def mcgraph_after_capture(self, step):
            seen["l2"] = clip_grads.l2_norm_impl

    _, rec = run(*FULL, *OPTIM, "--cuda-graph-warmup-steps", "1", plugins=[Look()], steps=4)
    assert seen["l2"] is grad_norm.multi_tensor_l2norm
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale
    assert clip_grads.multi_tensor_scale_tensor_impl is None
    [note] = [n for n in rec.report.notes if n.startswith("gradient norm:")]
    assert "torch foreach kernels in place of" in note and "stays on the device" in note


@pytest.mark.parametrize(
    "field,value,phrase",
    [
        ("log_num_zeros_in_grad", True, "count_zeros_fp32 calls .item()"),
        ("loss_scale", 1024.0, "found_inf.item()"),
    ],
)
def test_the_built_optimizers_own_config_is_checked(
    graphs, capturable, monkeypatch, field, value, phrase
):
    """The host's flags may not say it, the OptimizerConfig it built from does: what runs
    inside optimizer.step() is refused from there, naming the OptimizerConfig field."""
    built = train_gpt._build_optimizer

    def with_field(args, model):
        optimizer = built(args, model)
        setattr(optimizer.config, field, value)
        return optimizer

    monkeypatch.setattr(train_gpt, "_build_optimizer", with_field)
    with pytest.raises(CudaGraphConfigError) as info:
        run(*FULL, *OPTIM, steps=3)
    [violation] = [v for v in info.value.violations if phrase in v.text]
    assert violation.fields[0] == f"OptimizerConfig.{field}"
    assert fake_optimizer_graph.StepGraph.made == []


def test_a_learning_rate_baked_into_the_captured_step_is_refused_before_it_goes_stale(
    graphs, capturable
):
    """This stand-in's Adam reads a Python-float learning rate (baked into a captured step):
    a schedule that changes it is refused before the replay that would ignore it."""
    from cudagraph_plugin.runtime.optimizer_sync import HyperparameterChangedError

    with pytest.raises(HyperparameterChangedError, match=r"param_groups\[0\]\['lr'\] is now"):
        run(
            *FULL, *OPTIM, "--cuda-graph-warmup-steps", "1", schedule=("--lr-decay-style", "cosine")
        )
    [optimizer] = fake_optimizer_graph.StepGraph.made
    assert optimizer.replays == 1  # the capture call's own replay; none after the change


# -- bucketed graphs: memory that moves frees the optimizer graph too ------------------------------

RL_LOOP = [
    "--seq-length", "48", "--min-length", "4", "--max-length", "48", "--train-iters", "24",
    "--steps-per-round", "4", "--rollout-batches", "2", "--log-interval", "0",
    "--cuda-graph-warmup-steps", "2", "--lr-decay-style", "constant",
]  # fmt: skip
RL_OFFLOAD = ["--offload-interval", "8"]
RL_GRAPHS = [
    "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
    "--cuda-graph-buckets", "16,32,48", *OPTIM,
]  # fmt: skip


def _restores_state_elsewhere(monkeypatch, but_first=False):
    """megatron-core's ``restore_from_cpu`` gives the optimizer's state new device memory
    (``state[k] = v.cuda()``, one tensor at a time); on the CPU its offload moves nothing,
    so the restore here gives each state tensor a copy elsewhere, as a GPU's would
    (``but_first``: the first parameter's state stays, as the H200's allocator once put it
    back at its old address)."""
    import torch
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    original = MegatronOptimizer.restore_from_cpu

    def restore_from_cpu(self):
        original(self)
        first = self.optimizer.param_groups[0]["params"][0]
        for param, state in self.optimizer.state.items():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not (but_first and param is first):
                    state[key] = value.clone()

    monkeypatch.setattr(MegatronOptimizer, "restore_from_cpu", restore_from_cpu)


def _grad_buffers_stay(monkeypatch):
    """megatron-core's gradient-buffer offload as a no-op: the buffers keep their addresses
    (the allocator may hand the same blocks back), so only the optimizer's state moves."""
    from megatron.core.distributed import DistributedDataParallel

    monkeypatch.setattr(DistributedDataParallel, "offload_grad_buffers", lambda self, *a, **k: None)
    monkeypatch.setattr(DistributedDataParallel, "restore_grad_buffers", lambda self, *a, **k: None)


def _rl_report(tmp_path, *argv, plugins=()):
    import json

    import rl_loop

    path = tmp_path / "report.json"
    summary = rl_loop.run(
        [*RL_LOOP, *RL_GRAPHS, *argv, "--cuda-graph-report-json", str(path)], plugins=plugins
    )
    return summary, json.loads(path.read_text())


def _rl_eager():
    """The RL host's eager twin: the same padding and offloads, no graphs."""
    import rl_loop

    return rl_loop.run([*RL_LOOP, *RL_OFFLOAD, "--pad-to-buckets", "16,32,48"])


@pytest.mark.parametrize("explicit", [False, True], ids=["fingerprint", "host-invalidates"])
def test_with_buckets_a_reload_frees_the_optimizer_graph_and_captures_it_again(
    graphs, capturable, bucket_fakes, tmp_path, monkeypatch, caplog, explicit
):
    """The RL host offloads the optimizer's state after steps 8 and 16 and brings it back
    at new addresses. Seen by the address check (which then samples the optimizer's state)
    or told by the host, the plugin frees the optimizer graph with the bucket graphs; it is
    captured again after its warm-up. A replay of the old one would read the old state (the
    fake refuses it), and the warm-up calls after a reload are not counted as replays."""
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    _restores_state_elsewhere(monkeypatch)
    forgotten = []
    forget = compat.forget_shared_graph_pool
    monkeypatch.setattr(compat, "forget_shared_graph_pool", lambda: forgotten.append(forget()))
    flags = ["--invalidate-after-reload"] if explicit else []
    summary, report = _rl_report(tmp_path, *RL_OFFLOAD, *flags)
    eager = _rl_eager()
    assert summary["offloads"] == eager["offloads"] == 2
    assert summary["losses"] == eager["losses"]
    made = fake_optimizer_graph.StepGraph.made
    assert len(made) == 3 and all(g.addresses for g in made)  # captured, then after each reload
    assert [g.resets for g in made] == [1, 1, 1]
    # each recapture into a fresh pool, not megatron-core's cached handle of the freed one;
    # and the run's release leaves none for the next run
    assert len(forgotten) == 3
    warmup = 2
    assert report["replays"]["optimizer"] == 24 - 3 * (warmup + 1)
    freed = [r.getMessage() for r in caplog.records if "CUDA graph buckets:" in r.getMessage()]
    assert len(freed) == 2 and all("and the optimizer step" in m for m in freed)
    if not explicit:
        assert all("optimizer state (optimizer 0" in m for m in freed)


class InvalidatesAt:
    """Tells the plugins, at the end of one step, that the graphs' memory moved (as a host's
    ``run.invalidate_graphs`` between two steps does); with ``bypass``, the host's
    optimizer.step() is not the one the plugin installed (a reference taken earlier)."""

    def __init__(self, step: int, bypass: bool = False) -> None:
        self.step = step
        self.bypass = bypass
        self.ended: list[int] = []
        self.pm = None

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    @hookimpl(trylast=True)
    def mcgraph_model_built(self, model, optimizer):
        if self.bypass:
            vars(optimizer).pop("step", None)

    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        self.ended.append(step)
        if step == self.step:
            self.pm.hook.mcgraph_invalidate_graphs(reason="a reload before the capture step")


def test_an_invalidation_in_the_warmup_puts_the_optimizer_check_off_until_its_capture(
    graphs, capturable, bucket_fakes, tmp_path
):
    """Review finding: the host invalidates after step 1, before the capture step 2; the
    optimizer graph's warm-up starts over (its capture comes at step 4), and the check at
    the end of step 2 used to stop the run, saying optimizer.step() was not called."""
    _, report = _rl_report(tmp_path, "--train-iters", "8", plugins=[InvalidatesAt(1)])
    [event] = report["invalidations"]
    assert event["step"] == 1
    assert report["replays"]["optimizer"] == 3  # captured at step 4, replayed by 5, 6, 7


def test_an_optimizer_step_bypassing_the_graph_is_still_caught_after_the_warmup_restarted(
    graphs, capturable, bucket_fakes, tmp_path
):
    host = InvalidatesAt(1, bypass=True)
    with pytest.raises(CudaGraphWiringError, match="without capturing the optimizer step"):
        _rl_report(tmp_path, "--train-iters", "8", plugins=[host])
    assert host.ended == [0, 1, 2, 3, 4]  # stopped at the end of step 4, one past its capture


def test_with_buckets_but_no_bucket_graph_the_optimizer_graph_still_gets_a_verdict(
    graphs, capturable, bucket_fakes, tmp_path
):
    """Every length outside the only bucket: the optimizer graph alone is captured, and
    the report compares the steps before its capture with those after it."""
    _, report = _rl_report(
        tmp_path, "--min-length", "40", "--cuda-graph-buckets", "16", "--pad-to-buckets", "16,48"
    )
    assert report["replays"] == {"optimizer": 24 - 3}
    assert report["verdict"] != "unknown" and report["speedup"] is not None
    assert report["eager_steps"] == [1] and report["replay_steps"] == list(range(3, 24))


def test_a_run_that_ends_in_the_warmup_after_a_reload_keeps_the_hyperparameter_note(
    graphs, capturable, bucket_fakes, tmp_path
):
    """The reload before step 16 frees the optimizer graph (and its learning-rate sync);
    the run ends at step 16, before the recapture: the report still says how the captured
    step read its hyperparameters."""
    _, report = _rl_report(
        tmp_path, *RL_OFFLOAD, "--train-iters", "17", "--invalidate-after-reload"
    )
    assert len(report["invalidations"]) == 2
    assert any(n.startswith("optimizer graph hyperparameters") for n in report["notes"])


def test_a_reload_that_leaves_the_sampled_state_in_place_still_recaptures(
    graphs, capturable, bucket_fakes, tmp_path, monkeypatch
):
    """Seen on the H200: a reload put the first main parameter's state back at its old
    address and the rest elsewhere; the address sample saw nothing and the optimizer graph
    replayed onto the others' freed memory (NaN losses). A call of megatron-core's offload
    API frees the graphs whatever the sample says (the fake refuses the stale replay)."""
    _restores_state_elsewhere(monkeypatch, but_first=True)
    _grad_buffers_stay(monkeypatch)
    summary, report = _rl_report(tmp_path, *RL_OFFLOAD)
    [optimizer] = capturable
    for inner in [optimizer, *optimizer.chained_optimizers]:  # the host's methods put back
        assert not {"offload_to_cpu", "restore_from_cpu"} & set(vars(inner)), vars(inner)
    assert [e["step"] for e in report["invalidations"]] == [8, 16]
    assert all("restore_from_cpu() ran" in e["reason"] for e in report["invalidations"])
    assert len(fake_optimizer_graph.StepGraph.made) == 3
    assert report["replays"]["optimizer"] == 24 - 3 * 3
    eager = _rl_eager()
    assert summary["offloads"] == eager["offloads"] == 2
    assert summary["losses"] == eager["losses"]


# -- the fallback, an invalidation after it, and the pool handle ----------------------------


class _StateMovesAt:
    """At the start of ``step`` the optimizer's state comes back at new addresses (a
    checkpoint load, an offload's reload) and the host says so, as documented."""

    def __init__(self, step):
        self.step, self.pm, self.optimizer = step, None, None

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.optimizer = optimizer

    @hookimpl
    def mcgraph_train_step_start(self, step):
        if step != self.step:
            return
        import torch

        for inner in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            for state in inner.optimizer.state.values():
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor):
                        state[key] = value.clone()
        self.pm.hook.mcgraph_invalidate_graphs(reason="checkpoint loaded")


def test_after_the_fallback_an_invalidation_frees_the_optimizer_graph_it_kept(
    graphs, capturable, monkeypatch
):
    # the fallback frees the full-iteration graph only; the optimizer graph replays on until
    # the host says its state moved: then it is freed, not replayed onto the moved state
    from cudagraph_plugin.runtime import fallback

    monkeypatch.setattr(fallback, "verdict", lambda e, r: ("slower", 0.5, 0.02, "slower"))
    _, rec = run(
        *FULL, *OPTIM, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown",
        plugins=[_StateMovesAt(10)], steps=13,
    )  # fmt: skip
    assert rec.report.fallback_step == 7
    [event] = rec.report.invalidations
    assert event["graphs_freed"] == 1 and event["step"] == 10
    assert not compat.optimizer_graph_captured()


def test_the_report_after_the_fallback_counts_the_optimizer_graph_still_held(
    graphs, capturable, monkeypatch
):
    from cudagraph_plugin.runtime import fallback

    monkeypatch.setattr(fallback, "verdict", lambda e, r: ("slower", 0.5, 0.02, "slower"))
    seen = {}

    class Look:
        @hookimpl
        def mcgraph_report(self, report):
            seen["held"] = report.graphs_held
            seen["live"] = compat.optimizer_graph_captured()

    _, rec = run(
        *FULL, *OPTIM, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown",
        plugins=[Look()], steps=12,
    )  # fmt: skip
    assert rec.report.fallback_step is not None
    assert seen == {"held": 1, "live": True}


def test_the_optimizer_graph_s_capture_hooks_name_megatron_core_s_local_impl(graphs, capturable):
    # an optimizer-graph-only run has cuda_graph_impl=none; the hooks promise local or TE
    _, rec = run(*OPTIM, "--cuda-graph-warmup-steps", "2", steps=5)
    captures = [e for e in rec.events if e[0] == "before_capture"]
    assert captures and all(e[2] == "local" and e[3] == ("optimizer",) for e in captures)


@pytest.mark.parametrize(
    "mode",
    [[], ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]],
    ids=["optimizer-only", "full-iteration-and-optimizer"],
)
def test_no_run_leaves_megatron_core_s_shared_pool_handle_for_the_next(
    graphs, capturable, monkeypatch, mode
):
    # megatron-core 0.19 caches one process-wide pool handle (cuda_graph_use_single_mempool,
    # its default); the next run would capture into a released pool
    from megatron.core import full_cuda_graph

    monkeypatch.setattr(full_cuda_graph, "_shared_graph_pool", None, raising=False)
    monkeypatch.setattr(compat, "single_mempool", lambda config: True)
    wrapper = fake_optimizer_graph.OptimizerCudaGraphWrapper
    original = wrapper.__call__

    def call(self):
        if self.curr_iter() == self.cuda_graph_warmup_steps and self.use_single_mempool:
            full_cuda_graph._shared_graph_pool = (0, 12345)  # get_shared_graph_pool()
        return original(self)

    monkeypatch.setattr(wrapper, "__call__", call)
    run(*mode, *OPTIM, "--cuda-graph-warmup-steps", "2", steps=5)
    assert full_cuda_graph._shared_graph_pool is None


class KeepsTheOptimizer:
    """A host's plugin that keeps the optimizer ``run.model_built()`` was given."""

    optimizer = None

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.optimizer = optimizer


class WrapsTheStepItself(KeepsTheOptimizer):
    """Megatron-LM's train() order: the model and optimizer are built (``run.model_built``),
    then ``optimizer.step = OptimizerCudaGraphWrapper(optimizer.step, ...)`` when
    ``--optimizer-cuda-graph`` is set, the flag the plugin reads too."""

    @hookimpl
    def mcgraph_train_step_start(self, step):
        if step == 0:
            wrapper = fake_optimizer_graph.OptimizerCudaGraphWrapper
            self.optimizer.step = wrapper(self.optimizer.step, cuda_graph_warmup_steps=2)


def test_a_hosts_own_optimizer_graph_wrapper_is_refused_with_the_fix(
    graphs, capturable, monkeypatch
):
    """(review of 2026-12-04: the two wrappers share megatron-core's class-level counter;
    the run failed with a misleading "optimizer.step() was not called", or a bare
    AssertionError from a capture inside a capture)"""
    with pytest.raises(CudaGraphWiringError, match="host's own OptimizerCudaGraphWrapper after"):
        run("--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "2",
            plugins=[WrapsTheStepItself()], steps=6)  # fmt: skip
    build = train_gpt._build_optimizer

    def wrapped_before(args, model):
        optimizer = build(args, model)
        wrapper = fake_optimizer_graph.OptimizerCudaGraphWrapper
        optimizer.step = wrapper(optimizer.step, cuda_graph_warmup_steps=2)
        return optimizer

    monkeypatch.setattr(train_gpt, "_build_optimizer", wrapped_before)
    with pytest.raises(CudaGraphConfigError, match="already megatron-core's Optimizer") as info:
        run("--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "2", steps=6)
    assert "drop the host's own `optimizer.step = OptimizerCudaGraphWrapper(...)`" in str(
        info.value
    )
    wrapper = fake_optimizer_graph.OptimizerCudaGraphWrapper
    wrapper.cuda_graph, wrapper.curr_iteration, wrapper.result = None, 0, None


class ReloadsTheOptimizerAt(KeepsTheOptimizer):
    """A host that reloads its optimizer at the start of ``step`` (a checkpoint read back,
    or megatron-core's offload API, as an RL trainer's phases do) without saying so."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    @hookimpl
    def mcgraph_train_step_start(self, step):
        if step != self.step:
            return
        import copy

        import torch

        optimizer = self.optimizer
        if self.how == "load_state_dict":
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        else:
            optimizer.offload_to_cpu()
            optimizer.restore_from_cpu()
            for state in optimizer.optimizer.state.values():  # (on a GPU: state[k] = v.cuda())
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor):
                        state[key] = value.clone()


@pytest.mark.parametrize("how", ["load_state_dict", "offload_api"])
def test_optimizer_state_moved_without_buckets_frees_the_graph_instead_of_replaying(
    graphs, capturable, caplog, how
):
    """(review of 2026-12-04: without buckets nothing checked the optimizer's state; the next
    replay wrote into the freed memory, which the fake graph reports as an illegal memory
    access, silent corruption on a GPU.) The move is noticed before the replay: the graph is
    freed, said once, and the run goes on eagerly."""
    caplog.set_level(logging.WARNING, "cudagraph_plugin")
    summary, rec = run(
        "--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "1",
        plugins=[ReloadsTheOptimizerAt(4, how)], steps=8,
    )  # fmt: skip
    assert summary["steps"] == 8
    [event] = rec.report.invalidations
    assert event["step"] == 4 and event["graphs_freed"] == 1
    assert (
        "memory the optimizer graph reads moved since its capture: optimizer state"
        in (event["reason"])
    )
    assert rec.report.replay_steps and max(rec.report.replay_steps) < 4


class ChangesClipGradAt(KeepsTheOptimizer):
    """Writes ``OptimizerConfig.<key>`` = ``value`` at ``step`` (and ``first`` at step 1, before
    the capture, where given)."""

    def __init__(self, step: int, key: str = "clip_grad", value=0.5, first=None) -> None:
        self.step, self.key, self.value, self.first = step, key, value, first

    @hookimpl
    def mcgraph_train_step_start(self, step):
        config = compat.optimizer_config(self.optimizer)
        if step == 1 and self.first is not None:
            setattr(config, self.key, self.first)
        if step == self.step:
            setattr(config, self.key, self.value)


def test_a_clip_grad_changed_after_the_capture_is_refused_before_the_replay(graphs, capturable):
    """megatron-core reads ``clip_grad`` in Python inside the step it captures (its branch and
    its factor): the captured step keeps the capture's value (review of 2026-12-04: a change
    mid-run was silently ignored)."""
    from cudagraph_plugin.runtime.optimizer_sync import HyperparameterChangedError

    with pytest.raises(HyperparameterChangedError) as raised:
        run("--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "1",
            plugins=[ChangesClipGradAt(4)], steps=8)  # fmt: skip
    message = str(raised.value)
    assert "OptimizerConfig.clip_grad is now float 0.5, float 1.0 at capture" in message
    assert "keep OptimizerConfig.clip_grad fixed for the whole run" in message


@pytest.mark.parametrize(
    "first, later, refused",
    [
        (math.inf, 10.0, True),  # a threshold set mid-run: the captured step never compares
        (math.inf, math.inf, False),  # rewritten unchanged
        (math.nan, math.nan, False),  # NaN is not equal to itself, but the same setting
    ],
)
def test_a_grad_norm_skip_threshold_changed_after_the_capture_is_refused(
    graphs, capturable, first, later, refused
):
    """megatron-core 0.19 compares the norm with ``grad_norm_skip_threshold`` in Python inside
    the captured step, skipping the comparison at its default inf: a finite threshold set after
    the capture would never skip an update (review of 2026-12-04: it was not compared). On
    0.16.1 the host sets the attribute itself, as 0.19's dataclass has it."""
    from cudagraph_plugin.runtime.optimizer_sync import HyperparameterChangedError

    plugin = ChangesClipGradAt(4, "grad_norm_skip_threshold", later, first=first)
    args = ("--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "1")
    if not refused:
        summary, rec = run(*args, plugins=[plugin], steps=8)
        assert summary["steps"] == 8 and not rec.report.invalidations
        assert max(rec.report.replay_steps) > 4  # replayed after the rewrite
        return
    with pytest.raises(HyperparameterChangedError) as raised:
        run(*args, plugins=[plugin], steps=8)
    assert (
        "OptimizerConfig.grad_norm_skip_threshold is now float 10.0, float inf at capture"
        in str(raised.value)
    )


def test_a_wrapper_left_by_an_earlier_run_does_not_free_this_runs_graph(graphs, capturable):
    """megatron-core's ``OptimizerCudaGraphWrapper.__del__`` frees the class-level graph,
    whichever instance captured it. A wrapper of an earlier run left in a reference cycle
    (a host's own, refused; ``optimizer.step = wrapper(optimizer.step)`` is one) freed the
    running graph when the collector reached it in the middle of a later run: the steps
    went on eagerly without a word (found by a random test order on 2026-12-05)."""
    import gc

    class Host:
        pass

    stale = Host()
    stale.step = fake_optimizer_graph.OptimizerCudaGraphWrapper(lambda: None)
    stale.me = stale  # (a cycle: only the collector frees it)
    del stale
    seen = {}

    class CollectsAfterTheCapture:
        @hookimpl
        def mcgraph_train_step_end(self, step, metrics):
            if step == 4:
                gc.collect()
                seen["live"] = compat.optimizer_graph_captured()

    enabled = gc.isenabled()
    gc.disable()  # (the collector runs where the test says, not at random)
    try:
        _, rec = run(*OPTIM, "--cuda-graph-warmup-steps", "2", plugins=[CollectsAfterTheCapture()])
    finally:
        if enabled:
            gc.enable()
    assert seen == {"live": True}
    assert rec.report.replays["optimizer"] == 5  # steps 3-7, all on the graph
