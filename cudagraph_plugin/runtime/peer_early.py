"""A peer whose own loop ended its run early, and the ranks that went on without it.

A rank whose run ends early (``early_exit``: its loop left before ``train_iters`` without
an exception, say a ``break`` or ``sys.exit(0)`` on one rank only) is no failure, and marks
none. But a rank that still trains goes on into steps the early rank never joins: the
first collective of such a step waits for it for good (over NCCL until the collective's
timeout, ten minutes or more; no launcher ends a job whose one rank exited 0).

This module owns what the peer watch (:mod:`~cudagraph_plugin.runtime.peers`) does about it:

* the early rank's record names the last step it entered (``PeerFailure.step``; ``-1``:
  none), written by :meth:`PeerWatch.end` to the job's first early end's key;
* :class:`EarlyEnd`, on every other rank's watcher, reads that key only while this rank's
  step has not moved since the previous poll (a healthy loop whose steps are shorter than
  the poll interval costs the store no extra request), and turns a record whose step is
  behind this rank's into a failure to act on: this rank is in a step the early rank
  never entered. The watch then ends this run as after a peer's failure
  (``peer_failed``, naming the early rank and both steps).

Ranks that all end early at the same step (an exit condition agreed by every rank, such as
Megatron-LM's exit interval) never trigger it: no rank goes past the early rank's step. A
rank that waits for the early one outside a step (an evaluation after the last step) is not
caught; a failure there still names the early end (:func:`named_before`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cudagraph_plugin.runtime.peer_mark import PeerFailure

NO_STEP = -1
"""The step of an early end that came before the rank's first step."""


class EarlyEnd:
    """The watcher's check for a peer's early end (see the module's docstring).

    :param rank: This rank.
    :param key: The store key of the job's first early end.
    :param current_step: The step this rank runs now, or the last one it ran; ``None``
        before its first step.
    """

    def __init__(self, rank: int, key: str, current_step: Callable[[], int | None]) -> None:
        self.rank = rank
        self.key = key
        self.current_step = current_step
        self.record: PeerFailure | None = None
        self._seen: int | None = None

    def check(self, store: Any) -> PeerFailure | None:
        """One poll (on the watcher's store connection): the failure to act on, once this
        rank is in a step after the last one the early rank entered; else ``None``."""
        step = self.current_step()
        if step is None:
            return None
        if self.record is None:
            moved, self._seen = step != self._seen, step
            if moved or not store.check([self.key]):
                return None
            self.record = PeerFailure.decode(store.get(self.key))
        record = self.record
        if record.rank == self.rank or record.step is None or step <= record.step:
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


def with_last_step(mine: PeerFailure, current_step: Callable[[], int | None] | None) -> PeerFailure:
    """This rank's early-end record with the last step it entered (``NO_STEP``: none);
    unchanged where the watch has no ``current_step``."""
    if current_step is None:
        return mine
    step = current_step()
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
