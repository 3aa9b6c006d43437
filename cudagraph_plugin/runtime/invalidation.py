"""The host's word that what captured graphs point at has moved (``run.invalidate_graphs``:
a checkpoint load, parameters or optimizer state offloaded and brought back), and the record
of every invalidation for the report (the bucket graphs' address check's too).

Bucketed full-iteration graphs are freed and captured again after their warm-up
(:meth:`BucketGraphs.invalidate`), and so is the optimizer graph tied to them. Without
buckets, megatron-core's own mechanisms cannot capture twice in a run (its full-iteration
wrapper keeps one graph per stage on its class; 0.19's TE helper captures once), so their
graphs are freed and the run goes on eagerly, said in the log: never a replay onto moved
memory.
"""

from __future__ import annotations

import logging

from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.fallback import go_eager
from cudagraph_plugin.runtime.guard import ShapeGuard
from cudagraph_plugin.runtime.release import DURING_TRAINING, ReleaseStep, settle
from cudagraph_plugin.runtime.state import Phase, RunState

logger = logging.getLogger("cudagraph_plugin")


class Invalidation:
    def __init__(self, state: RunState, captures: Captures, guard: ShapeGuard) -> None:
        self.state = state
        self.captures = captures
        self.guard = guard
        self.graphs_freed = 0
        self.events: list[dict[str, object]] = []
        self.starved = False  # said that invalidations come too often for any capture

    def invalidate(self, reason: str) -> None:
        state = self.state
        if state.buckets is not None:
            state.buckets.invalidate(reason, step=state.step)  # recorded by bucket_invalidated
            return
        # (after the fallback the optimizer graph may still be held, and replay)
        if state.phase is not Phase.CAPTURED and not state.graphs_held():
            self._record(reason, 0, "no graph was held")
            return
        steps: list[ReleaseStep] = []
        if state.full is not None:
            steps += state.full.graph_release_steps()
        if state.te is not None:
            steps += [s for s in state.te.release_steps() if s.frees_graphs]
        if state.optim is not None:
            steps += state.optim.release_steps()
        result = go_eager(state, self.captures, self.guard, steps)
        if not result.failures:
            state.optim = None  # (else what is left of it is released at shutdown)
        freed = result.graphs_freed
        logger.warning(
            "the host invalidated the CUDA graphs at step %s (%s): %d graph(s) freed; "
            "megatron-core's graphs are captured once per run, so the run goes on eagerly "
            "(bucketed full-iteration graphs, --cuda-graph-buckets, are captured again)",
            state.step,
            reason,
            freed,
        )
        self._record(reason, freed, "the run goes on eagerly")
        settle(result.failures, None, DURING_TRAINING)

    def bucket_invalidated(self, step: int | None, reason: str, freed: int) -> None:
        """The bucket graphs were invalidated: on the host's word or because the address
        check saw memory move (``BucketGraphs.on_invalidate``)."""
        self.captures.graph_count = self.state.graphs_held()  # the report's "held now"
        before = self.events[-1] if self.events else None
        then = "recaptured after their warm-up" if freed else "each bucket's warm-up starts over"
        self._record(reason, freed, then, step=step)
        now, warmup = self.events[-1]["step"], self.state.settings.warmup_steps
        if freed or self.starved or before is None or before["graphs_freed"]:
            return
        then = before["step"]
        if not isinstance(now, int) or not isinstance(then, int) or not 0 < now - then <= warmup:
            return
        # nothing to free twice in a row, too few steps apart for any bucket's warm-up and
        # capture: every invalidation starts every warm-up over
        self.starved = True
        logger.warning(
            "CUDA graph buckets: invalidated at steps %s and %s, %d step(s) apart, with no "
            "graph captured in between: a bucket needs its warm-up of %d step(s) and its "
            "capture step between two invalidations, so at this pace nothing is ever captured "
            "and the run stays eager. Fix: lower cuda_graph_warmup_steps "
            "(--cuda-graph-warmup-steps) below the steps between invalidations, or invalidate "
            "less often",
            then,
            now,
            now - then,
            warmup,
            extra=JOB_WIDE,
        )

    def _record(self, reason: str, freed: int, then: str, step: int | None = None) -> None:
        self.graphs_freed += freed
        step = self.state.step if step is None else step
        self.events.append({"step": step, "reason": reason, "graphs_freed": freed, "then": then})
