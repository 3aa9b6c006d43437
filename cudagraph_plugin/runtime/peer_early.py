"""A peer whose own loop ended its run early, and the ranks that went on without it.

A rank whose run ends early (``early_exit``: its loop left before ``train_iters`` without
an exception, say a ``break`` or ``sys.exit(0)`` on one rank only) is no failure, and marks
none. But a rank that still trains goes on into steps the early rank never joins: the
first collective of such a step waits for it for good (over NCCL until the collective's
timeout, ten minutes or more; no launcher ends a job whose one rank exited 0).

This module owns what the peer watch (:mod:`~cudagraph_plugin.runtime.peers`) does about it:

* the early rank's record names the last step it entered (``PeerFailure.step``;
  :data:`NO_STEP`: none), written by :meth:`PeerWatch.end` to the job's first early end's
  key, after which the rank adds one to the job's news counter (as a failure's mark does):
  the watchers poll that counter alone, one store request a poll whatever happened;
* :class:`EarlyEnd`, on every other rank, reads the record when the counter moved and
  keeps it; at every poll it compares this rank's step with the record's: a rank in a
  later step is in a step the early rank never entered, and the watch ends its run as
  after a peer's failure (``peer_failed``, naming the early rank and both steps);
* at a clean end of this rank (its loop may run ahead of its device, and finish before the
  watch looked), :meth:`PeerWatch.end` asks once more (``EarlyEnd.check_now``), and, with
  no record there yet, a :class:`LateWatch` keeps asking until the shutdown's end (the
  early rank writes its record at the start of its own shutdown, which may come a moment
  later): a rank past the early end then begins the abort (a device wait of its shutdown
  on the collective ends) and its run ends with ``PeerFailed`` after the shutdown.

Ranks that all end early at the same step (an exit condition agreed by every rank, such as
Megatron-LM's exit interval) never trigger it: no rank goes past the early rank's step.
Not caught: a rank that waits for the early one outside a step (an evaluation after the
last step), and an early end from inside a step before its collectives (a ``break`` in the
``train_step`` block: that step counts as entered); a failure there still names the early
end (:func:`named_before`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cudagraph_plugin.runtime.peer_mark import PeerFailure, own_connection

logger = logging.getLogger("cudagraph_plugin")

NO_STEP = -1
"""The step of an early end that came before the rank's first step."""

LATE_WATCH_S = 60.0
"""How long, at most, a :class:`LateWatch` looks for an early end after this rank's clean
end (it stops with the shutdown, at the watch's ``finish``)."""


class EarlyEnd:
    """The watch's view of a peer's early end (see the module's docstring).

    :param rank: This rank.
    :param key: The store key of the job's first early end.
    :param current_step: The step this rank runs now, or the last one it ran; ``None``
        before its first step. A callable that raises, or gives no integer, is logged once
        and read no more (the check is then off; the rest of the watch goes on).
    """

    def __init__(self, rank: int, key: str, current_step: Callable[[], Any]) -> None:
        self.rank = rank
        self.key = key
        self._current_step: Callable[[], Any] | None = current_step
        self.record: PeerFailure | None = None

    def step(self) -> int | None:
        """This rank's step as an ``int`` (None before the first, or once unreadable)."""
        if self._current_step is None:
            return None
        try:
            step = self._current_step()
            return None if step is None else int(step)
        except Exception as exc:
            self._current_step = None
            logger.warning(
                "rank %d: the run's step cannot be read (%r): an early end of this rank "
                "records no step, and going on past a peer's is no longer watched for (a "
                "peer's failure still is)",
                self.rank,
                exc,
            )
            return None

    @property
    def readable(self) -> bool:
        return self._current_step is not None

    def read(self, store: Any) -> None:
        """Read the early end's record, if there is one and it is not known yet (when the
        job's news counter moved; raises what the store raises)."""
        if self.record is None and store.check([self.key]):
            self.record = PeerFailure.decode(store.get(self.key))

    def past(self) -> PeerFailure | None:
        """The failure to act on, once this rank is in a step after the last one the early
        rank entered; else ``None``."""
        record, step = self.record, self.step()
        if record is None or step is None or record.rank == self.rank or record.step is None:
            return None  # (no step: a record of an older version, not ours to compare)
        if step <= record.step:
            return None
        entered = "before its first step" if record.step == NO_STEP else f"after step {record.step}"
        return dataclasses.replace(
            record,
            reason=(
                f"early_exit {entered}, while rank {self.rank} went on to step {step}: that "
                "step's collectives wait for it for good. Fix: end the loop at the same step "
                "on every rank (decide on one rank and broadcast the decision, as "
                "Megatron-LM's exit conditions do)"
            ),
        )

    def check_now(self, store: Any) -> PeerFailure | None:
        """:meth:`read`, then :meth:`past`: at this rank's clean end, whatever the counter."""
        self.read(store)
        return self.past()


class LateWatch:
    """After a clean end of this rank with no early end to compare yet: polls the early
    end's key on a connection of its own (the shutdown's thread uses the watch's) until
    :meth:`stop` (the watch's ``finish``), at most :data:`LATE_WATCH_S`, and calls
    ``tell(failure)`` once this rank is found past it. A store that fails ends it quietly
    (the job is ending)."""

    def __init__(
        self, early: EarlyEnd, store: Any, poll_s: float, tell: Callable[[PeerFailure], None]
    ) -> None:
        self._early, self._store, self._poll_s, self._tell = early, store, poll_s, tell
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcgraph-late-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(self._poll_s + 1.0)

    def _run(self) -> None:
        deadline = time.monotonic() + LATE_WATCH_S
        try:
            connection = own_connection(self._store)
            while not self._done.wait(self._poll_s) and time.monotonic() < deadline:
                failure = self._early.check_now(connection)
                if failure is not None:
                    self._tell(failure)
                if failure is not None or self._early.record is not None:
                    return  # (a record not behind this ended rank's step never will be)
        except Exception as exc:  # (gone with the job: nothing left to tell)
            logger.debug("late watch for an early end: the store failed (%r)", exc)


def with_last_step(mine: PeerFailure, early: EarlyEnd | None) -> PeerFailure:
    """This rank's early-end record with the last step it entered (``NO_STEP``: none);
    unchanged where the watch does not know the run's step."""
    if early is None:
        return mine
    step = early.step()  # (first: a step that cannot be read makes it unreadable)
    if not early.readable:  # (unknown is not "before its first step")
        return mine
    return dataclasses.replace(mine, step=NO_STEP if step is None else step)


def named_before(read: Callable[[str, Callable[[Any], Any]], Any], key: str, rank: int) -> str:
    """The words that name a peer's early end in the line of a failure on ``rank`` that came
    after it (a collective the early rank no longer joins is a likely cause, and nobody
    else says it), else nothing. ``read``: the watch's optional store call, after the mark
    and apart from it (a store too slow for it costs these words, never the mark)."""
    raw = read("read an early end", lambda store: store.check([key]) and store.get(key))
    early = PeerFailure.decode(raw) if raw else None
    if early is None or early.rank == rank:
        return ""
    return (
        f" ({early.who()} had ended its run early, before this: a collective it no longer "
        "joins may be what failed here)"
    )
