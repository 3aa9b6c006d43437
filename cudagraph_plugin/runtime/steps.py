"""The plugin's per-step hooks, on an object of their own; owns when the plugin listens to
every step.

:class:`hookspecs.TrainingRun` dispatches ``mcgraph_train_step_start``/``_end`` only while
some registered plugin implements them. So the CUDA graph plugin keeps them here, on a
:class:`StepListener` registered when training starts and unregistered at the end of the
first step after which no step needs them:

* the capture step's wiring check (``Wiring.capture_step_ended``) is behind it;
* the run has a :class:`hookspecs.StepProgress` to read the step from (a host firing the
  hooks itself may pass ``progress=None``: the listener then hears every step);
* the measurement's window of timed steps is over (:meth:`Measurement.timed_until`:
  :data:`~cudagraph_plugin.runtime.measurement.DENSE_REPLAY_STEPS` after the capture;
  never for a run without a capture, or with buckets, which time every step);
* the opt-in fallback has nothing left to decide (:attr:`Fallback.pending`).

From then on a step costs the host no hook dispatch for the plugin. Whatever else needs
the step reads it from the run's :class:`hookspecs.StepProgress` (``RunState.step``).

The step starts the plugin's timer first (``tryfirst``) and its end stops it last
(``trylast``), so a timed step includes other plugins' step-hook work, whatever order the
plugins were registered in.
"""

from __future__ import annotations

import logging
from typing import Any

from cudagraph_plugin.runtime.fallback import Fallback
from cudagraph_plugin.runtime.measurement import Measurement
from cudagraph_plugin.runtime.state import RunState
from cudagraph_plugin.runtime.wiring import Wiring
from hookspecs import hookimpl

logger = logging.getLogger("cudagraph_plugin")


class StepListener:
    def __init__(
        self, state: RunState, measurement: Measurement, wiring: Wiring, fallback: Fallback
    ) -> None:
        self.state = state
        self.measurement = measurement
        self.wiring = wiring
        self.fallback = fallback
        self.registered = False
        # the last step it heard, once it stopped listening
        self.stopped_after: int | None = None

    def start(self) -> None:
        """Listen to every step from the next one (at ``mcgraph_train_start``)."""
        if not self.registered:
            self.state.pm.register(self)
            self.registered = True

    def stop(self) -> None:
        if self.registered:
            self.registered = False
            self.state.pm.unregister(self)

    # (Both run on every step of a run without a capture: kept to a few calls.)

    @hookimpl(tryfirst=True)
    def mcgraph_train_step_start(self, step: int) -> None:
        state = self.state
        if state.progress is None:  # a host firing the hooks itself (no TrainingRun)
            state.step = step
        if self.measurement.times(step):
            self.measurement.timer.start(step)

    @hookimpl(trylast=True)
    def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        measurement = self.measurement
        measurement.timer.stop(step)
        state = self.state
        start = state.start_step
        # (nothing to check after the capture step, but an optimizer capture that an
        # invalidation during the warm-up put off)
        wiring = self.wiring
        if (
            start is None
            or step - start <= state.settings.warmup_steps
            or step == wiring.optimizer_due
        ):
            wiring.capture_step_ended(step)
        fallback = self.fallback
        deciding = state.settings.fallback_on_slowdown and fallback.pending
        if deciding:
            fallback.step_ended(step)
            deciding = fallback.pending
        until = measurement.timed_until()
        if (
            until is not None
            and step >= until
            and not deciding
            and state.progress is not None
            and start is not None
            and step - start >= state.settings.warmup_steps
        ):
            self.stop()
            self.stopped_after = step
            logger.debug(
                "cudagraph plugin: the step hooks have nothing left to do after step %d: "
                "no longer listening to them",
                step,
            )
