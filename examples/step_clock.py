"""The step clock of the example hosts (``train_gpt.py``, ``rl_loop.py``) and of the
hand-written baseline (``benchmarks/handwritten.py``): one clock, so that both sides of a
comparison time their steps the same way. No plugin, no hook: torch only.

Step times without a device synchronisation per step, as Megatron-LM's timers take them: a
pair of CUDA events around each step, read when the log interval comes and at the end (one
wait for the newest); on the CPU the wall clock.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    def __init__(self, use_cuda: bool) -> None:
        self.use_cuda = use_cuda
        self._pending: list[tuple[Any, Any]] = []
        self._spare: list[Any] = []
        self._start: Any = None

    def _mark(self) -> Any:
        if not self.use_cuda:
            return time.perf_counter()
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        self._pending.append((self._start, self._mark()))

    def read(self) -> list[float]:
        """Milliseconds of the steps stopped since the last read (waits for the last one)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if not self.use_cuda:
            return [(end - start) * 1000.0 for start, end in pending]
        pending[-1][1].synchronize()
        times = [start.elapsed_time(end) for start, end in pending]
        for start, end in pending:
            self._spare += (start, end)
        return times
