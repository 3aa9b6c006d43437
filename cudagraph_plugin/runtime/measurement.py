"""Measurement of one run: the training steps timed, split into eager and replayed steps.

The step whose capture splits them is the training graph's (full iteration or TE), else the
optimizer graph's (:meth:`Captures.training_capture_step`), if it produced graphs (a TE
scope that matches no layer captures none: the run stays eager); replays end where the graphs
were freed for the rest of the run (the opt-in fallback, the host's invalidation without
buckets: :attr:`Captures.replay_end`). A step whose timed span held a capture (the optimizer
graph's, captured after its own warm-up) is neither; a validation graph is captured in an
evaluation, outside the timed step.

Which steps are timed (:meth:`Measurement.times`): every step up to
:data:`DENSE_REPLAY_STEPS` steps after the capture (the warm-up, the capture, and the
replays the report's figures and the fallback decision rest on), and none after
(:meth:`Measurement.timed_until`): a median needs no more, and after them the plugin stops
listening to the step hooks altogether (``runtime/steps.py``), so the steady state costs the
host neither event records nor a hook dispatch. Runs without a capture time every step;
bucketed runs too (each bucket's figures come from its own steps, whatever order the host
runs them in, and a bucket may be captured late).
"""

from __future__ import annotations

from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.state import RunState
from cudagraph_plugin.runtime.timing import StepTimer, split_samples

DENSE_REPLAY_STEPS = 50


def timed_after_capture(step: int, capture_step: int) -> bool:
    """The rule of the module's docstring for a run whose graphs were captured at
    ``capture_step`` (without buckets)."""
    return step - capture_step <= DENSE_REPLAY_STEPS


class Measurement:
    def __init__(self, state: RunState, captures: Captures) -> None:
        self.state = state
        self.captures = captures
        self.timer = StepTimer(use_cuda=state.cuda)
        self.fallback_step: int | None = None
        self._capture_step: int | None = None

    def times(self, step: int) -> bool:
        """Whether ``step`` is timed (see the module's docstring)."""
        capture = self._capture_step
        if capture is None:
            if self.state.buckets is not None:
                return True
            capture = self._capture_step = self.captures.training_capture_step()
            if capture is None:
                return True
        return timed_after_capture(step, capture)

    def timed_until(self) -> int | None:
        """The last step timed, once :meth:`times` knows the capture step (from the step
        after the capture on); None while every step may still be timed (no capture yet,
        buckets)."""
        capture = self._capture_step
        if capture is None or self.state.buckets is not None:
            return None
        return capture + DENSE_REPLAY_STEPS

    def samples(self, sync: bool = True) -> tuple[list[int], list[int], dict[int, float]]:
        """(eager steps, replayed steps, milliseconds per timed step); ``sync=False`` leaves
        out steps still in flight on the device."""
        durations = self.timer.durations_ms(sync=sync)
        captures = self.captures
        eager, replay = split_samples(
            sorted(durations),
            self.state.start_step,
            captures.training_capture_step() if captures.produced_graphs else None,
            captures.replay_end,
            holding_captures=captures.steps_holding_a_capture(),
        )
        return eager, replay, durations

    def steps_replayed(self) -> int | None:
        """Training steps that ran on the graphs: from the step after the capture step to
        the last step that started (a step that raised counts), or to the end of the
        replays (:attr:`Captures.replay_end`); None before the first step or without a
        capture. Counted from step numbers, not from the timed steps (those stop
        :data:`DENSE_REPLAY_STEPS` after the capture)."""
        capture, last = self.captures.training_capture_step(), self.state.step
        if capture is None or last is None:
            return None
        end = self.captures.replay_end
        if end is not None:
            last = min(last, end)
        return max(0, last - capture)
