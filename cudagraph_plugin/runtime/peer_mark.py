"""A rank's failure as the job's store records it, and store calls that cannot hang.

:class:`PeerFailure` is the record a failing rank writes (``rank``, ``reason``, host, pid,
a refusal's message), :class:`PeerFailed` (:class:`PeerRefused`) what a told rank raises;
:class:`BoundedCall` runs one store call in a daemon thread that its caller waits for at
most a bounded time: a TCPStore whose server no longer answers (stopped, unreachable)
blocks its caller indefinitely, whatever the store's timeout says (measured with torch
2.13). :class:`StoreCalls` makes the watch's calls through it. The watch itself is
:mod:`cudagraph_plugin.runtime.peers`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from cudagraph_plugin.runtime.ranklog import RankNamed
from hookspecs import ConfigurationError, ShutdownReason
from hookspecs import PeerFailed as _ContractPeerFailed
from hookspecs import PeerRefused as _ContractPeerRefused
from hookspecs.reasons import refused_by
from hookspecs.run import TrainingRun

logger = logging.getLogger("cudagraph_plugin")
rank_named = RankNamed()  # (for lines that name their rank: no "[rank 1] rank 1: ...")

KEY_PREFIX = "mcgraph/peer_failure"
"""Store keys live under ``<prefix>/<generation>/``: one generation per watch started in
this process, so a second run in the same job never sees the first run's mark (ranks start
their runs in the same order)."""

RECHECK_POLLS = 10
"""Every this many polls the watchers check the failure mark even without news."""

MIN_POLL_S = 0.5
"""Poll interval of a small job: a peer's failure is seen within about this long."""

POLL_S_PER_RANK = 0.0005
"""The interval grows with the job so that the store serves at most ~2000 polls a second
(10,000 ranks: every 5 s)."""

STORE_WAIT_S = 2.0
"""How long the main thread waits for a store call made for it (the mark at shutdown, the
watcher's last poll when it stops)."""

PEER_WAIT_S = 5.0
"""How long the rank that failed waits, at most, for every rank to begin its shutdown
(raised to four poll intervals in large jobs)."""

ABORT_WAIT_S = 10.0
"""How long :meth:`PeerWatch.finish`, at the end of a rank's shutdown (its graphs freed),
waits for the abort of the process groups the watcher began to end."""

MAX_REASON_CHARS = 500

STOPPED = frozenset({ShutdownReason.SIGNAL.value, ShutdownReason.INTERRUPTED.value})
"""The ends that come from outside the run (a mark's reason begins with one of them)."""

MAX_REFUSAL_CHARS = 20_000
"""A refusal's message is kept whole (every problem with its fix): the other ranks print it.
The watchers poll the news counter and read a mark's value once."""


def default_interrupt_signal() -> int:
    """The signal sent to the main thread on a peer's failure: a real-time signal, which no
    launcher or library in this stack sends (launchers, schedulers and hosts use SIGTERM,
    SIGINT, SIGUSR1 and SIGUSR2)."""
    return int(signal.SIGRTMIN) + 2


@dataclasses.dataclass(frozen=True)
class PeerFailure:
    """One rank's failure as recorded in the store."""

    rank: int
    reason: str
    host: str = ""
    pid: int = 0
    refusal: str = ""
    """The rank refused the run as configured: its ``ConfigurationError``'s message."""
    step: int | None = None
    """An early end's last step entered (``-1``: none); None where not recorded."""

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> PeerFailure:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        try:
            data = json.loads(text)
            return cls(
                int(data["rank"]),
                str(data["reason"]),
                str(data["host"]),
                int(data["pid"]),
                str(data.get("refusal", "")),
                None if data.get("step") is None else int(data["step"]),
            )
        except (ValueError, KeyError, TypeError):
            # Not ours to parse (another writer of the key): still a failure, of unknown rank.
            return cls(-1, f"unreadable failure mark {text[:100]!r}")

    @property
    def stopped(self) -> bool:
        """The rank was stopped (a signal, Ctrl-C) rather than failed: what a launcher, a
        scheduler or a user does to a whole job, one rank being merely the first to mark it."""
        return self.reason.split(":", 1)[0] in STOPPED

    @property
    def outcome(self) -> str:
        if self.reason.startswith(ShutdownReason.EARLY_EXIT.value):
            return "ended its run early"
        return "was stopped" if self.stopped else "failed"

    def who(self) -> str:
        where = f" ({self.host}, pid {self.pid})" if self.host else ""
        return (f"rank {self.rank}" if self.rank >= 0 else "a rank") + where

    @property
    def summary(self) -> str:
        """The reason's first line (a refusal lists its problems on the lines after it, and
        the rank that refused prints them once; a backend error goes on for lines)."""
        lines = [line.strip() for line in self.reason.splitlines() if line.strip()] or [""]
        head, rest = lines[0], lines[1:]
        if head.endswith(":") and rest:  # (a message that begins on its next line)
            head = f"{head} {rest.pop(0)}"
        return head + (" ..." if rest else "")

    def describe(self) -> str:
        return f"{self.who()} {self.outcome}: {self.summary}"


class PeerFailed(_ContractPeerFailed):
    """Raised in the main thread when another rank of the job failed first: the contract's
    :class:`hookspecs.PeerFailed` (``TrainingRun`` ends the run with
    ``ShutdownReason.PEER_FAILED``), with the failure record."""

    def __init__(self, failure: PeerFailure, message: str | None = None) -> None:
        self.failure = failure
        super().__init__(
            failure.rank,
            failure.reason,
            message or failure.describe(),
        )


class PeerRefused(PeerFailed, _ContractPeerRefused):
    """What this rank raises when the peer that failed first refused the run as configured:
    the contract's :class:`hookspecs.PeerRefused` (the host prints the refusal, exit status
    2), with the failure record."""

    def __init__(self, failure: PeerFailure) -> None:
        super().__init__(failure, refused_by(failure.rank, failure.refusal))
        self.refusal = failure.refusal


def describe_end(reason: ShutdownReason | str, exception: BaseException | None) -> str:
    """The reason text a failing rank writes into its mark."""
    text = str(ShutdownReason(reason))
    if exception is not None:
        detail = str(exception)
        text += f": {type(exception).__name__}" + (f": {detail}" if detail else "")
    return text[:MAX_REASON_CHARS]


def refusal_of(exception: BaseException | None) -> str:
    """What a failing rank writes as its refusal: a ``ConfigurationError``'s whole message
    (the other ranks print it, as this rank would), else nothing."""
    if not isinstance(exception, ConfigurationError):
        return ""
    return (str(exception) or type(exception).__name__)[:MAX_REFUSAL_CHARS]


def note_speaker(exception: BaseException | None, first: PeerFailure | None, rank: int) -> None:
    """Tell ``print_refusal`` whether this rank (``rank``, this process) says the job's
    refusal (``ConfigurationError.said_here``), from the job's first failure its mark
    found: this rank's own (it says it), another rank's refusal (that rank says it), another
    rank's failure of another kind (not known: rank 0 says it). A mark the store did not
    answer in time (``first`` is None) may still land and tell the other ranks, who then
    say nothing: this rank says it (said twice, at worst, rather than never).

    The same for ``print_interrupted`` and a Ctrl-C (``KeyboardInterrupt.said_here``), which
    usually reaches every rank at once: the rank whose interrupt was the job's first
    failure says it; an interrupt after another rank's failure of any kind is not said
    here (the first failure is: by its rank, and by each rank told of it)."""
    if not isinstance(exception, ConfigurationError | KeyboardInterrupt):
        return
    if first is None:
        exception.said_here = True
        return
    first_is_mine = (first.rank, first.pid) == (rank, os.getpid())
    if first_is_mine or first.refusal or isinstance(exception, KeyboardInterrupt):
        exception.said_here = first_is_mine


def own_connection(store: Any) -> Any:
    """A connection of this thread's own: a TCPStore client serialises its calls, and the
    main thread may be inside one (a barrier) for a long time."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        logger.debug("peer watch: store %r cannot be cloned (%s); sharing it", store, exc)
        return store


class BoundedCall:
    """One store call in a daemon thread, waited for at most a bounded time: a TCPStore
    whose server no longer answers (stopped, unreachable) blocks its caller indefinitely,
    whatever the store's timeout says (measured with torch 2.13)."""

    def __init__(self, what: str, func: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._func = func
        self._done = threading.Event()
        self._early: BaseException | None = None  # interrupted the start, the call begun
        thread = threading.Thread(target=self._run, name=f"mcgraph-{what}", daemon=True)
        try:
            thread.start()
        except BaseException as exc:  # a Ctrl-C in start()'s own wait for the new thread
            if not (thread.is_alive() or self._done.is_set()):
                raise  # the call never began
            self._early = exc

    def _run(self) -> None:
        try:
            self.result = self._func()
        except BaseException as exc:  # reported to the waiting thread
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        if self._early is not None:
            raise self._early
        return self._done.wait(timeout)

    def wait_through(self, timeout: float) -> tuple[bool, BaseException | None]:
        """:meth:`wait`, resumed whatever interrupts it (a second Ctrl-C while the store is
        slow), until ``timeout`` has passed: whether the call ended, and the first
        interruption, for the caller to raise once it has used the answer."""
        deadline = time.monotonic() + timeout
        interrupted = self._early
        while True:
            try:
                return self._done.wait(max(0.0, deadline - time.monotonic())), interrupted
            except BaseException as exc:
                interrupted = interrupted or exc


class StoreCalls:
    """The peer watch's calls to the job's store, each bounded (:class:`BoundedCall`); its
    state is set by the watch's ``__init__``."""

    rank: int
    _store: Any
    _connection: Any
    _prefix: str
    _deferred: BaseException | None
    _store_lost: bool

    def _store_call(
        self,
        what: str,
        func: Callable[[Any], Any],
        timeout_s: float = STORE_WAIT_S,
        *,
        quiet: bool = False,
        defer: bool = False,
        lose_store: bool = True,
    ) -> Any:
        """``func(store)`` on the watcher's connection (the shared store before it has one),
        waited for at most ``timeout_s``; ``None`` (logged) if the store does not answer.
        ``defer``: an interruption of the wait waits for the answer too (the other ranks
        learn of this rank's end only from the store), kept for ``_raise_deferred``.
        ``lose_store``: a store that failed here is not asked again (False: a read whose
        answer is optional, its failure no sign of the store's)."""
        store = self._connection if self._connection is not None else self._store
        call = BoundedCall(f"peer-{what}", lambda: func(store))
        if defer:
            answered, interrupted = call.wait_through(timeout_s)
            self._deferred = self._deferred or interrupted
        else:
            answered = call.wait(timeout_s)
        if answered and call.error is None:
            return call.result
        self._store_lost = self._store_lost or lose_store
        problem = (
            f"did not answer within {timeout_s:.1f} s"
            if not answered
            else f"failed ({first_line(call.error)})"  # type: ignore[arg-type]
        )
        if quiet:
            rank_named.info("rank %d: the job's store %s (%s)", self.rank, problem, what)
        else:
            rank_named.warning(
                "rank %d: the job's store %s (%s); the other ranks are not told (the launcher "
                "ends them)",
                self.rank,
                problem,
                what,
            )
        return None

    def _optional_call(self, what: str, func: Callable[[Any], Any]) -> Any:
        """A store call whose answer only adds words to a line: short, quiet, and a store
        that fails it is still asked the calls that matter (None: no answer)."""
        return self._store_call(what, func, STORE_WAIT_S / 2, quiet=True, lose_store=False)

    def _claim(self, what: str) -> bool:
        """Whether this rank is the job's first to claim ``what`` (said by one rank: the
        first to get here); False where the store does not answer (said by none)."""
        mine = str(self.rank)
        claimed = self._optional_call(
            f"claim {what}",
            lambda store: store.compare_set(f"{self._prefix}/{what}", "", mine),
        )
        return claimed is not None and bytes(claimed).decode(errors="replace") == mine

    def _raise_deferred(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


_SHUTDOWN_CODE = (TrainingRun._finish.__code__, TrainingRun.__exit__.__code__)


def run_is_shutting_down(frame: Any) -> bool:
    """Whether the interrupted main thread is inside ``TrainingRun``'s shutdown: raising
    there would skip the shutdown hook (and the freeing of the graphs)."""
    while frame is not None:
        if frame.f_code in _SHUTDOWN_CODE:
            return True
        frame = frame.f_back
    return False
