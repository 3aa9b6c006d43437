"""TrainingRun's signal handlers and its hold on the process, at the edges the other run
tests do not reach: runs that overlap, a start that fails half-way, a Ctrl-C while the
handlers go back, a host's own SIGINT handler during shutdown, a handler the host sets
during the run, and a run left from another thread."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from typing import Any

import pytest

from hookspecs import ShutdownReason, TrainingRun, get_plugin_manager, hookimpl, run_signals


def new_pm():
    return get_plugin_manager(load_entrypoints=False)


class Reasons:
    def __init__(self, log: list[str] | None = None) -> None:
        self.log = log if log is not None else []

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.log.append(str(reason))


# -- one run at a time ------------------------------------------------------------------------


def test_a_run_entered_while_another_is_active_is_refused_and_changes_nothing(host_sigterm):
    first, second = new_pm(), new_pm()
    seen = Reasons()
    second.register(seen)
    with TrainingRun(first, None, train_iters=0):
        handler_of_the_first = signal.getsignal(signal.SIGTERM)
        with pytest.raises(RuntimeError, match="another TrainingRun is active"):
            TrainingRun(second, None, train_iters=0).__enter__()
        assert signal.getsignal(signal.SIGTERM) == handler_of_the_first
    assert seen.log == []  # refused before its configure: no shutdown either
    # once the first is left, the second manager serves a run (it was not marked used)
    with TrainingRun(second, None, train_iters=0):
        pass
    assert seen.log == ["completed"]
    assert signal.getsignal(signal.SIGTERM) is not None
    os.kill(os.getpid(), signal.SIGTERM)
    assert host_sigterm == [signal.SIGTERM]  # the host's handler is back


def test_a_run_entered_and_never_left_holds_the_process_until_it_is_left(host_sigterm):
    """(its signal handler holds it: the claim does not lapse on its own; `with` leaves)"""
    import gc

    abandoned = TrainingRun(new_pm(), None, train_iters=0)
    abandoned.__enter__()
    gc.collect()
    with pytest.raises(RuntimeError, match="another TrainingRun is active"):
        TrainingRun(new_pm(), None, train_iters=0).__enter__()
    abandoned.__exit__(None, None, None)
    with TrainingRun(new_pm(), None, train_iters=0):
        pass


def test_a_second_ctrl_c_while_a_failed_start_is_blamed_still_shuts_it_down(
    monkeypatch, host_sigterm
):
    from hookspecs import run as run_module

    class Refuses:
        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            raise ValueError("bad config")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "blame", interrupted)
    seen = Reasons()
    pm = new_pm()
    pm.register(seen)
    pm.register(Refuses())
    with pytest.raises(KeyboardInterrupt):
        with TrainingRun(pm, None, train_iters=0):
            pass
    assert seen.log == ["exception"]
    with TrainingRun(new_pm(), None, train_iters=0):  # the process was let go
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    assert host_sigterm == [signal.SIGTERM]


# -- handle_signals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("handle_signals", "match"),
    [
        ((signal.SIGTERM, signal.SIGKILL), "SIGKILL, which no process can catch"),
        ((signal.SIGSTOP,), "SIGSTOP"),
        ((signal.SIGTERM, 9999), "not a tuple of signals"),
        (signal.SIGTERM, "not a tuple of signals"),
    ],
)
def test_handle_signals_that_cannot_be_caught_are_refused_when_the_run_is_made(
    handle_signals, match, host_sigterm
):
    pm = new_pm()
    with pytest.raises(ValueError, match=match) as refused:
        TrainingRun(pm, None, train_iters=0, handle_signals=handle_signals)
    assert "handle_signals=" in str(refused.value)
    with TrainingRun(pm, None, train_iters=0):  # nothing was installed, nothing marked
        pass


def test_a_signal_named_twice_is_handled_once_and_the_hosts_handler_comes_back(host_sigterm):
    with TrainingRun(new_pm(), None, train_iters=0, handle_signals=(signal.SIGTERM,) * 2):
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # (was: the run's own handler, calling itself)
    assert host_sigterm == [signal.SIGTERM]


def test_sigint_among_handle_signals_is_put_back_after_the_run(default_sigint, caplog):
    with caplog.at_level(logging.INFO, logger="hookspecs.run"):
        with TrainingRun(new_pm(), None, train_iters=0, handle_signals=(signal.SIGINT,)):
            pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "left in place" not in caplog.text


def test_a_start_that_fails_while_installing_handlers_takes_off_those_installed(
    monkeypatch, host_sigterm
):
    real = signal.signal

    def refuses_sigusr1(signum, handler):
        if signum == signal.SIGUSR1 and getattr(handler, "__self__", None) is not None:
            raise OSError("refused")
        return real(signum, handler)

    monkeypatch.setattr(run_signals.signal, "signal", refuses_sigusr1)
    seen = Reasons()
    pm = new_pm()
    pm.register(seen)
    with pytest.raises(OSError, match="refused"):
        with TrainingRun(pm, None, train_iters=0, handle_signals=(signal.SIGTERM, signal.SIGUSR1)):
            pass
    assert seen.log == ["exception"]
    os.kill(os.getpid(), signal.SIGTERM)  # the host's handler, not the failed run's
    assert host_sigterm == [signal.SIGTERM]


# -- Ctrl-C while shutdown ends -------------------------------------------------------------------


@pytest.fixture
def default_sigint():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_while_the_handlers_go_back_leaves_none_of_the_runs_behind(
    monkeypatch, default_sigint, host_sigterm
):
    restore = TrainingRun._restore_signal_handlers

    def ctrl_c_first(self):
        os.kill(os.getpid(), signal.SIGINT)
        restore(self)

    monkeypatch.setattr(TrainingRun, "_restore_signal_handlers", ctrl_c_first)
    seen = Reasons()
    pm = new_pm()
    pm.register(seen)
    with pytest.raises(KeyboardInterrupt):
        with TrainingRun(pm, None, train_iters=0):
            pass
    assert seen.log == ["completed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert host_sigterm == [signal.SIGTERM]


class CtrlCPressed:
    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def host_sigint():
    """The host's own SIGINT handler: it records, then interrupts as the default would."""
    calls: list[str] = []

    def handler(signum, frame):
        calls.append("host's Ctrl-C handler")
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, handler)
    yield calls, handler
    signal.signal(signal.SIGINT, before)


def test_a_hosts_own_sigint_handler_is_held_until_every_shutdown_implementation_ran(host_sigint):
    calls, handler = host_sigint
    log: list[str] = []
    pm = new_pm()
    pm.register(Reasons(log))
    pm.register(CtrlCPressed())  # registered last: called first
    with pytest.raises(KeyboardInterrupt):
        with TrainingRun(pm, None, train_iters=0):
            pass
    assert log == ["completed"]  # the implementation after the Ctrl-C still ran
    assert calls == ["host's Ctrl-C handler"]  # and the host's handler ran once, afterwards
    assert signal.getsignal(signal.SIGINT) is handler


def test_an_ignored_sigint_stays_ignored_during_shutdown():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        log: list[str] = []
        pm = new_pm()
        pm.register(Reasons(log))
        pm.register(CtrlCPressed())
        with TrainingRun(pm, None, train_iters=0):
            pass
        assert log == ["completed"]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


# -- handlers left installed after the run -------------------------------------------------------


def test_a_handler_the_host_sets_during_the_run_is_kept(host_sigterm, caplog):
    def set_during_the_run(signum, frame):
        pass

    with caplog.at_level(logging.INFO, logger="hookspecs.run"):
        with TrainingRun(new_pm(), None, train_iters=0):
            signal.signal(signal.SIGTERM, set_during_the_run)
    assert signal.getsignal(signal.SIGTERM) is set_during_the_run
    assert "SIGTERM: the handler set during the run is left in place" in caplog.text


def test_a_run_left_from_another_thread_leaves_handlers_that_act_as_the_hosts(host_sigterm, caplog):
    run = TrainingRun(new_pm(), None, train_iters=0)
    run.__enter__()
    try:
        errors: list[BaseException] = []

        def leave():
            try:
                run.__exit__(None, None, None)
            except BaseException as error:  # (a ValueError from signal.signal, before)
                errors.append(error)

        with caplog.at_level(logging.WARNING, logger="hookspecs.run"):
            thread = threading.Thread(target=leave)
            thread.start()
            thread.join()
        assert errors == []
        assert run.shutdown_reason is ShutdownReason.COMPLETED
        assert "left from another thread" in caplog.text
        # the run's handler is still installed, and now does what the host's did
        assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is run
        os.kill(os.getpid(), signal.SIGTERM)  # no SignalReceived: the run is over
        assert host_sigterm == [signal.SIGTERM]
    finally:
        run._restore_signal_handlers()


def test_a_signal_during_the_run_still_ends_it(host_sigterm):
    """(the handler's new first check, ``_finished``, must not swallow a live run's signal;
    the host's handler returns, so the program goes on after the shutdown)"""
    reached: list[str] = []
    with TrainingRun(new_pm(), None, train_iters=2) as run:
        for step in range(2):
            with run.train_step(step):
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append(f"step {step}")
    assert reached == []
    assert run.shutdown_reason is ShutdownReason.SIGNAL
    assert host_sigterm == [signal.SIGTERM]


# -- whose line is it ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "[rank 1] SIGTERM received: ending the run cleanly"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "SIGTERM received: ending the run cleanly"),
        ({}, "SIGTERM received: ending the run cleanly"),
    ],
    ids=["rank-1-of-2", "one-rank", "no-launcher"],
)
def test_a_signal_line_names_its_rank_in_a_job_of_several(
    host_sigterm, caplog, monkeypatch, env, said
):
    """(2026-12-06: a SIGTERM to a 2-rank torchrun job printed "SIGTERM received: ending the
    run cleanly" twice, nothing saying whose each was; the plugin's own lines carry the rank)"""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="hookspecs.run"):
        with TrainingRun(new_pm(), None, train_iters=1) as run:
            with run.train_step(0):
                os.kill(os.getpid(), signal.SIGTERM)
    [line] = [r.getMessage() for r in caplog.records if "received" in r.getMessage()]
    assert line.startswith(said)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
        ({}, (0, 1)),
        ({"RANK": "", "WORLD_SIZE": ""}, (0, 1)),
        ({"RANK": "x", "WORLD_SIZE": "2"}, (0, 2)),
        ({"RANK": "3", "WORLD_SIZE": "abc"}, (3, 1)),
        ({"RANK": "-1", "WORLD_SIZE": "0"}, (0, 1)),
    ],
)
def test_the_launchers_rank_and_size_are_each_read_or_defaulted(monkeypatch, env, expected):
    from hookspecs.ranks import launcher_rank, rank_tag

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launcher_rank() == expected
    assert rank_tag() == (f"[rank {expected[0]}] " if expected[1] > 1 else "")


def test_a_signal_held_during_shutdown_is_told_to_plugins_and_one_that_ended_the_run_is_not(
    host_sigterm,
):
    """``run_signals.held_signal()``: a Ctrl-C during the shutdown (the job is being ended)
    is visible to the shutdown's own waits; a SIGTERM the host's own handler takes after
    the shutdown is not (the program may go on), nor is the signal that ended the run."""
    seen: list[int | None] = []

    class Shutdown:
        def __init__(self, send: int | None) -> None:
            self.send = send

        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            seen.append(run_signals.held_signal())
            if self.send is not None:
                os.kill(os.getpid(), self.send)
                seen.append(run_signals.held_signal())

    pm = new_pm()
    pm.register(Shutdown(send=signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):  # (acted on once the shutdown ended)
        with TrainingRun(pm, None, train_iters=0):
            pass
    assert seen == [None, signal.SIGINT]
    assert run_signals.held_signal() is None  # (the run is over)
    seen.clear()
    pm = new_pm()
    pm.register(Shutdown(send=signal.SIGTERM))
    with TrainingRun(pm, None, train_iters=0):
        pass
    assert seen == [None, None] and host_sigterm == [signal.SIGTERM]
    seen.clear()
    pm = new_pm()
    pm.register(Shutdown(send=None))
    with TrainingRun(pm, None, train_iters=1) as run:
        with run.train_step(0):
            os.kill(os.getpid(), signal.SIGTERM)
    assert run.shutdown_reason is ShutdownReason.SIGNAL and seen == [None]


_TOLD_THEN_TERMINATED = """
import os, signal, sys
from hookspecs import (
    ConfigurationError, PeerFailed, TrainingRun, get_plugin_manager, hookimpl,
    print_peer_failure,
)

class Unwritable:
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

class Told:
    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        from hookspecs import run_signals

        os.kill(os.getpid(), signal.SIGTERM)  # (torchrun's, once the failed rank exited)
        print("held:", run_signals.held_signal(), flush=True)
        {then}

pm = get_plugin_manager(load_entrypoints=False)
pm.register(Told())
try:
    with TrainingRun(pm, None, train_iters=1) as run:
        with run.train_step(0):
            {raise_it}
except PeerFailed as told:
    raise SystemExit(print_peer_failure(told))
"""


INTERRUPTED = "[rank 1] interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)"


@pytest.mark.parametrize(
    "raise_it, said",
    [
        (
            'raise PeerFailed(0, "exception: boom", "rank 0 (h, pid 7) failed: exception: boom")',
            ["[rank 1] run ended: rank 0 (h, pid 7) failed: exception: boom"],
        ),
        # (2026-12-06, a loaded 2-rank gloo job given a SIGINT on every rank: the silent
        # rank exited first, and torchrun's SIGTERM ended the rank that says the job's
        # Ctrl-C during its shutdown, so nothing said it)
        ("raise KeyboardInterrupt", [INTERRUPTED]),
        # (a rank whose Ctrl-C another rank says stays silent there too)
        ("error = KeyboardInterrupt(); error.said_here = False; raise error", []),
        # (2026-12-06, a review: the rank that failed, SIGTERMed in its shutdown once a told
        # rank exited first, as over NCCL, whose abort frees the told rank at once: ended
        # without its traceback, the one word of why from the rank that failed)
        ('raise RuntimeError("boom on rank 1")', ["RuntimeError: boom on rank 1"]),
        # (the rank that refused first says it; the others are silent)
        (
            'error = ConfigurationError("bad value"); error.said_here = True; raise error',
            ["error: rank 1 refused the run: bad value"],
        ),
        ('error = ConfigurationError("bad value"); error.said_here = False; raise error', []),
        # (a rank told of another's refusal says nothing: that rank says it)
        ('from hookspecs import PeerRefused; raise PeerRefused(0, "bad value")', []),
        # (a SystemExit's message, as Python says it; a status alone, nothing)
        ('raise SystemExit("fatal: dataset missing")', ["fatal: dataset missing"]),
        ("raise SystemExit(3)", []),
    ],
    ids=[
        "told",
        "interrupted",
        "interrupted-silent",
        "failed",
        "refused",
        "refused-silent",
        "told-of-a-refusal",
        "exit-message",
        "exit-status",
    ],
)
def test_a_rank_ended_by_a_signal_held_in_its_shutdown_still_says_its_line(
    raise_it, said, subprocess_env
):
    """(2026-12-05, a review of 2-rank failure paths: torchrun's SIGTERM, sent once the
    failed rank exited, came during the told rank's shutdown; held, it then ended the
    process by the signal, and the host, which says the told rank's line, never ran)"""
    done = _held_sigterm_job(raise_it, "pass", subprocess_env)
    assert done.returncode == -signal.SIGTERM, done.stderr  # (still ended by the signal)
    assert done.stdout == f"held: {int(signal.SIGTERM)}\n"  # (the process's end: told)
    lines = [line for line in done.stderr.splitlines() if _SAID_LINE.search(line)]
    assert lines == said, done.stderr
    # a failure's traceback, once, as Python prints it
    assert done.stderr.count("Traceback (most recent call last)") == ("RuntimeError" in raise_it)


_SAID_LINE = re.compile(r"run ended:|rupted \(|^RuntimeError: |^error: |^fatal: ")


def test_a_held_signal_ends_the_process_even_where_its_line_cannot_be_written(subprocess_env):
    """(2026-12-06, a review: standard error a pipe nobody reads any more, e.g. a `| tee`
    that died; saying the line raised BrokenPipeError, which skipped the death by the held
    SIGTERM: the host's code ran on and the process exited 1)"""
    done = _held_sigterm_job("raise KeyboardInterrupt", "sys.stderr = Unwritable()", subprocess_env)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)


def _held_sigterm_job(raise_it: str, then: str, env: dict[str, str]) -> Any:
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run(
        [sys.executable, "-c", _TOLD_THEN_TERMINATED.format(raise_it=raise_it, then=then)],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **env,
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
            "RANK": "1",
            "WORLD_SIZE": "2",
        },
    )


_END_BY_SIGTERM = """
import signal
from hookspecs.errors import end_by_signal
{first}
end_by_signal(signal.SIGTERM)
print("returned", flush=True)
"""


def _unshare_works() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    except OSError:
        return False
    return probe.returncode == 0


@pytest.mark.parametrize(
    "where",
    [
        # the kernel drops a default-action signal that the first process of a PID namespace
        # sends itself: as if raise_signal did nothing
        "simulated",
        pytest.param(
            "pid-namespace",
            marks=pytest.mark.skipif(
                not _unshare_works(), reason="unshare --pid --fork is not allowed here"
            ),
        ),
    ],
)
def test_a_process_the_signal_cannot_end_exits_with_its_shell_status(where, subprocess_env):
    """(2026-12-06, a review: a container's `python train.py` is PID 1, whose own SIGTERM
    with the default action the kernel ignores: the held signal's end returned, the run's
    `__exit__` went on, and a Ctrl-C's line was said twice.) The process ends all the same,
    with 128 + the signal number, what a shell reports for it."""
    import subprocess
    import sys
    from pathlib import Path

    first = "signal.raise_signal = lambda signum: None" if where == "simulated" else ""
    command = [sys.executable, "-c", _END_BY_SIGTERM.format(first=first)]
    if where == "pid-namespace":
        command = ["unshare", "--pid", "--fork", *command]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={**subprocess_env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert (done.returncode, done.stdout) == (128 + signal.SIGTERM, ""), done.stderr
