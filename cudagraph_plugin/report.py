"""What CUDA graphs bought this run: step timing, capture time, memory, the verdict.

Owns the step timer (CUDA events on a CUDA device: two event records per step, turned into
milliseconds once the device has passed them, never waiting for it before the numbers are
read; ``time.perf_counter`` on CPU), the memory
snapshots around the capture, the eager-vs-replay verdict and the :class:`RunReport` that
is printed as a table at shutdown, written as JSON on request, and passed to the
``mcgraph_report`` hook.

Eager step time comes from the warm-up steps without the first one (it pays one-off
costs); replay step time from the steps after the capture step (the capture step pays for
the capture). Both are medians.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hookspecs.report_schema import REPORT_SCHEMA_VERSION

MIB = 1024 * 1024
NOISE_FLOOR = 0.02  # below a 2% difference nobody should call a winner


class StepTimer:
    """Times each training step without synchronising the device in the steady state.

    On CUDA a step is a pair of events. Pairs whose end event the device has passed
    (``Event.query()``, which does not block) become milliseconds as later steps stop, so a
    run of any length holds only the events still in flight (a few steps' worth), and the
    timings as 16 bytes per step. Read events are recorded again by later steps instead of
    creating new ones (creating a CUDA event costs the host more than recording one).
    """

    def __init__(self, use_cuda: bool) -> None:
        self.use_cuda = use_cuda
        self._open: dict[int, Any] = {}
        self._in_flight: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._steps = array.array("q")
        self._ms = array.array("d")
        self._spare: list[Any] = []
        self._event_class: Any = None

    def _mark(self) -> Any:
        if self.use_cuda:
            if self._spare:
                event = self._spare.pop()
            else:
                if self._event_class is None:
                    import torch

                    self._event_class = torch.cuda.Event
                event = self._event_class(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, step: int) -> None:
        self._open[step] = self._mark()

    def stop(self, step: int) -> None:
        start = self._open.pop(step, None)
        if start is None:
            return
        end = self._mark()
        if not self.use_cuda:
            self._keep(step, (end - start) * 1000.0)
            return
        self._in_flight.append((step, start, end))
        self._collect(wait=False)

    def discard(self, step: int) -> None:
        self._open.pop(step, None)

    @property
    def in_flight(self) -> int:
        """Steps stopped whose events the device has not passed yet."""
        return len(self._in_flight)

    def _keep(self, step: int, ms: float) -> None:
        self._steps.append(step)
        self._ms.append(ms)

    def _collect(self, wait: bool) -> None:
        # Oldest first: a stream passes its events in order, so the first pending end event
        # that is not done means none after it is.
        while self._in_flight:
            step, start, end = self._in_flight[0]
            if not wait and not end.query():
                return
            self._in_flight.popleft()
            self._keep(step, start.elapsed_time(end))
            self._spare += (start, end)

    def durations_ms(self, sync: bool = True) -> dict[int, float]:
        """Milliseconds per finished step. Steps still in flight on the device are waited
        for with one synchronisation, or, with ``sync=False`` (a peer rank may be gone and
        the device never finish), left out."""
        self._collect(wait=False)
        if self._in_flight and sync:
            import torch

            torch.cuda.synchronize()
            self._collect(wait=True)
        return dict(zip(self._steps, self._ms, strict=True))


@dataclasses.dataclass(frozen=True)
class MemorySnapshot:
    allocated_mib: float
    reserved_mib: float
    peak_allocated_mib: float

    @staticmethod
    def take() -> MemorySnapshot:
        import torch

        return MemorySnapshot(
            torch.cuda.memory_allocated() / MIB,
            torch.cuda.memory_reserved() / MIB,
            torch.cuda.max_memory_allocated() / MIB,
        )


def median_or_none(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def _median_and_spread(samples: list[float]) -> tuple[float | None, float]:
    """Median and relative median absolute deviation (0 for fewer than 2 samples)."""
    if not samples:
        return None, 0.0
    median = statistics.median(samples)
    if len(samples) < 2 or median <= 0:
        return median, 0.0
    mad = statistics.median(abs(x - median) for x in samples)
    return median, mad / median


def verdict(eager: list[float], replay: list[float]) -> tuple[str, float | None, float, str]:
    """(verdict, speed-up, noise, one-line explanation) for eager vs replay step times.

    The verdict is ``faster`` only when the speed-up exceeds the noise (the larger of 2% and
    the two samples' relative spreads added), ``slower`` when replay loses by more than the
    noise, else ``no_gain``; ``unknown`` without samples on both sides.
    """
    eager_ms, eager_spread = _median_and_spread(eager)
    replay_ms, replay_spread = _median_and_spread(replay)
    if eager_ms is None or replay_ms is None or replay_ms <= 0:
        missing = "eager" if eager_ms is None else "replay"
        hint = (
            " (needs cuda_graph_warmup_steps >= 2: the first step is excluded)"
            if missing == "eager"
            else " (no step ran after the capture step)"
        )
        return "unknown", None, 0.0, f"no {missing} step time measured{hint}"
    speedup = eager_ms / replay_ms
    noise = max(NOISE_FLOOR, eager_spread + replay_spread)
    if speedup > 1.0 + noise:
        return "faster", speedup, noise, f"replay is {speedup:.2f}x faster than eager"
    if speedup < 1.0 - noise:
        return (
            "slower",
            speedup,
            noise,
            (
                f"replay is SLOWER than eager: {replay_ms:.2f} ms vs {eager_ms:.2f} ms per step "
                f"(speed-up {speedup:.2f}x, noise ±{noise:.0%}); CUDA graphs cost you time here"
            ),
        )
    return (
        "no_gain",
        speedup,
        noise,
        (
            f"replay is NOT faster than eager beyond noise: {replay_ms:.2f} ms vs "
            f"{eager_ms:.2f} ms per step (speed-up {speedup:.2f}x, noise ±{noise:.0%})"
        ),
    )


@dataclasses.dataclass
class RunReport:
    """The run report; ``to_dict()`` is JSON-ready, ``format_table()`` is for humans.

    Plugins see it through the ``mcgraph_report`` hook and may rely only on ``to_dict()``
    (the public schema of :mod:`hookspecs.report_schema`, documented in docs/hooks.md) and
    ``format_table()``; the attributes here are internals.
    """

    impl: str
    scope: list[str]
    graphs_captured: bool
    no_graph_reason: str | None
    warmup_steps: int
    start_step: int | None
    capture_step: int | None
    capture_seconds: float | None
    graph_count: int
    steps_timed: int
    eager_steps: list[int]
    eager_step_ms: float | None
    replay_steps: list[int]
    replay_step_ms: float | None
    speedup: float | None
    verdict: str
    verdict_text: str
    noise: float
    memory_before_capture: MemorySnapshot | None
    memory_after_capture: MemorySnapshot | None
    peak_allocated_at_end_mib: float | None
    fallback_step: int | None
    graphs_held: int
    shutdown_reason: str
    device: str
    versions: dict[str, str | None]
    rank: int = 0
    world_size: int = 1

    @property
    def memory_overhead_mib(self) -> float | None:
        before, after = self.memory_before_capture, self.memory_after_capture
        if before is None or after is None:
            return None
        return after.allocated_mib - before.allocated_mib

    @property
    def peak_overhead_mib(self) -> float | None:
        before = self.memory_before_capture
        if before is None or self.peak_allocated_at_end_mib is None:
            return None
        return self.peak_allocated_at_end_mib - before.peak_allocated_mib

    def to_dict(self) -> dict[str, Any]:
        """The public form: the keys of :data:`hookspecs.report_schema.REPORT_FIELDS`."""
        data = {"schema_version": REPORT_SCHEMA_VERSION, **dataclasses.asdict(self)}
        data["memory_overhead_mib"] = self.memory_overhead_mib
        data["peak_overhead_mib"] = self.peak_overhead_mib
        data["memory_overhead_pct"] = _pct(
            self.memory_overhead_mib, self.memory_before_capture, "allocated_mib"
        )
        data["peak_overhead_pct"] = _pct(
            self.peak_overhead_mib, self.memory_before_capture, "peak_allocated_mib"
        )
        return data

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def format_table(self) -> str:
        d = self.to_dict()
        scope = ",".join(self.scope) or "-"
        where = self.device if self.world_size == 1 else f"{self.device}, rank {self.rank}"
        rows = [("CUDA graphs", f"impl={self.impl} scope={scope} on {where}")]
        if not self.graphs_captured:
            rows.append(("captured", f"NO GRAPH CAPTURED: {self.no_graph_reason}"))
        else:
            rows.append(
                (
                    "captured",
                    f"{self.graph_count} graph(s) at step {self.capture_step} "
                    f"in {self.capture_seconds:.3f} s",
                )
            )
        rows.append(("eager step", _ms(self.eager_step_ms, self.eager_steps)))
        if self.graphs_captured:
            rows.append(("replay step", _ms(self.replay_step_ms, self.replay_steps)))
            rows.append(("verdict", self.verdict_text))
        if self.fallback_step is not None:
            rows.append(("fallback", f"graph freed at step {self.fallback_step}; eager since"))
        if self.memory_before_capture is not None:
            rows.append(
                (
                    "memory",
                    (
                        f"allocated {self.memory_before_capture.allocated_mib:.0f} -> "
                        f"{self.memory_after_capture.allocated_mib:.0f} MiB "
                        f"(+{d['memory_overhead_mib']:.0f} MiB, "
                        f"{_fmt_pct(d['memory_overhead_pct'])}); "
                        f"peak {self.memory_before_capture.peak_allocated_mib:.0f} -> "
                        f"{self.peak_allocated_at_end_mib:.0f} MiB "
                        f"(+{d['peak_overhead_mib']:.0f} MiB, "
                        f"{_fmt_pct(d['peak_overhead_pct'])})"
                    ),
                )
            )
        if self.graphs_captured:
            rows.append(("held now", f"{self.graphs_held} graph(s), freed right after this"))
        rows.append(("run", f"{self.steps_timed} step(s) timed, ended: {self.shutdown_reason}"))
        rows.append(("versions", ", ".join(f"{k} {v or '-'}" for k, v in self.versions.items())))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _ms(value: float | None, steps: list[int]) -> str:
    if value is None:
        return "n/a"
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    return f"{value:.3f} ms (median of {len(steps)}, {span})"


def _pct(delta: float | None, base: MemorySnapshot | None, field: str) -> float | None:
    if delta is None or base is None or getattr(base, field) <= 0:
        return None
    return 100.0 * delta / getattr(base, field)


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"
