"""The last bound of a rank whose peer failed: it ends by a deadline, whatever blocks it.

:mod:`~cudagraph_plugin.runtime.peers` ends such a rank within seconds through its normal
shutdown: :class:`~cudagraph_plugin.runtime.peer_mark.PeerFailed` in the main thread, the abort
of the process groups, the graphs freed, the abort waited for. Each of those waits is
bounded, but a rank can still stay stuck in C where no Python code runs again: a device wait
behind a collective whose communicator's teardown waits for a CUDA graph no one can free, a
``PeerFailed`` swallowed (raised inside a ``__del__``, caught by a host's ``except
BaseException``) and the main thread then blocked in the next collective, a host teardown
that waits once more for an abort that did not end. torchrun then kills it only after its
grace period (30 s), and the whole job waits.

:class:`ExitDeadline` is armed by the watcher when it acts on a peer's failure, and by the
release of a main thread blocked in C (a signal after a peer died without a word). If the
process still runs ``seconds`` later, a thread of its own writes why to stderr (straight to
the file descriptor: no logging lock, which the stuck thread may hold), dumps every thread's
stack (:func:`faulthandler.dump_traceback`, useful to say where it hung) and ends the process
with :data:`EXIT_CODE` (``os._exit``: nothing more waits). Where the process is already in
the interpreter's finalisation (a process group's destructor stuck at exit), no Python
thread runs any more: a backstop, :func:`faulthandler.dump_traceback_later` (a C thread),
then dumps the stacks ("Timeout") and exits with status 1, :data:`BACKSTOP_S` later. It is
the process's one such timer: arming replaces a host's own (a periodic stack dump, say), and
cancelling ends whichever is set. Armed, it also takes the process's end over from the
run's stuck-signal watch (``hookspecs.run_signals.end_bounded_elsewhere``): a SIGTERM the
blocked main thread cannot act on would otherwise end the process 5 s later without its
shutdown, before the abort (or, over gloo, the failed peer's exit) releases it. A shutdown
that settled (the abort ended, the groups forgotten) cancels both. The deadline is
``cuda_graph_peer_exit_deadline`` (``--cuda-graph-peer-exit-deadline``, 0: off).

Pure Python (no torch).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

from cudagraph_plugin.runtime.ranklog import RankNamed
from hookspecs.run_signals import end_bounded_elsewhere

logger = RankNamed()  # (every line names its rank: no "[rank 1] rank 1 failed")

EXIT_CODE = 70
"""The exit status of a rank ended by its deadline (``EX_SOFTWARE``): non-zero, and told
apart from an exception's 1 and a signal's negative status."""

BACKSTOP_S = 1.0
"""How long after the deadline the finalisation backstop ends the process."""

MAX_DEADLINE_S = 3600.0
"""The longest deadline (past it, the timers overflow on some platforms)."""

MARGIN_S = 1.0
"""What :meth:`ExitDeadline.budget` leaves before the deadline: a wait cut short by it ends
in time for the rank to log and exit by itself."""


class ExitDeadline:
    """End this process ``seconds`` after :meth:`arm` unless :meth:`cancel` came first.

    :param rank: This rank (named in the message).
    :param seconds: The deadline, a positive number of seconds.
    :param exit: What ends the process (``os._exit``; tests pass a recorder).
    :param fd: Where the message and the stacks go (standard error).
    :param backstop: Also arm :func:`faulthandler.dump_traceback_later` (off for in-process
        tests, whose ``exit`` returns).
    """

    def __init__(
        self,
        rank: int,
        seconds: float,
        *,
        exit: Callable[[int], None] = os._exit,
        fd: int | None = None,
        backstop: bool = True,
    ) -> None:
        number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if not number or not 0 < seconds <= MAX_DEADLINE_S:
            raise ValueError(
                f"ExitDeadline: seconds={seconds!r} must be a positive number of seconds, at "
                f"most {MAX_DEADLINE_S:g}"
            )
        self.rank = rank
        self.seconds = float(seconds)
        self._exit = exit
        self._fd = fd if fd is not None else _stderr_fd()
        self._backstop = backstop
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None
        self._ends_at: float | None = None
        self.fired = False

    @property
    def armed(self) -> bool:
        """Counting down: armed, neither cancelled nor fired."""
        return self._thread is not None and not self._cancelled.is_set() and not self.fired

    def arm(self, what: str) -> None:
        """Start the countdown (once; a second call changes nothing): ``what`` says what
        happened (the peer's failure), for the message. Never raises: it runs in the watch's
        reaction to the failure, which must go on (logged if the countdown cannot start)."""
        if self._thread is not None:
            return
        try:
            self._ends_at = time.monotonic() + self.seconds
            thread = threading.Thread(
                target=self._run, args=(what,), name="mcgraph-exit-deadline", daemon=True
            )
            thread.start()
            self._thread = thread  # (only once it runs: `armed` says the countdown is on)
            # (the run's stuck-signal exit, without the shutdown hooks, would come first)
            end_bounded_elsewhere(f"rank {self.rank}'s peer exit deadline, {self.seconds:g} s")
            if self._backstop:
                faulthandler.dump_traceback_later(
                    self.seconds + BACKSTOP_S, exit=True, file=self._fd
                )
        except Exception as exc:
            logger.error("rank %d: the exit deadline could not be armed: %s", self.rank, exc)

    def budget(self, seconds: float) -> float:
        """``seconds``, shortened to end :data:`MARGIN_S` before an armed deadline (at least
        0.1 s): what a wait of the shutdown may still take."""
        if not self.armed or self._ends_at is None:
            return seconds
        return max(0.1, min(seconds, self._ends_at - time.monotonic() - MARGIN_S))

    def cancel(self) -> None:
        if self._thread is not None and not self._cancelled.is_set():
            if self._backstop:
                faulthandler.cancel_dump_traceback_later()
            end_bounded_elsewhere(None)
        self._cancelled.set()

    def _run(self, what: str) -> None:
        if self._cancelled.wait(self.seconds):
            return
        self.fired = True
        message = (
            f"cudagraph_plugin: rank {self.rank}: still running {self.seconds:g} s after "
            f"{what}; its threads' stacks follow, then it exits with status {EXIT_CODE} "
            "(cuda_graph_peer_exit_deadline; 0 turns this off)\n"
        )
        try:
            os.write(self._fd, message.encode("utf-8", "replace"))
            faulthandler.dump_traceback(file=self._fd, all_threads=True)
        except (OSError, ValueError):
            pass  # no stderr left: the exit is what matters
        self._exit(EXIT_CODE)
        end_bounded_elsewhere(None)  # (an exit that returned bounds nothing: handed back)


def _stderr_fd() -> int:
    try:
        return (sys.__stderr__ or sys.stderr).fileno()
    except (AttributeError, OSError, ValueError):
        return 2
