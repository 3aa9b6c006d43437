"""Building DistributedDataParallel for graphs, and its forward pre-hooks."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any


class DDPBuildContext:
    """The stream DDP must be built on while graphs are on, and a record of what was built.

    DDP keeps the ``AccumulateGrad`` node of every parameter (its gradient hooks hang on
    them); autograd runs each node on the stream that was current when the node was made.
    Built on the legacy default stream, those nodes make a capture's backward pass wait on
    that stream, and CUDA refuses ("operation would make the legacy stream depend on a
    capturing blocking stream", cudaErrorStreamCaptureImplicit, seen on an H200 for TE
    graphs with megatron-core 0.16.1 in every fresh process). So, as Megatron-LM's loop
    does: full-iteration graphs on 0.18+ build DDP on the shared capture stream, TE graphs
    (every generation) on a dedicated side stream; 0.16 full-iteration graphs need no
    stream (its wrapper captures on a fresh stream of its own; seen working on the H200).

    While entered it records every module that registers a submodule (DDP registers the
    model it wraps in its constructor), so :meth:`missing` can tell which DDP chunks were
    built elsewhere.
    """

    def __init__(self, full_iteration: bool) -> None:
        self.full_iteration = full_iteration
        self.entered = False
        self._built: weakref.WeakSet[Any] = weakref.WeakSet()

    @property
    def needs_stream(self) -> bool:
        return not self.full_iteration or _has_shared_capture_stream()

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        import torch
        from torch.nn.modules import module as torch_module

        self.entered = True
        handle = torch_module.register_module_module_registration_hook(
            lambda parent, name, child: self._built.add(parent)
        )
        try:
            if not self.needs_stream:
                yield
                return
            if self.full_iteration:
                from megatron.core.full_cuda_graph import get_shared_capture_stream

                stream = get_shared_capture_stream()
            else:
                stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                yield
            torch.cuda.current_stream().wait_stream(stream)
        finally:
            handle.remove()

    def missing(self, model: list[Any]) -> list[int]:
        """Indices of the DDP chunks of ``model`` not built inside :meth:`enter`."""
        if not self.needs_stream:
            return []
        from megatron.core.distributed.data_parallel_base import _BaseDataParallel

        return [
            index
            for index, chunk in enumerate(model)
            if isinstance(chunk, _BaseDataParallel) and chunk not in self._built
        ]


def _has_shared_capture_stream() -> bool:
    from megatron.core import full_cuda_graph

    return hasattr(full_cuda_graph, "get_shared_capture_stream")


def uses_forward_pre_hooks(model: list[Any]) -> bool:
    """The DDP chunks overlap the param all-gather with forward (distributed optimizer +
    overlap_param_gather), so their forward pre-hooks must be toggled around a capture."""
    return any(getattr(chunk, "use_forward_hook", False) for chunk in model)


def forward_pre_hooks_enabled(model: list[Any]) -> bool:
    return any(len(getattr(chunk, "remove_forward_pre_hook_handles", ())) for chunk in model)


def param_gather_groups(model: list[Any]) -> list[Any]:
    """The DDP bucket groups whose parameter all-gather the forward pre-hooks run (the chunks
    with the distributed optimizer and ``overlap_param_gather``)."""
    return [
        group
        for chunk in model
        if getattr(chunk, "use_forward_hook", False)
        for group in (
            *getattr(chunk, "bucket_groups", ()),
            *getattr(chunk, "expert_parallel_bucket_groups", ()),
        )
    ]


def mark_param_gather_due(groups: list[Any]) -> None:
    """What ``finish_grad_sync`` leaves at the end of an eager training iteration: each
    group's all-gather due again at the next forward. A replayed iteration runs no Python,
    so after one the flags still say "gathered": an eager forward-only call next (an
    evaluation before its graph is captured, an RL rollout) would then run on the shards
    gathered before the last optimizer step. An all-gather still in flight (dispatched
    early by a forward-only call that never reached its modules) is waited for first:
    megatron-core asserts that none is when it dispatches the next."""
    for group in groups:
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
        group.param_gather_dispatched = False


def rearm_param_gather(model: list[Any]) -> int:
    """Before a capture: make the next forward all-gather the parameters again, on the DDP
    chunks whose forward pre-hooks are on; returns how many bucket groups had to be re-armed.

    A pre-hook all-gathers a bucket only while its ``param_gather_dispatched`` is false, and
    only ``finish_grad_sync`` (the end of a training iteration) clears it. A forward-only
    call (an evaluation, an RL rollout) or ``disable_forward_pre_hook(param_sync=True)``
    leaves it set: the next forward runs on the parameters already gathered, which is right
    eagerly, but a capture then records no all-gather, and every replay runs on stale
    shards of the other ranks' parameters. An all-gather still in flight is waited for."""
    done = [
        group
        for chunk in model
        if forward_pre_hooks_enabled([chunk])
        for group in param_gather_groups([chunk])
        if group.param_gather_dispatched
    ]
    mark_param_gather_due(done)
    return len(done)
