"""Every rank ends within seconds when one rank of a multi-rank job fails.

This module owns the watch: what each rank does about a peer's failure mark (the mark and
the bounded store calls are :mod:`~cudagraph_plugin.runtime.peer_mark`, the main thread's
interrupt :mod:`~cudagraph_plugin.runtime.peer_interrupt`):

* **Mark.** A rank whose run ends abnormally (exception, Ctrl-C, signal, failed capture)
  writes ``rank`` and ``reason`` into the store of the default process group (torchrun's
  TCPStore) as the first thing of its shutdown: :meth:`PeerWatch.end`. The first rank to
  fail claims one key (``compare_set``), so two ranks failing at once agree on which was
  first; each also leaves its own record. A refused configuration (``ConfigurationError``)
  is marked with its whole message: the told ranks raise :class:`PeerRefused`, which the
  host hands to ``print_refusal`` as its own refusal (it then says nothing and exits 2),
  and the refusing rank learns from the mark that its refusal came first
  (``said_here``): it says it for the job.
* **Watch.** A daemon thread on every rank polls the job's news counter (one store
  request a poll; every mark adds one to it after it is written) over its own connection
  to the store (:meth:`PeerWatch.start`), and reads the mark when the counter moved. A
  store that is gone (connection refused or reset) stops the watch quietly; a store that
  no longer answers can stall only that thread: the main thread never waits on a store
  call longer than a bounded time.
* **Abort and interrupt.** On a peer's mark the watcher logs once which rank failed and
  why, sends a signal to the main thread whose handler raises :class:`PeerFailed` (a
  ``BaseException``, so a host's ``except Exception`` does not swallow it), then aborts
  this rank's process groups. The abort is what ends a main thread blocked in C: a CUDA
  synchronisation or ``.item()`` behind an NCCL collective that can never complete returns
  once the communicator is aborted, and the handler runs as soon as Python code runs again.
  ``TrainingRun`` then shuts down with ``ShutdownReason.PEER_FAILED``. Every group is
  aborted from its own thread at once (:class:`~cudagraph_plugin.compat.GroupAbort`
  says why one after the other hangs), and the teardown of a communicator that a CUDA
  graph captured ends only once the graph is destroyed: the watcher only begins the
  abort; the shutdown frees the graphs, then waits for the abort's end and forgets the
  groups at its very end, on its own thread (:meth:`PeerWatch.finish`).
* **Wait for the peers.** The rank that failed keeps its process until every rank has
  begun its shutdown (:meth:`PeerWatch.wait_for_peers`, bounded): its exit would make
  torchrun send SIGTERM to the others, which, arriving first, would end them with
  ``signal`` instead of ``peer_failed``. Every rank counts itself as ended in
  :meth:`PeerWatch.end`, whatever its reason.

* **Deadline.** A rank that acted on a peer's mark is ended if it still runs
  ``exit_deadline_s`` later (:class:`~cudagraph_plugin.runtime.peer_deadline.ExitDeadline`,
  ``cuda_graph_peer_exit_deadline``); a shutdown that settled (:meth:`finish`) cancels it.

* **Early end.** A rank whose own loop ended its run early (``early_exit``) marks no
  failure, but a rank that goes on into a step it never entered ends as after one, or,
  where its loop finished first, its clean end does (``told_at_end``;
  :mod:`~cudagraph_plugin.runtime.peer_early`, with ``current_step``).

A rank never reacts to its own mark, never interrupts its own shutdown (the handler does
nothing once :meth:`PeerWatch.stop` began or while ``TrainingRun`` is shutting down), and a
normal end marks nothing: no false alarm when ranks finish at different times.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.peer_deadline import ExitDeadline
from cudagraph_plugin.runtime.peer_early import EarlyEnd, LateWatch, named_before, with_last_step
from cudagraph_plugin.runtime.peer_interrupt import PeerInterrupt
from cudagraph_plugin.runtime.peer_mark import (
    ABORT_WAIT_S,
    KEY_PREFIX,
    MAX_REASON_CHARS,
    MIN_POLL_S,
    PEER_WAIT_S,
    POLL_S_PER_RANK,
    RECHECK_POLLS,
    STORE_WAIT_S,
    PeerFailure,
    StoreCalls,
    default_interrupt_signal,
    describe_end,
    first_line,
    note_speaker,
    own_connection,
    refusal_of,
)
from cudagraph_plugin.runtime.ranklog import RankNamed
from hookspecs import ShutdownReason
from hookspecs.run_signals import held_signal, offer_release, withdraw_release

logger = RankNamed()  # (every line names its rank: no "[rank 1] rank 1 failed")

_generation = 0
_active: PeerWatch | None = None
_registry_lock = threading.Lock()


class PeerWatch(PeerInterrupt, StoreCalls):
    """The failure mark and the watcher of one run on one rank; create it with :meth:`start`.

    :ivar peer_failure: The peer failure this rank's watcher acted on, if any.
    :ivar first_failure: The job's first failure as the mark at this rank's end found it
        (this rank's own, or an earlier one of a peer), if this rank marked one.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        poll_s: float | None = None,
        abort: Callable[[], None] = compat.begin_abort_process_groups,
        settle: Callable[[float], bool] = compat.abort_process_groups,
        interrupt_signal: int | None = None,
        generation: int = 0,
        exit_deadline_s: float | None = None,
        current_step: Callable[[], int | None] | None = None,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"PeerWatch: need 0 <= rank < world_size and world_size >= 2, got rank={rank} "
                f"and world_size={world_size}; a single-rank run has no peer to watch"
            )
        if poll_s is not None and not poll_s > 0:
            raise ValueError(f"PeerWatch: poll_s={poll_s!r} must be a positive number of seconds")
        self.rank = rank
        self.world_size = world_size
        if poll_s is None:
            poll_s = max(MIN_POLL_S, POLL_S_PER_RANK * world_size)
        self.poll_s = poll_s
        self.peer_failure: PeerFailure | None = None
        self.first_failure: PeerFailure | None = None
        self._store = store
        self._connection: Any = None
        self._abort = abort
        self._settle = settle
        self._signum = interrupt_signal
        self.generation = generation
        self._prefix = f"{KEY_PREFIX}/{generation}"
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False  # read by the signal handler, which must not take the lock
        self._stopping = False
        self._acting = False
        self._raised = False
        self._ended = False
        self._store_lost = False  # the store failed or did not answer: not asked again
        self._deferred: BaseException | None = None  # interrupted the mark: raised after it
        self._previous_handler: Any = None
        self._handler_installed = False
        self._main_ident = threading.main_thread().ident
        self.deadline = ExitDeadline(rank, exit_deadline_s) if exit_deadline_s else None
        self._early = EarlyEnd(rank, self.early_key, current_step) if current_step else None
        self.told_at_end: PeerFailure | None = None  # (its clean end went past an early end)
        self._late: LateWatch | None = None
        self._thread = threading.Thread(target=self._watch, name="mcgraph-peer-watch", daemon=True)

    @property
    def first_key(self) -> str:
        return f"{self._prefix}/first"

    def rank_key(self, rank: int) -> str:
        return f"{self._prefix}/rank/{rank}"

    @property
    def news_key(self) -> str:
        """Counts the marks written (failures, the first early end): what the watchers poll."""
        return f"{self._prefix}/news"

    @property
    def ended_key(self) -> str:
        return f"{self._prefix}/ended"

    @property
    def early_key(self) -> str:
        """The first rank whose run ended early (``early_exit``): no failure, but a rank
        going past its last step is ended, and a later failure names it."""
        return f"{self._prefix}/early"

    # -- life cycle ---------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        *,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        poll_s: float | None = None,
        abort: Callable[[], None] = compat.begin_abort_process_groups,
        settle: Callable[[float], bool] = compat.abort_process_groups,
        interrupt_signal: int | None = None,
        interrupt: bool = True,
        exit_deadline_s: float | None = None,
        release: bool | None = None,
        current_step: Callable[[], int | None] | None = None,
    ) -> PeerWatch | None:
        """Start watching for a peer's failure; ``None`` in a single-rank run.

        Call it from the thread that runs the training loop once the default process group
        exists, and end the watch with :meth:`end` (or :meth:`stop`) first thing at
        shutdown. Never blocks: the watcher connects to the store in its own thread.

        :param store: The job's store; the default process group's by default.
        :param rank: This rank; ``torch.distributed.get_rank()`` by default.
        :param world_size: Ranks in the job; ``torch.distributed.get_world_size()`` by default.
        :param poll_s: Seconds between polls (default: 0.5 s, more for jobs over 1000 ranks).
        :param abort: What ends this rank's waits on the failed peer, run by the watcher:
            it must return once the abort has begun, not wait for its end (default: start
            aborting every process group at once).
        :param settle: What :meth:`finish` calls, on the shutdown's thread, to wait (at
            most the seconds it is given) for the abort to end and clean up after it;
            returns whether it ended (default: wait, then forget the process groups).
        :param interrupt_signal: The signal whose handler raises :class:`PeerFailed` in the
            main thread (default: :func:`default_interrupt_signal`).
        :param interrupt: With False (or off the main thread, or when the signal already has
            a handler) the watcher only aborts: the blocked call then fails with the
            backend's error and the run ends with ``exception``.
        :param exit_deadline_s: Once the watcher acted (or released a blocked main thread:
            ``release``), end the process this many seconds later unless :meth:`finish`
            settled first (:class:`ExitDeadline`); None: never.
        :param release: Offer :meth:`release_blocked_main_thread` to the run's stuck-signal
            watch (with a deadline only). None: over NCCL, whose abort ends a blocked
            collective (over gloo only the peer's exit does: it would delay the exit).
        :param current_step: The step this rank runs now, or last ran (None before the
            first): an early end records it; a rank in a step after a peer's early end
            ends as after its failure (:mod:`~cudagraph_plugin.runtime.peer_early`).
        :raises RuntimeError: if another watch is running in this process.
        """
        global _generation, _active
        if rank is None or world_size is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        if world_size < 2:
            return None
        with _registry_lock:
            if _active is not None:
                raise RuntimeError(
                    f"PeerWatch.start: a watch is already running in this process (rank "
                    f"{_active.rank}); end it with end() or stop() before starting another"
                )
            _generation += 1
            watch = cls(
                compat.default_store() if store is None else store,
                rank,
                world_size,
                poll_s=poll_s,
                abort=abort,
                settle=settle,
                interrupt_signal=default_interrupt_signal()
                if interrupt_signal is None
                else interrupt_signal,
                generation=_generation,
                exit_deadline_s=exit_deadline_s,
                current_step=current_step,
            )
            _active = watch
        if interrupt:
            watch._install_handler()
        if release is None:
            release = compat.nccl_initialized()
        if release and watch.deadline is not None:  # (a release needs a bound)
            offer_release(watch.release_blocked_main_thread)
        try:
            watch._thread.start()
        except BaseException:  # ("can't start new thread": the run goes on without a watch)
            watch.stop()  # (the offer, the handler and the registry taken back)
            raise
        logger.debug(
            "peer watch: rank %d of %d polls %s every %.2f s",
            rank,
            world_size,
            watch.news_key,
            watch.poll_s,
        )
        return watch

    def end(self, reason: ShutdownReason | str, exception: BaseException | None = None) -> None:
        """The first thing of this rank's shutdown: stop watching; if the run ended
        abnormally by its own failure, mark it so that every other rank ends too (a run
        ended by ``peer_failed`` marks nothing: the peer's mark is there); count this rank
        as ended (what :meth:`wait_for_peers` waits for)."""
        reason = ShutdownReason(reason)
        if reason.abnormal and reason is not ShutdownReason.PEER_FAILED:
            if self.peer_failure is None:
                said = describe_end(reason, exception)
                if self.released_by is not None:  # (the launcher's signal, whatever came first)
                    said = f"{ShutdownReason.SIGNAL}: {self.released_by}"
                first = self.mark_failed(said, refusal_of(exception))
                note_speaker(exception, first, self.rank)
                return
            # The watch had acted on a peer's failure: what ended this run is its
            # consequence, not a failure of this rank's (the launcher's SIGTERM handled
            # before the watch's interrupt, a collective broken by the abort): no mark of
            # its own, which would say this rank failed too (said below, as an end after it)
            note_speaker(exception, self.peer_failure, self.rank)
        self.stop()
        if not reason.abnormal:
            self._past_early_end()
        if self.peer_failure is not None and reason is not ShutdownReason.PEER_FAILED:
            logger.warning(
                "rank %d: the run ended (%s) after %s",
                self.rank,
                reason,
                self.peer_failure.describe(),
            )
        if not self._ended and not self._store_lost:
            self._ended = True
            early = reason is ShutdownReason.EARLY_EXIT and self.peer_failure is None
            mine = PeerFailure(self.rank, str(reason), socket.gethostname(), os.getpid())
            mine = with_last_step(mine, self._early) if early else mine

            def count(store: Any) -> None:
                store.add(self.ended_key, 1)  # (first: what a failing rank waits for)
                if early:  # (the first to end early is kept, as the first failure is)
                    store.compare_set(self.early_key, "", mine.encode())
                    store.add(self.news_key, 1)

            # A normal end must not complain when the store is gone (rank 0, which hosted
            # it, may have finished first): only a rank that failed waits for this count.
            self._store_call("end", count, quiet=True, defer=True)
            self._raise_deferred()

    def mark_failed(self, reason: str, refusal: str = "") -> PeerFailure | None:
        """Record this rank's failure in the store and count the rank as ended (stopping
        the watch first, so that this rank never reacts to its own mark). ``refusal``: the
        run was refused as configured, with this message (the told ranks raise
        :class:`PeerRefused`).

        :returns: The job's first failure: this rank's own, or a peer's that came earlier
            (logged); ``None`` if the store did not answer within ``STORE_WAIT_S``.
        """
        self.stop()
        if self._ended:
            return self.first_failure
        self._ended = True
        mine = PeerFailure(
            self.rank, reason[:MAX_REASON_CHARS], socket.gethostname(), os.getpid(), refusal
        )

        def record(store: Any) -> PeerFailure:
            store.set(self.rank_key(self.rank), mine.encode())
            first = PeerFailure.decode(store.compare_set(self.first_key, "", mine.encode()))
            store.add(self.news_key, 1)  # (after the mark: a watcher reads it on news)
            store.add(self.ended_key, 1)
            return first

        first = self._store_call("mark", record, defer=True)
        if first is None:
            self._raise_deferred()
            return None
        self.first_failure = first
        if (first.rank, first.pid) == (mine.rank, mine.pid):
            logger.error(
                "rank %d %s (%s): every other rank is told to end its run%s",
                self.rank,
                mine.outcome,
                mine.summary,
                ""
                if mine.stopped
                else named_before(self._optional_call, self.early_key, self.rank),
            )
        else:
            # Stopped after a peer was: most likely the whole job is being stopped (torchrun
            # passes a SIGTERM or Ctrl-C on to every rank; a scheduler's preemption), which
            # no rank caused: said so rather than as two failures.
            logger.warning(
                "rank %d %s (%s); %s first%s",
                self.rank,
                mine.outcome,
                mine.summary,
                first.describe(),
                ": the job as a whole is likely being stopped (by its launcher, a scheduler "
                "or a Ctrl-C; torchrun also stops every rank after one died without a word, "
                "its exit status in torchrun's log)"
                if mine.stopped and first.stopped and self._claim("stop-hint")
                else "",
            )
        self._raise_deferred()
        return first

    def wait_for_peers(self, timeout_s: float | None = None) -> bool:
        """On the rank that failed, the last thing of its shutdown: wait until every rank
        has begun its shutdown (counted by :meth:`end`), at most ``timeout_s`` (default
        ``PEER_WAIT_S``, or four poll intervals if longer). Returns at once (True) on a rank
        that did not mark a failure.

        :returns: True once every rank ended; False at the timeout, if the store does not
            answer, or at once on a rank released from a blocked call by a signal (the
            launcher ends every rank).
        """
        if self.first_failure is None:
            return True
        if self.released_by is not None:  # (the launcher ends every rank: waiting serves none)
            logger.info(
                "rank %d: not waiting for the other ranks (%s)", self.rank, self.released_by
            )
            return False
        limit = timeout_s if timeout_s is not None else max(PEER_WAIT_S, 4 * self.poll_s)
        deadline = time.monotonic() + limit
        while True:
            ended = self._store_call(
                "wait for the other ranks",
                lambda store: store.add(self.ended_key, 0),
                timeout_s=min(STORE_WAIT_S, max(deadline - time.monotonic(), 0.1)),
                quiet=True,
            )
            if ended is None:
                return False
            if ended >= self.world_size:
                return True
            held = held_signal()
            if held is not None:  # (the launcher ends every rank: waiting serves none)
                logger.info(
                    "rank %d: %s came during this rank's shutdown: the job is being ended; "
                    "not waiting for the other ranks (%d of %d began their shutdown)",
                    self.rank,
                    signal.Signals(held).name,
                    ended,
                    self.world_size,
                )
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning(
                    "rank %d: %d of %d ranks began their shutdown within %.1f s; exiting "
                    "without the others",
                    self.rank,
                    ended,
                    self.world_size,
                    limit,
                )
                return False
            time.sleep(min(0.1, left))

    def stop(self) -> None:
        """Stop watching (idempotent). Waits for the watcher's current poll, or for it to
        begin its abort (at most ``STORE_WAIT_S``; the abort's end is :meth:`finish`'s);
        then puts the interrupt signal's previous handler back."""
        global _active
        self._closing = True
        with self._lock:
            first_stop = not self._stopping
            self._stopping = True
            acting = self._acting and self.released_by is None  # (the watcher's own abort)
        self._wake.set()
        try:
            if first_stop and self._thread.ident is not None:
                self._thread.join(STORE_WAIT_S)
                if self._thread.is_alive():
                    self._store_lost = self._store_lost or not acting
                    logger.warning(
                        "rank %d: the peer watch did not end within %.0f s (%s); left behind",
                        self.rank,
                        STORE_WAIT_S,
                        "the abort of the process groups does not begin"
                        if acting
                        else "its store call does not return",
                    )
        finally:  # a Ctrl-C in the join: the handler and the registry are still put back
            withdraw_release(self.release_blocked_main_thread)
            self._restore_handler()
            with _registry_lock:
                if _active is self:
                    _active = None

    def finish(self, timeout_s: float = ABORT_WAIT_S) -> bool:
        """The last thing of this rank's shutdown, after its graphs were freed: wait (at
        most ``timeout_s``) for the abort of the process groups the watcher began to end,
        and forget the groups (``settle``), on the shutdown's thread.

        A communicator's teardown waits for every CUDA graph that captured it to be
        destroyed, so the abort on a rank whose full-iteration graph holds collectives ends
        only after its shutdown freed the graphs. Returns True at once where the watcher
        never acted.
        """
        if self._late is not None:
            self._late.stop()
        if not self._acting:
            return True
        if self.deadline is not None:  # stop waiting in time to end by the deadline's own log
            timeout_s = self.deadline.budget(timeout_s)
        if self._settle(timeout_s):
            if self.deadline is not None:
                self.deadline.cancel()
            return True
        logger.warning(
            "rank %d: the abort of the process groups did not end within %.0f s (a "
            "communicator's teardown still waits); left behind",
            self.rank,
            timeout_s,
        )
        return False

    # -- the watcher thread -------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            self._connection = own_connection(self._store)
        except Exception as exc:
            self._give_up(exc)
            return
        seen, self._polls = 0, 0
        while not self._wake.wait(self.poll_s):
            try:
                failure, seen = self._poll(seen)
            except Exception as exc:
                self._give_up(exc)
                return
            failure = failure or (self._early.past() if self._early is not None else None)
            if failure is None:
                continue
            if failure.rank != self.rank:  # (its own mark: this rank is shutting down)
                self._act(failure)
            return

    def _poll(self, seen: int) -> tuple[PeerFailure | None, int]:
        """One poll: the job's news counter (one store request); on news, the failure mark,
        else the early end's record (kept by ``_early``). Every ``RECHECK_POLLS``-th poll
        checks the failure mark all the same (a mark whose news was never added: the
        failing rank's store call ran out of time between the two)."""
        connection = self._connection
        news = int(connection.add(self.news_key, 0))
        self._polls += 1
        if news > seen or self._polls % RECHECK_POLLS == 0:
            if connection.check([self.first_key]):
                return PeerFailure.decode(connection.get(self.first_key)), news
        if news > seen and self._early is not None:
            self._early.read(connection)
        return None, news

    def _past_early_end(self) -> None:
        """A clean end of this rank after it went on past a peer's early end (a loop ahead
        of its device may finish before the watch looked): acted on now (the abort ends the
        shutdown's device waits), and the run ends with it (``told_at_end``); where no
        record is there yet, a :class:`LateWatch` looks until :meth:`finish`."""
        if self._early is None or self.peer_failure is not None or self._store_lost:
            return
        failure = self._optional_call("read an early end", self._early.check_now)
        if failure is not None:
            self._tell_late(failure)
        elif not self._store_lost:
            self._late = LateWatch(self._early, self._store, self.poll_s, self._tell_late)

    def _tell_late(self, failure: PeerFailure) -> None:
        if self._act(failure, late=True):
            self.told_at_end = failure

    def _give_up(self, exc: BaseException) -> None:
        self._store_lost = True
        if self._stopping:
            return
        # The store goes away at the end of a normal job (rank 0 hosting it finished first):
        # not an alarm, and never an error raised into the training loop.
        logger.info(
            "rank %d: the job's store does not answer (%s); no longer watching for a "
            "peer's failure",
            self.rank,
            first_line(exc),
        )
