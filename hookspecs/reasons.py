"""Why a run ended (a leaf: imports nothing of the contract).

:class:`ShutdownReason` is the ``reason`` of ``mcgraph_shutdown``; :class:`SignalReceived` is
what a handled signal becomes in the main thread, so the stack unwinds through the host's
``finally`` blocks and the shutdown hook; :class:`PeerFailed` is what another rank's failure
becomes there (:class:`PeerRefused` when that rank refused its configuration).
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
    PEER_FAILED = "peer_failed"
    """Another rank of the job failed first; this rank was told and ended its run."""

    @property
    def abnormal(self) -> bool:
        """The run ended by an exception, Ctrl-C, a signal or a peer's failure: in a
        multi-rank job a peer may be gone, so nothing may wait on it (no device
        synchronisation, no graceful process-group teardown)."""
        return self in _ABNORMAL


_ABNORMAL = frozenset(
    (
        ShutdownReason.EXCEPTION,
        ShutdownReason.INTERRUPTED,
        ShutdownReason.SIGNAL,
        ShutdownReason.PEER_FAILED,
    )
)


class SignalReceived(BaseException):
    """Raised in the main thread when a handled signal (SIGTERM) arrives during a run.

    A ``BaseException`` so that a host's ``except Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


class PeerFailed(BaseException):
    """Raised in a rank's main thread when another rank of the job failed first (a plugin
    that watches the job raises it, e.g. the CUDA graph plugin's); the run then ends with
    ``ShutdownReason.PEER_FAILED``.

    A ``BaseException``, like :class:`SignalReceived`, so that a host's ``except Exception``
    does not swallow it. ``rank`` is the rank that failed (-1: not known), ``reason`` what
    it said. A host hands it to ``print_peer_failure`` (one line, no traceback, exit status
    ``exit_code``).
    """

    exit_code = 1

    def __init__(self, rank: int, reason: str, message: str | None = None) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(message or f"rank {rank} failed: {reason}")


def refused_by(rank: int | str, refusal: str) -> str:
    """A refusal as said by (or for) a rank other than 0: ``rank N refused the run: ...``."""
    return f"rank {rank} refused the run: {refusal}"


class PeerRefused(PeerFailed):
    """A :class:`PeerFailed` whose rank refused the run as configured (it raised a
    ``ConfigurationError``, the same refusal each rank usually reaches, that one sooner).
    ``refusal`` is that rank's message. A host hands it to ``print_refusal`` like its own
    ``ConfigurationError`` (``except (ConfigurationError, PeerRefused)``): the refusal is
    then printed once per job, by the rank that refused first, without a traceback, and
    every rank exits with status 2 (this one says nothing: ``said_here`` is False). A
    plugin that raises it sets ``said_here = True`` on the refusing rank's
    ``ConfigurationError`` (the CUDA graph plugin's watch does, from the job's failure mark).
    """

    exit_code = 2
    said_here: bool | None = False

    def __init__(
        self, rank: int, reason: str, message: str | None = None, refusal: str = ""
    ) -> None:
        self.refusal = refusal
        super().__init__(rank, reason, message or refused_by(rank, refusal))
