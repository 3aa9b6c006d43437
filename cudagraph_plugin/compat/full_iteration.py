"""megatron-core's full-iteration graphs (``FullCudaGraphWrapper``): making the wrapper,
reading its class-level state, and freeing it (0.16 has no API for that)."""

from __future__ import annotations

import inspect
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
    without waiting (0.17 fixed it upstream); on later versions this is one more wait."""
    import torch

    wrapper.static_loader.stream.wait_stream(torch.cuda.current_stream())


def full_iteration_captured(stage: str) -> bool:
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper.cuda_graph[stage] is not None


def full_iteration_calls(stage: str) -> int:
    """How many times the wrapper has run ``stage`` (its capture counter)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper.curr_iteration[stage]


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
