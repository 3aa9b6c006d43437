"""Why a run ended (a leaf: imports nothing of the contract).

:class:`ShutdownReason` is the ``reason`` of ``mcgraph_shutdown``; :class:`SignalReceived` is
what a handled signal becomes in the main thread, so the stack unwinds through the host's
``finally`` blocks and the shutdown hook.
"""

from __future__ import annotations

import enum
import signal


class ShutdownReason(enum.StrEnum):
    """Why a run ended (the ``reason`` of ``mcgraph_shutdown``)."""

    COMPLETED = "completed"
    EARLY_EXIT = "early_exit"
    EXCEPTION = "exception"
    INTERRUPTED = "interrupted"
    SIGNAL = "signal"

    @property
    def abnormal(self) -> bool:
        """The run ended by an exception, Ctrl-C or a signal: in a multi-rank job a peer may
        be gone, so nothing may wait on it (no device synchronisation, no graceful
        process-group teardown)."""
        return self in (ShutdownReason.EXCEPTION, ShutdownReason.INTERRUPTED, ShutdownReason.SIGNAL)


class SignalReceived(BaseException):
    """Raised in the main thread when a handled signal (SIGTERM) arrives during a run.

    A ``BaseException`` so that a host's ``except Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")
