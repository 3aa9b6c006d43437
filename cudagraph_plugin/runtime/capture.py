"""Capture bookkeeping: every capture of the run, bracketed the same way.

:meth:`Captures.bracket` runs one capture (a full-iteration call, the TE helper's
``create_cudagraphs()``, the optimizer's capture call) between the ``mcgraph_before_capture``
and ``mcgraph_after_capture`` hooks, with a device synchronisation on each side, its
duration and memory snapshots; it records which stage was captured at which step and how
many graphs the run holds, and a capture that raised. The report and the fallback read
these records.
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


# The stages captured inside a training step, in the order their capture splits the run
# (a validation graph is captured in an evaluation, between two steps).
IN_STEP_STAGES = ("training", "optimizer")


@dataclasses.dataclass
class Captures:
    """What was captured, when, how long it took, and the memory around it."""

    state: RunState
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    graph_count: int = 0
    graphs_held_max: int = 0
    # (before, after) memory snapshots of each record, in the same order
    snapshots: list[tuple[MemorySnapshot, MemorySnapshot]] = dataclasses.field(default_factory=list)
    # replays after the capture, per captured stage (training, validation, optimizer)
    replays: dict[str, int] = dataclasses.field(default_factory=dict)
    # the last step that could replay before the graphs were freed for the rest of the run
    # (the fallback, the host's invalidation without buckets): later steps ran eagerly
    replay_end: int | None = None
    # the step of the last replay of a training step's graph (training or optimizer stage):
    # where replay_end is put when the graphs are freed for the rest of the run
    last_step_replayed: int | None = None
    # the steps whose optimizer.step replayed the optimizer graph (after an invalidation it
    # warms up again eagerly: those steps are not replays)
    optimizer_replay_steps: set[int] = dataclasses.field(default_factory=set)
    # (stage, step, "Type: message") of a capture that raised, for the report's "why no
    # graph"; the words only: the exception's frames would keep what the capture held alive
    failed: tuple[str, int | None, str] | None = None

    def bracket(self, stage: str, capture: Callable[[], Any]) -> Any:
        """Run ``capture`` bracketed by the capture hooks, timing and memory snapshots."""
        import torch

        state = self.state
        step = state.step
        # the optimizer graph is megatron-core's own (local) capture, whatever the model's
        if stage == "optimizer":
            impl, scope = "local", ["optimizer"]
        else:
            impl, scope = state.settings.impl, list(state.settings.scope)
        call_hook(state.pm, "mcgraph_before_capture", step=step, impl=impl, scope=scope)
        torch.cuda.synchronize()
        before = MemorySnapshot.take()
        held_before = state.graphs_held()
        start = time.perf_counter()
        try:
            result = capture()
            torch.cuda.synchronize()
        except BaseException as error:
            self.failed = (stage, step, _error_line(error))
            raise
        seconds = time.perf_counter() - start
        after = MemorySnapshot.take()
        self.snapshots.append((before, after))
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
        self.records[-1]["graphs"] = self.graph_count - held_before
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
            if stage != "validation":
                self.last_step_replayed = self.state.step
            if stage == "optimizer":
                self.optimizer_replay_steps.add(self.state.step)

    def made_graphs(self, stage: str) -> bool:
        """A capture of ``stage`` made graphs (whether or not they are held now: the host
        may have invalidated them since)."""
        return any(r["stage"] == stage and r["graphs"] > 0 for r in self.records)

    @property
    def produced_graphs(self) -> bool:
        """A capture ran and left graphs (a TE scope that matches no layer captures none):
        only then do the steps after it replay."""
        return bool(self.records) and self.graphs_held_max > 0

    def training_capture_step(self) -> int | None:
        """The step whose capture splits eager from replay steps: the training graph's
        (full iteration or TE), else the optimizer graph's."""
        for stage in IN_STEP_STAGES:
            for capture in self.records:
                if capture["stage"] == stage:
                    return capture["step"]
        return None

    def seconds(self) -> float | None:
        return sum(c["seconds"] for c in self.records) if self.records else None

    def capture_step_memory(self) -> tuple[MemorySnapshot | None, MemorySnapshot | None]:
        """The memory right before and right after the captures of the capture step
        (:meth:`training_capture_step`): its training and optimizer captures, in the order
        they ran. A validation graph captured at another step (an evaluation before the
        training capture) or after them is not in it: the figures are the training graph's."""
        step = self.training_capture_step()
        around = [
            snapshot
            for record, snapshot in zip(self.records, self.snapshots, strict=True)
            if record["step"] == step and record["stage"] in IN_STEP_STAGES
        ]
        if not around:
            return None, None
        return around[0][0], around[-1][1]

    def steps_holding_a_capture(self) -> set[int]:
        """The training steps whose timed span holds a capture: the training graph's and the
        optimizer graph's (captured after its own warm-up, at whatever step that falls on).
        A validation graph is captured in an evaluation, after its step was timed."""
        return {r["step"] for r in self.records if r["stage"] in IN_STEP_STAGES}

    @property
    def memory_before(self) -> MemorySnapshot | None:
        """Memory right before the run's first capture, whatever its stage (the shutdown
        log line's baseline)."""
        return self.snapshots[0][0] if self.snapshots else None


def _error_line(error: BaseException) -> str:
    """``Type: first line of the message`` (CUDA errors run over several lines)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
