"""The vocabulary of bucket routing: a call's key (its shape), what a call does with it
(:class:`Action`, :class:`Route`), what happened to each key (:class:`BucketStats`), the
padding the host reported per step (:class:`PaddingLedger`), and a call's micro-batches
drawn ahead (:func:`draw_micro_batches`) and compared with a bucket's
(:func:`differs_from_buffers`), and the report's rows per key (:func:`summary_rows`).
The graphs themselves are :mod:`cudagraph_plugin.runtime.buckets`'."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from cudagraph_plugin.config.buckets import padding_waste_percent
from cudagraph_plugin.runtime.guard import difference, fingerprint, signature
from cudagraph_plugin.runtime.timing import median_or_none

BUCKET_FIX = (
    "with CUDA graph buckets, pad every micro-batch of a step to the bucket length passed as "
    "seq_length (cudagraph_plugin.runtime.padding.pad_step), and keep a bucket's "
    "micro_batch_size, tensor dtypes, micro-batch keys and non-tensor values fixed (a value "
    "that changes per step, a token count or a coefficient, goes in a tensor)"
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

    def replayed_since_capture(self) -> bool:
        """Whether a step replayed the key's graph after the call that last captured it."""
        actions = [action for _, action in self.calls]
        last = max((i for i, a in enumerate(actions) if a is Action.CAPTURE), default=-1)
        return Action.REPLAY in actions[last + 1 :]


def no_capture_reason(graphs: Any, warmup_steps: int, invalidations: int = 0) -> str | None:
    """Why the bucket graphs ``graphs`` (a :class:`~cudagraph_plugin.runtime.buckets.
    BucketGraphs`: its ``stats`` per key and its ``buckets``) captured nothing, where the
    run's length is not why: no step fit a bucket, or none got past its own warm-up (which
    each invalidation starts over); ``None`` before any step."""
    stats: Mapping[BucketKey, BucketStats] = graphs.stats
    buckets: Sequence[int] = graphs.buckets
    if not stats:
        return None
    fitting = [entry for entry in stats.values() if entry.in_bucket]
    if not fitting:
        lengths = sorted({key.seq_length for key in stats})
        longer = [length for length in lengths if length > max(buckets)]
        # (a length below the largest bucket fits one once padded to it)
        fix = (
            "pad each step to its bucket (pad_step) and pass that length as seq_length"
            if len(longer) < len(lengths)
            else "add a bucket that fits them"
        )
        if longer and len(longer) < len(lengths):
            fix += f", and add a bucket for the longer ones ({', '.join(map(str, longer))})"
        return (
            f"no training step fit a CUDA graph bucket ({', '.join(map(str, buckets))}): "
            f"every step came at a length outside them ({', '.join(map(str, lengths))}) and "
            f"ran eagerly; {fix}"
        )
    most = max(fitting, key=lambda entry: len(entry.calls))
    over = (
        f" in all, {invalidations} invalidation(s) starting the warm-ups over"
        if invalidations
        else ""
    )
    return (
        f"no bucket got past its warm-up ({warmup_steps} step(s) of its own before its "
        f"capture): the most any saw was {len(most.calls)}{over} (seq_length "
        f"{most.key.seq_length})"
    )


def key_of(kwargs: Mapping[str, Any]) -> BucketKey:
    """The key of one ``forward_backward_func`` call (its keyword arguments)."""
    for name in ("seq_length", "num_microbatches"):
        value = kwargs.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"forward_backward_func called with {name}={kwargs.get(name)!r}; CUDA graph "
                f"buckets route each training call by its seq_length and num_microbatches. "
                f"Fix: pass {name} as an int (megatron-core's schedules take it)"
            )
    return BucketKey(
        kwargs["seq_length"], kwargs.get("micro_batch_size"), kwargs["num_microbatches"]
    )


class PaddingLedger:
    """Real and padded token positions per (step, length), as the host reports them
    (``run.step_padded``): a report row (a key) counts the steps it ran, as keys of one
    length differ in their micro-batch count. Lengths reported for a step that none of its
    training calls came at count for no row: :meth:`record` and :meth:`routed` return them,
    ``(step, padded to, called at)``, once the step is over (a step may make several
    calls); :meth:`finish` those of the last step."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int | None, int], list[int]] = {}
        # the step being reported, its reported lengths and its training calls' lengths
        self._step: int | None = None
        self._padded: set[int] = set()
        self._called: set[int] = set()

    def record(
        self, step: int | None, seq_length: int, real: int, padded: int
    ) -> list[tuple[int | None, int, int]]:
        said = self._move_to(step)
        counts = self._counts.setdefault((step, seq_length), [0, 0])
        counts[0] += real
        counts[1] += padded
        self._padded.add(seq_length)
        return said

    def routed(self, step: int | None, seq_length: int) -> list[tuple[int | None, int, int]]:
        """Note the seq_length of one of ``step``'s training calls."""
        said = self._move_to(step)
        self._called.add(seq_length)
        return said

    def finish(self) -> list[tuple[int | None, int, int]]:
        """The lengths of the step being reported that no training call of it came at
        (nothing where it made no training call: there is nothing to compare)."""
        if not self._called:
            return []
        called = min(self._called)
        return [(self._step, length, called) for length in sorted(self._padded - self._called)]

    def _move_to(self, step: int | None) -> list[tuple[int | None, int, int]]:
        if step == self._step:
            return []
        said = self.finish()
        self._step, self._padded, self._called = step, set(), set()
        return said

    def waste_percent(self, seq_length: int, steps: Collection[int | None]) -> float | None:
        """Padded positions of all positions of ``steps`` at ``seq_length``."""
        real = padded = 0
        for (step, length), (step_real, step_padded) in self._counts.items():
            if length == seq_length and step in steps:
                real, padded = real + step_real, padded + step_padded
        return padding_waste_percent(real, padded)


def unmatched(step: int | None, padded_to: int, called: int) -> str:
    """What is wrong with padding reported at another length than the step's call."""
    return (
        f"run.step_padded said step {step} was padded to seq_length {padded_to}, but its "
        f"training call came at seq_length {called}: that padding counts for no bucket of the "
        "report (said once for these lengths). Fix: pass step_padded the length the "
        "micro-batches were padded to, the seq_length forward_backward_func gets (pad_step's "
        "seq_length)"
    )


def differs_from_buffers(seen: list[tuple[Any, Any]], drawn: list[Any]) -> str:
    """How ``drawn`` differs from the micro-batches a bucket's static buffers were made from
    (``seen``: each index's fingerprint and signature); ``""`` when alike. A micro-batch
    beyond those seen is compared with the first (its buffer is yet to be made from it)."""
    for index, batch in enumerate(drawn if seen else []):
        made_from, described = seen[index if index < len(seen) else 0]
        if fingerprint(batch) == made_from:
            continue
        # (the fingerprint follows the dict's key order, the signature sorts: the same keys
        # in another order are the same micro-batch, megatron-core copies by key)
        now = signature(batch)
        if now != described:
            return difference(described, now, "at first")
    return ""


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


def summary_rows(
    stats: Mapping[BucketKey, BucketStats],
    held: Collection[BucketKey],
    padding: PaddingLedger,
    durations: Mapping[int, float],
    holding_captures: Collection[int] = (),
) -> list[dict[str, Any]]:
    """Per key: its steps by action, capture seconds, replays (after the capture call,
    which replays once too), whether its graph is ``held``, padding waste, and with the
    host's step ``durations`` the median eager and replay step times. A key's first call
    (its static buffers, lazy allocations), its capture steps and the steps in
    ``holding_captures`` (another capture ran in them: the optimizer graph's) are left out
    of the medians."""
    rows = []
    for key, stat in sorted(stats.items(), key=lambda item: sort_key(item[0])):
        # (no sample: its first call, and the steps that held another capture)
        skip = {stat.calls[0][0] if stat.calls else None, *holding_captures}
        eager = [s for s in stat.steps(Action.EAGER, Action.WARMUP) if s not in skip]
        replay = [s for s in stat.steps(Action.REPLAY) if s not in skip]
        rows.append(
            {
                "seq_length": key.seq_length,
                "micro_batch_size": key.micro_batch_size,
                "num_microbatches": key.num_microbatches,
                "in_bucket": stat.in_bucket,
                "eager_steps": stat.steps(Action.EAGER, Action.WARMUP),
                "capture_steps": stat.steps(Action.CAPTURE),
                "replay_steps": stat.steps(Action.REPLAY),
                "capture_seconds": list(stat.capture_seconds),
                "replays": stat.replays,
                "graph_held": key in held,
                "eager_step_ms": median_or_none([durations[s] for s in eager if s in durations]),
                "replay_step_ms": median_or_none([durations[s] for s in replay if s in durations]),
                "padding_waste_percent": padding.waste_percent(
                    key.seq_length, {step for step, _ in stat.calls}
                ),
            }
        )
    return rows
