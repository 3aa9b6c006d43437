"""Does capture pay off? The figures the report adds to eager vs replay: whether its samples
are too thin to trust the speed-up, after how many replays the capture cost is earned back
(and whether the run lasts that long), and the same per sequence-length bucket.

Break-even: a capture costs what it adds to the step it runs in (:func:`capture_cost_seconds`:
that step's time less a replayed step's); each replayed step saves ``eager_ms -
replay_ms``; the capture has paid for itself after ``ceil(cost_ms / saving)`` replayed
steps (never, when replay saves nothing, or nothing beyond the verdict's noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from cudagraph_plugin.config.advice import THIN_SAMPLE
from cudagraph_plugin.runtime.capture import IN_STEP_STAGES
from cudagraph_plugin.runtime.timing import median_or_none


def thin_sample_note(
    eager_steps: int, replay_steps: int, *, per_bucket: bool = False
) -> str | None:
    """Why the speed-up rests on too few steps, or None. ``per_bucket``: ``eager_steps`` is
    the fewest eager steps of one bucket (each bucket is compared with its own)."""
    if min(eager_steps, replay_steps) >= THIN_SAMPLE:
        return None
    eager = f"{eager_steps} eager step(s) in a bucket" if per_bucket else f"{eager_steps} eager"
    return (
        f"measured on {eager} and {replay_steps} replayed step(s): too few to "
        f"trust this speed-up (at least {THIN_SAMPLE} each; --cuda-graph-baseline-steps N "
        f"measures N eager steps before {'each' if per_bucket else 'the'} capture)"
    )


def fewest_eager_samples(
    summary: Sequence[Mapping[str, Any]],
    durations_ms: Mapping[int, float],
    holding_captures: Collection[int] = (),
) -> int | None:
    """The fewest eager samples of a bucket that replayed (None when none did): each bucket
    is judged against its own eager steps, so the thinnest one bounds the trust in all."""
    counts = []
    for row in summary:
        eager, replay, _, _ = bucket_samples([row], durations_ms, holding_captures)
        if replay:
            counts.append(len(eager))
    return min(counts, default=None)


def capture_cost_seconds(
    records: Sequence[Mapping[str, Any]],
    durations_ms: Mapping[int, float],
    replay_ms: float | None,
) -> float | None:
    """What the captures of ``records`` cost the run beyond the work of the steps they ran
    in (None without one): for each timed step that held captures (the training graph's,
    the optimizer graph's), that step's time less a replayed step's (``replay_ms``: the
    same work, without capturing; megatron-core's full-iteration wrapper replays its graph
    right after capturing it, so the capture's own time holds that work); for a capture
    outside a timed step (a validation graph's, in an evaluation) or without a replay
    median, the capture's own time."""
    if not records:
        return None
    cost_ms = 0.0
    steps: set[int] = set()
    for record in records:
        step = record["step"]
        if record["stage"] in IN_STEP_STAGES and step in durations_ms and replay_ms is not None:
            steps.add(step)
        else:
            cost_ms += record["seconds"] * 1000.0
    cost_ms += sum(max(0.0, durations_ms[step] - replay_ms) for step in steps)  # type: ignore[operator]
    return cost_ms / 1000.0


def break_even_steps(
    capture_seconds: float | None, eager_ms: float | None, replay_ms: float | None
) -> int | None:
    """Replayed steps after which the capture has paid for itself; None when replay saves
    nothing (or a figure is missing)."""
    if capture_seconds is None or eager_ms is None or replay_ms is None:
        return None
    saving = eager_ms - replay_ms
    if saving <= 0:
        return None
    # (rounded first: a cost of 0.1 - 0.01 s over 10 ms is 9 steps, not ceil(9.000000000000002))
    return max(1, math.ceil(round(capture_seconds * 1000.0 / saving, 9)))


def pays_off(
    eager_ms: float | None, replay_ms: float | None, break_even: int | None, replayed: int | None
) -> bool | None:
    """Whether the steps the run replayed (``replayed``) earned the capture back; None when
    it is not known: a median is missing (nothing is known about the saving) or the
    replayed steps are unknown. False when replay saves nothing (no break-even)."""
    if eager_ms is None or replay_ms is None or replayed is None:
        return None
    return break_even is not None and replayed >= break_even


def bucket_samples(
    summary: Sequence[Mapping[str, Any]],
    durations_ms: Mapping[int, float],
    holding_captures: Collection[int] = (),
) -> tuple[list[int], list[int], list[float], list[float]]:
    """What the run's eager-vs-replay verdict compares with buckets: each bucket's replayed
    steps against its own eager steps, never one length against another. Returns the
    eager steps (of the buckets that replayed) and the replayed steps (of every bucket),
    and the durations of those of the buckets with an eager median, divided by it (so the
    eager ones lie around 1): a bucket without one (warm-up 1: its only warm-up step is its
    first) keeps its replayed steps, but has nothing to compare them with. A step in
    ``holding_captures`` (its time includes a capture: the optimizer graph's, captured after
    its own warm-up, whatever bucket the step is in) is no sample."""
    eager_steps: list[int] = []
    replay_steps: list[int] = []
    eager: list[float] = []
    replay: list[float] = []
    for row in summary:
        if not row["in_bucket"]:
            continue
        # a bucket's first call (its static buffers, lazy allocations) is no sample
        own_eager = [
            s for s in row["eager_steps"][1:] if s in durations_ms and s not in holding_captures
        ]
        own_replay = [
            s for s in row["replay_steps"] if s in durations_ms and s not in holding_captures
        ]
        if not own_replay:
            continue
        eager_steps += own_eager
        replay_steps += own_replay
        base = row["eager_step_ms"]
        if base:
            eager += [durations_ms[s] / base for s in own_eager]
            replay += [durations_ms[s] / base for s in own_replay]
    return sorted(eager_steps), sorted(replay_steps), eager, replay


def key_samples(
    summary: Sequence[Mapping[str, Any]],
    durations_ms: Mapping[int, float],
    holding_captures: Collection[int],
    replayed: Collection[int],
) -> tuple[list[int], list[int], list[float], list[float]]:
    """As :func:`bucket_samples`, for a bucketed run whose only graph is the optimizer's
    (no bucket was captured; every forward/backward ran eagerly): each shape's steps whose
    optimizer step replayed its graph (``replayed``) against the same shape's steps whose
    optimizer step ran eagerly (before the capture, and again while it warms up after an
    invalidation), as fractions of the latter's median, never one length against another.
    A shape's first step (its lazy allocations) and the steps in ``holding_captures`` are no
    sample."""
    eager_steps: list[int] = []
    replay_steps: list[int] = []
    eager: list[float] = []
    replay: list[float] = []
    for row in summary:
        steps = sorted({*row["eager_steps"], *row["capture_steps"], *row["replay_steps"]})
        steps = [s for s in steps[1:] if s in durations_ms and s not in holding_captures]
        before = [s for s in steps if s not in replayed]
        after = [s for s in steps if s in replayed]
        if not before or not after:
            continue
        base = median_or_none([durations_ms[s] for s in before])
        if not base:
            continue
        eager_steps += before
        replay_steps += after
        eager += [durations_ms[s] / base for s in before]
        replay += [durations_ms[s] / base for s in after]
    return sorted(eager_steps), sorted(replay_steps), eager, replay


def bucket_rows(
    summary: Sequence[Mapping[str, Any]],
    captures: Sequence[Mapping[str, Any]],
    durations_ms: Mapping[int, float] | None = None,
    holding: Collection[int] = (),
    judge: Callable[[list[float], list[float]], str] | None = None,
) -> list[dict[str, Any]]:
    """The bucket graphs' summary with, per bucket, its speed-up, break-even, graph memory
    (what its last capture added to the allocated memory: with one shared pool, a later
    bucket adds little; an earlier capture's was freed when it was invalidated) and whether
    it earned its capture back within the run (every capture's cost counts there). With the
    step durations and a ``judge`` of eager vs replayed samples (the report's verdict), a
    bucket whose replays it finds ``slower`` or of ``no_gain`` (not faster beyond noise)
    has no break-even and did not pay off, whatever its medians say (``holding``: steps that
    are no sample, as in :func:`bucket_samples`)."""
    rows = []
    for row in summary:
        steps = set(row["capture_steps"])
        last = max(
            (c for c in captures if c["stage"] == "training" and c["step"] in steps),
            key=lambda c: c["step"],
            default=None,
        )
        eager_ms, replay_ms = row["eager_step_ms"], row["replay_step_ms"]
        capture_seconds = sum(row["capture_seconds"]) if row["capture_seconds"] else None
        even = break_even_steps(capture_seconds, eager_ms, replay_ms)
        if even is not None and judge is not None:
            _, _, own_eager, own_replay = bucket_samples([row], durations_ms or {}, holding)
            if judge(own_eager, own_replay) in ("slower", "no_gain"):
                even = None  # (a saving within the noise earns nothing back)
        rows.append(
            {
                **row,
                "capture_seconds": capture_seconds,
                "speedup": eager_ms / replay_ms if eager_ms and replay_ms else None,
                "pool_mib": None if last is None else last.get("mib"),
                "break_even_steps": even,
                # the replays of the capture calls save nothing: replayed steps only; a
                # bucket captured and never replayed earned nothing back
                "paid_off": (
                    None
                    if not capture_seconds
                    else False
                    if not row["replay_steps"]
                    else pays_off(eager_ms, replay_ms, even, len(row["replay_steps"]))
                ),
            }
        )
    return rows
