"""When one rank fails, every other rank leaves its wait, shuts down with ``peer_failed``
naming that rank, and exits non-zero (``cudagraph_plugin.runtime.peers``).

Two halves:

* the watcher's logic in this process, over real stores (``HashStore``, and a ``TCPStore``
  served by a child process that is killed or stopped to make the store gone or deaf);
* real multi-rank jobs over gloo on the CPU (``tests/peer_host.py`` under torchrun, through
  ``tests/jobs.py``, which ends the whole job at its timeout). A rank that must be released
  blocks in a wait that neither a signal nor its peer's exit ends, only its abort
  (``peer_host.DeviceStandIn``), as a CUDA synchronisation behind an NCCL collective that
  can never complete: that rank can only end in time if the watch works.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import hookspecs
from cudagraph_plugin import compat
from cudagraph_plugin.runtime import job_watch, peer_early, peer_mark
from cudagraph_plugin.runtime import peers as peer_failure
from cudagraph_plugin.runtime.peer_mark import (
    PeerFailed,
    PeerFailure,
    default_interrupt_signal,
    describe_end,
)
from cudagraph_plugin.runtime.peers import PeerWatch
from hookspecs import ShutdownReason, TrainingRun, get_plugin_manager, hookimpl
from jobs import CPU_RANKS, JobResult, first_failure, run_job, torchrun_command

HOST = Path(__file__).resolve().parent / "peer_host.py"
POLL_S = 0.05
# A bound for "returns at all" checks only (a hang would otherwise wait for pytest-timeout).
HANG_S = 60.0


# -------------------------------------------------------------------------------------------
# The watcher's logic, in this process.
# -------------------------------------------------------------------------------------------


class StandIn:
    """A C++ wait with the GIL released, deaf to signals, ended only by ``release``."""

    def __init__(self) -> None:
        self.store = dist.HashStore()

    def wait(self, seconds: float) -> None:
        self.store.wait(["released"], datetime.timedelta(seconds=seconds))

    def release(self) -> None:
        self.store.set("released", "1")


class Aborts:
    """The abort a watch calls, recorded; optionally releasing a stand-in wait."""

    def __init__(self, stand_in: StandIn | None = None) -> None:
        self.calls = 0
        self.done = threading.Event()
        self.stand_in = stand_in

    def __call__(self) -> None:
        self.calls += 1
        if self.stand_in is not None:
            self.stand_in.release()
        self.done.set()


@pytest.fixture
def store() -> Any:
    return dist.HashStore()


@pytest.fixture
def watches() -> Iterator[list[PeerWatch]]:
    """Watches a test starts; each is stopped afterwards (the signal handler put back)."""
    started: list[PeerWatch] = []
    yield started
    for watch in started:
        watch.stop()
    assert signal.getsignal(default_interrupt_signal()) is signal.SIG_DFL


def start(watches: list[PeerWatch], store: Any, rank: int = 0, **kwargs: Any) -> PeerWatch:
    kwargs.setdefault("world_size", 2)
    kwargs.setdefault("poll_s", POLL_S)
    watch = PeerWatch.start(store=store, rank=rank, **kwargs)
    assert watch is not None
    watches.append(watch)
    return watch


def peer(watch: PeerWatch, rank: int, store: Any = None, **kwargs: Any) -> PeerWatch:
    """Another rank of ``watch``'s run (same store and generation), not watching;
    ``kwargs`` go to ``PeerWatch``."""
    return PeerWatch(
        store if store is not None else watch._store,
        rank,
        watch.world_size,
        generation=watch.generation,
        **kwargs,
    )


def later(seconds: float, func: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), func()), daemon=True)
    thread.start()
    return thread


def test_a_peer_mark_aborts_and_then_interrupts_the_blocked_main_thread(store, watches):
    stand_in = StandIn()
    aborts = Aborts(stand_in)
    watch = start(watches, store, abort=aborts)
    later(0.3, lambda: peer(watch, 1).mark_failed("exception: RuntimeError: boom"))
    with pytest.raises(PeerFailed) as info:
        stand_in.wait(HANG_S)  # only the abort releases it; the handler raises right after
    assert (info.value.rank, info.value.reason) == (1, "exception: RuntimeError: boom")
    assert "rank 1" in str(info.value) and "boom" in str(info.value)
    assert isinstance(info.value, hookspecs.PeerFailed)  # TrainingRun: PEER_FAILED
    assert aborts.calls == 1
    assert watch.peer_failure == info.value.failure
    watch.end(ShutdownReason.PEER_FAILED, info.value)
    assert watch.first_failure is None  # a rank told by a peer marks nothing itself
    assert not store.check([watch.rank_key(0)])


def test_a_ctrl_c_after_this_rank_was_told_of_a_peers_failure_is_not_said_here(store, watches):
    """A job-wide Ctrl-C that reaches this rank after its watch acted on a peer's failure
    (that peer's own Ctrl-C, say): the first failure is said by its rank and by this rank's
    told line; this interrupt is not said again (``said_here`` False), and it marks nothing."""
    stand_in = StandIn()
    watch = start(watches, store, abort=Aborts(stand_in))
    later(0.3, lambda: peer(watch, 1).mark_failed("interrupted: KeyboardInterrupt"))
    with pytest.raises(PeerFailed):
        stand_in.wait(HANG_S)
    interrupt = KeyboardInterrupt()
    watch.end(ShutdownReason.INTERRUPTED, interrupt)
    assert interrupt.said_here is False
    assert watch.first_failure is None  # (no mark of its own)


@pytest.mark.parametrize("refused", [True, False], ids=["refusal", "exception"])
def test_a_peers_refusal_reaches_this_rank_whole_and_is_said_once_by_the_refusing_rank(
    store, watches, monkeypatch, capsys, refused
):
    """A rank that refused the run as configured (a ``ConfigurationError``) marks its
    message whole; the told rank raises ``PeerRefused``, which the host hands to
    ``print_refusal`` as its own refusal: exit status 2, nothing said (it waits, as a rank
    that does not speak does). The refusing rank, the job's first failure, says it, naming
    itself, although it is not rank 0. Any other failure stays a plain ``PeerFailed``."""
    stand_in = StandIn()
    watch = start(watches, store, abort=Aborts(stand_in))
    message = "2 problem(s) with the CUDA graph configuration: " + "a problem and its fix; " * 40
    error = hookspecs.ConfigurationError(message) if refused else RuntimeError(message)
    refusing = later(0.3, lambda: peer(watch, 1).end(ShutdownReason.EXCEPTION, error))
    with pytest.raises(PeerFailed) as info:
        stand_in.wait(HANG_S)
    refusing.join(HANG_S)  # its end() goes on after the mark this rank was told of
    assert isinstance(info.value, hookspecs.PeerRefused) is refused
    assert len(info.value.reason) == peer_failure.MAX_REASON_CHARS  # the reason is cut short
    if not refused:
        return
    assert info.value.refusal == message  # the refusal is not
    assert info.value.rank == 1
    slept: list[float] = []
    monkeypatch.setattr(hookspecs.errors.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert hookspecs.print_refusal(info.value, grace_s=7.5) == 2
    assert (capsys.readouterr().err, slept) == ("", [7.5])  # told: silent, waits
    assert error.said_here is True  # the refusing rank's mark was the job's first failure
    monkeypatch.setenv("RANK", "1")
    assert hookspecs.print_refusal(error, grace_s=7.5) == 2
    assert capsys.readouterr().err == f"error: rank 1 refused the run: {message}\n"
    assert slept == [7.5]  # the speaker does not wait


@pytest.mark.parametrize(
    "exception,first,said_here",
    [
        # this rank's refusal was the job's first failure: it says it
        (hookspecs.ConfigurationError("bad"), (1, "mine", "bad"), True),
        # another rank refused first: that rank says it
        (hookspecs.ConfigurationError("bad"), (0, "other", "worse"), False),
        # another rank failed first, not by a refusal: nobody else says this one (rank 0 does)
        (hookspecs.ConfigurationError("bad"), (0, "other", ""), None),
        # the store did not answer in time (the mark may still land): this rank says it
        (hookspecs.ConfigurationError("bad"), None, True),
        # not a refusal: nothing to say
        (RuntimeError("boom"), (1, "mine", ""), None),
        # a Ctrl-C (every rank usually gets one): the rank whose interrupt came first says it
        (KeyboardInterrupt(), (1, "mine", ""), True),
        # another rank failed first, whatever its failure: that rank has said why
        (KeyboardInterrupt(), (0, "other", ""), False),
        (KeyboardInterrupt(), (0, "other", "worse"), False),
        # the store did not answer in time: this rank says it
        (KeyboardInterrupt(), None, True),
    ],
)
def test_the_mark_tells_print_refusal_which_rank_says_the_refusal(exception, first, said_here):
    pids = {"mine": os.getpid(), "other": os.getpid() + 1}
    found = None
    if first is not None:
        rank, whose, refusal = first
        found = peer_mark.PeerFailure(rank, "exception", "host", pids[whose], refusal)
    peer_mark.note_speaker(exception, found, 1)
    assert getattr(exception, "said_here", None) is said_here


def test_the_interrupt_alone_does_not_end_a_wait_in_c_the_abort_does(store, watches):
    """Why the abort matters: a signal's handler runs only once the blocked call returns
    (here by its own short timeout, as an NCCL wait never would)."""
    watch = start(watches, store, abort=Aborts())
    peer(watch, 1).mark_failed("exception: RuntimeError: boom")
    seen: list[BaseException] = []
    with pytest.raises(PeerFailed) as info:
        try:
            StandIn().wait(1.5)
        except RuntimeError as timed_out:  # the store's wait timeout (DistStoreError)
            seen.append(timed_out)
            for _ in range(10**8):  # Python runs again: the pending handler raises here
                pass
            pytest.fail("the interrupt never came")
    assert len(seen) == 1 and info.value.__context__ is seen[0]


def test_the_interrupt_wakes_a_wait_that_python_runs(store, watches):
    """A real signal to the main thread: a wait in Python (an Event, a sleep) ends at once
    instead of running to its timeout before the handler gets its turn."""
    watch = start(watches, store, abort=Aborts())
    peer(watch, 1).mark_failed("exception: RuntimeError: boom")
    wait_s = 20.0
    began = time.monotonic()
    with pytest.raises(PeerFailed):
        threading.Event().wait(wait_s)
    # an ordering, not a speed limit: the interrupt came before the wait's own timeout
    assert time.monotonic() - began < wait_s


@pytest.mark.parametrize(
    "reason, exception",
    [
        (ShutdownReason.SIGNAL, hookspecs.SignalReceived(signal.SIGTERM)),
        (ShutdownReason.EXCEPTION, RuntimeError("Connection closed by peer")),
    ],
)
def test_an_end_after_the_watch_acted_is_no_failure_of_this_rank(
    store, watches, caplog, reason, exception
):
    """(2026-12-05, a review on gloo: torchrun's SIGTERM, handled before the watch's
    interrupt as the lower signal number, or the collective the abort broke, ended the run;
    the told rank then marked a failure of its own and logged "rank 0 failed (signal: ...)",
    as if two ranks had failed.)"""
    stand_in = StandIn()
    watch = start(watches, store, abort=Aborts(stand_in))
    later(0.3, lambda: peer(watch, 1).mark_failed("exception: RuntimeError: boom"))
    with pytest.raises(PeerFailed):
        stand_in.wait(HANG_S)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        watch.end(reason, exception)
    assert not store.check([watch.rank_key(0)])  # no mark of its own
    assert watch.first_failure is None
    assert f"rank 0: the run ended ({reason}) after rank 1" in caplog.text
    assert "rank 0 failed" not in caplog.text


def test_a_rank_never_reacts_to_its_own_mark(store, watches):
    aborts = Aborts()
    watch = start(watches, store, rank=1, abort=aborts)
    # this rank's mark, written by another object (as a restarted process would)
    peer(watch, 1).mark_failed("exception: RuntimeError: mine")
    watch._thread.join(HANG_S)  # the watcher ends when it sees its own rank's mark
    assert not watch._thread.is_alive()
    assert aborts.calls == 0 and watch.peer_failure is None


def test_the_failing_rank_stops_watching_before_it_marks(store, watches):
    aborts = Aborts()
    watch = start(watches, store, rank=1, abort=aborts)
    watch.end(ShutdownReason.EXCEPTION, RuntimeError("mine"))
    time.sleep(10 * POLL_S)
    assert aborts.calls == 0 and watch.peer_failure is None
    assert watch.first_failure is not None and watch.first_failure.rank == 1
    assert store.check([watch.rank_key(1), watch.first_key])


def test_after_stop_a_mark_is_ignored(store, watches):
    aborts = Aborts()
    watch = start(watches, store, abort=aborts)
    watch.stop()
    assert signal.getsignal(default_interrupt_signal()) is signal.SIG_DFL
    peer(watch, 1).mark_failed("exception: RuntimeError: late")
    time.sleep(10 * POLL_S)
    assert aborts.calls == 0 and watch.peer_failure is None


def test_two_ranks_failing_at_once_agree_on_the_first(store):
    first, second = PeerWatch(store, 0, 3, generation=7), PeerWatch(store, 2, 3, generation=7)
    mine = first.mark_failed("exception: A")
    theirs = second.mark_failed("signal: B")
    assert mine == theirs == first.first_failure == second.first_failure
    assert (mine.rank, mine.reason) == (0, "exception: A")
    assert PeerFailure.decode(store.get(second.rank_key(2))).reason == "signal: B"


@pytest.mark.parametrize(
    ("first_reason", "second_reason", "said"),
    [
        (
            "signal: SignalReceived: received SIGTERM",
            "signal: SignalReceived: received SIGTERM",
            "rank 1 was stopped (signal: SignalReceived: received SIGTERM); rank 0 was "
            "stopped: signal: SignalReceived: received SIGTERM first: the job as a whole is "
            "likely being stopped",
        ),
        (
            "exception: RuntimeError: boom",
            "signal: SignalReceived: received SIGTERM",
            "rank 1 was stopped (signal: SignalReceived: received SIGTERM); rank 0 failed: "
            "exception: RuntimeError: boom first",
        ),
        (
            "signal: SignalReceived: received SIGTERM",
            "exception: RuntimeError: boom",
            "rank 1 failed (exception: RuntimeError: boom); rank 0 was stopped: signal: "
            "SignalReceived: received SIGTERM first",
        ),
    ],
    ids=["both-stopped", "stopped-after-a-failure", "failed-after-a-stop"],
)
def test_a_stop_of_the_whole_job_is_not_said_as_a_failure(
    store, caplog, first_reason, second_reason, said
):
    """(2026-12-06: a SIGTERM to a 2-rank torchrun job, which torchrun passes on to every
    rank, was said as "rank 0 failed ... every other rank is told" and "rank 1 failed ...;
    rank 0 failed ... first": two failures where the job was stopped from outside)"""
    first, second = PeerWatch(store, 0, 2, generation=3), PeerWatch(store, 1, 2, generation=3)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        first.mark_failed(first_reason)
        second.mark_failed(second_reason)
    verb = "was stopped" if first_reason.startswith("signal") else "failed"
    opening = f"rank 0 {verb} ({first_reason}): every other rank is told to end its run"
    assert [r.getMessage() for r in caplog.records] == [
        opening,
        caplog.records[1].getMessage(),
    ]
    where = f" ({socket.gethostname()}, pid {os.getpid()})"
    assert caplog.records[1].getMessage().replace(where, "").startswith(said)
    assert ("likely being stopped" in caplog.text) == (said.endswith("likely being stopped"))


def test_of_ranks_stopped_after_the_first_one_says_the_job_is_being_stopped(store, caplog):
    """(2026-12-05, a review: every rank but the first said the hint, N-1 times)"""
    stopped = "signal: SignalReceived: received SIGTERM"
    watches = [PeerWatch(store, rank, 4, generation=6) for rank in range(4)]
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        for rank in (2, 0, 3, 1):  # rank 2 first; then the others: rank 0 claims the hint
            watches[rank].mark_failed(stopped)
    hinted = [r.getMessage() for r in caplog.records if "likely being stopped" in r.getMessage()]
    assert len(hinted) == 1 and hinted[0].startswith("rank 0 was stopped"), caplog.text


def test_the_watch_names_its_rank_once_under_the_runs_rank_filter(store, caplog, monkeypatch):
    """(2026-12-06: "[rank 1] rank 1 was stopped ..." in a 2-rank job: the run's filter put
    its rank before lines that name it already; the watch's lines logged after the run's
    filter was taken off, as the wait for the peers, must keep naming it)"""
    from cudagraph_plugin.config.logs import JOB_WIDE
    from cudagraph_plugin.runtime import peers, ranklog

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    log_filter = ranklog.install(every_rank=False)
    try:
        with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
            PeerWatch(store, 1, 2, generation=5).mark_failed("exception: boom")
            logging.getLogger("cudagraph_plugin").info("captured 1 graph")
            # (a caller's own extra is kept: a job-wide line is rank 0's alone)
            peers.logger.info("said by rank 0 only", extra=JOB_WIDE)
    finally:
        ranklog.remove(log_filter)
    assert [r.getMessage() for r in caplog.records] == [
        "rank 1 failed (exception: boom): every other rank is told to end its run",
        "[rank 1] captured 1 graph",
    ]


@pytest.mark.parametrize("how", ["early_exit", "completed"])
def test_a_failure_after_a_rank_ended_early_names_that_rank(store, caplog, how):
    """(2026-12-05, a review: a rank whose own loop ended its run early leaves the others
    in a collective it never joins; their failure, a collective's timeout minutes later, said
    nothing of it.) A rank that completed its steps is no such suspect."""
    left = PeerWatch(store, 1, 2, generation=9)
    left.end(how)
    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        PeerWatch(store, 0, 2, generation=9).mark_failed("exception: DistBackendError: timeout")
    [said] = [r.getMessage() for r in caplog.records]
    where = f"rank 1 ({socket.gethostname()}, pid {os.getpid()})"
    early = (
        f" ({where} had ended its run early, before this: a collective it no longer joins may "
        "be what failed here)"
    )
    assert said == (
        "rank 0 failed (exception: DistBackendError: timeout): every other rank is told to end "
        "its run" + (early if how == "early_exit" else "")
    )
    assert int(store.add(left.ended_key, 0)) == 2  # both counted as ended


class EarlyKeyFails:
    """The job's store, failing every read of the early-end key (a store too slow or broken
    for that one optional read)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def check(self, keys: list[str]) -> bool:
        if any(key.endswith("/early") for key in keys):
            raise RuntimeError("connection reset")
        return self.store.check(keys)


def test_a_stopped_rank_does_not_blame_an_early_end_and_a_failed_read_keeps_the_mark(store, caplog):
    """(a review of the early-end naming: it was appended to a stopped rank's line, where
    nothing failed; and, read inside the mark's bounded call, a failing read threw away a
    mark that was written: "the other ranks are not told", no first failure)"""
    PeerWatch(store, 1, 3, generation=4).end("early_exit")
    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        PeerWatch(store, 0, 3, generation=4).mark_failed("signal: SignalReceived: x")
    assert "ended its run early" not in caplog.text
    other = PeerWatch(EarlyKeyFails(dist.HashStore()), 2, 3, generation=4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        first = other.mark_failed("exception: RuntimeError: boom")
    assert first is not None and first.rank == 2 and other.first_failure == first
    assert "rank 2 failed (exception: RuntimeError: boom): every other rank is told" in (
        caplog.text
    )
    assert "not told" not in caplog.text and other._store_lost is False


# -- a peer whose own loop ended early (cudagraph_plugin.runtime.peer_early) --------------


def early_peer(watch: PeerWatch, rank: int, last_step: int | None, store: Any = None) -> PeerWatch:
    """Another rank of ``watch``'s run whose run ends after entering ``last_step``."""
    return peer(watch, rank, store, current_step=lambda: last_step)


def test_a_rank_in_a_step_after_a_peers_early_end_is_released_and_told(store, watches, caplog):
    """(2026-12-06: a rank whose loop ends early marked no failure, so a rank still training
    waited in the next step's collective for good, over NCCL until its timeout.) The watch
    ends this run as after a peer's failure, naming the early rank and both steps."""
    stand_in = StandIn()
    aborts = Aborts(stand_in)
    watch = start(watches, store, abort=aborts, current_step=lambda: 6)
    later(0.3, lambda: early_peer(watch, 1, 5).end("early_exit"))
    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        with pytest.raises(PeerFailed) as info:
            stand_in.wait(20)  # (standing in for step 6's all-reduce)
    assert info.value.rank == 1 and aborts.calls == 1
    assert info.value.reason.startswith(
        "early_exit after step 5, while rank 0 went on to step 6: that step's collectives "
        "wait for it for good. Fix: end the loop at the same step on every rank"
    )
    where = f"rank 1 ({socket.gethostname()}, pid {os.getpid()})"
    assert str(info.value).startswith(f"{where} ended its run early: early_exit after step 5")
    assert f"rank 0: {where} ended its run early: early_exit after step 5" in caplog.text
    watch.end(ShutdownReason.PEER_FAILED, info.value)
    assert watch.first_failure is None and not store.check([watch.first_key])  # no failure


@pytest.mark.parametrize("mine", [4, 5], ids=["behind", "same_step"])
def test_a_rank_not_past_a_peers_early_end_is_left_alone(store, watches, mine):
    """Ranks that end early at the same step (an exit condition every rank agreed on) are
    no failure: the rank still in that step, or behind it, is not told."""
    steps = [mine]
    aborts = Aborts()
    watch = start(watches, store, abort=aborts, current_step=lambda: steps[0])
    early_peer(watch, 1, 5).end("early_exit")
    time.sleep(20 * POLL_S)  # the watch reads the record (the news counter moved)
    assert aborts.calls == 0 and watch.peer_failure is None
    assert watch._early is not None and watch._early.record is not None
    steps[0] = 6  # a step after the peer's last: told, from the record it already read
    with pytest.raises(PeerFailed) as info:
        threading.Event().wait(HANG_S)
    assert "went on to step 6" in info.value.reason and aborts.calls == 1


def test_a_peer_that_ended_before_its_first_step_is_past_at_any_step(store, watches):
    watch = start(watches, store, abort=Aborts(), current_step=lambda: 0)
    later(0.2, lambda: early_peer(watch, 1, None).end("early_exit"))
    with pytest.raises(PeerFailed) as info:
        threading.Event().wait(HANG_S)
    assert info.value.reason.startswith("early_exit before its first step, while rank 0 went on")


@pytest.mark.parametrize(
    "reason, current_step, recorded",
    [
        ("early_exit", lambda: 7, 7),
        ("early_exit", lambda: None, peer_early.NO_STEP),
        ("early_exit", None, None),  # a watch not given the step records none
        ("completed", lambda: 7, "absent"),  # only an early end is recorded
    ],
)
def test_an_early_end_records_the_last_step_the_rank_entered(store, reason, current_step, recorded):
    watch = PeerWatch(store, 1, 2, generation=3, current_step=current_step)
    watch.end(reason)
    if recorded == "absent":
        assert not store.check([watch.early_key])
        return
    record = PeerFailure.decode(store.get(watch.early_key))
    assert (record.rank, record.reason, record.step) == (1, "early_exit", recorded)


class CountingStore:
    """A store that counts the requests naming each key (``check``, ``get``, ``add``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def clone(self) -> Any:
        raise NotImplementedError("shared, so that the watcher's requests are counted too")

    def _count(self, key: str) -> None:
        name = key.rsplit("/", 1)[-1]
        self.requests[name] = self.requests.get(name, 0) + 1

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            self._count(key)
        return self.store.check(keys)

    def get(self, key: str) -> Any:
        self._count(key)
        return self.store.get(key)

    def add(self, key: str, value: int) -> int:
        self._count(key)
        return self.store.add(key, value)


def test_a_poll_is_one_store_request_and_the_marks_are_read_once(store, watches):
    """The watch polls the job's news counter, one request a poll whatever this rank's
    steps do (a second key per poll would double the load of the job's store), and the
    failure mark every RECHECK_POLLS-th poll besides; a mark is read when the counter
    moved, and an early end's record once, then kept."""
    counting = CountingStore(store)
    steps = [4]
    watch = start(watches, counting, abort=Aborts(), current_step=lambda: steps[0])
    time.sleep(25 * POLL_S)
    polls, rechecks = counting.requests["news"], counting.requests.get("first", 0)
    assert polls >= 10 and set(counting.requests) <= {"news", "first"}
    assert rechecks <= polls // peer_mark.RECHECK_POLLS  # (not one a poll)
    # (on the store itself: only this watch's requests are counted)
    early_peer(watch, 1, 5, store).end("early_exit")
    time.sleep(10 * POLL_S)
    steps[0] = 5
    time.sleep(10 * POLL_S)
    polls_after = counting.requests["news"] - polls
    first_after = counting.requests["first"] - rechecks
    assert 1 <= first_after <= 1 + polls_after // peer_mark.RECHECK_POLLS + 1
    assert counting.requests["early"] == 2  # checked and read once, then kept
    assert watch.peer_failure is None and watch._early is not None
    assert watch._early.record is not None and watch._early.record.step == 5


def test_a_mark_is_found_through_its_news_alone(store, watches, monkeypatch):
    """Without the every-RECHECK_POLLS-th check, the news counter alone leads the watch to
    the mark, at the first poll after it: one request a poll until then."""
    monkeypatch.setattr(peer_failure, "RECHECK_POLLS", 10**9)
    counting = CountingStore(store)
    watch = start(watches, counting, abort=Aborts())
    time.sleep(5 * POLL_S)
    assert "first" not in counting.requests
    with pytest.raises(PeerFailed) as info:
        later(0.0, lambda: peer(watch, 1, store).mark_failed("exception: news"))
        threading.Event().wait(HANG_S)
    assert info.value.reason == "exception: news" and counting.requests["first"] == 2  # check, get


def test_a_mark_whose_news_was_never_added_is_still_found(store, watches):
    """(a review: the news is added after the mark, in the same bounded store call; one
    that ran out of time between the two left a mark no watcher would read.) Every
    RECHECK_POLLS-th poll checks the failure mark without news."""
    watch = start(watches, store, abort=Aborts())
    half = PeerFailure(1, "exception: half-written", "h", 7)
    with pytest.raises(PeerFailed) as info:
        store.compare_set(watch.first_key, "", half.encode())  # (and no news)
        threading.Event().wait(HANG_S)
    assert info.value.reason == "exception: half-written"
    assert int(store.add(watch.news_key, 0)) == 0


def test_a_failure_mark_comes_before_an_early_end_read_at_the_same_poll(store, watches):
    aborts = Aborts()
    watch = start(watches, store, rank=0, world_size=3, abort=aborts, poll_s=1.0,
                  current_step=lambda: 9)  # fmt: skip
    with pytest.raises(PeerFailed) as info:  # (both marks well within the first poll)
        early_peer(watch, 1, 5).end("early_exit")
        peer(watch, 2).mark_failed("exception: boom")
        threading.Event().wait(HANG_S)
    assert (info.value.rank, info.value.reason) == (2, "exception: boom")
    assert aborts.calls == 1


def test_an_early_end_without_a_step_is_not_compared_and_the_watch_goes_on(store, watches):
    """A record with no step (a watch not given the run's step, an older version) is no
    failure; the watch still hears of a real one afterwards."""
    aborts = Aborts()
    watch = start(watches, store, abort=aborts, current_step=lambda: 9)
    peer(watch, 1).end("early_exit")  # (not given the run's step)
    time.sleep(10 * POLL_S)
    assert watch._early is not None and watch._early.record is not None
    assert watch._early.record.step is None and aborts.calls == 0
    later(0.2, lambda: peer(watch, 1).mark_failed("exception: later"))
    with pytest.raises(PeerFailed) as info:
        threading.Event().wait(HANG_S)
    assert info.value.reason == "exception: later"


@pytest.mark.parametrize("bad", ["raises", "not a number"])
def test_a_step_that_cannot_be_read_turns_off_only_the_early_end_check(store, watches, caplog, bad):
    """(a review: an error there went to the store's give-up, which ended the whole watch
    and said the store did not answer.) Logged once; a peer's failure is still heard,
    and this rank's own early end records no step rather than "before its first step"."""

    def step() -> Any:
        if bad == "raises":
            raise RuntimeError("no step here")
        return bad

    aborts = Aborts()
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        watch = start(watches, store, abort=aborts, current_step=step)
        time.sleep(10 * POLL_S)
        early_peer(watch, 1, 5).end("early_exit")
        time.sleep(10 * POLL_S)
        assert aborts.calls == 0
        later(0.2, lambda: peer(watch, 1).mark_failed("exception: later"))
        with pytest.raises(PeerFailed):
            threading.Event().wait(HANG_S)
    said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(said) == 1 and "a peer's failure still is" in said[0]
    assert "does not answer" not in caplog.text
    own = PeerWatch(dist.HashStore(), 1, 2, generation=2, current_step=step)
    own.end("early_exit")
    assert PeerFailure.decode(own._store.get(own.early_key)).step is None


def test_a_rank_told_of_a_failure_then_ending_early_records_no_early_end(store, watches):
    watch = start(watches, store, abort=Aborts(), interrupt=False, current_step=lambda: 3)
    peer(watch, 1).mark_failed("exception: boom")
    deadline = time.monotonic() + HANG_S
    while watch.peer_failure is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    watch.end("early_exit")
    assert not store.check([watch.early_key])


@pytest.mark.parametrize("mine, told", [(9, True), (5, False)], ids=["past", "same_step"])
def test_an_early_end_recorded_after_this_ranks_clean_end_is_still_told(store, watches, mine, told):
    """(a review: the clean end read the early end once; the early rank writes its record
    at the start of its own shutdown, which may come a moment after this rank's end.) A
    late watch keeps looking until the shutdown's end (``finish``)."""
    aborts = Aborts()
    watch = start(watches, store, abort=aborts, poll_s=POLL_S, current_step=lambda: mine)
    watch.end(ShutdownReason.COMPLETED)
    assert watch.told_at_end is None and aborts.calls == 0  # (nothing to read yet)
    early_peer(watch, 1, 5).end("early_exit")
    if told:
        assert aborts.done.wait(HANG_S)
    else:
        time.sleep(20 * POLL_S)
    watch.finish(1.0)
    assert (watch.told_at_end is not None, aborts.calls) == (told, int(told))
    assert watch._late is not None and not watch._late._thread.is_alive()


@pytest.mark.parametrize("mine, told", [(9, True), (5, False)], ids=["past", "same_step"])
def test_a_clean_end_past_a_peers_early_end_is_told_at_its_end(store, watches, caplog, mine, told):
    """(a review: a loop running ahead of its device, its steps queued without a wait,
    could finish before the watch looked; its shutdown then waited on the device for the
    collectives of steps the early rank never entered.) The clean end reads the early end
    once more: past it, the abort begins, the plugin's shutdown does not wait on the
    device, and the run ends with PeerFailed after its shutdown."""
    import types

    from cudagraph_plugin.runtime.shutdown import device_may_block

    aborts = Aborts()
    watch = start(watches, store, abort=aborts, poll_s=60.0, current_step=lambda: mine)
    early_peer(watch, 1, 5).end("early_exit")
    state = types.SimpleNamespace(past_peer_early_end=False, rank_and_world=lambda: (0, 2))
    job = job_watch.JobWatch(state)
    job.peers = watch
    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        job.end(ShutdownReason.COMPLETED, None)
    assert (aborts.calls == 1, state.past_peer_early_end) == (told, told)
    assert device_may_block("completed", state) is told
    assert not store.check([watch.first_key]) and not store.check([watch.rank_key(0)])
    if not told:
        job.raise_told_at_end()
        return
    assert "went on to step 9" in caplog.text
    with pytest.raises(PeerFailed) as info:
        job.raise_told_at_end()
    assert info.value.rank == 1 and "ended its run early" in str(info.value)


def test_a_mark_of_an_earlier_run_is_not_seen_by_the_next(store, watches):
    first = start(watches, store, abort=Aborts())
    peer(first, 1).mark_failed("exception: old run")
    with pytest.raises(PeerFailed):
        threading.Event().wait(HANG_S)  # interrupted by the first run's mark
    first.end(ShutdownReason.PEER_FAILED)
    aborts = Aborts()
    second = start(watches, store, abort=aborts)
    assert second.generation != first.generation
    time.sleep(10 * POLL_S)
    assert aborts.calls == 0 and second.peer_failure is None


def test_a_shutdown_in_progress_is_never_interrupted(store, watches):
    """A peer's mark seen while TrainingRun is shutting down (before the plugin's shutdown
    ended the watch): the handler must not raise into the shutdown."""
    aborts = Aborts()
    events: list[str] = []

    class Wiring:
        watch: PeerWatch | None = None

        @hookimpl
        def mcgraph_train_start(self, start_step, train_iters):
            self.watch = start(watches, store, abort=aborts)

        @hookimpl(wrapper=True, tryfirst=True)
        def mcgraph_shutdown(self, reason, exception):
            assert self.watch is not None
            peer(self.watch, 1).mark_failed("exception: RuntimeError: peer")
            assert aborts.done.wait(HANG_S)
            time.sleep(0.05)  # bytecode runs: the pending handler gets its chance here
            events.append("watch acted during shutdown")
            self.watch.end(reason, exception)
            result = yield
            events.append("shutdown done")
            return result

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Wiring())
    error = RuntimeError("own failure")
    with pytest.raises(RuntimeError) as info:
        with TrainingRun(pm, None, train_iters=3) as run:
            with run.train_step(0):
                raise error
    assert info.value is error
    assert run.shutdown_reason is ShutdownReason.EXCEPTION
    assert events == ["watch acted during shutdown", "shutdown done"]


def test_peer_failed_ends_a_training_run_with_peer_failed(store, watches):
    stand_in = StandIn()
    seen: list[Any] = []

    class Wiring:
        watch: PeerWatch | None = None

        @hookimpl
        def mcgraph_train_start(self, start_step, train_iters):
            self.watch = start(watches, store, abort=Aborts(stand_in))

        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            seen.append((reason, exception))

    pm = get_plugin_manager(load_entrypoints=False)
    wiring = Wiring()
    pm.register(wiring)
    with pytest.raises(PeerFailed):
        with TrainingRun(pm, None, train_iters=3) as run:
            for step in range(3):
                with run.train_step(step):
                    if step == 1:
                        assert wiring.watch is not None
                        later(0.2, lambda: peer(wiring.watch, 1).mark_failed("signal: TERM"))
                        try:
                            stand_in.wait(HANG_S)
                        except Exception:  # a host's handler does not swallow it
                            pytest.fail("PeerFailed was caught by `except Exception`")
    assert run.shutdown_reason is ShutdownReason.PEER_FAILED
    [(reason, exception)] = seen
    assert reason is ShutdownReason.PEER_FAILED and exception.rank == 1


class GraphBoundAbort:
    """An abort as NCCL's is on a rank whose CUDA graph captured collectives: begun by the
    watcher, the stuck kernel ends at once (the stand-in wait released: the abort flag),
    the communicators' teardown only once the graph is destroyed (``graphs_freed``);
    ``settle`` waits for that end, as ``compat.abort_process_groups`` does."""

    def __init__(self, stand_in: StandIn, events: list[str]) -> None:
        self.stand_in = stand_in
        self.events = events
        self.graphs_freed = threading.Event()
        self.teardown: threading.Thread | None = None

    def __call__(self) -> None:
        self.events.append("abort began")
        self.teardown = threading.Thread(target=self._teardown, daemon=True)
        self.teardown.start()
        self.stand_in.release()

    def _teardown(self) -> None:
        if self.graphs_freed.wait(HANG_S):
            self.events.append("abort ended")

    def settle(self, timeout_s: float) -> bool:
        assert self.teardown is not None
        self.teardown.join(timeout_s)
        return not self.teardown.is_alive()


def test_the_shutdown_frees_the_graphs_before_it_waits_for_the_abort(store, watches, caplog):
    """Wired as the plugin wires it (``JobWatch``: end first, the peers and the abort last):
    the shutdown frees the graphs while the abort goes on, and waits for its end last. A
    shutdown that waited for the abort before freeing would wait for good (here: until the
    watch gave up on it, with a warning)."""
    stand_in = StandIn()
    events: list[str] = []
    abort = GraphBoundAbort(stand_in, events)
    job = job_watch.JobWatch(state=None)

    class Wiring:
        @hookimpl
        def mcgraph_train_start(self, start_step, train_iters):
            job.peers = start(watches, store, abort=abort, settle=abort.settle)

        @hookimpl(wrapper=True, tryfirst=True)
        def mcgraph_shutdown(self, reason, exception):
            job.end(reason, exception)
            try:
                return (yield)
            finally:
                job.wait_for_peers()
                events.append("shutdown done")

    class Release:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            events.append("graphs freed")
            abort.graphs_freed.set()

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Wiring())
    pm.register(Release())
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    with pytest.raises(PeerFailed):
        with TrainingRun(pm, None, train_iters=3) as run:
            with run.train_step(0):
                assert job.peers is not None
                later(0.2, lambda: peer(job.peers, 1).mark_failed("exception: x"))
                stand_in.wait(HANG_S)
    assert run.shutdown_reason is ShutdownReason.PEER_FAILED
    assert events == ["abort began", "graphs freed", "abort ended", "shutdown done"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not warnings, warnings


def test_finish_gives_up_on_an_abort_that_does_not_end(store, watches, caplog):
    stand_in = StandIn()
    abort = GraphBoundAbort(stand_in, [])
    watch = start(watches, store, abort=abort, settle=abort.settle)
    assert watch.finish(0.1)  # never acted: nothing to wait for
    peer(watch, 1).mark_failed("exception: x")
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    try:
        with pytest.raises(PeerFailed):
            stand_in.wait(HANG_S)  # released as the abort begins; the interrupt follows
        assert not watch.finish(0.2)
        assert "did not end within" in caplog.text
    finally:
        abort.graphs_freed.set()
    assert watch.finish(HANG_S)


def test_wait_for_peers_returns_once_every_rank_ended(store):
    failed, healthy, done = (PeerWatch(store, r, 3, generation=3) for r in (1, 0, 2))
    failed.mark_failed("exception: x")
    healthy.end(ShutdownReason.PEER_FAILED)
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(failed.wait_for_peers, HANG_S)
    time.sleep(0.3)
    assert not waiting.done()  # rank 2 has not begun its shutdown
    done.end(ShutdownReason.COMPLETED)
    assert waiting.result(HANG_S) is True
    assert PeerWatch(store, 0, 3, generation=3).wait_for_peers() is True  # marked nothing


def test_wait_for_peers_gives_up_at_once_when_a_signal_came_during_the_shutdown(
    store, monkeypatch, caplog
):
    """(2026-12-05, a review: a rank whose peer died silently (SIGKILL) marked its own
    failure, then waited the whole 5 s for a peer that could never count itself, while
    torchrun's SIGTERM, ending every rank, was already held)"""
    from cudagraph_plugin.runtime import peers

    watch = PeerWatch(store, 0, 2, generation=8)
    watch.mark_failed("exception: RuntimeError: Connection reset by peer")
    monkeypatch.setattr(peers, "held_signal", lambda: signal.SIGTERM)
    began = time.monotonic()
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        assert watch.wait_for_peers(timeout_s=20) is False
    assert time.monotonic() - began < 10  # (not the 20 s it would wait otherwise)
    assert "SIGTERM came during this rank's shutdown: the job is being ended" in caplog.text


def test_wait_for_peers_gives_up_at_its_timeout(store):
    failed = PeerWatch(store, 1, 2, generation=4)
    failed.mark_failed("exception: x")
    assert failed.wait_for_peers(timeout_s=0.3) is False


# -- the store gone or deaf ---------------------------------------------------------------------

SERVER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                      wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def tcp_store() -> Iterator[tuple[subprocess.Popen[str], Any]]:
    """A TCPStore served by a child process (to kill or stop), and a client of it."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore(
            "127.0.0.1", port, None, False, datetime.timedelta(seconds=10), wait_for_workers=False
        )
        yield server, client
    finally:
        server.kill()
        server.wait()
        assert server.stdout is not None
        server.stdout.close()


def test_a_store_that_is_gone_stops_the_watch_quietly(tcp_store, watches, caplog):
    server, client = tcp_store
    # before the store goes: the watch may say so before this thread runs again
    caplog.set_level(logging.INFO, logger="cudagraph_plugin")
    aborts = Aborts()
    watch = start(watches, client, abort=aborts)
    time.sleep(5 * POLL_S)
    server.kill()
    server.wait()
    watch._thread.join(HANG_S)
    assert not watch._thread.is_alive()
    assert "no longer watching for a peer's failure" in caplog.text
    watch.end(ShutdownReason.COMPLETED)  # a normal end: nothing raised, nothing marked
    assert aborts.calls == 0 and watch.peer_failure is None and watch.first_failure is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_store_that_does_not_answer_never_holds_the_main_thread(tcp_store, watches):
    """A stopped store server leaves a client's call blocked whatever its timeout: the
    watcher's poll hangs in its thread, and the main thread's calls are bounded."""
    server, client = tcp_store
    watch = start(watches, client, abort=Aborts())
    time.sleep(5 * POLL_S)
    server.send_signal(signal.SIGSTOP)
    time.sleep(5 * POLL_S)  # the watcher is inside a call that will not return
    ended = threading.Thread(target=watch.end, args=(ShutdownReason.COMPLETED,), daemon=True)
    ended.start()
    ended.join(HANG_S)
    assert not ended.is_alive()
    marked: list[Any] = []
    other = peer(watch, 1)
    failing = threading.Thread(target=lambda: marked.append(other.mark_failed("x")), daemon=True)
    failing.start()
    failing.join(HANG_S)
    assert marked == [None]  # not recorded, and said so; the run goes on
    assert other.wait_for_peers() is True  # nothing was marked: nothing to wait for


@contextlib.contextmanager
def ctrl_c(after_s: float) -> Iterator[None]:
    """A ``KeyboardInterrupt`` raised in this (the main) thread ``after_s`` into the block, as
    a Ctrl-C would be (through SIGUSR1: the test runner may own SIGINT). Never raised after
    the block."""
    inside = threading.Event()
    inside.set()

    def interrupted(signum: int, frame: Any) -> None:
        if inside.is_set():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupted)
    main = threading.get_ident()
    try:
        timer = later(after_s, lambda: signal.pthread_kill(main, signal.SIGUSR1))
        yield
    finally:
        inside.clear()
        timer.join(HANG_S)
        signal.signal(signal.SIGUSR1, previous)


def test_a_ctrl_c_while_stopping_still_puts_the_handler_back(tcp_store, watches):
    """The stop waits for the watcher's poll (a deaf store: up to its bound); an interrupt
    in that wait still puts the interrupt signal's handler back and ends the registration,
    so a later watch in this process starts."""
    server, client = tcp_store
    watch = start(watches, client, abort=Aborts())
    time.sleep(5 * POLL_S)
    server.send_signal(signal.SIGSTOP)
    time.sleep(5 * POLL_S)  # the watcher is inside a call that will not return
    with ctrl_c(after_s=0.3), pytest.raises(KeyboardInterrupt):
        watch.stop()
    assert signal.getsignal(default_interrupt_signal()) is signal.SIG_DFL
    assert peer_failure._active is None
    start(watches, dist.HashStore())  # not refused as "already running"


def test_a_ctrl_c_while_the_store_is_slow_still_gets_the_mark_there(tcp_store, watches):
    """The failing rank's mark is what ends the other ranks: an interrupt while the store
    is slow to answer (stopped until the interrupt was raised) waits for the answer, then
    goes on. The mark's own first store call sends the interrupt, so it comes while the
    main thread waits for that call, however loaded the machine."""
    server, client = tcp_store
    watch = start(watches, client, abort=Aborts())
    time.sleep(5 * POLL_S)
    watch.stop()  # the watcher's own poll is not what this waits on
    server.send_signal(signal.SIGSTOP)
    main, raised = threading.get_ident(), threading.Event()

    def interrupted(signum: int, frame: Any) -> None:
        raised.set()
        raise KeyboardInterrupt

    class InterruptingConnection:
        """The watcher's connection: the mark's first call interrupts the main thread, and
        the stopped store answers once the interrupt was raised."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def set(self, key: str, value: Any) -> Any:
            signal.pthread_kill(main, signal.SIGUSR1)
            if raised.wait(HANG_S):
                server.send_signal(signal.SIGCONT)
            return self.inner.set(key, value)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    watch._connection = InterruptingConnection(watch._connection or client)
    previous = signal.signal(signal.SIGUSR1, interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            watch.end(ShutdownReason.EXCEPTION, RuntimeError("boom"))
    finally:
        signal.signal(signal.SIGUSR1, previous)
        server.send_signal(signal.SIGCONT)
    assert raised.is_set()
    assert watch.first_failure is not None and watch.first_failure.rank == 0
    assert PeerFailure.decode(client.get(watch.first_key)).rank == 0
    assert int(client.add(watch.ended_key, 0)) == 1


# -- small contracts -----------------------------------------------------------------------------


def test_start_needs_a_multi_rank_run(store, watches):
    assert PeerWatch.start(store=store, rank=0, world_size=1) is None
    with pytest.raises(ValueError, match="rank=2 and world_size=2"):
        PeerWatch.start(store=store, rank=2, world_size=2)
    with pytest.raises(ValueError, match="poll_s=0"):
        PeerWatch.start(store=store, rank=0, world_size=2, poll_s=0)
    start(watches, store)
    with pytest.raises(RuntimeError, match="already running"):
        PeerWatch.start(store=store, rank=0, world_size=2)


def test_start_without_a_process_group_watches_nothing():
    assert not dist.is_initialized()
    assert PeerWatch.start() is None


def test_an_interrupt_signal_in_use_leaves_the_abort(store, watches, caplog):
    signum = default_interrupt_signal()
    host_handler_calls: list[int] = []
    previous = signal.signal(signum, lambda s, f: host_handler_calls.append(s))
    try:
        aborts = Aborts()
        watch = start(watches, store, abort=aborts)
        assert "already has a handler" in caplog.text
        peer(watch, 1).mark_failed("exception: x")
        assert aborts.done.wait(HANG_S)
        time.sleep(0.05)
        assert host_handler_calls == []  # the host's handler is neither replaced nor called
        watch.stop()
    finally:
        signal.signal(signum, previous)


def test_the_mark_says_how_the_run_ended():
    assert describe_end(ShutdownReason.EXCEPTION, RuntimeError("boom")) == (
        "exception: RuntimeError: boom"
    )
    assert describe_end("interrupted", KeyboardInterrupt()) == "interrupted: KeyboardInterrupt"
    assert len(describe_end("exception", ValueError("x" * 10_000))) == peer_failure.MAX_REASON_CHARS
    failure = PeerFailure(3, "signal: received SIGTERM", "node7", 42)
    assert PeerFailure.decode(failure.encode()) == failure
    refused = PeerFailure(3, "exception: ConfigurationError: x", "node7", 42, "x" * 5000)
    assert PeerFailure.decode(refused.encode()) == refused
    assert peer_mark.refusal_of(hookspecs.ConfigurationError("y" * 30_000)) == "y" * (
        peer_mark.MAX_REFUSAL_CHARS
    )
    assert peer_mark.refusal_of(RuntimeError("y")) == peer_mark.refusal_of(None) == ""
    # a signal or a Ctrl-C stops a rank (what a launcher, a scheduler or a user does to a
    # whole job); anything else is a failure
    assert failure.describe() == "rank 3 (node7, pid 42) was stopped: signal: received SIGTERM"
    assert PeerFailure(0, "interrupted: KeyboardInterrupt").describe() == (
        "rank 0 was stopped: interrupted: KeyboardInterrupt"
    )
    assert PeerFailure(0, "exception: RuntimeError: signal").describe() == (
        "rank 0 failed: exception: RuntimeError: signal"
    )
    # one line: a refusal's problems (printed once by the rank that refused) and a backend
    # error's further lines are left to the record
    refusal = "exception: CudaGraphConfigError: 1 problem(s)\n  --x = 3: differs\n  fix: y"
    assert PeerFailure(2, refusal).describe() == (
        "rank 2 failed: exception: CudaGraphConfigError: 1 problem(s) ..."
    )
    assert PeerFailure(2, refusal).reason == refusal
    assert PeerFailure(1, "exception: RuntimeError: \n  the message\n").describe() == (
        "rank 1 failed: exception: RuntimeError: the message"
    )
    assert PeerFailure.decode(b"garbage").rank == -1


# -------------------------------------------------------------------------------------------
# Real jobs: gloo ranks on the CPU.
# -------------------------------------------------------------------------------------------

JOB_TIMEOUT_S = 150

# name: (ranks, launcher, host arguments)
JOBS: dict[str, tuple[int, str, list[str]]] = {
    "raise": (2, "torchrun", ["--fail", "1:2:raise", "--block", "0:2", "--exit-deadline", "12"]),
    "raise3": (3, "torchrun", ["--fail", "1:2:raise", "--block", "0:2"]),
    "sigterm": (
        2,
        "torchrun",
        ["--fail", "1:2:sigterm", "--block", "0:2", "--exit-deadline", "12"],
    ),
    "refused": (2, "torchrun", ["--fail", "1:2:refuse", "--block", "0:2"]),
    "both": (2, "torchrun", ["--fail", "0:2:raise", "--fail", "1:2:raise", "--slow-shutdown", "2"]),
    "completed": (2, "torchrun", ["--linger", "1:2"]),
    "store_gone": (2, "launch", ["--linger", "1:4"]),
    "store_host_raises": (2, "launch", ["--fail", "0:2:raise", "--block", "1:2"]),
    "swallowed": (
        2,
        "torchrun",
        ["--fail", "1:2:raise", "--block", "0:2", "--swallow", "0", "--exit-deadline", "2"],
    ),
    # rank 1's loop ends after step 2 and its process stays 8 s; rank 0 waits in step 3
    "left_early": (
        2,
        "torchrun",
        ["--leave", "1:2:8", "--block", "0:3:first", "--exit-deadline", "12"],
    ),
    # both loops end after step 2; rank 0 stays in step 2 for 3 s after rank 1 ended
    "left_together": (2, "torchrun", ["--leave", "0:2:0", "--leave", "1:2:0", "--linger", "0:3"]),
}


class Job:
    def __init__(self, name: str, result: JobResult, out: Path) -> None:
        self.name = name
        self.result = result
        self.records = {
            int(path.stem[4:]): json.loads(path.read_text()) for path in out.glob("rank*.json")
        }

    def record(self, rank: int) -> dict[str, Any]:
        assert rank in self.records, f"rank {rank} wrote no record\n{self.context()}"
        return self.records[rank]

    def context(self) -> str:
        reasons = {rank: rec.get("reason") for rank, rec in sorted(self.records.items())}
        return f"{self.result.describe()}\nreasons: {reasons}\n{self.result.tail()}"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    # Made before the threads start: a worker's first mktemp empties its base folder, and
    # concurrent first calls race (FileExistsError under pytest-xdist).
    outs = {name: tmp_path_factory.mktemp(name) for name in JOBS}

    def one(name: str) -> Job:
        nproc, launcher, args = JOBS[name]
        out = outs[name]
        host_args = ["--out", str(out), *args]
        if launcher == "torchrun":
            command = torchrun_command(nproc, HOST, *host_args)
        else:
            command = [sys.executable, str(HOST), "--launch", str(nproc), *host_args]
        result = run_job(
            command,
            log_dir=out,
            timeout_s=JOB_TIMEOUT_S,
            name=name,
            env={**os.environ, **CPU_RANKS},
            dump_signal=signal.SIGUSR1,
        )
        return Job(name, result, out)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return dict(zip(JOBS, pool.map(one, JOBS), strict=True))


def ended_in_time(job: Job) -> None:
    assert not job.result.timed_out, f"HANG\n{job.context()}"
    assert job.result.leftovers == [] and job.result.survivors == [], job.context()


def told_by(job: Job, rank: int, peer_rank: int, reason: str, stand_in: bool = True) -> None:
    """``rank`` ended its run because ``peer_rank`` failed with ``reason``; with
    ``stand_in`` it was blocked in the stand-in device wait, which only its abort ended."""
    record = job.record(rank)
    assert record["reason"] == "peer_failed", job.context()
    assert record["exception_type"] in ("PeerFailed", "PeerRefused")
    assert f"rank {peer_rank} " in record["exception"] and reason in record["exception"]
    assert record["peer_failure"] == {"rank": peer_rank, "reason": record["peer_failure"]["reason"]}
    assert reason in record["peer_failure"]["reason"]
    assert record["process_group_after_abort"] is False  # torch's abort ran: the groups are gone
    assert record["first_failure"] is None  # a rank told by a peer marks nothing
    if stand_in:  # the wait never returned by itself: the abort released it
        assert "t_block" in record and "t_unblocked" not in record


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_rank_1_raising_ends_the_blocked_rank_0_with_peer_failed(jobs):
    job = jobs["raise"]
    ended_in_time(job)
    assert job.result.rc != 0
    told_by(job, 0, 1, "RuntimeError: injected failure at step 2 on rank 1")
    failing = job.record(1)
    assert failing["reason"] == "exception"
    assert failing["first_failure"]["rank"] == 1
    assert failing["peers_ended"] is True  # it waited until rank 0 began its shutdown
    assert job.record(0)["t_shutdown"] > failing["t_fault"]
    not_ended_by_the_deadline(job, 0)


def not_ended_by_the_deadline(job: Job, rank: int) -> None:
    """The told rank's shutdown settled: its exit deadline (12 s, the plugin's default) was
    cancelled, and the rank ended by the PeerFailed, not by the deadline."""
    assert job.record(rank)["settled"] is True, job.context()
    output = job.result.output()
    assert "still running" not in output and "exitcode  : 70" not in output, job.context()


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_every_other_rank_of_three_is_told(jobs):
    """Rank 0 waits in the stand-in; rank 2 in the next step's gloo all-reduce, which its
    abort cannot end (gloo's abort does nothing) while the failed rank 1 is alive: rank 1
    waits for it only so long, then exits, and the collective's error lets rank 2's pending
    interrupt through (still ``peer_failed``: a SIGTERM from torchrun arriving with it only
    becomes the exception's context)."""
    job = jobs["raise3"]
    ended_in_time(job)
    assert job.result.rc != 0
    told_by(job, 0, 1, "injected failure at step 2 on rank 1")
    told_by(job, 2, 1, "injected failure at step 2 on rank 1", stand_in=False)
    assert job.record(2)["last_step"] == 2  # it was in step 3's all-reduce
    # released by rank 1's exit: gloo's error, or torchrun's SIGTERM that came with it
    context = job.record(2)["exception_context"]
    assert "Connection closed by peer" in context or "received SIGTERM" in context, context
    assert job.record(1)["peers_ended"] is False  # rank 2 could not begin its shutdown


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_sigterm_to_rank_1_ends_the_blocked_rank_0_with_peer_failed(jobs):
    job = jobs["sigterm"]
    ended_in_time(job)
    assert job.result.rc != 0
    told_by(job, 0, 1, "signal")
    assert "SIGTERM" in job.record(0)["exception"]
    not_ended_by_the_deadline(job, 0)
    assert job.record(1)["reason"] == "signal"


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_a_refusal_on_rank_1_is_printed_once_by_rank_1_without_a_traceback(jobs):
    # rank 1 refuses the run at step 2 while rank 0 waits on the device: rank 0 hears of it
    # before it could reach a refusal of its own (PeerRefused: it says nothing, exit 2);
    # rank 1, the first to refuse, says its refusal, naming itself, and exits 2 first
    job = jobs["refused"]
    ended_in_time(job)
    told_by(job, 0, 1, "CUDA graphs were asked for but rank 1 refused step 2")
    assert job.record(0)["exception_type"] == "PeerRefused"
    assert job.record(1)["exception_type"] == "ConfigurationError"
    output = job.result.output()
    said = "error: rank 1 refused the run: CUDA graphs were asked for but rank 1 refused step 2"
    assert output.count(said) == 1, job.context()
    assert output.count("the end of the refusal") == 1, job.context()  # whole, once
    # the one traceback is torchrun's own ChildFailedError: none from a worker
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.context()
    assert first_failure(2, 1) in output, job.context()  # rank 1 said it


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_two_ranks_failing_at_once_each_finish_their_own_shutdown(jobs):
    job = jobs["both"]
    ended_in_time(job)
    assert job.result.rc != 0
    first = job.record(0)["first_failure"]
    assert first is not None and first["rank"] in (0, 1)
    for rank in (0, 1):
        record = job.record(rank)
        assert record["reason"] == "exception", job.context()
        assert record["peer_failure"] is None  # neither was interrupted by the other's mark
        assert record["inner_shutdown_done"] is True  # a slow shutdown ran to its end
        assert record["first_failure"] == first  # and they agree on which failed first


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_ranks_completing_at_different_times_raise_no_alarm(jobs):
    job = jobs["completed"]
    ended_without_alarm(job, "completed")
    assert "failed" not in job.result.output().lower(), job.context()


def ended_without_alarm(job: Job, reason: str) -> None:
    """Both ranks ended in time with ``reason`` and exit 0, neither told nor marked."""
    ended_in_time(job)
    assert job.result.rc == 0, job.context()
    for rank in (0, 1):
        record = job.record(rank)
        assert record["reason"] == reason, job.context()
        assert record["peer_failure"] is None and record["first_failure"] is None


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_a_rank_going_on_past_a_peers_early_end_is_ended_within_seconds(jobs):
    """Rank 1's own loop ends after step 2 (no failure; its process and process group live
    on 8 s); rank 0 waits in step 3, in a wait only its abort ends: told by its watch, it
    ends with peer_failed naming rank 1 and both steps, long before rank 1's process ends."""
    job = jobs["left_early"]
    ended_in_time(job)
    assert job.result.rc != 0, job.context()
    told_by(job, 0, 1, "early_exit after step 2, while rank 0 went on to step 3")
    assert "ended its run early" in job.record(0)["exception"]
    left = job.record(1)
    assert (left["reason"], left["first_failure"], left["last_step"]) == ("early_exit", None, 2)
    # the abort, not rank 1's exit (8 s after its shutdown), released rank 0
    assert job.record(0)["t_end"] < left["t_shutdown"] + 8, job.context()
    not_ended_by_the_deadline(job, 0)


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_ranks_ending_early_at_the_same_step_raise_no_alarm(jobs):
    job = jobs["left_together"]
    ended_without_alarm(job, "early_exit")
    assert [job.record(rank)["last_step"] for rank in (0, 1)] == [2, 2], job.context()
    # rank 0 was still in step 2 for 3 s after rank 1's early end: its watch read that end
    assert job.record(0)["t_shutdown"] > job.record(1)["t_shutdown"] + 2, job.context()
    assert job.record(0)["early_end_seen"] == {"rank": 1, "step": 2}, job.context()
    assert "ended its run early" not in job.result.output(), job.context()


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_the_store_gone_with_rank_0_leaves_rank_1_to_complete(jobs):
    job = jobs["store_gone"]
    ended_in_time(job)
    assert job.result.rc == 0, job.context()
    assert [job.record(r)["reason"] for r in (0, 1)] == ["completed", "completed"]
    assert job.record(1)["t_end"] > job.record(0)["t_end"]  # rank 0 (and its store) went first
    output = job.result.output()
    assert "[rank 1] INFO cudagraph_plugin: rank 1: the job's store does not answer" in output
    assert "Traceback" not in output, job.context()


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_the_rank_hosting_the_store_keeps_it_until_the_others_were_told(jobs):
    """Without torchrun, rank 0's process serves the job's store: it fails, and waits for
    the peers before its exit takes the store (and the mark) away."""
    job = jobs["store_host_raises"]
    ended_in_time(job)
    assert job.result.rc != 0
    told_by(job, 1, 0, "injected failure at step 2 on rank 0")
    assert job.record(0)["reason"] == "exception"
    assert job.record(0)["peers_ended"] is True


@pytest.mark.slow
@pytest.mark.xdist_group("peer_failure_jobs")
def test_a_rank_stuck_after_swallowing_peer_failed_ends_by_its_exit_deadline(jobs):
    """Rank 0's host swallows the PeerFailed, then blocks in a wait that neither a signal
    nor an abort ends (as a device wait behind a communicator whose teardown waits for a
    graph): no shutdown runs, torchrun's SIGTERM cannot get through, and only its SIGKILL
    after the grace period would end it. The exit deadline ends it first, saying why and
    where it was stuck."""
    job = jobs["swallowed"]
    ended_in_time(job)
    assert job.record(0)["swallowed"] == "PeerFailed"
    assert "t_unblocked" not in job.record(0)  # still in the second wait when it ended
    output = job.result.output()
    assert "rank 0: still running 2 s after rank 1 (" in output, job.context()
    assert "injected failure at step 2 on rank 1; its threads' stacks follow" in output
    assert "in wait" in output  # the stack dump: where it was stuck (DeviceStandIn.wait)
    assert "exitcode  : 70" in output, job.context()  # torchrun's summary of rank 0
    assert job.result.rc != 0


# -------------------------------------------------------------------------------------------
# The abort of every process group (compat.abort_process_groups).
# -------------------------------------------------------------------------------------------


class EntangledGroup:
    """A group whose abort ends only once the other group's abort has begun: as NCCL's
    teardown of one communicator waits for a kernel stuck on another's collective, which
    only that other communicator's abort flag ends."""

    def __init__(self, name: str, began: dict[str, threading.Event], other: str) -> None:
        self.name, self.began, self.other = name, began, other
        self.released_by_the_other: bool | None = None

    def abort(self) -> None:
        self.began[self.name].set()
        self.released_by_the_other = self.began[self.other].wait(5.0)


def test_every_group_is_aborted_at_once():
    """One group after the other, the first abort would wait for good (here: 5 s, then
    record that nothing released it)."""
    began = {"a": threading.Event(), "b": threading.Event()}
    groups = [EntangledGroup("a", began, "b"), EntangledGroup("b", began, "a")]
    assert compat.GroupAbort(groups).wait(HANG_S)
    assert [group.released_by_the_other for group in groups] == [True, True]


def test_an_abort_that_does_not_return_is_left_behind_at_the_timeout():
    release = threading.Event()
    began = threading.Event()

    class Stuck:
        def abort(self) -> None:
            began.set()
            release.wait(HANG_S)

    try:
        assert not compat.GroupAbort([Stuck()]).wait(0.2)
        assert began.is_set()
    finally:
        release.set()


def test_a_failing_abort_is_logged_and_the_others_still_run(caplog):
    aborted: list[str] = []

    class Failing:
        def abort(self) -> None:
            raise RuntimeError("backend gone")

    class Fine:
        def abort(self) -> None:
            aborted.append("fine")

    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        assert compat.GroupAbort([Failing(), Fine()]).wait(HANG_S)
    assert aborted == ["fine"]
    assert "backend gone" in caplog.text


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo world with one more group, torn down afterwards."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        extra = dist.new_group([0], backend="gloo")
        yield [dist.group.WORLD, extra]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_real_groups_are_aborted_once_and_forgotten(gloo_world, monkeypatch):
    """Over real gloo groups in this process: the watcher's begin, a second begin and the
    host's abort all share one abort of every group; then torch forgets them (a host's
    teardown then skips destroy_process_group)."""
    from cudagraph_plugin.compat import device

    aborted: list[Any] = []

    def recorded(group: Any) -> None:
        aborted.append(group)
        group.abort()

    monkeypatch.setattr(device, "_abort_group", recorded)
    assert sorted(map(id, dist.distributed_c10d._world.pg_names)) == sorted(map(id, gloo_world))
    compat.begin_abort_process_groups()
    compat.begin_abort_process_groups()
    assert compat.abort_process_groups(HANG_S)
    assert sorted(map(id, aborted)) == sorted(map(id, gloo_world))
    assert not dist.is_initialized()
    assert compat.abort_process_groups(HANG_S)  # nothing left: nothing to do


def test_an_abort_left_behind_is_waited_for_again_not_restarted(gloo_world, monkeypatch):
    """A host's abort after finish() gave up waits for the same aborts; the groups are
    forgotten once they ended."""
    from cudagraph_plugin.compat import device

    release = threading.Event()
    aborted: list[Any] = []

    def slow(group: Any) -> None:
        aborted.append(group)
        release.wait(HANG_S)
        group.abort()

    monkeypatch.setattr(device, "_abort_group", slow)
    compat.begin_abort_process_groups()
    assert not compat.abort_process_groups(0.1)
    assert dist.is_initialized()  # left registered while the aborts go on
    release.set()
    assert compat.abort_process_groups(HANG_S)
    assert len(aborted) == len(gloo_world) and not dist.is_initialized()
