"""The one place that knows megatron-core and Transformer Engine version differences.

| concept                  | megatron-core 0.16.x              | 0.18+ / 0.19.x                   |
|--------------------------|-----------------------------------|----------------------------------|
| full-iteration config    | impl="local", scope=[full_iter.]  | impl="full_iteration", modules=[]|
| TE scopes config         | cuda_graph_scope (CudaGraphScope) | cuda_graph_modules (...Module)   |
| free full-iteration graph| no API: reset class state by hand | reset_cuda_graph()               |
| TE capture done          | graphs_created()                  | capture_finished()               |
| DDP build stream (TE)    | a side stream                     | a side stream                    |
| DDP build stream (full)  | any                               | get_shared_capture_stream()      |
| FullCudaGraphWrapper     | (fn, cuda_graph_warmup_steps)     | + use_single_mempool             |
| TECudaGraphHelper        | (model, config, seq, mbs, opts)   | + pg_collection                  |

Differences are detected by feature (a field, an attribute, a parameter), never by reading
version numbers: megatron-core on ``PYTHONPATH`` has no package metadata, and release
candidates of a new generation sort before its first release. Version numbers are read
only to be shown (the report, ``check``).

Everything else in the package talks to megatron-core through the functions here. The
module imports neither torch nor megatron at import time (``settings`` and the ``check``
command use its pure part); the runtime functions import lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from packaging.version import Version

logger = logging.getLogger(__name__)

# Field names under which a host config may hold the scope (0.16: scope; 0.18+: modules).
SCOPE_FIELD_NAMES = ("cuda_graph_scope", "cuda_graph_modules")
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
    """The installed megatron-core version, for display: from the package metadata, else
    (megatron on ``PYTHONPATH``) from ``megatron.core.package_info``."""
    version = _dist_version("megatron-core", "megatron_core")
    if version is not None:
        return version
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise RuntimeError("megatron-core is not installed: pip install megatron-core") from exc
    return Version(package_info.__version__)


OPTIMIZER_GRAPH_FIRST_RELEASE = Version("0.17.0")
"""The first megatron-core release with ``OptimizerCudaGraphWrapper`` (checked on PyPI's
0.16.1, 0.17.0, 0.18.x and 0.19.x wheels)."""


def has_optimizer_graph() -> bool | None:
    """Whether the installed megatron-core has ``OptimizerCudaGraphWrapper`` (None: no
    megatron-core found). Looks for the module file, without importing megatron-core."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return any(
        (Path(location) / "core" / "optimizer" / "optimizer_cuda_graph.py").is_file()
        for location in spec.submodule_search_locations
    )


def te_version() -> Version | None:
    """The installed Transformer Engine version, or None (read from metadata, no import)."""
    return _dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch")


@functools.cache
def new_generation() -> bool:
    """megatron-core's 0.18+ configuration spelling: ``TransformerConfig`` has
    ``cuda_graph_modules`` (and the ``full_iteration`` impl)."""
    from megatron.core.transformer import TransformerConfig

    return "cuda_graph_modules" in {field.name for field in dataclasses.fields(TransformerConfig)}


def versions() -> dict[str, str | None]:
    """torch / megatron-core / Transformer Engine versions for reports (never raises)."""

    def shown(read: Callable[[], Any]) -> str | None:
        try:
            value = read()
        except Exception:  # a report must not fail over a version it cannot read
            return None
        return None if value is None else str(value)

    return {
        "torch": shown(lambda: _dist_version("torch") or __import__("torch").__version__),
        "megatron-core": shown(mcore_version),
        "transformer-engine": shown(te_version),
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


def distributed_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank: one all-reduce over the default
    group, so that a decision that changes what a rank executes is the same everywhere."""
    import torch
    import torch.distributed as dist

    if distributed_world()[1] == 1:
        return flag
    on_gpu = "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


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


# -- full-iteration graphs --------------------------------------------------------------------

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


# -- optimizer graphs (megatron-core 0.17+) ----------------------------------------------------


def make_optimizer_graph_wrapper(step: Any, warmup_steps: int, use_single_mempool: bool) -> Any:
    """megatron-core's ``OptimizerCudaGraphWrapper`` around a bound ``optimizer.step``;
    ``use_single_mempool`` where it takes it (0.18+)."""
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper

    if "use_single_mempool" in inspect.signature(OptimizerCudaGraphWrapper.__init__).parameters:
        return OptimizerCudaGraphWrapper(
            step, cuda_graph_warmup_steps=warmup_steps, use_single_mempool=use_single_mempool
        )
    return OptimizerCudaGraphWrapper(step, cuda_graph_warmup_steps=warmup_steps)


def _optimizer_graph_class() -> Any:
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper

    return OptimizerCudaGraphWrapper


def optimizer_graph_captured() -> bool:
    return _optimizer_graph_class().cuda_graph is not None


def optimizer_graph_calls() -> int:
    return _optimizer_graph_class().curr_iteration


def optimizer_graph_state_dirty() -> bool:
    cls = _optimizer_graph_class()
    return cls.cuda_graph is not None or cls.curr_iteration != 0 or cls.result is not None


def free_optimizer_graph() -> int:
    """Free the class-level optimizer graph (``reset()``) and forget it; 1 if one was held."""
    cls = _optimizer_graph_class()
    graph, cls.cuda_graph = cls.cuda_graph, None
    if graph is None:
        return 0
    graph.reset()
    return 1


def reset_optimizer_graph_counters() -> None:
    cls = _optimizer_graph_class()
    cls.result = None
    cls.curr_iteration = 0


def grad_norm_on_device() -> bool | None:
    """Whether megatron-core computes the gradient norm with fused multi-tensor kernels
    (Transformer Engine's or Apex's), on the device. Without either it falls back to
    ``megatron.core.utils.local_multi_tensor_l2_norm``, which reads the norm on the host
    (``float(...)``): an optimizer step that does so cannot be captured (seen on an H200,
    megatron-core 0.19.2 with Transformer Engine 2.11 and no Apex). None: not known."""
    try:
        from megatron.core.optimizer import clip_grads
    except ImportError:
        return None
    implementation = getattr(clip_grads, "l2_norm_impl", None)
    if implementation is None:
        return None
    return getattr(implementation, "__module__", None) != "megatron.core.utils"


def optimizer_is_capturable(optimizer: Any) -> bool | None:
    """``OptimizerConfig.optimizer_cuda_graph`` of the built optimizer (it makes megatron-core
    build a capturable Adam); None when the optimizer has no megatron-core config."""
    config = getattr(optimizer, "config", None)
    if config is None:
        chained = getattr(optimizer, "chained_optimizers", None) or []
        config = getattr(chained[0], "config", None) if chained else None
    if config is None:
        return None
    return bool(getattr(config, "optimizer_cuda_graph", False))


# -- Transformer Engine per-layer graphs -------------------------------------------------------


def make_te_helper(
    model: list[Any], model_config: Any, seq_length: int, micro_batch_size: int, optimizers: list
) -> Any:
    """megatron-core's ``TECudaGraphHelper``. Where it takes ``pg_collection`` (0.19) it gets
    the model's own process groups, as Megatron-Bridge passes them; a model without them
    leaves the helper's default (the global parallel state)."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    kwargs: dict[str, Any] = {}
    if "pg_collection" in inspect.signature(TECudaGraphHelper.__init__).parameters:
        pg_collection = _model_pg_collection(model)
        if pg_collection is not None:
            kwargs["pg_collection"] = pg_collection
    return TECudaGraphHelper(
        model=model,
        config=model_config,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        optimizers=optimizers,
        **kwargs,
    )


def _model_pg_collection(model: list[Any]) -> Any:
    module = model[0] if model else None
    # DDP and Float16Module wrap the model in ``.module``.
    while module is not None and getattr(module, "pg_collection", None) is None:
        module = getattr(module, "module", None)
    return None if module is None else module.pg_collection


def te_capture_done(helper: Any) -> bool:
    """``create_cudagraphs()`` has run (0.19 separates this from "graphs exist")."""
    if hasattr(helper, "capture_finished"):
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
