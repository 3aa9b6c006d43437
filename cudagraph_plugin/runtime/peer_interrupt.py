"""How a peer's failure reaches the main thread of this rank: the interrupt signal's handler,
and the abort of the process groups that releases a main thread blocked in a collective.

The peer watch's thread (:class:`~cudagraph_plugin.runtime.peers.PeerWatch`, which mixes
this in) sends :func:`~cudagraph_plugin.runtime.peer_mark.default_interrupt_signal` to the
main thread when it acts on a peer's mark; the handler installed here raises
:class:`~cudagraph_plugin.runtime.peer_mark.PeerFailed` (or ``PeerRefused``) there, once,
never during this rank's own shutdown, and goes back to the signal's previous handler when
the watch stops. A signal that already has a handler, or a watch started outside the main
thread, gets no interrupt: the abort alone ends the blocked call.

A peer that dies without a word (SIGKILL, a lost node) leaves no mark; torchrun then sends
SIGTERM to the other ranks, which a main thread blocked in that peer's collective cannot act
on. The run's stuck-signal watch asks :meth:`PeerInterrupt.release_blocked_main_thread`
(offered at the watch's start) before it would end the process without its shutdown: the
same abort ends the blocked call, and the SIGTERM's own handler ends the run.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from cudagraph_plugin.runtime.peer_deadline import ExitDeadline
from cudagraph_plugin.runtime.peer_mark import (
    PeerFailed,
    PeerFailure,
    PeerRefused,
    run_is_shutting_down,
)
from cudagraph_plugin.runtime.ranklog import RankNamed

logger = RankNamed()  # (every line names its rank: no "[rank 1] rank 1 failed")


class PeerInterrupt:
    """The interrupt half of a peer watch (its state is set by the watch's ``__init__``)."""

    rank: int
    peer_failure: PeerFailure | None
    _signum: int | None
    _previous_handler: Any
    _handler_installed: bool
    _closing: bool
    _raised: bool
    _lock: threading.Lock
    _stopping: bool
    _acting: bool
    _abort: Callable[[], None]
    _main_ident: int | None
    deadline: ExitDeadline | None
    released_by: str | None = None  # (the signal whose stuck wait the release ended)

    def _install_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.info(
                "rank %d: peer watch started outside the main thread: a peer's failure aborts "
                "the process groups but cannot interrupt the training loop",
                self.rank,
            )
            return
        assert self._signum is not None
        previous = signal.getsignal(self._signum)
        if isinstance(getattr(previous, "__self__", None), PeerInterrupt):
            # left by a watch stopped from another thread (it could not put SIG_DFL back)
            previous = signal.SIG_DFL
        if previous not in (signal.SIG_DFL, None):
            logger.warning(
                "rank %d: peer watch: signal %d already has a handler (%r); a peer's failure "
                "aborts the process groups but does not interrupt the training loop (pass "
                "another interrupt_signal to PeerWatch.start)",
                self.rank,
                self._signum,
                previous,
            )
            return
        self._previous_handler = previous
        signal.signal(self._signum, self._on_signal)
        self._handler_installed = True

    def _restore_handler(self) -> None:
        if not self._handler_installed:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # stopped from another thread: the handler stays, and does nothing now
        self._handler_installed = False
        assert self._signum is not None
        signal.signal(self._signum, self._previous_handler or signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        failure = self.peer_failure
        if failure is None or self._raised:
            return
        if self._closing or run_is_shutting_down(frame):
            logger.info(
                "rank %d: %s while this rank was shutting down: its shutdown goes on",
                self.rank,
                failure.describe(),
            )
            return
        self._raised = True
        raise (PeerRefused if failure.refusal else PeerFailed)(failure)

    def _act(self, failure: PeerFailure, *, late: bool = False) -> bool:
        """Act on a peer's failure: log it, arm the exit deadline, interrupt the main thread
        (while the handler is installed), begin the abort. Once only, and never after the
        watch began to stop, unless ``late``: a clean end of this rank that found, after its
        watch stopped, that it had gone past a peer's early end (nothing to interrupt).
        Returns whether it acted."""
        with self._lock:
            if (self._stopping and not late) or self._acting:
                return False
            self._acting = True
            self.peer_failure = failure
            logger.error(
                "rank %d: %s; aborting this rank's process groups and ending its run",
                self.rank,
                failure.describe(),
            )
            if self.deadline is not None:
                self.deadline.arm(failure.describe())
            if self._handler_installed and self._main_ident is not None:
                # Sent before the abort: the handler is pending when the blocked call returns.
                try:
                    signal.pthread_kill(self._main_ident, self._signum)
                except OSError as exc:  # the main thread is gone (the interpreter is exiting)
                    logger.info("rank %d: cannot interrupt the main thread (%s)", self.rank, exc)
        self._begin_abort()
        return True

    def release_blocked_main_thread(self, signum: int) -> bool:
        """Offered to the run's stuck-signal watch (``hookspecs.run_signals.offer_release``):
        a signal the main thread could not act on (torchrun's SIGTERM after a rank died
        without a word, while this one waits in a collective on it) begins the abort of the
        process groups, as a peer's mark does, instead of ending the process without its
        shutdown. The blocked call then returns, the signal's handler ends the run
        (``signal``), and the shutdown frees the graphs; the exit deadline, armed here, bounds
        the rest. False (the watch ends the process as before) once this watch acted or
        stopped, without a deadline, or where the deadline's countdown cannot start."""
        name = signal.Signals(signum).name
        with self._lock:
            if self._stopping or self._acting or self.deadline is None:
                return False
            self.deadline.arm(f"{name} came while the main thread was blocked in C")
            if not self.deadline.armed:
                return False  # (logged: nothing would bound a release that does not end)
            self._acting = True
            self.released_by = f"{name} came while a peer left this rank blocked in C"
            logger.error(
                "rank %d: %s came while this rank's main thread was blocked in C (a collective "
                "whose peer ended without a word?); aborting this rank's process groups so "
                "that its shutdown runs (the exit deadline: %g s)",
                self.rank,
                name,
                self.deadline.seconds,
            )
        self._begin_abort()
        return True

    def _begin_abort(self) -> None:
        began = time.monotonic()
        try:
            self._abort()
        except Exception:
            logger.exception("rank %d: aborting the process groups failed", self.rank)
            return
        logger.info(
            "rank %d: the abort of every process group began (%.3f s)",
            self.rank,
            time.monotonic() - began,
        )
