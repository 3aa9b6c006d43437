"""The end of a host's teardown (``TrainingRun(teardown=...)``) that a signal reached: it
runs inside the run's shutdown, where a signal is held until the shutdown ends, so a
teardown that never returns would hold it for good. :mod:`hookspecs.run_signals` starts the
bound; this module is its own so that module stays within its size."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from hookspecs.errors import say_ending_anyway, write_stderr
from hookspecs.ranks import rank_tag


class TeardownBound:
    """The bound on a host's teardown (``TrainingRun(teardown=...)``) that a signal reached:
    held there like one during the shutdown hook, the signal would otherwise wait for a
    teardown that waits for good (a graceful ``destroy_process_group()`` whose peer is
    gone) until the launcher's SIGKILL, or for ever under a plain ``kill``, where after the
    run it ended the process at once. The graphs are freed by then: after the stuck-signal
    wait (``run_signals.stuck_signal_seconds()``) this says the run's ending and ends the
    process with status 128 + the signal number, in one line. ``cancel()`` once the
    teardown returned."""

    def __init__(self, run: Any, signum: int, seconds: float, wait_var: str) -> None:
        # run: the RunSignals whose teardown this bounds (its ``_ending`` is said)
        self.run, self.signum, self.seconds, self.wait_var = run, signum, seconds, wait_var
        self._timer = threading.Timer(seconds, self._end)
        self._timer.daemon = True
        self._timer.name = "mcgraph-teardown-bound"
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def _end(self) -> None:
        say_ending_anyway(self.run._ending)
        write_stderr(
            f"hookspecs.run: {rank_tag()}{signal.Signals(self.signum).name} received during "
            f"the host's teardown, which has not returned {self.seconds:g} s later: ending "
            f"the process now with status {128 + self.signum} (the graphs are freed; the "
            f"wait: {self.wait_var})\n"
        )
        os._exit(128 + self.signum)
