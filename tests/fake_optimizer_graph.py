"""A stand-in for megatron-core 0.19's ``megatron.core.optimizer.optimizer_cuda_graph``.

megatron-core 0.16.1 (the CPU suite's version) has no optimizer graph; 0.17.0 added
``OptimizerCudaGraphWrapper``. :class:`OptimizerCudaGraphWrapper` here follows 0.19.2's
class (``megatron/core/optimizer/optimizer_cuda_graph.py``) line for line where it matters:
the same constructor signature, class-level ``curr_iteration``/``cuda_graph``/``result``,
capture on the ``cuda_graph_warmup_steps``-th call between two barriers, replay afterwards,
and a ``__del__`` that drops the class-level graph.

One difference, on purpose: the graph is a :class:`StepGraph`, whose replay runs the step
again, not ``fakes.py``'s recording graph. On the CPU megatron-core's optimizer step cannot
be captured at all (torch's CPU Adam reads its step counter on the host, megatron-core
0.16's gradient clipping calls ``.item()``; the recording fake rightly refuses both), so
these tests check the plugin's handling of the optimizer graph (capture step, hooks,
report, cleanup, the host's ``optimizer.step`` restored), not the capturability of the step,
which the plugin checks itself (``compat.grad_norm``: device-side kernels where megatron-core
would read the norm on the host, a refusal where a host read would remain).

:func:`install` makes it importable under the real module name and tells ``compat`` that
the installed megatron-core has it.
"""

from __future__ import annotations

import sys
import types
from typing import Any, ClassVar

import torch

MODULE = "megatron.core.optimizer.optimizer_cuda_graph"


class StepGraph:
    """Mirrors the part of ``torch.cuda.CUDAGraph`` the wrapper and the plugin use
    (``replay``, ``reset``); a replay runs the captured step function again.

    A real replay works on the captured addresses: if what the step reads (the main
    parameters, their ``main_grad``, the optimizer's state) was given new memory since
    the capture (megatron-core's ``restore_from_cpu`` does ``state[k] = v.cuda()``), it
    reads freed memory. The fake refuses, as :class:`fakes.FakeCUDAGraph` does."""

    made: ClassVar[list[StepGraph]] = []

    def __init__(self, step: Any) -> None:
        self.step = step
        self.replays = 0
        self.resets = 0
        self.addresses = step_addresses(step)
        StepGraph.made.append(self)

    def replay(self) -> Any:
        """Run the step again; its result stands for the graph's static outputs."""
        assert self.step is not None, "replay of a graph that was reset"
        moved = sorted(
            where
            for where, now in step_addresses(self.step).items()
            if self.addresses.get(where) != now
        )
        if moved:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (fake optimizer "
                f"graph: {moved[0]} moved since the capture)"
            )
        self.replays += 1
        return self.step()

    def reset(self) -> None:
        self.resets += 1
        self.step = None


def step_addresses(step: Any) -> dict[str, int]:
    """``data_ptr()`` of what an optimizer step bound to a megatron-core optimizer reads,
    by where it is found (the torch optimizers inside, their parameters, each parameter's
    ``main_grad`` and state tensors)."""
    owner = getattr(step, "__self__", None)
    inner = getattr(owner, "chained_optimizers", None) or [owner]
    found = {}
    for i, megatron_optimizer in enumerate(inner):
        torch_optimizer = getattr(megatron_optimizer, "optimizer", None)
        if torch_optimizer is None:
            continue
        for g, group in enumerate(torch_optimizer.param_groups):
            for p, param in enumerate(group["params"]):
                where = f"optimizer {i} group {g} parameter {p}"
                found[where] = param.data_ptr()
                main_grad = getattr(param, "main_grad", None)
                if main_grad is not None:
                    found[f"{where} main_grad"] = main_grad.data_ptr()
                for key, value in torch_optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        found[f"{where} state {key!r}"] = value.data_ptr()
    return found


class OptimizerCudaGraphWrapper:
    """Mirrors megatron-core 0.19.2's ``OptimizerCudaGraphWrapper``."""

    curr_iteration = 0
    cuda_graph: Any = None
    result: Any = None

    def __init__(self, optimizer_step_func, cuda_graph_warmup_steps=1, use_single_mempool=False):
        self.optimizer_step_func = optimizer_step_func
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.use_single_mempool = use_single_mempool

    def __call__(self, *args, **kwargs):
        assert len(args) == 0, "optimizer.step() does not accept positional args"
        assert len(kwargs) == 0, "optimizer.step() does not accept keyword args"
        if self.curr_iter() == self.cuda_graph_warmup_steps:
            torch.distributed.barrier()
            assert OptimizerCudaGraphWrapper.cuda_graph is None
            OptimizerCudaGraphWrapper.cuda_graph = StepGraph(self.optimizer_step_func)
            torch.cuda.synchronize()
            # the real capture records the step without running it; its result tensors are
            # the graph's static outputs (here: the one computed by the first replay below)
            OptimizerCudaGraphWrapper.result = None
            torch.cuda.synchronize()
            torch.distributed.barrier()
        if OptimizerCudaGraphWrapper.cuda_graph is None:
            OptimizerCudaGraphWrapper.result = self.optimizer_step_func()
        else:
            OptimizerCudaGraphWrapper.result = OptimizerCudaGraphWrapper.cuda_graph.replay()
        OptimizerCudaGraphWrapper.curr_iteration += 1
        return OptimizerCudaGraphWrapper.result

    def curr_iter(self):
        return OptimizerCudaGraphWrapper.curr_iteration

    def next_iter(self):
        OptimizerCudaGraphWrapper.curr_iteration += 1

    def __del__(self):
        if OptimizerCudaGraphWrapper.cuda_graph is not None:
            del OptimizerCudaGraphWrapper.cuda_graph
            OptimizerCudaGraphWrapper.cuda_graph = None
        if OptimizerCudaGraphWrapper.result is not None:
            OptimizerCudaGraphWrapper.result = None


def install(monkeypatch: Any) -> type[OptimizerCudaGraphWrapper]:
    """Make the wrapper importable as megatron-core's and report the feature as present."""
    from cudagraph_plugin.config import environment

    module = types.ModuleType(MODULE)
    module.OptimizerCudaGraphWrapper = OptimizerCudaGraphWrapper
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setattr(environment, "has_optimizer_graph", lambda: True)
    monkeypatch.setattr(OptimizerCudaGraphWrapper, "curr_iteration", 0)
    monkeypatch.setattr(OptimizerCudaGraphWrapper, "cuda_graph", None)
    monkeypatch.setattr(OptimizerCudaGraphWrapper, "result", None)
    monkeypatch.setattr(StepGraph, "made", [])
    return OptimizerCudaGraphWrapper


def capturable_build(build: Any, built: list[Any] | None = None) -> Any:
    """``build`` (a host's ``_build_optimizer(args, model)``) as megatron-core 0.17+ builds
    for ``optimizer_cuda_graph``: 0.16.1's OptimizerConfig has no such field, so the
    optimizer is built without it and then marked; each optimizer built is appended to
    ``built`` when given."""

    def without_flag(args: Any, model: Any) -> Any:
        flag, args.optimizer_cuda_graph = args.optimizer_cuda_graph, False
        try:
            optimizer = build(args, model)
        finally:
            args.optimizer_cuda_graph = flag
        optimizer.config.optimizer_cuda_graph = flag
        if built is not None:
            built.append(optimizer)
        return optimizer

    return without_flag
