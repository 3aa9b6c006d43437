"""Capture bookkeeping: every capture of the run, bracketed the same way.

:meth:`Captures.bracket` runs one capture (a full-iteration call, the TE helper's
``create_cudagraphs()``, the optimizer's capture call) between the ``mcgraph_before_capture``
and ``mcgraph_after_capture`` hooks, with a device synchronisation on each side, its
duration and memory snapshots; it records which stage was captured at which step and how
many graphs the run holds. The report and the fallback read these records.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from cudagraph_plugin.runtime.state import Phase, RunState
from cudagraph_plugin.runtime.timing import MemorySnapshot
from hookspecs import call_hook

logger = logging.getLogger("cudagraph_plugin")


@dataclasses.dataclass
class Captures:
    """What was captured, when, how long it took, and the memory around it."""

    state: RunState
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    graph_count: int = 0
    graphs_held_max: int = 0
    memory_before: MemorySnapshot | None = None
    memory_after: MemorySnapshot | None = None
    # replays after the capture, per captured stage (training, validation, optimizer)
    replays: dict[str, int] = dataclasses.field(default_factory=dict)

    def bracket(self, stage: str, capture: Callable[[], Any]) -> Any:
        """Run ``capture`` bracketed by the capture hooks, timing and memory snapshots."""
        import torch

        state = self.state
        step = state.step
        impl = state.settings.impl
        scope = ["optimizer"] if stage == "optimizer" else list(state.settings.scope)
        call_hook(state.pm, "mcgraph_before_capture", step=step, impl=impl, scope=scope)
        torch.cuda.synchronize()
        before = MemorySnapshot.take()
        start = time.perf_counter()
        result = capture()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # The report's memory numbers span the captures of the first capture step (a
        # full-iteration or TE capture and the optimizer's, in the same step).
        after = MemorySnapshot.take()
        if not self.records:
            self.memory_before = before
        if not self.records or self.records[0]["step"] == step:
            self.memory_after = after
        self.records.append(
            {
                "stage": stage,
                "step": step,
                "seconds": seconds,
                # what this capture added to the allocated memory (its graph's pool share)
                "mib": after.allocated_mib - before.allocated_mib,
            }
        )
        self.replays.setdefault(stage, 0)
        self.graph_count = state.graphs_held()
        self.graphs_held_max = max(self.graphs_held_max, self.graph_count)
        if state.phase is Phase.BUILT:
            state.advance((Phase.BUILT,), Phase.CAPTURED)
        logger.info(
            "captured %s CUDA graph(s) for %s at step %s in %.3f s",
            ",".join(scope),
            stage,
            step,
            seconds,
        )
        call_hook(
            state.pm,
            "mcgraph_after_capture",
            step=step,
            impl=impl,
            scope=scope,
            seconds=seconds,
            graph_count=self.graph_count,
        )
        return result

    def replayed(self, stage: str) -> None:
        """One replay of ``stage``'s graph(s), if they were captured."""
        if stage in self.replays:
            self.replays[stage] += 1

    def training_capture_step(self) -> int | None:
        """The step whose capture splits eager from replay steps: the training graph's
        (full iteration or TE), else the optimizer graph's."""
        for stage in ("training", "optimizer"):
            for capture in self.records:
                if capture["stage"] == stage:
                    return capture["step"]
        return None

    def seconds(self) -> float | None:
        return sum(c["seconds"] for c in self.records) if self.records else None
