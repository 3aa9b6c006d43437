"""Measurement of one run: every training step timed, split into eager and replayed steps.

The step whose capture splits them is the training graph's (full iteration or TE), else the
optimizer graph's (:meth:`Captures.training_capture_step`); replays end where the opt-in
fallback freed the graph.
"""

from __future__ import annotations

from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.state import RunState
from cudagraph_plugin.runtime.timing import StepTimer, split_samples


class Measurement:
    def __init__(self, state: RunState, captures: Captures) -> None:
        self.state = state
        self.captures = captures
        self.timer = StepTimer(use_cuda=state.cuda)
        self.fallback_step: int | None = None

    def samples(self, sync: bool = True) -> tuple[list[int], list[int], dict[int, float]]:
        """(eager steps, replayed steps, milliseconds per timed step); ``sync=False`` leaves
        out steps still in flight on the device."""
        durations = self.timer.durations_ms(sync=sync)
        eager, replay = split_samples(
            sorted(durations),
            self.state.start_step,
            self.captures.training_capture_step(),
            self.fallback_step,
        )
        return eager, replay, durations
