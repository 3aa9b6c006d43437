"""The opt-in fallback (``cuda_graph_fallback_on_slowdown``, full iteration only): after a
few replayed steps, if replay is measurably slower than eager on any rank, free the
full-iteration graph and carry on with the plain ``forward_backward_func`` on every rank.
"""

from __future__ import annotations

import gc
import logging

from cudagraph_plugin import compat
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.guard import ShapeGuard
from cudagraph_plugin.runtime.measurement import Measurement
from cudagraph_plugin.runtime.release import (
    DURING_TRAINING,
    ReleaseResult,
    ReleaseStep,
    release_each,
    settle,
)
from cudagraph_plugin.runtime.report import verdict
from cudagraph_plugin.runtime.state import Phase, RunState

logger = logging.getLogger("cudagraph_plugin")

FALLBACK_REPLAY_STEPS = 5
"""Replay steps measured before the opt-in fallback policy decides."""


def go_eager(
    state: RunState, captures: Captures, guard: ShapeGuard, steps: list[ReleaseStep]
) -> ReleaseResult:
    """Free the captured graphs (``steps``) and go on eagerly for the rest of the run (the
    fallback, or the host's invalidation of megatron-core's graphs, between steps; after
    the fallback, an invalidation frees the optimizer graph it kept).

    Every step runs (:func:`release_each`); what they raised is in the result, for the
    caller to :func:`settle` once it has said what happened: this runs during training, so
    an interruption that arrives while a graph is freed (a Ctrl-C, a signal, a peer's
    failure) must end the run, not be logged and forgotten."""
    result = release_each(steps)
    gc.collect()
    guard.disarm()
    # the report's "held now": what the steps left (the fallback keeps the optimizer graph)
    captures.graph_count = state.graphs_held()
    if state.phase is Phase.CAPTURED:
        # the report's replayed steps end at the last step that replayed: the one that just
        # ended, or the one before when the host invalidates at the start of a step (before
        # its forward/backward, which then runs eagerly)
        captures.replay_end = captures.last_step_replayed
        if captures.replay_end is None:
            captures.replay_end = captures.training_capture_step()
        state.advance((Phase.CAPTURED,), Phase.FALLEN_BACK)
    return result


class Fallback:
    def __init__(
        self, state: RunState, captures: Captures, measurement: Measurement, guard: ShapeGuard
    ) -> None:
        self.state = state
        self.captures = captures
        self.measurement = measurement
        self.guard = guard
        self.decided = False
        self.graphs_freed = 0

    @property
    def pending(self) -> bool:
        """The policy is on and has a graph to decide about, and has not decided yet."""
        state = self.state
        return (
            state.settings.fallback_on_slowdown
            and state.full_iteration_mode
            and state.phase is Phase.CAPTURED
            and not self.decided
        )

    def step_ended(self, step: int) -> None:
        """Decide once, :data:`FALLBACK_REPLAY_STEPS` after the capture, if the policy is on."""
        if not self.pending:
            return
        state = self.state
        # Counted from the step numbers: reading the timings synchronises the device, which
        # must happen once, at the decision, not on every replay step before it.
        capture_step = self.captures.training_capture_step()
        if capture_step is None or step - capture_step < FALLBACK_REPLAY_STEPS:
            return
        self.decided = True
        eager, replay, durations = self.measurement.samples()
        result, _, _, text = verdict([durations[s] for s in eager], [durations[s] for s in replay])
        # What a rank executes must not differ: every rank falls back if any rank measured
        # a slowdown (a rank replaying while another runs eagerly deadlocks a collective).
        if not compat.any_rank(result == "slower"):
            logger.info(
                "fallback policy: keeping the full-iteration graph (%s)", text, extra=JOB_WIDE
            )
            return
        logger.warning(
            "fallback policy: %s; freeing the full-iteration graph at step %d and continuing "
            "with the plain forward_backward_func",
            text if result == "slower" else f"another rank measured a slowdown (here: {text})",
            step,
            extra=JOB_WIDE,
        )
        assert state.full is not None
        result = go_eager(state, self.captures, self.guard, state.full.graph_release_steps())
        self.graphs_freed += result.graphs_freed
        self.measurement.fallback_step = step
        settle(result.failures, None, DURING_TRAINING)
