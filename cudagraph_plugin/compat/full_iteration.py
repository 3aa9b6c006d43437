"""megatron-core's full-iteration graphs (``FullCudaGraphWrapper``): making the wrapper,
reading its class-level state, and freeing it (0.16 has no API for that)."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Collection
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


# what megatron-core's copy into a static buffer does wrong, by the kind of difference
FAILS = "megatron-core's copy would fail ({})"
BROADCAST = (
    "megatron-core's copy would broadcast it into the buffer without an error, and the model "
    "would train on the wrong data"
)
CONVERTED = "megatron-core's copy would convert it to the buffer's dtype"
STALE = "megatron-core's copy would leave the old value in the buffer, and the model read it"
ALIASED = (
    "megatron-core adds such a key to the buffer without copying it: the buffer would hold "
    "this call's own tensors, and every later call would be copied into them"
)


def copy_problem(
    buffer: dict[Any, Any] | None,
    batch: dict[Any, Any],
    passed_before: Collection[Any] = (),
    dtypes_passed: dict[str, Any] | None = None,
) -> tuple[str, ...] | None:
    """Where ``StaticBufferLoader``'s copy of micro-batch ``batch`` into its existing static
    ``buffer`` goes wrong, as (path, the buffer's, the batch's, what megatron-core would
    do), or ``None``. It mirrors 0.16-0.19's code: a top-level key the buffer lacks is added
    (a tensor as a new device tensor, anything else as it is), then ``clone_tensors_in_struct``
    copies each tensor into the buffer's, walks dicts and lists, refuses tuples and puts
    every other value in place. A top-level key the buffer has and ``batch`` lacks stays
    in the buffer: wrong where the same caller passed it before (``passed_before``; with
    virtual pipeline stages the model chunks share the buffer, each with its own keys).

    A tensor's dtype is compared with the dtype the same caller passed first at its path
    (``dtypes_passed``, filled in as new paths come; with no ``buffer`` yet, only that):
    megatron-core hands ``forward_step`` the buffer itself, and one that converts a value
    in place (``batch["mask"] = batch["mask"].bool()``) changes the buffer's dtype, which
    every later copy then converts to, as each eager call's ``forward_step`` would."""
    import torch

    seen = {} if dtypes_passed is None else dtypes_passed
    if buffer is None:
        _clone_problem(torch, batch, batch, "batch", seen)
        return None
    gone = sorted((key for key in passed_before if key in buffer and key not in batch), key=str)
    if gone:
        return (f"batch[{gone[0]!r}]", "a key", "absent", STALE)
    for key, value in batch.items():
        path = f"batch[{key!r}]"
        if key in buffer:
            found = _clone_problem(torch, buffer[key], value, path, seen)
            if found:
                return found
        elif isinstance(value, torch.Tensor):
            seen.setdefault(path, value.dtype)  # (a new device tensor of its dtype)
        else:
            # put in as it is, then copied onto itself (where a tuple inside still fails)
            found = _clone_problem(torch, value, value, path, seen)
            if found:
                return found
            if _holds_tensor(torch, value):
                return (path, "absent", _describe(torch, value), ALIASED)
    return None


def _clone_problem(
    torch: Any, made: Any, value: Any, path: str, seen: dict[str, Any]
) -> tuple[str, ...] | None:
    if isinstance(value, tuple):
        return (
            path,
            _describe(torch, made),
            _describe(torch, value),
            FAILS.format('"Unsupported copy for tuple yet"; a list is copied'),
        )
    if isinstance(value, torch.Tensor):
        if not isinstance(made, torch.Tensor):
            return (
                path,
                _describe(torch, made),
                _describe(torch, value),
                FAILS.format("no tensor in the buffer to copy into"),
            )
        if made.shape != value.shape:
            try:
                fits = torch.broadcast_shapes(made.shape, value.shape) == made.shape
            except RuntimeError:
                fits = False
            what = BROADCAST if fits else FAILS.format("the shapes do not match")
            return (path, _describe(torch, made), _describe(torch, value), what)
        first = seen.setdefault(path, value.dtype)
        if value.dtype != first:
            return (path, f"{_describe(torch, made)} (passed as {first})",
                    _describe(torch, value), CONVERTED)  # fmt: skip
        return None
    if isinstance(value, list):
        items = list(enumerate(value))
        if not isinstance(made, list) or len(made) != len(value):
            what = (
                STALE
                if isinstance(made, list) and len(made) > len(value)
                else FAILS.format("no matching item in the buffer")
            )
            return (path, _describe(torch, made), _describe(torch, value), what)
        pairs = [(made[i], item, f"{path}[{i}]") for i, item in items]
    elif isinstance(value, dict):
        if not isinstance(made, dict) or made.keys() != value.keys():
            stale = isinstance(made, dict) and made.keys() > value.keys()
            what = STALE if stale else FAILS.format("no matching key in the buffer")
            return (path, _describe(torch, made), _describe(torch, value), what)
        pairs = [(made[k], item, f"{path}[{k!r}]") for k, item in value.items()]
    else:
        return None  # put in place as it is
    for inner_made, item, where in pairs:
        found = _clone_problem(torch, inner_made, item, where, seen)
        if found:
            return found
    return None


def _holds_tensor(torch: Any, value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(torch, item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(torch, item) for item in value)
    return False


def _describe(torch: Any, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:80]


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
