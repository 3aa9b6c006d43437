"""The exit deadline of a rank whose peer failed (``cudagraph_plugin.runtime.peer_deadline``):
what it writes and when it ends the process, its arming by the peer watch, its cancelling
by a shutdown that settled, and the setting that sets it. A real job in which only the
deadline ends a stuck rank: ``test_peer_failure_cpu.py``
(``test_a_rank_stuck_after_swallowing_peer_failed_ends_by_its_exit_deadline``)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from blocked_child import sigterm_and_wait, start_blocked

from cudagraph_plugin import compat
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.runtime import job_watch
from cudagraph_plugin.runtime.peer_deadline import EXIT_CODE, ExitDeadline
from cudagraph_plugin.runtime.peers import PeerWatch


class Exits:
    """``os._exit`` recorded instead of taken."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


class Pipe:
    """A pipe whose write end the deadline writes to; each end closed once."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.open = {self.read_fd, self.write_fd}

    def close(self, fd: int) -> None:
        if fd in self.open:
            self.open.discard(fd)
            os.close(fd)

    def read_all(self) -> str:
        self.close(self.write_fd)
        chunks = []
        while chunk := os.read(self.read_fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()


@pytest.fixture
def pipe() -> Iterator[Pipe]:
    made = Pipe()
    yield made
    for fd in list(made.open):
        made.close(fd)


def test_the_deadline_says_why_dumps_every_stack_and_exits_non_zero(pipe):
    exits = Exits()
    deadline = ExitDeadline(3, 0.05, exit=exits, fd=pipe.write_fd, backstop=False)
    deadline.arm("rank 1 (node, pid 7) failed: exception: boom")
    assert exits.done.wait(30)
    assert exits.codes == [EXIT_CODE] and EXIT_CODE not in (0, 1) and deadline.fired
    assert not deadline.armed
    text = pipe.read_all()
    assert text.startswith(
        "cudagraph_plugin: rank 3: still running 0.05 s after rank 1 (node, pid 7) failed: "
        "exception: boom; its threads' stacks follow, then it exits with status 70"
    )
    # every thread's stack: the main thread's (this test) and the deadline's own
    assert "test_the_deadline_says_why_dumps_every_stack_and_exits_non_zero" in text
    assert "in _run" in text


def test_a_cancelled_deadline_never_ends_the_process(pipe):
    exits = Exits()
    deadline = ExitDeadline(0, 2.0, exit=exits, fd=pipe.write_fd, backstop=False)
    deadline.arm("a peer failed")
    assert deadline.armed
    deadline.cancel()
    assert not deadline.armed
    assert not exits.done.wait(3.0)  # past the deadline
    assert exits.codes == [] and not deadline.fired
    assert pipe.read_all() == ""


def test_arming_twice_keeps_one_countdown(pipe):
    exits = Exits()
    deadline = ExitDeadline(0, 0.05, exit=exits, fd=pipe.write_fd, backstop=False)
    deadline.arm("first")
    deadline.arm("second")
    assert exits.done.wait(30)
    assert deadline._thread is not None
    deadline._thread.join(30)
    assert exits.codes == [EXIT_CODE]
    text = pipe.read_all()
    assert "after first;" in text and "second" not in text


def test_an_armed_deadline_holds_the_stuck_signal_exit_until_it_is_cancelled_or_fires(pipe):
    """(see test_an_armed_deadline_takes_over_from_the_stuck_signal_exit for a real process)"""
    from hookspecs import run_signals

    cancelled = ExitDeadline(2, 30.0, exit=Exits(), fd=pipe.write_fd, backstop=False)
    cancelled.cancel()  # before it was armed: nothing taken over
    assert run_signals._BOUNDED_ELSEWHERE is None
    deadline = ExitDeadline(2, 30.0, exit=Exits(), fd=pipe.write_fd, backstop=False)
    deadline.arm("rank 0 failed")
    assert run_signals._BOUNDED_ELSEWHERE == "rank 2's peer exit deadline, 30 s"
    deadline.cancel()
    assert run_signals._BOUNDED_ELSEWHERE is None
    exits = Exits()
    fired = ExitDeadline(2, 0.05, exit=exits, fd=pipe.write_fd, backstop=False)
    fired.arm("rank 0 failed")
    assert exits.done.wait(30)
    assert fired._thread is not None
    fired._thread.join(30)
    assert run_signals._BOUNDED_ELSEWHERE is None  # (its exit returned: it bounds nothing)


_STUCK_AT_EXIT = textwrap.dedent(
    """
    import sys, time
    from cudagraph_plugin.runtime.peer_deadline import ExitDeadline

    class Stuck:  # a destructor that blocks at exit, as a process group's can
        def __del__(self):
            time.sleep(60)

    deadline = ExitDeadline(0, 1.0)
    deadline.arm("a peer failed")
    if sys.argv[1] == "cancel":
        deadline.cancel()
        time.sleep(3)  # past the deadline and its backstop
    else:
        stuck = Stuck()
    """
)


def test_the_backstop_ends_a_process_stuck_in_the_interpreters_finalisation():
    """Past the start of the interpreter's finalisation no Python thread runs: the deadline's
    own thread cannot, faulthandler's C timer can (status 1, its "Timeout" dump)."""
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_AT_EXIT, "stuck"], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("Timeout (0:00:02)!"), done.stderr
    assert "in __del__" in done.stderr and "still running" not in done.stderr


def test_a_cancelled_deadline_cancels_its_backstop_too():
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_AT_EXIT, "cancel"], capture_output=True, text=True, timeout=50
    )
    assert (done.returncode, done.stderr) == (0, "")


_BLOCKED_AFTER_A_PEERS_FAILURE = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    from hookspecs import TrainingRun, get_plugin_manager
    from cudagraph_plugin.runtime.peer_deadline import ExitDeadline

    with TrainingRun(get_plugin_manager(load_entrypoints=False), config={}, train_iters=1):
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        deadline = ExitDeadline(1, 3.0)
        deadline.arm("rank 0 (h, pid 1) failed: exception: boom")  # as the peer watch does
        if sys.argv[1] == "cancelled":
            deadline.cancel()
        print("blocking", flush=True)
        store.wait(["never"], datetime.timedelta(seconds=60))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("deadline", "status", "said"),
    [
        ("armed", EXIT_CODE, "still running 3 s after rank 0"),
        ("cancelled", 143, "SIGTERM received, but the main thread has not come back"),
    ],
)
def test_an_armed_deadline_takes_over_from_the_stuck_signal_exit(
    subprocess_env, deadline, status, said
):
    """(2026-12-06, a SIGTERM to a 2-rank gloo job: the rank blocked in a collective, told of
    its peer's stop, was ended by the run's stuck-signal exit 5 s later without its
    shutdown, just before the peer's exit released the collective and let it shut down.)
    Armed, the deadline owns the process's end: the SIGTERM (1 s stuck-signal wait here) no
    longer ends it; the deadline does, at 3 s. Cancelled, the stuck-signal exit is back."""
    proc = start_blocked(
        [sys.executable, "-c", _BLOCKED_AFTER_A_PEERS_FAILURE, deadline],
        {**subprocess_env, "MCGRAPH_STUCK_SIGNAL_S": "1"},
    )
    _, err = sigterm_and_wait(proc, 30)
    assert proc.returncode == status, err
    assert said in err
    if deadline == "armed":
        assert "has not come back to Python" not in err


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), True, "5", 3601, 1e10])
def test_the_deadline_needs_a_positive_number_of_seconds(seconds):
    with pytest.raises(ValueError, match=r"ExitDeadline: seconds=.* must be a positive number"):
        ExitDeadline(0, seconds)


def test_arming_never_raises_into_the_watchs_reaction(monkeypatch, caplog):
    """The watch arms the deadline in its reaction to a peer's failure, whose interrupt and
    abort must happen whatever the deadline's thread or timer does."""
    from cudagraph_plugin.runtime import peer_deadline

    class NoThreads:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(peer_deadline.threading, "Thread", NoThreads)
    deadline = ExitDeadline(2, 5.0, exit=Exits(), backstop=False)
    deadline.arm("a peer failed")  # logged, not raised
    assert "rank 2: the exit deadline could not be armed: can't start new thread" in caplog.text


def test_the_budget_of_a_wait_ends_a_margin_before_the_deadline(pipe):
    deadline = ExitDeadline(0, 5.0, exit=Exits(), fd=pipe.write_fd, backstop=False)
    assert deadline.budget(10.0) == 10.0  # not armed: nothing to keep to
    deadline.arm("a peer failed")
    try:
        assert 3.0 < deadline.budget(10.0) <= 4.0  # 5 s less the 1 s margin, less time passed
        assert deadline.budget(0.5) == 0.5
    finally:
        deadline.cancel()
    assert deadline.budget(10.0) == 10.0


# -- armed by the watch, cancelled by a shutdown that settled ---------------------------------


def _rank0_watch(
    settle: Any, deadline_s: float = 30, release: bool = False
) -> tuple[PeerWatch, threading.Event, Exits | None]:
    """A started rank-0 watch of a 2-rank job on a ``HashStore``, not interrupting this
    thread, its abort an event and its deadline's exit recorded (None without a deadline)."""
    aborted = threading.Event()
    watch = PeerWatch.start(
        store=dist.HashStore(),
        rank=0,
        world_size=2,
        poll_s=0.02,
        abort=aborted.set,
        settle=settle,
        interrupt=False,
        exit_deadline_s=deadline_s,
        release=release,
    )
    assert watch is not None
    exits = None
    if watch.deadline is not None:
        exits = Exits()
        watch.deadline._exit = exits
        watch.deadline._backstop = False  # no faulthandler timer in this process
    return watch, aborted, exits


@pytest.fixture
def acted() -> Iterator[Any]:
    """A rank-0 watch with a 30 s deadline (its exit recorded) that acted on rank 1's mark,
    without interrupting this thread; ``settled`` says what the shutdown's settle returns."""
    made: list[PeerWatch] = []
    waits: list[float] = []  # what each settle was given

    def make(settled: bool, deadline_s: float = 30) -> tuple[PeerWatch, Exits]:
        def settle(seconds: float) -> bool:
            waits.append(seconds)
            return settled

        watch, aborted, exits = _rank0_watch(settle, deadline_s)
        assert watch.deadline is not None and exits is not None
        made.append(watch)
        assert not watch.deadline.armed  # nothing failed yet
        peer = PeerWatch(watch._store, 1, 2, generation=watch.generation)
        peer.mark_failed("exception: RuntimeError: boom")
        assert aborted.wait(30)
        return watch, exits

    make.waits = waits
    yield make
    for watch in made:
        watch.stop()
        if watch.deadline is not None:
            watch.deadline.cancel()  # never let a test's process be ended later


def test_the_watch_arms_the_deadline_when_it_acts_and_a_settled_shutdown_cancels_it(acted):
    watch, exits = acted(settled=True)
    assert watch.deadline.armed
    assert watch.finish(0.1) is True
    assert not watch.deadline.armed and exits.codes == []


def test_a_shutdown_whose_abort_did_not_end_keeps_the_deadline(acted):
    watch, exits = acted(settled=False)
    assert watch.finish(0.1) is False
    assert watch.deadline.armed and exits.codes == []  # the host's teardown: still bounded


def test_the_wait_for_the_abort_ends_in_time_for_the_rank_to_log_before_its_deadline(acted):
    watch, _ = acted(settled=False, deadline_s=4)
    assert watch.finish(10.0) is False
    [waited] = acted.waits
    assert 2.0 < waited <= 3.0  # 4 s less the 1 s margin, less the time since it acted


def test_a_watch_without_a_deadline_arms_nothing():
    watch = PeerWatch(dist.HashStore(), 0, 2)
    assert watch.deadline is None
    assert PeerWatch(dist.HashStore(), 0, 2, exit_deadline_s=0).deadline is None


# -- the setting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, 12.0),
        ({"cuda_graph_peer_exit_deadline": 30}, 30.0),
        ({"cuda_graph_peer_exit_deadline": "4.5"}, 4.5),
        (argparse.Namespace(cuda_graph_peer_exit_deadline="0"), 0.0),
        (argparse.Namespace(cuda_graph_peer_exit_deadline=None), 12.0),  # the flag not given
    ],
)
def test_the_setting_reads_seconds_with_12_by_default_and_0_for_off(config, expected):
    settings = read_settings(config)
    assert settings.peer_exit_deadline == expected and not settings.input_problems


@pytest.mark.parametrize("value", ["-1", 0.5, "soon", float("inf"), 1e10, "3601"])
def test_a_bad_deadline_is_a_problem_naming_the_field_and_the_fix(value):
    [problem] = read_settings({"cuda_graph_peer_exit_deadline": value}).input_problems
    assert problem.setting == "peer_exit_deadline" and problem.value == value
    assert "give 0 (off) or a number of seconds from 1 to 3600" in problem.fix


@pytest.mark.parametrize("seconds, passed", [(7.0, 7.0), (0.0, None)])
def test_the_run_passes_its_setting_and_its_step_to_the_watch(monkeypatch, seconds, passed):
    seen: list[Any] = []
    monkeypatch.setattr(compat, "distributed_world", lambda: (0, 2))
    monkeypatch.setattr(PeerWatch, "start", classmethod(lambda cls, **kw: seen.append(kw)))
    state = types.SimpleNamespace(
        settings=types.SimpleNamespace(peer_exit_deadline=seconds), step=None
    )
    job_watch.JobWatch(state).watch()
    [kwargs] = seen
    assert kwargs["exit_deadline_s"] == passed
    # and the run's step, read live (what an early end records, and the watch compares)
    assert kwargs["current_step"]() is None
    state.step = 11
    assert kwargs["current_step"]() == 11
    assert set(kwargs) == {"exit_deadline_s", "current_step"}


# -- a peer gone without a word: the run's stuck-signal watch asks the peer watch ------------


@pytest.fixture
def offered() -> Iterator[Any]:
    """A rank-0 watch with a 30 s deadline (its exit recorded) whose release of a blocked
    main thread is offered to the run's stuck-signal watch; no peer marked anything."""
    from hookspecs import run_signals

    made: list[PeerWatch] = []

    def make(deadline_s: float = 30) -> tuple[PeerWatch, threading.Event, Exits | None]:
        started = _rank0_watch(lambda seconds: True, deadline_s, release=True)
        made.append(started[0])
        return started

    yield make
    for watch in made:
        watch.stop()
        if watch.deadline is not None:
            watch.deadline.cancel()
    run_signals.offer_release(None)


def test_a_signal_the_blocked_main_thread_cannot_act_on_begins_the_abort_under_the_deadline(
    offered, caplog
):
    """torchrun's SIGTERM after a peer died without a word (no mark): the stuck-signal watch
    asks the offered release, which begins the abort that ends the blocked collective and
    arms the deadline that bounds the rest, instead of an end without the shutdown."""
    from hookspecs import run_signals

    watch, aborted, exits = offered()
    assert run_signals._RELEASE == watch.release_blocked_main_thread
    with caplog.at_level("ERROR"):
        assert run_signals._release_main_thread(signal.SIGTERM, 5.0) is True
    assert aborted.is_set()
    assert watch.deadline.armed and exits.codes == []
    assert run_signals._BOUNDED_ELSEWHERE == "rank 0's peer exit deadline, 30 s"
    assert "SIGTERM came while this rank's main thread was blocked in C" in caplog.text
    assert watch.peer_failure is None  # (no peer failure invented: the run ends by its signal)
    assert watch.finish(0.1) is True  # the shutdown's settle cancels the deadline
    assert not watch.deadline.armed and run_signals._BOUNDED_ELSEWHERE is None
    # its run ends by the signal: marked for the others, and no wait for the peer that left
    # it blocked (the launcher ends every rank)
    watch.end("signal", None)
    assert watch.first_failure is not None and watch.first_failure.rank == 0
    with caplog.at_level("INFO"):
        assert watch.wait_for_peers(timeout_s=10) is False
    assert (
        "not waiting for the other ranks (SIGTERM came while a peer left this rank" in caplog.text
    )


def test_a_released_rank_whose_blocked_call_raised_first_is_marked_as_stopped(offered):
    """The abort can break the blocked collective with an error that reaches the run before
    the signal's handler does (the run then ends with ``exception``, the signal held): its
    mark still says the rank was stopped by the launcher's signal, not that it failed
    first with the abort's error (review of 2026-12-05)."""
    from hookspecs import run_signals

    watch, _, _ = offered()
    assert run_signals._release_main_thread(signal.SIGTERM, 5.0) is True
    watch.end("exception", RuntimeError("NCCL communicator was aborted on rank 0"))
    first = watch.first_failure
    assert first is not None and first.rank == 0 and first.stopped, first
    assert first.reason.startswith("signal: SIGTERM came while a peer left this rank"), first
    assert "aborted" not in first.reason


def test_a_watch_whose_thread_cannot_start_leaves_no_offer_handler_or_registry(monkeypatch, caplog):
    """A thread limit reached as the watch starts: the run goes on without a watch (logged),
    and nothing of the watch is left behind: no release offered to the stuck-signal watch (a
    later SIGTERM would begin an abort and arm a deadline no shutdown settles), its signal's
    handler put back, and the next run's watch free to start (review of 2026-12-05, second
    session)."""
    from cudagraph_plugin.runtime import peers
    from cudagraph_plugin.runtime.peer_mark import default_interrupt_signal
    from hookspecs import run_signals

    signum = default_interrupt_signal()
    before = signal.getsignal(signum)
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "mcgraph-peer-watch":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(compat, "nccl_initialized", lambda: True)  # (the release offered)
    monkeypatch.setattr(compat, "default_store", dist.HashStore)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with caplog.at_level("WARNING"):
        assert job_watch.watch_job(exit_deadline_s=12) is None
    assert "can't start new thread: this run does not watch its peers" in caplog.text
    assert run_signals._RELEASE is None
    assert peers._active is None
    assert signal.getsignal(signum) is before


def test_a_deadline_whose_countdown_cannot_start_is_not_armed_and_nothing_is_released(
    offered, monkeypatch, caplog
):
    from hookspecs import run_signals

    watch, aborted, _ = offered()

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with caplog.at_level("ERROR"):
        assert watch.release_blocked_main_thread(signal.SIGTERM) is False
    assert "the exit deadline could not be armed: can't start new thread" in caplog.text
    assert not watch.deadline.armed and run_signals._BOUNDED_ELSEWHERE is None
    assert not aborted.is_set()


def test_a_release_after_the_watch_acted_or_stopped_declines_and_stop_withdraws_it(offered):
    from hookspecs import run_signals

    watch, aborted, _ = offered()
    watch.stop()
    assert run_signals._RELEASE is None  # withdrawn by its watch's stop
    assert watch.release_blocked_main_thread(signal.SIGTERM) is False
    assert not aborted.is_set() and not watch.deadline.armed
    acting, aborted, _ = offered()
    peer = PeerWatch(acting._store, 1, 2, generation=acting.generation)
    peer.mark_failed("exception: RuntimeError: boom")
    assert aborted.wait(30)  # the watch acted on the mark: the release is not asked twice
    assert acting.release_blocked_main_thread(signal.SIGTERM) is False


def test_a_watch_without_a_deadline_offers_no_release(offered):
    """Nothing would bound a release whose abort does not end the call: the run's own exit
    (5 s after the signal, without the shutdown) stays."""
    from hookspecs import run_signals

    watch, _, _ = offered(deadline_s=0)
    assert watch.deadline is None and run_signals._RELEASE is None
    assert watch.release_blocked_main_thread(signal.SIGTERM) is False


def test_over_gloo_no_release_is_offered_by_default(monkeypatch):
    """Over gloo the abort does not end a blocked collective (only the peer's exit does): a
    release would only move the run's own exit (5 s) to the deadline (12 s)."""
    from hookspecs import run_signals

    for nccl in (False, True):
        monkeypatch.setattr(compat, "nccl_initialized", lambda nccl=nccl: nccl)
        watch = PeerWatch.start(
            store=dist.HashStore(), rank=0, world_size=2, interrupt=False, exit_deadline_s=30
        )
        try:
            offered = run_signals._RELEASE is not None
        finally:
            watch.stop()
        assert offered == nccl
        assert run_signals._RELEASE is None
