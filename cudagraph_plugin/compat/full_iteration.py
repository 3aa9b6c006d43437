"""megatron-core's full-iteration graphs (``FullCudaGraphWrapper``): making the wrapper,
reading its class-level state, and freeing it (0.16 has no API for that)."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

STAGES = ("training", "validation")


def single_mempool(model_config: Any) -> bool:
    """Whether full-iteration (and optimizer) graphs share one memory pool: the model
    config's ``cuda_graph_use_single_mempool`` (0.18+), as Megatron-LM passes it."""
    return bool(getattr(model_config, "cuda_graph_use_single_mempool", False))


def make_full_iteration_wrapper(
    forward_backward_func: Any, warmup_steps: int, use_single_mempool: bool
) -> Any:
    """megatron-core's ``FullCudaGraphWrapper`` around ``forward_backward_func``.

    ``use_single_mempool`` is passed where the wrapper takes it (0.18+).
    """
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    if "use_single_mempool" in inspect.signature(FullCudaGraphWrapper.__init__).parameters:
        return FullCudaGraphWrapper(
            forward_backward_func,
            cuda_graph_warmup_steps=warmup_steps,
            use_single_mempool=use_single_mempool,
        )
    return FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=warmup_steps)


def order_input_copy_after_replay(wrapper: Any) -> None:
    """Make the wrapper's input-copy stream wait for the work already queued (the previous
    replay, which reads the static buffers the copy overwrites). megatron-core 0.16 copies
    without waiting; where its loader waits itself (0.17 fixed it upstream:
    :func:`loader_orders_its_copy`) this does nothing, since it runs on every step."""
    if loader_orders_its_copy():
        return
    import torch

    wrapper.static_loader.stream.wait_stream(torch.cuda.current_stream())


@functools.cache
def loader_orders_its_copy() -> bool:
    """Whether megatron-core's ``StaticBufferLoader`` makes its copy stream wait for the
    current stream before it copies into the static buffers (a feature, read from its code;
    ``False`` when the code cannot be read, which costs one more wait per step, never a
    race)."""
    from megatron.core.full_cuda_graph import StaticBufferLoader

    try:
        return copy_waits_for_current_stream(inspect.getsource(StaticBufferLoader.__call__))
    except (OSError, TypeError):
        return False


def copy_waits_for_current_stream(loader_source: str) -> bool:
    """``StaticBufferLoader.__call__``'s code orders its copy after the current stream."""
    return "self.stream.wait_stream(torch.cuda.current_stream())" in loader_source


def _wrapper_class() -> Any:
    # The two readers below run on every forward/backward call: the module from
    # sys.modules (a dictionary lookup) rather than an import statement each time. The class
    # is read each time, never cached: tests put another class in the module.
    module = sys.modules.get("megatron.core.full_cuda_graph")
    if module is None:
        from megatron.core import full_cuda_graph as module
    return module.FullCudaGraphWrapper


def is_full_iteration_wrapper(func: Any) -> bool:
    """``func`` is megatron-core's ``FullCudaGraphWrapper`` (a host that wrapped its
    forward/backward function itself, as Megatron-LM's ``train()`` does)."""
    return isinstance(func, _wrapper_class())


def full_iteration_graphs() -> dict[str, Any]:
    """megatron-core's graphs per stage, the wrapper class's own dict (``None`` where none is
    held): whoever keeps it sees captures and frees as they happen."""
    return _wrapper_class().cuda_graph


def full_iteration_captured(stage: str) -> bool:
    return _wrapper_class().cuda_graph[stage] is not None


def full_iteration_calls(stage: str) -> int:
    """How many times the wrapper has run ``stage`` (its capture counter)."""
    return _wrapper_class().curr_iteration[stage]


def full_iteration_state_dirty() -> bool:
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    return any(
        FullCudaGraphWrapper.cuda_graph[s] is not None
        or FullCudaGraphWrapper.curr_iteration[s] != 0
        or StaticBufferLoader.static_buffers[s]
        for s in STAGES
    )


def free_full_iteration_graph(stage: str) -> int:
    """Free ``stage``'s graph (``CUDAGraph.reset()``) and forget it; returns 1 if one was
    held. megatron-core keeps the graph on the class; 0.18+'s ``reset_cuda_graph()`` does the
    same without the explicit ``reset()`` (freeing waits for the garbage collector)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    graph = FullCudaGraphWrapper.cuda_graph[stage]
    FullCudaGraphWrapper.cuda_graph[stage] = None
    if graph is None:
        return 0
    graph.reset()
    return 1


def reset_full_iteration_counters() -> None:
    """Reset the class-level results and step counters of both stages (0.16 has no API),
    so the next run captures after its own warm-up."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    for stage in STAGES:
        FullCudaGraphWrapper.result[stage] = None
        FullCudaGraphWrapper.curr_iteration[stage] = 0


def static_buffer(stage: str, index: int) -> Any:
    """The static input buffer ``FullCudaGraphWrapper`` copies micro-batch ``index`` of
    ``stage`` into (one per index, made by the first call that drew that index, shared by
    the model chunks), or ``None`` while none is made."""
    from megatron.core.full_cuda_graph import StaticBufferLoader

    buffers = StaticBufferLoader.static_buffers[stage]
    return buffers[index] if index < len(buffers) else None


def loader_input(batch: Any) -> Any:
    """What ``StaticBufferLoader`` copies of a micro-batch: the dict itself, or the first
    item of a tuple that starts with one."""
    if isinstance(batch, tuple) and batch and isinstance(batch[0], dict):
        return batch[0]
    return batch


def clear_static_buffers() -> None:
    """Drop the class-level static input buffers of both stages (no version resets them)."""
    from megatron.core.full_cuda_graph import StaticBufferLoader

    for stage in STAGES:
        StaticBufferLoader.static_buffers[stage].clear()


def forget_shared_graph_pool() -> None:
    """0.18+ caches one process-wide graph pool handle; once its graphs are gone the pool
    is released, and capturing into the stale handle trips the caching allocator
    ("use_count > 0 INTERNAL ASSERT FAILED", seen on an H200). The next capture asks for a
    fresh one. 0.16 has no shared pool."""
    from megatron.core import full_cuda_graph

    if hasattr(full_cuda_graph, "_shared_graph_pool"):
        full_cuda_graph._shared_graph_pool = None


def free_full_iteration_graphs() -> int:
    """Every full-iteration resource at once (state an earlier run left behind)."""
    freed = sum(free_full_iteration_graph(stage) for stage in STAGES)
    reset_full_iteration_counters()
    clear_static_buffers()
    forget_shared_graph_pool()
    return freed
