"""The one place that knows megatron-core and Transformer Engine version differences.

| concept                  | megatron-core 0.16.x              | 0.18+ / 0.19.x                   |
|--------------------------|-----------------------------------|----------------------------------|
| full-iteration config    | impl="local", scope=[full_iter.]  | impl="full_iteration", modules=[]|
| TE scopes config         | cuda_graph_scope (CudaGraphScope) | cuda_graph_modules (...Module)   |
| free full-iteration graph| no API: reset class state by hand | reset_cuda_graph()               |
| TE capture done          | graphs_created()                  | capture_finished()               |
| DDP build stream         | any                               | get_shared_capture_stream()      |
| FullCudaGraphWrapper     | (fn, cuda_graph_warmup_steps)     | + use_single_mempool             |

Everything else in the package talks to megatron-core through the functions here. The
module imports neither torch nor megatron at import time (``settings`` and the ``check``
command use its pure part); the runtime functions import lazily.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
from typing import Any

from packaging.version import Version

logger = logging.getLogger(__name__)

# Field names under which a host config may hold the scope (0.16: scope; 0.18+: modules).
SCOPE_FIELD_NAMES = ("cuda_graph_scope", "cuda_graph_modules")
_NEW_GENERATION = Version("0.18.0")
# Transformer Engine releases that matter to the constraints.
TE_DELAY_WGRAD_WITH_ATTN = Version("2.12.0")
TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS = Version("2.10.0")


# -- pure part: names and versions ------------------------------------------------------------


def canonical_impl_and_scope(impl: Any, scope: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    """Translate either generation's spelling into the plugin's (0.16's) vocabulary.

    0.18+ spells full-iteration graphs ``impl="full_iteration"`` with no modules; both
    generations spell "whole layer" as the scope ``"full"`` (an empty list after their
    ``__post_init__``).
    """
    if scope == ("full",):
        scope = ()
    if impl == "full_iteration":
        return "local", ("full_iteration", *scope)
    return impl, scope


def _dist_version(*names: str) -> Version | None:
    for name in names:
        try:
            return Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def mcore_version() -> Version:
    version = _dist_version("megatron-core", "megatron_core")
    if version is None:
        raise RuntimeError("megatron-core is not installed: pip install megatron-core")
    return version


def te_version() -> Version | None:
    """The installed Transformer Engine version, or None (read from metadata, no import)."""
    return _dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch")


def new_generation() -> bool:
    """megatron-core 0.18 or later (the ``full_iteration`` impl / ``cuda_graph_modules``)."""
    return mcore_version() >= _NEW_GENERATION


def versions() -> dict[str, str | None]:
    """torch / megatron-core / Transformer Engine versions for reports."""
    te = te_version()
    return {
        "torch": str(_dist_version("torch")),
        "megatron-core": str(mcore_version()),
        "transformer-engine": str(te) if te else None,
    }


def model_config_kwargs(impl: str, scope: tuple[str, ...], warmup_steps: int) -> dict[str, Any]:
    """``TransformerConfig`` fields for these settings, spelled for the installed MCore."""
    kwargs: dict[str, Any] = {"cuda_graph_impl": impl}
    if impl == "none":
        return kwargs
    kwargs["cuda_graph_warmup_steps"] = warmup_steps
    kwargs["use_te_rng_tracker"] = True
    if new_generation():
        if "full_iteration" in scope:
            kwargs["cuda_graph_impl"] = "full_iteration"
            kwargs["cuda_graph_modules"] = []
        else:
            kwargs["cuda_graph_modules"] = list(scope)
    else:
        kwargs["cuda_graph_scope"] = list(scope)
    return kwargs


# -- runtime part: devices, RNG, DDP ----------------------------------------------------------


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def clear_cublas_workspaces() -> None:
    """Release cuBLAS workspaces. A capture on its own stream allocates a workspace for that
    stream (tens of MiB, inside the graph's pool) that outlives the graph; torch's own
    CUDA-graph trees and test utilities clear them the same way."""
    import torch

    torch._C._cuda_clearCublasWorkspaces()


def nccl_initialized() -> bool:
    """True once torch.distributed runs an NCCL process group (NCCL has read its env)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "nccl" in str(dist.get_backend()).lower()


def rng_tracker_state() -> tuple[bool, str]:
    """(graph-safe, description) of megatron-core's active CUDA RNG tracker.

    Graph-safe means MCore itself accepts it for graphs: TE's tracker, MCore's tracker
    with ``use_cudagraphable_rng``, or the inference tracker (no forking).
    """
    from megatron.core.tensor_parallel import random as mrandom

    # Reading the private module state avoids get_cuda_rng_tracker(), which would create a
    # default (non-graph-safe) tracker as a side effect when none exists.
    if not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return False, "no RNG tracker (model_parallel_cuda_manual_seed was not called)"
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    name = type(tracker).__name__
    if getattr(tracker, "is_inference_rng_tracker", False):
        return True, f"{name} (inference tracker)"
    if _is_te_tracker(tracker):
        return True, f"{name} (Transformer Engine)"
    if getattr(tracker, "use_cudagraphable_rng", False):
        return True, f"{name} (use_cudagraphable_rng=True)"
    return False, f"{name} (use_cudagraphable_rng=False)"


def _is_te_tracker(tracker: Any) -> bool:
    try:
        from megatron.core.extensions.transformer_engine import TECudaRNGStatesTracker
    except ImportError:
        return False
    # Without Transformer Engine the name is bound to a placeholder, not a class.
    return isinstance(TECudaRNGStatesTracker, type) and isinstance(tracker, TECudaRNGStatesTracker)


def te_available() -> bool:
    """Transformer Engine's graph support can be used by megatron-core."""
    from megatron.core.transformer import cuda_graphs

    return bool(cuda_graphs.HAVE_TE_GRAPHS)


def ddp_build_context(full_iteration: bool) -> contextlib.AbstractContextManager[Any] | None:
    """The stream DDP must be built on with megatron-core 0.18+ (graphs on).

    DDP's retained AccumulateGrad nodes remember the stream they were created on; a capture
    that meets one from the legacy default stream fails ("operation would make the legacy
    stream depend on a capturing blocking stream", seen on an H200 with TE graphs). As
    Megatron-LM 0.19 does: full-iteration graphs use the shared capture stream, other
    implementations a dedicated side stream.
    """
    if not new_generation():
        return None
    import torch

    if full_iteration:
        from megatron.core.full_cuda_graph import get_shared_capture_stream

        return _on_stream(torch, get_shared_capture_stream())
    return _on_stream(torch, torch.cuda.Stream())


@contextlib.contextmanager
def _on_stream(torch: Any, stream: Any) -> Any:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def uses_forward_pre_hooks(model: list[Any]) -> bool:
    """The DDP chunks overlap the param all-gather with forward (distributed optimizer +
    overlap_param_gather), so their forward pre-hooks must be toggled around a capture."""
    return any(getattr(chunk, "use_forward_hook", False) for chunk in model)


def forward_pre_hooks_enabled(model: list[Any]) -> bool:
    return any(len(getattr(chunk, "remove_forward_pre_hook_handles", ())) for chunk in model)


# -- full-iteration graphs --------------------------------------------------------------------

STAGES = ("training", "validation")


def make_full_iteration_wrapper(forward_backward_func: Any, warmup_steps: int) -> Any:
    """megatron-core's ``FullCudaGraphWrapper`` around ``forward_backward_func``."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    if full_iteration_state_dirty():
        logger.warning(
            "megatron-core's FullCudaGraphWrapper holds state from an earlier run in this "
            "process (a graph or a non-zero step counter); resetting it so this run captures "
            "after its own %d warm-up step(s)",
            warmup_steps,
        )
        free_full_iteration_graphs(None)
    if new_generation():
        return FullCudaGraphWrapper(
            forward_backward_func, cuda_graph_warmup_steps=warmup_steps, use_single_mempool=True
        )
    return FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=warmup_steps)


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


def free_full_iteration_graphs(wrapper: Any) -> int:
    """Free the training and validation graphs and reset the class-level state.

    megatron-core keeps the graphs, results, step counters and static input buffers on the
    classes; 0.16 has no API to reset them and 0.18+'s ``reset_cuda_graph()`` leaves the
    static buffers behind. Returns the number of graphs freed.
    """
    from megatron.core import full_cuda_graph
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    freed = 0
    for stage in STAGES:
        graph = FullCudaGraphWrapper.cuda_graph[stage]
        if graph is not None:
            graph.reset()
            freed += 1
    if wrapper is not None and new_generation():
        wrapper.reset_cuda_graph()
    else:
        for stage in STAGES:
            FullCudaGraphWrapper.cuda_graph[stage] = None
            FullCudaGraphWrapper.result[stage] = None
            FullCudaGraphWrapper.curr_iteration[stage] = 0
    for stage in STAGES:
        StaticBufferLoader.static_buffers[stage].clear()
    if new_generation():
        # 0.18+ caches one process-wide graph pool handle; once its graphs are gone the pool
        # is released, and capturing into the stale handle trips the caching allocator
        # ("use_count > 0 INTERNAL ASSERT FAILED", seen on an H200). The next capture asks
        # for a fresh one.
        full_cuda_graph._shared_graph_pool = None
    return freed


# -- Transformer Engine per-layer graphs -------------------------------------------------------


def make_te_helper(
    model: list[Any], model_config: Any, seq_length: int, micro_batch_size: int, optimizers: list
) -> Any:
    """megatron-core's ``TECudaGraphHelper`` (0.19 also accepts ``pg_collection``; its
    default, the global parallel state, is what a host without custom groups wants)."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    return TECudaGraphHelper(
        model=model,
        config=model_config,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        optimizers=optimizers,
    )


def te_capture_done(helper: Any) -> bool:
    """``create_cudagraphs()`` has run (0.19 separates this from "graphs exist")."""
    if new_generation():
        return helper.capture_finished()
    return helper.graphs_created()


def te_graph_count(helper: Any) -> int:
    return sum(len(layer.cuda_graphs) for layers in helper.callables_per_chunk for layer in layers)


def te_layer_count(helper: Any) -> int:
    return len(helper.flattened_callables)


def num_microbatches_calculator_ready() -> bool:
    """megatron-core's global micro-batch calculator is set up (``TECudaGraphHelper`` reads
    it while capturing, as Megatron-LM's loop always has it)."""
    from megatron.core import num_microbatches_calculator as calc

    return calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None


def end_stuck_te_capture() -> bool:
    """Clear megatron-core's "capturing" flag if a failed ``create_cudagraphs()`` left it
    set (it is global: every later forward would take the capture path). Returns whether
    it was stuck."""
    import gc as _gc

    from megatron.core.transformer import cuda_graphs

    if not cuda_graphs.is_graph_capturing():
        return False
    cuda_graphs._set_capture_end()
    # _start_capturing may have frozen the garbage collector (FREEZE_GC) before failing.
    _gc.unfreeze()
    return True


def free_te_graphs(helper: Any) -> int:
    """Delete the helper's graphs if it created any; returns how many were held."""
    if not helper.graphs_created():
        return 0
    count = te_graph_count(helper)
    helper.delete_cuda_graphs()
    return count
