"""megatron-core (and torch.distributed) access for the bucketed full-iteration graphs.

Everything ``cudagraph_plugin.runtime.buckets`` needs from megatron-core goes through here, so that
it can move into ``compat/`` as it is. Feature detection, never version numbers:

* static inputs: ``FullCudaGraphWrapper.data_read`` and its ``StaticBufferLoader`` (both);
* capture stream: ``get_shared_capture_stream()`` (0.18+; DDP is built on it), none in 0.16
  (the caller keeps one of its own);
* generator states to register in each graph: ``get_all_rng_states()`` (both);
* DDP's contiguous buffers: ``buffers`` and ``expert_parallel_buffers``, each with
  ``param_data`` (distributed optimizer only) and ``grad_data`` (both);
* scratch buffers: ``parallel_state._GLOBAL_MEMORY_BUFFER.buffer`` (both);
* a chunk's learned position embeddings: ``position_embedding_type`` and
  ``max_sequence_length`` under its wrappers (``megatron.core.utils.get_attr_wrapped_model``);
* torch's ``torch.cuda.graph(check_input_liveness=...)`` (torch 2.13+).

Lazy imports only: importing this module imports neither torch nor megatron-core.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cudagraph_plugin import compat

# each step's bucket is agreed across ranks with the same all-reduce as any_rank's
from cudagraph_plugin.compat.device import max_across_ranks as max_across_ranks


def static_input_reader(forward_backward_func: Any) -> Any:
    """A megatron-core ``FullCudaGraphWrapper`` used only for its static-input handling
    (``data_read`` and its ``StaticBufferLoader`` with the loader's copy stream); it is
    never called, so its class-level graph, result and counters stay untouched."""
    return compat.make_full_iteration_wrapper(forward_backward_func, 1, False)


def read_static_inputs(
    reader: Any, buffers: list[Any], data_iterator: Any, model: Any, num_microbatches: int
) -> Any:
    """Draw ``num_microbatches`` micro-batches (per model chunk) and copy them into
    ``buffers``, the caller's own static buffers, with megatron-core's loader; returns the
    data iterator(s) over the static buffers, as ``FullCudaGraphWrapper`` passes them on.

    megatron-core keeps one buffer list per stage on ``StaticBufferLoader``'s class; the
    caller's list stands in for the training one while the loader runs, and the class's own
    list is back in place afterwards, also when drawing raises.
    """
    from megatron.core.full_cuda_graph import StaticBufferLoader

    compat.order_input_copy_after_replay(reader)
    lists = StaticBufferLoader.static_buffers
    saved = lists["training"]
    lists["training"] = buffers
    try:
        return reader.data_read(data_iterator, model, True, num_microbatches)
    finally:
        lists["training"] = saved


def shared_capture_stream() -> Any:
    """megatron-core's process-wide capture stream (0.18+: DDP is built on it), else
    ``None`` (0.16: every capture stream is the caller's)."""
    from megatron.core import full_cuda_graph

    get = getattr(full_cuda_graph, "get_shared_capture_stream", None)
    return None if get is None else get()


def rng_generator_states() -> list[Any]:
    """The generator states of megatron-core's RNG tracker, which every graph must register
    (``CUDAGraph.register_generator_state``) so its replays advance them (megatron-core's
    ``FullCudaGraphWrapper`` registers the same, per graph)."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    return list(get_all_rng_states().values())


def ddp_buffer_tensors(model: list[Any]) -> list[tuple[str, str, Any]]:
    """(group, name, tensor) for every contiguous parameter and gradient buffer of
    megatron-core's DDP chunks. megatron-core's own RL offloading (``offload_grad_buffers``,
    ``_ParamAndGradBuffer.offload_to_cpu``) frees and reallocates exactly these, with
    ``storage().resize_()``: the tensors stay, their addresses change."""
    found = []
    for index, chunk in enumerate(model):
        # Instance attributes of megatron-core's DDP (``buffers`` shadows Module.buffers()).
        attributes = vars(chunk)
        buffers = [
            *attributes.get("buffers", ()),
            *attributes.get("expert_parallel_buffers", ()),
        ]
        for number, buffer in enumerate(buffers):
            grad_data = getattr(buffer, "grad_data", None)
            if grad_data is not None:
                found.append(
                    ("gradient buffers", f"model chunk {index} grad buffer {number}", grad_data)
                )
            param_data = getattr(buffer, "param_data", None)
            if param_data is not None:
                found.append(
                    ("parameters", f"model chunk {index} param buffer {number}", param_data)
                )
    return found


def global_memory_buffer_tensors() -> list[tuple[str, str, Any]]:
    """megatron-core's global scratch buffers (sequence-parallel all-gathers use them).
    They grow when a longer sequence first needs more, freeing the old tensor, which a
    graph captured for a shorter bucket still points at."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is None:
        return []
    return [
        ("megatron-core global memory buffer", f"{name} ({dtype})", tensor)
        for (name, dtype), tensor in list(buffer.buffer.items())
    ]


@contextlib.contextmanager
def cached_forward_outputs(
    model: Sequence[Any], into: list[Any], missed: list[Any] | None = None
) -> Iterator[None]:
    """Record in ``into`` the tensors returned, while this is entered, by every module of
    ``model`` whose ``forward`` megatron-core caches with ``functools.lru_cache`` (the
    rotary embeddings' tables: ``RotaryEmbedding.forward``, ``YarnRotaryEmbedding.forward``,
    32 entries). A graph captured meanwhile reads them from the cache; once 32 other lengths
    ran eagerly (an RL host's rollouts) the cache drops them and their memory is freed
    under the graph, unless something else keeps them. ``missed``: the cached forwards
    that computed an entry meanwhile (a cache miss inside a capture makes the table in the
    graph pool; see :func:`forget_cached_outputs`)."""
    import torch

    def record(module: Any, args: Any, output: Any) -> None:
        into.extend(t for t in _tensors(output) if isinstance(t, torch.Tensor))

    modules = [
        module
        for chunk in (model if isinstance(model, (list, tuple)) else [model])
        for module in chunk.modules()
        if hasattr(type(module).forward, "cache_info")  # an lru_cache wrapper
    ]
    misses = {type(m).forward: type(m).forward.cache_info().misses for m in modules}
    handles = [module.register_forward_hook(record) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if missed is not None:
            missed += [f for f, before in misses.items() if f.cache_info().misses > before]


def forget_cached_outputs(functions: Sequence[Any]) -> None:
    """Empty the caches of ``functions`` (cached forwards that computed an entry during a
    capture): that entry lives in the shared graph pool, where memory an earlier graph
    uses as scratch may lie, and its replays would overwrite it under every later reader
    (eager calls, a later capture taking it from the cache). The graph that made it keeps
    its own reference and recomputes it on each replay; others compute theirs anew."""
    for function in functions:
        function.cache_clear()


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return [value]


def loss_scale_tensor(optimizer: Any) -> Any:
    """The loss-scale tensor the captured backward multiplies by (``config.grad_scale_func``
    is the optimizer's ``scale_loss``), or ``None``."""
    get = getattr(optimizer, "get_loss_scale", None)
    if get is None:
        return None
    scale = get()
    return scale if hasattr(scale, "data_ptr") else None


OPTIMIZER_PARAMS_SAMPLED = 16
"""Main parameters per inner optimizer whose address, and their state tensors', the
fingerprint reads (spread from first to last)."""


def optimizer_state_tensors(optimizer: Any) -> list[tuple[str, str, Any]]:
    """A sample of the optimizer's own memory: per inner torch optimizer, up to
    :data:`OPTIMIZER_PARAMS_SAMPLED` main parameters spread over its groups (megatron-core
    keeps empty groups so that every rank has the same) and their state tensors
    (megatron-core's ``MegatronOptimizer.offload_to_cpu`` moves all of them, by
    ``p.data = ...`` and ``state[k] = ...``, and its calls are watched besides; a host's own
    offload moves them one by one, and the allocator may give the first its old address
    back)."""
    found = []
    for index, torch_optimizer in enumerate(compat.torch_optimizers(optimizer)):
        params = [p for group in torch_optimizer.param_groups for p in group["params"]]
        last = len(params) - 1
        count = min(len(params), OPTIMIZER_PARAMS_SAMPLED)
        picked = sorted({round(n * last / max(count - 1, 1)) for n in range(count)})
        for position in picked:
            param = params[position]
            found.append(("optimizer state", f"optimizer {index} main parameter {position}", param))
            for key, value in sorted(torch_optimizer.state.get(param, {}).items()):
                if hasattr(value, "data_ptr") and getattr(value, "dim", lambda: 0)() > 0:
                    found.append(
                        (
                            "optimizer state",
                            f"optimizer {index} parameter {position} state {key!r}",
                            value,
                        )
                    )
    return found


def optimizer_holds_model_params(optimizer: Any, model: Sequence[Any]) -> bool:
    """Whether the optimizer's main parameters are the model's own (megatron-core's fp32
    optimizer without the distributed optimizer keeps no main copy): its offload API then
    moves the weights every forward/backward reads."""
    own = {id(param) for chunk in model for param in chunk.parameters()}
    return any(
        id(param) in own
        for torch_optimizer in compat.torch_optimizers(optimizer)
        for group in torch_optimizer.param_groups
        for param in group["params"]
    )


def _placement(optimizer: Any) -> list[tuple[str, int]]:
    """Where every main parameter and state tensor of ``optimizer`` lives (device and
    address): what an offload call can change."""
    placed = []
    for torch_optimizer in compat.torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                placed.append((str(param.device), param.data_ptr()))
                for value in torch_optimizer.state.get(param, {}).values():
                    if hasattr(value, "data_ptr"):
                        placed.append((str(value.device), value.data_ptr()))
    return placed


OFFLOAD_METHODS = ("offload_to_cpu", "restore_from_cpu")
"""megatron-core's ``MegatronOptimizer`` methods (its RL offload API) that move the main
parameters and the optimizer's state."""


def watch_optimizer_offload(optimizer: Any, moved: Callable[[str], None]) -> Callable[[], None]:
    """Call ``moved(what)`` after each :data:`OFFLOAD_METHODS` call on ``optimizer`` or one
    of its chained optimizers that moved anything. They give every main parameter and state
    tensor new memory, one tensor at a time: a sample of the addresses can come back
    unchanged while the rest moved (seen on an H200: the first main parameter back at its
    old address, an optimizer graph replayed onto the others' freed memory, NaN losses), so
    every tensor's place is compared before and after the call (once per call); a call that
    moved nothing (a restore with the state on the device already) frees no graph, and a
    call that raised partway counts what it moved. Returns what puts the methods back."""
    undo: list[tuple[Any, str, Any]] = []
    for target in [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]:
        for name in OFFLOAD_METHODS:
            original = getattr(target, name, None)
            if not callable(original):
                continue

            def wrapped(
                *args: Any, _call: Any = original, _what: str = name, _of: Any = target, **kw: Any
            ) -> Any:
                before = _placement(_of)
                try:
                    return _call(*args, **kw)
                finally:
                    if _placement(_of) != before:
                        moved(f"MegatronOptimizer.{_what}()")

            undo.append((target, name, vars(target).get(name)))
            setattr(target, name, wrapped)

    def restore() -> None:
        for target, name, own in reversed(undo):
            if own is not None:
                setattr(target, name, own)
            else:
                vars(target).pop(name, None)
        undo.clear()

    return restore


def barrier() -> None:
    """megatron-core's capture barrier (every rank enters and leaves a capture together)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


@contextlib.contextmanager
def stale_capture_streams_overridden() -> Iterator[None]:
    """What megatron-core 0.19 sets before its capture (``full_cuda_graph.py``):
    ``torch.autograd.graph.set_override_stale_capture_stream(True)``, so autograd nodes made
    on another stream (DDP's gradient hooks) join the capture instead of invalidating it.
    megatron-core leaves the process-wide flag on; it is restored here. Torch builds
    without it (before pytorch#180090) capture as before."""
    import torch

    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if setter is None:
        yield
        return
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    before = bool(getter()) if getter is not None else False
    setter(True)
    try:
        yield
    finally:
        setter(before)


def liveness_kwargs(check: bool) -> dict[str, bool]:
    """``torch.cuda.graph``'s keyword for its input-liveness check (a replay that reads a
    freed tensor raises), where ``check`` asks for it; refused where torch lacks it."""
    if not check:
        return {}
    import torch

    if "check_input_liveness" not in inspect.signature(torch.cuda.graph).parameters:
        raise ValueError(
            f"check_input_liveness=True needs torch.cuda.graph(check_input_liveness=...), "
            f"which torch {torch.__version__} lacks (torch 2.13 has it). Fix: upgrade torch "
            "or leave the check off"
        )
    return {"check_input_liveness": True}


def learned_position_limit(chunk: Any) -> int | None:
    """The longest sequence a model chunk's learned position embeddings take
    (``max_sequence_length`` where ``position_embedding_type`` is ``"learned_absolute"``
    and the chunk has the embedding, its first pipeline stage); ``None`` where nothing
    limits the length (rotary embeddings, a later stage, not a GPT-like model)."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        inner = get_attr_wrapped_model(chunk, "position_embedding_type", return_model_obj=True)
    except RuntimeError:  # (no such attribute on any wrapper level)
        return None
    limit = getattr(inner, "max_sequence_length", None)
    if inner.position_embedding_type != "learned_absolute" or not isinstance(limit, int):
        return None
    return limit if getattr(inner, "pre_process", True) else None
