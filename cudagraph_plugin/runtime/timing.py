"""Step timing and memory snapshots.

The step timer uses CUDA events on a CUDA device (two event records per step, turned into
milliseconds once the device has passed them, never waiting for it before the numbers are
read) and ``time.perf_counter`` on the CPU; which steps it times is the measurement's
choice (:meth:`~cudagraph_plugin.runtime.measurement.Measurement.times`).
:func:`split_samples` divides the timed steps into eager ones (the warm-up steps without the
first one, which pays one-off costs) and replayed ones (after the capture step, which pays
for the capture, up to where the graphs were freed), leaving out every step that held a
capture.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import statistics
import time
from collections.abc import Collection
from typing import Any

MIB = 1024 * 1024


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
        self._current_stream: Any = None

    def _mark(self) -> Any:
        if self.use_cuda:
            if self._spare:
                event = self._spare.pop()
            else:
                if self._event_class is None:
                    import torch

                    from cudagraph_plugin import compat

                    self._event_class = torch.cuda.Event
                    self._current_stream = compat.current_stream_lookup()
                event = self._event_class(enable_timing=True)
            # on the current stream, as Event.record() does, without building a new Stream
            # object per call (compat.current_stream_lookup)
            event.record(self._current_stream())
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


def split_samples(
    steps: list[int],
    first: int | None,
    capture_step: int | None,
    last_replay: int | None,
    holding_captures: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """(eager steps, replayed steps) of the timed ``steps``: the first step is neither, nor
    is a step in ``holding_captures`` (its time includes a capture: the optimizer graph's,
    captured after its own warm-up); without a capture every other
    step is eager; replays end at ``last_replay`` (where the graphs were freed for the rest
    of the run: the fallback, an invalidation) when given, and the steps after it ran
    eagerly but are no eager sample either (the warm-up's are the baseline)."""
    steps = [s for s in steps if s != first and s not in holding_captures]
    if capture_step is None:
        return steps, []
    end = float("inf") if last_replay is None else last_replay
    eager = [s for s in steps if s < capture_step]
    replay = [s for s in steps if capture_step < s <= end]
    return eager, replay
