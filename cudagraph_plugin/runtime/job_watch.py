"""The run's side of the peer watch (:mod:`~cudagraph_plugin.runtime.peers`): when this
run starts watching (once the process group exists, from whichever hook sees it first), the
mark at the start of its shutdown (with the run's step, which an early end records), the
wait for the peers at its end, and the ``PeerFailed`` after a clean end that had gone on
past a peer's early end."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.peer_mark import PeerFailed
from cudagraph_plugin.runtime.peers import PeerWatch
from hookspecs import ShutdownReason

logger = logging.getLogger("cudagraph_plugin")


def watch_job(
    exit_deadline_s: float | None = None, current_step: Callable[[], int | None] | None = None
) -> PeerWatch | None:
    """The run's watch of its peers, once the default process group exists: ``None`` in a
    single-rank run, without a process group, or (logged) when another watch already runs
    in this process."""
    try:
        return PeerWatch.start(exit_deadline_s=exit_deadline_s, current_step=current_step)
    except RuntimeError as exc:
        logger.warning("%s: this run does not watch its peers", exc)
        return None


class JobWatch:
    """The run's side of the watch: started once the process group exists (from whichever
    hook sees it first, else at an abnormal shutdown, to mark it: a failure in the host's
    set-up or seeding), the mark at the start of shutdown, the wait for the peers at its
    end. Caches the rank and world size while the process group lives (an abort forgets
    them, and the report needs them)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.peers: PeerWatch | None = None
        self._tried = False

    def watch(self) -> None:
        if self._tried or not compat.distributed_world()[1] > 1:
            return
        self._tried = True
        self.state.ranks = compat.distributed_world()
        state = self.state
        self.peers = watch_job(state.settings.peer_exit_deadline or None, lambda: state.step)

    def end(self, reason: Any, exception: BaseException | None) -> None:
        if self.peers is None and reason.abnormal and reason is not ShutdownReason.PEER_FAILED:
            # A failure before any hook started the watch (in the host's model-parallel
            # set-up, its seeding, its model build) with the process group there: the peers
            # that watch already must hear of it, or they wait in a collective for good.
            self.watch()
        if self.peers is not None:
            self.peers.end(reason, exception)
            if self.peers.told_at_end is not None:  # (no device wait, then PeerFailed)
                self.state.past_peer_early_end = True

    def wait_for_peers(self) -> None:
        if self.peers is not None:
            self.peers.finish()
            self.peers.wait_for_peers()

    def raise_told_at_end(self) -> None:
        """After the shutdown: a clean end that had gone past a peer's early end ends the
        run with :class:`PeerFailed` (its host exits non-zero, saying it in one line)."""
        told = self.peers.told_at_end if self.peers is not None else None
        if told is not None:
            raise PeerFailed(told)
