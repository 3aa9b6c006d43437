"""The device, the process group and the RNG tracker, as megatron-core sees them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def clear_cublas_workspaces() -> None:
    """Release cuBLAS workspaces. A capture on its own stream allocates a workspace for that
    stream (tens of MiB, inside the graph's pool) that outlives the graph; torch's own
    CUDA-graph trees and test utilities clear them the same way."""
    import torch

    torch._C._cuda_clearCublasWorkspaces()


def current_stream_lookup() -> Callable[[], Any]:
    """A callable that returns ``torch.cuda.current_stream()`` for the current device, made
    for code that runs on every step.

    ``torch.cuda.current_stream()`` builds a new ``Stream`` object on each call (device
    lookup, CUDA-support check, constructor: several microseconds of Python, measured on the
    H200 host as the largest part of the plugin's per-step time). The callable asks torch's
    C binding which stream is current (two C calls) and reuses one ``Stream`` object per
    stream it has seen, so a host that switches streams still gets the right one. Where the
    binding is missing (CPU builds of torch) it returns ``None``: ``Event.record(None)``
    then asks torch itself.
    """
    import torch

    get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    if get_stream is None or get_device is None:
        return lambda: None
    streams: dict[Any, Any] = {}

    def current_stream() -> Any:
        key = get_stream(get_device())
        stream = streams.get(key)
        if stream is None:
            stream_id, device_index, device_type = key
            stream = torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
            streams[key] = stream
        return stream

    return current_stream


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
    return bool(max_across_ranks([int(flag)])[0])


def gather_across_ranks(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank: one
    ``all_gather_object`` over the default group, for rare paths only (it pickles, and over
    NCCL it goes through the current device); ``[value]`` in a single-rank job."""
    import torch.distributed as dist

    if distributed_world()[1] == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def max_across_ranks(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over every rank of the default group (one
    small all-reduce and a host read); ``values`` itself in a single-rank job."""
    import torch
    import torch.distributed as dist

    if distributed_world()[1] == 1:
        return list(values)
    on_gpu = "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


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


def _abort_group(group: Any) -> None:
    group.abort()


def _abort_logged(abort: Callable[[Any], Any], group: Any) -> None:
    try:
        abort(group)
    except Exception:
        logging.getLogger("cudagraph_plugin").exception("aborting process group %r failed", group)


class GroupAbort:
    """The abort of some process groups, each from its own daemon thread, all at once.

    Why not one after the other, as torch's ``_abort_process_group()`` does: an NCCL
    group's ``abort()`` waits (up to the group's timeout, ten minutes by default) for its
    communicators' teardown, which runs in a thread of torch's own, outside the
    ``ncclGroupStart/End`` torch puts around the loop (NCCL's group state is per thread).
    A communicator's teardown waits for its work and for every CUDA graph that captured it
    to be destroyed. So with a kernel spinning on a collective that the failed peer never
    joins, the first teardown whose work or graph depends on it never ends, and the
    communicator of that collective is never aborted: on 2x H200 (torch 2.11, NCCL 2.28)
    the healthy rank hung in ``pg.abort()`` until torchrun killed it, with a full-iteration
    graph and with Transformer Engine's layer graphs alike. ``ncclCommAbort`` raises the
    communicator's abort flag before its teardown waits, so aborting every group at once
    ends every stuck kernel at once; each teardown then ends as soon as what it waits for
    is gone (this rank's graphs, freed by its shutdown).

    Gloo's abort does nothing: a gloo collective still waits for its peers (their exit ends
    it).
    """

    def __init__(
        self,
        groups: Sequence[Any],
        abort: Callable[[Any], Any] | None = None,
        world: Any = None,
    ) -> None:
        """Start aborting ``groups``: ``abort(group)`` (``group.abort()`` by default) for
        each, each in its own daemon thread; ``world`` names the process groups' generation
        (``torch.distributed.group.WORLD`` when they were listed)."""
        self.world = world
        how = abort if abort is not None else _abort_group
        self.threads = [
            threading.Thread(
                target=_abort_logged, args=(how, group), name=f"mcgraph-abort-{i}", daemon=True
            )
            for i, group in enumerate(groups)
        ]
        for thread in self.threads:
            thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether every abort returned within ``timeout_s`` (``None``: as long as they
        take)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return not any(thread.is_alive() for thread in self.threads)


_abort_lock = threading.Lock()
_abort_in_flight: GroupAbort | None = None


def begin_abort_process_groups() -> None:
    """Start aborting every process group of this process (:class:`GroupAbort`: each
    group from its own thread, so every NCCL abort flag is up within milliseconds) and
    return without waiting for the teardowns; :func:`abort_process_groups` waits for them
    and forgets the groups. Does nothing without a process group, or while an abort of the
    same groups is in flight."""
    import torch.distributed as dist

    global _abort_in_flight
    with _abort_lock:
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.group.WORLD
        if _abort_in_flight is not None and _abort_in_flight.world is world:
            return
        _abort_in_flight = GroupAbort(list(dist.distributed_c10d._world.pg_names), world=world)


def abort_process_groups(timeout_s: float | None = None) -> bool:
    """Abort every process group of this process (the default one included), all at once
    (:class:`GroupAbort` says why not one after the other), and forget them: what a host
    calls instead of torch's ``_abort_process_group()`` after an abnormal end of a
    multi-rank run. An abort already begun (:func:`begin_abort_process_groups`, the peer
    watch's) is waited for, not started again.

    :param timeout_s: How long to wait for every abort to return; ``None``: as long as they
        take.
    :returns: True once every abort returned (or there was no process group); the groups
        are then forgotten (torch's ``_abort_process_group()``, whose second abort of each
        backend returns at once): ``torch.distributed.is_initialized()`` is False, so a
        host's teardown skips ``destroy_process_group()``. False at the timeout: the
        groups stay registered, their aborts go on in daemon threads (a later call waits
        for the same ones).
    """
    import torch.distributed as dist

    global _abort_in_flight
    begin_abort_process_groups()
    with _abort_lock:
        running = _abort_in_flight
    if running is not None and not running.wait(timeout_s):
        return False
    with _abort_lock:
        if _abort_in_flight is running:
            _abort_in_flight = None
        if (
            dist.is_available()
            and dist.is_initialized()
            and (running is None or dist.group.WORLD is running.world)
        ):
            dist.distributed_c10d._abort_process_group()
    return True


def default_store() -> Any:
    """The store of the default process group: under torchrun a client of its agent's
    TCPStore (a new one for every restart of the workers), behind prefix stores."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
