"""What bucketed graphs point at and a host may reallocate: the address fingerprint that
:class:`~cudagraph_plugin.runtime.buckets.BucketGraphs` compares before every training
call while graphs are held (a changed fingerprint frees the graphs and captures again)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cudagraph_plugin.compat import buckets as bucket_compat

PARAMS_PER_CHUNK: int | None = None
"""Parameters read per model chunk by the address fingerprint: all of them (``None``). A
sample (16 each, before 2026-12-04) missed a move the caching allocator hid: after an
offload and reload the sampled parameters can come back at their old addresses while
others do not. Every parameter costs about 0.13 µs per training call (0.25 ms for 2,000
parameter tensors on the 2-core CI machine, 2026-12-04), only while bucket graphs are
held."""

Fingerprint = tuple[tuple[str, str, int], ...]


class AddressFingerprint:
    """``data_ptr()`` of what a full-iteration graph points at and a host may reallocate.

    Cheap enough for every step (one pointer read per tensor): megatron-core DDP's
    contiguous parameter and gradient buffers (what megatron-core's own RL offloading frees
    and reallocates), every parameter of each model chunk (``param.data = ...``
    offloading; ``params_per_chunk`` limits it to a sample spread over them, which can
    miss a move) and the loss scale the captured backward multiplies by.
    (megatron-core's global scratch buffers move too, but the graphs keep the ones they
    use: :class:`BucketGraphs`.) With
    ``optimizer_state`` also a sample of the optimizer's main parameters and state, which
    an optimizer-step graph reads and a forward/backward graph does not.
    """

    def __init__(
        self,
        model: Sequence[Any],
        optimizer: Any = None,
        *,
        params_per_chunk: int | None = PARAMS_PER_CHUNK,
        optimizer_state: bool = False,
    ) -> None:
        self.model: list[Any] | None = list(model)
        self.optimizer = optimizer
        self.optimizer_state = optimizer_state
        self._params = [
            (f"model chunk {index} {name}", param)
            for index, chunk in enumerate(self.model)
            for name, param in _spread(list(chunk.named_parameters()), params_per_chunk)
        ]

    def take(self) -> Fingerprint:
        if self.model is None:
            return ()
        entries = [("parameters", name, param.data_ptr()) for name, param in self._params]
        tensors = bucket_compat.ddp_buffer_tensors(self.model)
        if self.optimizer is not None:
            scale = bucket_compat.loss_scale_tensor(self.optimizer)
            if scale is not None:
                tensors.append(("loss scale", "optimizer loss scale", scale))
            if self.optimizer_state:
                tensors += bucket_compat.optimizer_state_tensors(self.optimizer)
        entries += [(group, name, tensor.data_ptr()) for group, name, tensor in tensors]
        return tuple(entries)

    @staticmethod
    def changes(before: Fingerprint, after: Fingerprint) -> list[str]:
        """What differs, one entry per group: ``"<group> (<first name>: old -> new)"``."""
        old = {(group, name): ptr for group, name, ptr in before}
        new = {(group, name): ptr for group, name, ptr in after}
        found: dict[str, str] = {}
        for entry in [*old, *(k for k in new if k not in old)]:
            group, name = entry
            if group not in found and old.get(entry) != new.get(entry):
                found[group] = f"{group} ({name}: {_ptr(old.get(entry))} -> {_ptr(new.get(entry))})"
        return list(found.values())

    def forget(self) -> None:
        """Drop the model and optimizer (the run is over)."""
        self.model = None
        self.optimizer = None
        self._params = []


class MoveWatch:
    """What moved since a capture: an :class:`AddressFingerprint`'s reference (taken by
    :meth:`mark`, at the capture) compared with a new one, and any call of megatron-core's
    optimizer offload API since the last look (it gives every state tensor new memory one by
    one: the sampled ones can come back at their old addresses). Serves the bucket graphs
    and, without buckets, the optimizer graph.

    :param offloaded: what an offload call moves, in the words of :meth:`moved`.
    """

    def __init__(self, fingerprint: AddressFingerprint, offloaded: str) -> None:
        self.fingerprint = fingerprint
        self.reference: Fingerprint | None = None
        self._offloaded_words = offloaded
        self._offload_call: str | None = None  # the offload API ran since the last look
        self._unwatch: Callable[[], None] | None = None

    def watch_offload(self, optimizer: Any) -> None:
        self._unwatch = bucket_compat.watch_optimizer_offload(optimizer, self._offloaded)

    def mark(self) -> None:
        self.reference = self.fingerprint.take()

    def moved(self, holds_graphs: bool = True) -> list[str]:
        """What moved since :meth:`mark` (nothing without a reference, or ``holds_graphs``
        False); an offload call is looked at once either way."""
        offload_call, self._offload_call = self._offload_call, None
        if self.reference is None or not holds_graphs:
            return []
        found = []
        if offload_call is not None:
            found.append(f"{self._offloaded_words} ({offload_call} ran)")
        now = self.fingerprint.take()
        if now != self.reference:
            found += AddressFingerprint.changes(self.reference, now) or ["the fingerprint changed"]
        return found

    def unwatch(self) -> None:
        """Put the optimizer's offload methods back."""
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()

    def forget(self) -> None:
        """Drop the reference and what the fingerprint reads (the run is over)."""
        self.fingerprint.forget()
        self.reference = None

    def _offloaded(self, what: str) -> None:
        self._offload_call = what


def _ptr(value: int | None) -> str:
    return "absent" if value is None else f"{value:#x}"


def _spread(items: list[Any], count: int | None) -> list[Any]:
    """``count`` items spread evenly from first to last (all of them if fewer, or None)."""
    if count is None or len(items) <= count:
        return items
    if count == 1:
        return items[:1]
    last = len(items) - 1
    return [items[i] for i in sorted({round(n * last / (count - 1)) for n in range(count)})]
