"""How a peer's failure reaches the main thread of this rank: the interrupt signal's handler.

The peer watch's thread (:class:`~cudagraph_plugin.runtime.peers.PeerWatch`, which mixes
this in) sends :func:`~cudagraph_plugin.runtime.peer_mark.default_interrupt_signal` to the
main thread when it acts on a peer's mark; the handler installed here raises
:class:`~cudagraph_plugin.runtime.peer_mark.PeerFailed` (or ``PeerRefused``) there, once,
never during this rank's own shutdown, and goes back to the signal's previous handler when
the watch stops. A signal that already has a handler, or a watch started outside the main
thread, gets no interrupt: the abort alone ends the blocked call.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

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
