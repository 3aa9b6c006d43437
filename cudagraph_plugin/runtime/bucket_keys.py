"""The vocabulary of bucket routing: a call's key (its shape), what a call does with it
(:class:`Action`, :class:`Route`), what happened to each key (:class:`BucketStats`) and a
call's micro-batches drawn ahead (:func:`draw_micro_batches`).
The graphs themselves are :mod:`cudagraph_plugin.runtime.buckets`'."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

BUCKET_FIX = (
    "with CUDA graph buckets, pad every micro-batch of a step to the bucket length passed as "
    "seq_length (cudagraph_plugin.runtime.padding.pad_step), and keep micro_batch_size and the "
    "tensor dtypes of a bucket fixed"
)


class Action(enum.Enum):
    """What a training call does."""

    EAGER = "eager"  # the host's own call: outside every bucket, forward-only, ranks disagree
    WARMUP = "warmup"  # eager on the key's static buffers, counted towards its capture
    CAPTURE = "capture"  # captured, then replayed once
    REPLAY = "replay"


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """The shape a graph is captured for."""

    seq_length: int
    micro_batch_size: int | None
    num_microbatches: int

    def __str__(self) -> str:
        return (
            f"seq_length {self.seq_length}, micro_batch_size {self.micro_batch_size}, "
            f"{self.num_microbatches} micro-batch(es)"
        )


@dataclasses.dataclass(frozen=True)
class Route:
    """The decision for one call; ``key`` is ``None`` for forward-only calls."""

    action: Action
    key: BucketKey | None
    reason: str | None = None
    drawn: list[Any] | None = None
    """The call's micro-batches, drawn by the routing to compare them with the bucket's
    (each call then passes iterators over these)."""
    listed: bool = False  # the call passed its data iterator in a list (one per chunk)


@dataclasses.dataclass
class BucketStats:
    """What happened to one key: each call's step and action, capture times, replays."""

    key: BucketKey
    in_bucket: bool
    calls: list[tuple[int | None, Action]] = dataclasses.field(default_factory=list)
    capture_seconds: list[float] = dataclasses.field(default_factory=list)
    replays: int = 0

    def steps(self, *actions: Action) -> list[int]:
        return [step for step, action in self.calls if action in actions and step is not None]


def key_of(kwargs: Mapping[str, Any]) -> BucketKey:
    """The key of one ``forward_backward_func`` call (its keyword arguments)."""
    for name in ("seq_length", "num_microbatches"):
        if not isinstance(kwargs.get(name), int):
            raise ValueError(
                f"forward_backward_func called with {name}={kwargs.get(name)!r}; CUDA graph "
                f"buckets route each training call by its seq_length and num_microbatches. "
                f"Fix: pass {name} as an int (megatron-core's schedules take it)"
            )
    return BucketKey(
        kwargs["seq_length"], kwargs.get("micro_batch_size"), kwargs["num_microbatches"]
    )


def sort_key(key: BucketKey) -> tuple[int, int, int]:
    """Keys in the order of their shapes (the report's rows)."""
    mbs = key.micro_batch_size if key.micro_batch_size is not None else -1
    return (key.seq_length, mbs, key.num_microbatches)


def draw_micro_batches(data_iterator: Any, count: int) -> tuple[list[Any] | None, bool]:
    """Draw a call's ``count`` micro-batches from its data iterator (a single one, or one in
    a list: one model chunk); ``(None, False)`` where there is none to draw from (a list of
    several, a stage without data). The second item: the iterator came in a list."""
    listed = isinstance(data_iterator, list) and len(data_iterator) == 1
    iterator = data_iterator[0] if listed else data_iterator
    if iterator is None or isinstance(iterator, list):
        return None, False
    return [next(iterator) for _ in range(count)], listed


def iterators_over(drawn: list[Any], listed: bool) -> Any:
    """What the call passes on instead of its data iterator, once its micro-batches were
    drawn: an iterator over them, in a list where the call's was."""
    inputs = iter(drawn)
    return [inputs] if listed else inputs
