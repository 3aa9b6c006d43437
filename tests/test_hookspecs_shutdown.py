"""TrainingRun fires mcgraph_shutdown exactly once, with the right reason, on every exit path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hookspecs import (
    PeerFailed,
    ShutdownReason,
    SignalReceived,
    TrainingRun,
    get_plugin_manager,
    hookimpl,
)


@pytest.fixture
def pm():
    return get_plugin_manager(load_entrypoints=False)


class ShutdownRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[ShutdownReason, BaseException | None]] = []

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.calls.append((reason, exception))


@pytest.fixture
def rec(pm):
    recorder = ShutdownRecorder()
    pm.register(recorder)
    return recorder


def loop(run: TrainingRun, train_iters: int, body=None) -> None:
    for step in range(run.start_step, train_iters):
        with run.train_step(step):
            if body is not None:
                body(step)


# -- in-process exit paths ------------------------------------------------------------------


def test_normal_end_is_completed(pm, rec):
    with TrainingRun(pm, None, train_iters=3) as run:
        loop(run, 3)
    assert rec.calls == [(ShutdownReason.COMPLETED, None)]
    assert run.shutdown_reason is ShutdownReason.COMPLETED


def test_resumed_run_that_reaches_train_iters_is_completed(pm, rec):
    with TrainingRun(pm, None, train_iters=5, start_step=3) as run:
        loop(run, 5)
    assert rec.calls == [(ShutdownReason.COMPLETED, None)]


def test_break_before_train_iters_is_early_exit(pm, rec):
    with TrainingRun(pm, None, train_iters=10) as run:
        for step in range(10):
            with run.train_step(step):
                pass
            if step == 2:
                break
    assert rec.calls == [(ShutdownReason.EARLY_EXIT, None)]
    assert run.last_step == 2


def test_leaving_before_any_step_is_early_exit(pm, rec):
    with TrainingRun(pm, None, train_iters=10):
        pass
    assert rec.calls == [(ShutdownReason.EARLY_EXIT, None)]


@pytest.mark.parametrize("code", [0, None])
def test_sys_exit_success_before_train_iters_is_early_exit(pm, rec, code):
    def body(step):
        if step == 1:
            sys.exit(code)

    with pytest.raises(SystemExit) as excinfo:
        with TrainingRun(pm, None, train_iters=10) as run:
            loop(run, 10, body)
    assert rec.calls == [(ShutdownReason.EARLY_EXIT, excinfo.value)]


def test_sys_exit_success_after_the_last_step_is_completed(pm, rec):
    """run.py's docstring: ``sys.exit(0)`` *before the last step* is an early exit. A host
    that exits with status 0 after every step has run has completed its run (today
    ``_classify`` answers early_exit for any successful SystemExit)."""
    with pytest.raises(SystemExit):
        with TrainingRun(pm, None, train_iters=3) as run:
            loop(run, 3)
            sys.exit(0)
    assert [reason for reason, _ in rec.calls] == [ShutdownReason.COMPLETED]


@pytest.mark.parametrize("code", [1, "fatal: bad data"])
def test_sys_exit_failure_is_exception(pm, rec, code):
    with pytest.raises(SystemExit) as excinfo:
        with TrainingRun(pm, None, train_iters=10) as run:
            loop(run, 10, lambda step: sys.exit(code))
    assert rec.calls == [(ShutdownReason.EXCEPTION, excinfo.value)]


def test_exception_in_a_step_is_passed_and_propagates(pm, rec):
    ended = []

    class StepEnds:
        @hookimpl
        def mcgraph_train_step_end(self, step):
            ended.append(step)

    pm.register(StepEnds())
    error = RuntimeError("CUDA out of memory")

    def body(step):
        if step == 2:
            raise error

    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(pm, None, train_iters=5) as run:
            loop(run, 5, body)
    assert excinfo.value is error
    assert rec.calls == [(ShutdownReason.EXCEPTION, error)]
    assert rec.calls[0][1] is error
    assert ended == [0, 1], "train_step_end must not fire for the step that raised"


def test_keyboard_interrupt_is_interrupted(pm, rec):
    interrupt = KeyboardInterrupt()

    def body(step):
        raise interrupt

    with pytest.raises(KeyboardInterrupt) as excinfo:
        with TrainingRun(pm, None, train_iters=5) as run:
            loop(run, 5, body)
    assert excinfo.value is interrupt
    assert rec.calls == [(ShutdownReason.INTERRUPTED, interrupt)]


def test_configure_raising_shuts_down_once_and_propagates(pm, rec):
    error = ValueError("cuda_graph_scope full_iteration requires cuda_graph_impl='local'")
    body_ran = []

    class Refuses:
        @hookimpl
        def mcgraph_configure(self):
            raise error

    pm.register(Refuses())
    run = TrainingRun(pm, None, train_iters=3)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError) as excinfo:
        with run:
            body_ran.append(True)
    assert excinfo.value is error
    assert body_ran == []
    assert rec.calls == [(ShutdownReason.EXCEPTION, error)]
    assert run.shutdown_reason is ShutdownReason.EXCEPTION
    assert signal.getsignal(signal.SIGTERM) == before


def test_failing_shutdown_does_not_hide_the_original_exception(pm, rec, caplog):
    class BrokenCleanup:
        @hookimpl
        def mcgraph_shutdown(self):
            raise OSError("cleanup failed")

    pm.register(BrokenCleanup())
    original = RuntimeError("step failed")

    def body(step):
        raise original

    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(pm, None, train_iters=3) as run:
            loop(run, 3, body)
    assert excinfo.value is original
    notes = getattr(original, "__notes__", [])
    assert any("mcgraph_shutdown" in note and "cleanup failed" in note for note in notes), notes
    assert "mcgraph_shutdown raised" in caplog.text
    # The recorder was registered first, so pluggy called it after the broken one: an
    # implementation that raises stops the others (pluggy's contract), which is why
    # cleanup belongs in wrapper=True implementations.
    assert rec.calls == []


def test_failing_shutdown_propagates_when_the_run_ended_cleanly(pm):
    error = OSError("cleanup failed")

    class BrokenCleanup:
        @hookimpl
        def mcgraph_shutdown(self):
            raise error

    pm.register(BrokenCleanup())
    with pytest.raises(OSError) as excinfo:
        with TrainingRun(pm, None, train_iters=1) as run:
            loop(run, 1)
    assert excinfo.value is error
    assert run.shutdown_reason is ShutdownReason.COMPLETED


@pytest.mark.parametrize("original", [None, RuntimeError("step failed")])
def test_wrapper_cleanup_runs_even_when_another_shutdown_raises(pm, original):
    events = []

    class Cleanup:
        @hookimpl(wrapper=True)
        def mcgraph_shutdown(self, reason):
            events.append(f"before {reason}")
            try:
                return (yield)
            finally:
                events.append("cleanup")

    class Broken:
        @hookimpl
        def mcgraph_shutdown(self):
            events.append("broken")
            raise OSError("cleanup failed")

    # Registered first: a wrapper wraps every plain implementation whatever the order.
    pm.register(Cleanup())
    pm.register(Broken())
    expected = OSError if original is None else RuntimeError

    def body(step):
        if original is not None:
            raise original

    with pytest.raises(expected):
        with TrainingRun(pm, None, train_iters=1) as run:
            loop(run, 1, body)
    reason = "completed" if original is None else "exception"
    assert events == [f"before {reason}", "broken", "cleanup"]


def test_shutdown_fires_once_even_if_exit_is_called_again(pm, rec):
    run = TrainingRun(pm, None, train_iters=0)
    with run:
        pass
    run.__exit__(None, None, None)
    assert rec.calls == [(ShutdownReason.COMPLETED, None)]


def test_using_the_run_after_shutdown_raises(pm, rec):
    with TrainingRun(pm, None, train_iters=2) as run:
        loop(run, 1)
    with pytest.raises(RuntimeError, match="shut down"):
        run.model_config_kwargs()
    with pytest.raises(RuntimeError, match="shut down"):
        with run.train_step(1):
            pass
    with pytest.raises(RuntimeError, match="shut down"):
        with run.evaluation():
            pass
    with pytest.raises(RuntimeError, match="only once"):
        with run:
            pass
    assert len(rec.calls) == 1


def test_using_the_run_before_entering_raises(pm, rec):
    run = TrainingRun(pm, None, train_iters=2)
    with pytest.raises(RuntimeError, match="context manager"):
        run.rng_options()
    with pytest.raises(RuntimeError, match="context manager"):
        with run.train_step(0):
            pass
    with pytest.raises(RuntimeError, match="context manager"):
        run.forward_backward_func(print)
    assert rec.calls == []


def test_signal_handler_is_installed_only_during_the_run(pm, rec):
    before = signal.getsignal(signal.SIGTERM)
    with TrainingRun(pm, None, train_iters=0) as run:
        during = signal.getsignal(signal.SIGTERM)
    assert during != before
    assert getattr(during, "__self__", None) is run
    assert signal.getsignal(signal.SIGTERM) == before


def test_signal_received_is_a_base_exception():
    """A host's ``except Exception`` must not swallow it."""
    assert not issubclass(SignalReceived, Exception)
    assert SignalReceived(signal.SIGTERM).signum == signal.SIGTERM


# -- SIGTERM, in a subprocess ---------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from hookspecs import TrainingRun, get_plugin_manager, hookimpl

    mode = sys.argv[1]

    class Printer:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            print(f"shutdown {reason} {type(exception).__name__}", flush=True)
            if mode == "during_shutdown":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                print("shutdown hook finished", flush=True)
            if mode.startswith("stuck"):
                print("stuck in shutdown", flush=True)
                time.sleep(30)  # e.g. waiting on a peer rank that is gone
                print("shutdown hook finished", flush=True)

    def previous_handler(signum, frame):
        print(f"previous handler {signum}", flush=True)

    if mode in ("python_handler", "stuck_python_handler"):
        signal.signal(signal.SIGTERM, previous_handler)
    elif mode == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    iters = 3 if mode == "during_shutdown" else 1000
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Printer())
    with TrainingRun(pm, None, train_iters=iters) as run:
        for step in range(iters):
            with run.train_step(step):
                if step == 2 and mode != "during_shutdown":
                    print("ready", flush=True)
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        time.sleep(0.01)
    print(f"after run handler_restored={signal.getsignal(signal.SIGTERM) is previous_handler}",
          flush=True)
    """
)


def start_child(tmp_path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_child_and_terminate(tmp_path, mode: str) -> tuple[int, list[str], str]:
    """Start the child, wait until it is inside a step, send SIGTERM, collect its output."""
    proc = start_child(tmp_path, mode)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out.splitlines(), err


def test_sigterm_with_default_handler_shuts_down_then_dies_by_sigterm(tmp_path):
    returncode, lines, err = run_child_and_terminate(tmp_path, "default")
    assert lines == ["shutdown signal SignalReceived"], err
    assert returncode == -signal.SIGTERM, err
    assert "Traceback" not in err  # (the signal says how it ended: nothing more to say)


def test_sigterm_with_python_handler_calls_it_after_shutdown(tmp_path):
    returncode, lines, err = run_child_and_terminate(tmp_path, "python_handler")
    assert lines == [
        "shutdown signal SignalReceived",
        f"previous handler {int(signal.SIGTERM)}",
        "after run handler_restored=True",
    ], err
    assert returncode == 0, err


def test_sigterm_during_shutdown_lets_shutdown_finish_then_dies(tmp_path):
    proc = start_child(tmp_path, "during_shutdown")
    out, err = proc.communicate(timeout=15)
    assert out.splitlines() == ["shutdown completed NoneType", "shutdown hook finished"], err
    assert proc.returncode == -signal.SIGTERM, err


@pytest.mark.parametrize("mode", ["stuck_default", "stuck_python_handler"])
def test_second_sigterm_while_shutdown_is_stuck_goes_to_the_previous_handler(tmp_path, mode):
    """The first SIGTERM starts a clean shutdown; if that hangs, a second one must not be
    swallowed: it reaches the handler the host had (by default: the process dies)."""
    proc = start_child(tmp_path, mode)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "shutdown signal SignalReceived\n"
        assert proc.stdout.readline() == "stuck in shutdown\n"
        proc.send_signal(signal.SIGTERM)
        if mode == "stuck_default":
            out, err = proc.communicate(timeout=10)  # not the 30 s the hook sleeps
            assert proc.returncode == -signal.SIGTERM, err
            assert "shutdown hook finished" not in out
        else:
            assert proc.stdout.readline() == f"previous handler {int(signal.SIGTERM)}\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sigterm_ignored_before_the_run_stays_ignored(tmp_path):
    proc = start_child(tmp_path, "ignored")
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        # The step keeps sleeping: the signal changed nothing.
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=0.5)
    finally:
        proc.kill()
        proc.communicate()


# -- the run's bookkeeping ---------------------------------------------------------------------


def test_last_step_is_none_until_a_step_finished(pm, rec):
    with TrainingRun(pm, None, train_iters=8, start_step=5) as run:
        assert run.last_step is None
        with run.train_step(5):
            assert run.last_step is None  # step 5 has not finished yet
        assert run.last_step == 5


def test_a_run_past_train_iters_completed(pm, rec):
    """A host that trains beyond ``train_iters`` still completed the run."""
    with TrainingRun(pm, None, train_iters=2) as run:
        loop(run, 3)
    assert rec.calls == [(ShutdownReason.COMPLETED, None)]


def test_run_arguments_after_the_config_are_keyword_only(pm):
    with pytest.raises(TypeError):
        TrainingRun(pm, None, 2)  # train_iters by position
    with TrainingRun(pm, None, train_iters=0) as run:
        with pytest.raises(TypeError):
            run.model_built([], None, None, 32, 2)


def test_leaving_the_run_again_swallows_nothing(pm, rec):
    run = TrainingRun(pm, None, train_iters=0)
    with run:
        pass
    assert run.__exit__(RuntimeError, RuntimeError("again"), None) is False


def test_the_hosts_own_sigterm_handler_is_back_after_the_run(pm, rec):
    def host_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, host_handler)
    try:
        with TrainingRun(pm, None, train_iters=0):
            assert signal.getsignal(signal.SIGTERM) is not host_handler
        assert signal.getsignal(signal.SIGTERM) is host_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_ignored_signal_stays_ignored_and_the_others_are_handled(pm, rec):
    before = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with TrainingRun(pm, None, train_iters=0, handle_signals=(signal.SIGUSR1, signal.SIGTERM)):
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGUSR1, previous)


# -- signals that arrive while shutdown starts or runs (issue 22) -------------------------------


def test_a_sigterm_at_the_start_of_shutdown_waits_for_it_instead_of_skipping_it(
    pm, rec, monkeypatch, host_sigterm
):
    from hookspecs import run as run_module

    classify = run_module._classify

    def signalled_first(exc, completed):
        # the very first thing shutdown does; a signal here used to skip the hook for good
        os.kill(os.getpid(), signal.SIGTERM)
        return classify(exc, completed)

    monkeypatch.setattr(run_module, "_classify", signalled_first)
    with TrainingRun(pm, None, train_iters=1) as run:
        loop(run, 1)
    assert [reason for reason, _ in rec.calls] == [ShutdownReason.COMPLETED]
    assert host_sigterm == [signal.SIGTERM]  # acted on once shutdown ended


@pytest.fixture
def default_sigint():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class CtrlC:
    """A shutdown implementation during which Ctrl-C is pressed ``times`` times."""

    def __init__(self, times: int, log: list[str]) -> None:
        self.times = times
        self.log = log

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        for _ in range(self.times):
            os.kill(os.getpid(), signal.SIGINT)
        self.log.append("ctrl-c plugin finished")


class After:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.log.append(f"next plugin ran ({reason})")


@pytest.mark.parametrize("where", ["before the deferral", "while it is installed"])
def test_a_ctrl_c_at_the_start_of_shutdown_still_fires_it_and_goes_on(
    pm, rec, monkeypatch, default_sigint, where
):
    # Shutdown defers Ctrl-C from its first lines on; one pressed just before (or while the
    # deferring handler goes in) used to leave with no shutdown at all: no release, the
    # run's SIGTERM handler left installed, and every later SIGTERM swallowed.
    host_sigterm = signal.getsignal(signal.SIGTERM)
    defer = TrainingRun._defer_sigint
    pressed: list[str] = []

    def ctrl_c_here(self):
        if pressed:
            return defer(self)
        pressed.append(where)
        if where == "while it is installed":
            defer(self)
            raise KeyboardInterrupt  # the host's handler, run as the deferring one went in
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, default handler
        raise AssertionError("the Ctrl-C did not interrupt")

    monkeypatch.setattr(TrainingRun, "_defer_sigint", ctrl_c_here)
    with pytest.raises(KeyboardInterrupt):
        with TrainingRun(pm, None, train_iters=1) as run:
            loop(run, 1)
    assert pressed == [where]
    assert [reason for reason, _ in rec.calls] == [ShutdownReason.INTERRUPTED]
    assert isinstance(rec.calls[0][1], KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) == host_sigterm
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_shutdown_waits_until_every_implementation_ran(pm, default_sigint):
    log: list[str] = []
    pm.register(After(log))
    pm.register(CtrlC(1, log))  # registered last: called first
    with pytest.raises(KeyboardInterrupt):
        with TrainingRun(pm, None, train_iters=1) as run:
            loop(run, 1)
    assert log == ["ctrl-c plugin finished", "next plugin ran (completed)"]
    assert run.shutdown_reason is ShutdownReason.COMPLETED
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_during_shutdown_interrupts_it(pm, default_sigint):
    log: list[str] = []
    pm.register(After(log))
    pm.register(CtrlC(2, log))
    with pytest.raises(KeyboardInterrupt):
        with TrainingRun(pm, None, train_iters=1) as run:
            loop(run, 1)
    assert log == []  # the user insisted: the shutdown was cut short
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_abnormal_endings_are_exception_interrupt_signal_and_peer_failure():
    assert {r for r in ShutdownReason if r.abnormal} == {
        ShutdownReason.EXCEPTION,
        ShutdownReason.INTERRUPTED,
        ShutdownReason.SIGNAL,
        ShutdownReason.PEER_FAILED,
    }
    assert ShutdownReason("signal").abnormal and not ShutdownReason("early_exit").abnormal
    assert ShutdownReason("peer_failed").abnormal


def test_a_peer_failed_exception_ends_the_run_with_peer_failed(pm, rec):
    error = PeerFailed(1, "exception: RuntimeError: boom")
    assert str(error) == "rank 1 failed: exception: RuntimeError: boom"
    assert not isinstance(error, Exception)  # a host's `except Exception` lets it through

    def body(step):
        if step == 1:
            raise error

    with pytest.raises(PeerFailed):
        with TrainingRun(pm, None, train_iters=3) as run:
            loop(run, 3, body)
    assert rec.calls == [(ShutdownReason.PEER_FAILED, error)]
    assert run.shutdown_reason is ShutdownReason.PEER_FAILED


@pytest.mark.parametrize("declared", ["completed", "signal", None])
def test_no_other_declaration_changes_the_reason(pm, rec, declared):
    class Declares(Exception):
        shutdown_reason = declared

    with pytest.raises(Declares):
        with TrainingRun(pm, None, train_iters=3):
            raise Declares()
    assert [reason for reason, _ in rec.calls] == [ShutdownReason.EXCEPTION]


def test_a_shutdown_error_while_ending_with_an_exception_logs_only_its_own_traceback(caplog):
    """(2026-12-05, a review of 2-rank failure paths: the shutdown error's log carried its
    whole context chain, the original exception's traceback included, which the host then
    printed a second time when it received it)"""
    import logging

    class Raises:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            try:
                raise OSError("disk gone")
            except OSError as cause:  # (its own cause stays in its traceback)
                raise ValueError("in shutdown") from cause

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Raises())
    with caplog.at_level(logging.ERROR, logger="hookspecs.run"):
        with pytest.raises(RuntimeError, match="the original") as raised:
            with TrainingRun(pm, None, train_iters=1):
                raise RuntimeError("the original")
    [record] = [r for r in caplog.records if "mcgraph_shutdown raised" in r.getMessage()]
    first, traceback_text = record.getMessage().split("\n", 1)
    assert "RuntimeError('the original')" in first
    assert traceback_text.startswith("Traceback") and "ValueError: in shutdown" in traceback_text
    assert "the original" not in traceback_text and record.exc_info is None
    assert "OSError: disk gone" in traceback_text
    assert "in shutdown" in str(raised.value.__notes__)


@pytest.mark.parametrize("ending", [None, RuntimeError("the real bug")])
def test_a_ctrl_c_held_during_shutdown_carries_what_the_run_was_ending_by(
    pm, default_sigint, ending
):
    """``print_interrupted`` says what the run was ending by (a failure keeps its
    traceback) from the interrupt's ``run_ended_by``, not from any exception it happened
    to be raised during (a review: a Ctrl-C in argparse's own ``except`` block)."""
    log: list[str] = []
    pm.register(CtrlC(1, log))
    with pytest.raises(KeyboardInterrupt) as info:
        with TrainingRun(pm, None, train_iters=1) as run:
            loop(run, 1)
            if ending is not None:
                raise ending
    assert info.value.run_ended_by is ending


# -- the host's teardown, inside the shutdown -----------------------------------------------


class Order:
    """Records the shutdown hook and the host's teardown in the order they ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.calls.append(f"shutdown {reason}")

    def teardown(self, run: TrainingRun) -> None:
        # still inside the shutdown: the run's handler takes a signal arriving now (held)
        held = signal.getsignal(signal.SIGTERM) == run._on_signal
        self.calls.append(f"teardown {run.shutdown_reason} held={held}")


def _body_raising(error):
    def body(step):
        raise error

    return body


@pytest.mark.parametrize(
    "body, reason",
    [
        (None, "completed"),
        (_body_raising(RuntimeError("step failed")), "exception"),
        (_body_raising(KeyboardInterrupt()), "interrupted"),
    ],
    ids=["completed", "exception", "interrupted"],
)
def test_the_hosts_teardown_runs_once_after_the_shutdown_hook_inside_the_shutdown(pm, body, reason):
    order = Order()
    pm.register(order)
    run = TrainingRun(pm, None, train_iters=2, teardown=order.teardown)
    try:
        with run:
            loop(run, 2, body)
    except (RuntimeError, KeyboardInterrupt):
        pass
    run.__exit__(None, None, None)  # (leaving again tears nothing down again)
    assert order.calls == [f"shutdown {reason}", f"teardown {reason} held=True"]


def test_the_hosts_teardown_runs_when_configure_refuses_the_run(pm):
    from hookspecs import ConfigurationError

    class Refuses:
        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            raise ConfigurationError("no")

    order = Order()
    pm.register(order)
    pm.register(Refuses())
    with pytest.raises(ConfigurationError):
        with TrainingRun(pm, None, train_iters=2, teardown=order.teardown):
            pass
    assert order.calls == ["shutdown exception", "teardown exception held=True"]


def test_the_hosts_teardown_runs_even_where_a_shutdown_hook_raises(pm, caplog):
    class BrokenCleanup:
        @hookimpl
        def mcgraph_shutdown(self):
            raise OSError("cleanup failed")

    torn_down = []
    pm.register(BrokenCleanup())
    with pytest.raises(OSError, match="cleanup failed"):
        with TrainingRun(pm, None, train_iters=1, teardown=torn_down.append) as run:
            loop(run, 1)
    assert torn_down == [run]


def test_a_raising_teardown_propagates_after_a_clean_end_and_is_noted_after_a_failure(pm, caplog):
    def teardown(run):
        raise OSError("teardown failed")

    with pytest.raises(OSError, match="teardown failed"):
        with TrainingRun(pm, None, train_iters=1, teardown=teardown) as run:
            loop(run, 1)
    assert run.shutdown_reason is ShutdownReason.COMPLETED
    original = RuntimeError("step failed")
    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(get_plugin_manager(load_entrypoints=False), None, train_iters=1,
                         teardown=teardown) as run:  # fmt: skip
            loop(run, 1, _body_raising(original))
    assert excinfo.value is original
    assert any("the host's teardown" in note and "teardown failed" in note
               for note in original.__notes__), original.__notes__  # fmt: skip
    assert "the host's teardown raised while the run was ending" in caplog.text


@pytest.mark.parametrize("code", [0, None, 3])
def test_a_shutdown_raising_after_sys_exit_0_propagates_as_after_a_clean_end(pm, caplog, code):
    """``sys.exit(0)`` in the loop is a clean end (``early_exit``): what the shutdown
    raises then goes on to the host, as after any clean end (a peer's ``PeerFailed``, said
    at this rank's clean end, included), with the exit as its context; it was logged and
    the process exited 0. A failing exit status still goes on itself, the error noted."""

    class TellsAtTheEnd:
        @hookimpl
        def mcgraph_shutdown(self):
            raise PeerFailed(1, "early_exit after step 0, while rank 0 went on to step 1")

    pm.register(TellsAtTheEnd())
    exit_ = SystemExit(code)
    with pytest.raises((PeerFailed, SystemExit)) as excinfo:
        with TrainingRun(pm, None, train_iters=3) as run:
            loop(run, 1)
            raise exit_
    assert run.shutdown_reason is (
        ShutdownReason.EARLY_EXIT if code in (0, None) else ShutdownReason.EXCEPTION
    )
    if code in (0, None):
        assert isinstance(excinfo.value, PeerFailed) and excinfo.value.__context__ is exit_
        assert "raised while the run was ending" not in caplog.text
    else:
        assert excinfo.value is exit_
        assert "mcgraph_shutdown raised while the run was ending" in caplog.text


def test_a_teardown_that_is_not_callable_is_refused(pm):
    with pytest.raises(TypeError, match="teardown must be callable"):
        TrainingRun(pm, None, train_iters=1, teardown="end_distributed")


_SIGTERM_IN_TEARDOWN = textwrap.dedent(
    """
    import os, signal, sys
    from hookspecs import PeerFailed, TrainingRun, get_plugin_manager, print_ending, PLAIN_ENDINGS

    def teardown(run):
        os.kill(os.getpid(), signal.SIGTERM)  # (torchrun's: the other rank exited first)
        print("teardown went on", flush=True)

    error = {error}
    error.said_here = True  # (this rank says the job's ending)
    run = TrainingRun(get_plugin_manager(load_entrypoints=False), None, train_iters=2,
                      teardown=teardown)
    try:
        with run:
            with run.train_step(0):
                raise error
    except PLAIN_ENDINGS as ended:
        sys.exit(print_ending(ended))
    """
)


@pytest.mark.parametrize(
    "error, said",
    [
        ("KeyboardInterrupt()", "[rank 0] interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)"),
        (
            'PeerFailed(1, "exception: boom", "rank 1 (h, pid 7) failed: exception: boom")',
            "[rank 0] run ended: rank 1 (h, pid 7) failed: exception: boom",
        ),
        ('RuntimeError("boom on rank 0")', "RuntimeError: boom on rank 0"),
    ],
    ids=["interrupted", "told", "failed"],
)
def test_a_sigterm_during_the_hosts_teardown_waits_for_it_and_the_ending_is_said(
    tmp_path, error, said
):
    """(2026-12-06, `make test`, a 2-rank gloo job given a SIGINT on every rank: the silent
    rank exited first, and torchrun's SIGTERM ended the rank that says the job's Ctrl-C in
    its teardown of the process groups, after the run: nothing said it.) In the run's
    ``teardown`` the signal waits for the teardown, the ending is said, then the signal
    ends the process."""
    script = tmp_path / "teardown.py"
    script.write_text(_SIGTERM_IN_TEARDOWN.replace("{error}", error))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"},
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == "teardown went on\n", done.stderr
    assert said in done.stderr.splitlines(), done.stderr
    assert done.stderr.count("Traceback") == ("RuntimeError" in error), done.stderr


_TEARDOWN_RAISES_AFTER_A_SIGTERM = textwrap.dedent(
    """
    import os, signal
    from hookspecs import TrainingRun, get_plugin_manager

    def teardown(run):
        os.kill(os.getpid(), signal.SIGTERM)  # (held: the teardown goes on)
        raise OSError("teardown failed")

    with TrainingRun(get_plugin_manager(load_entrypoints=False), None, train_iters=1,
                     teardown=teardown) as run:
        with run.train_step(0):
            pass
    print("the host went on", flush=True)
    """
)


def test_a_teardown_raising_after_a_clean_end_still_ends_by_the_held_signal(tmp_path):
    """(2026-12-06, a review: the teardown's exception left the run before the held SIGTERM
    was acted on: the process exited 1, and a host that caught it went on.)"""
    script = tmp_path / "raises.py"
    script.write_text(_TEARDOWN_RAISES_AFTER_A_SIGTERM)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == ""
    assert "OSError: teardown failed" in done.stderr.splitlines(), done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr


def test_a_ctrl_c_cutting_the_teardown_of_an_ending_run_short_is_one_line(pm, caplog):
    """(2026-12-06, a review: a second Ctrl-C during a slow teardown logged a traceback.)"""

    def teardown(run):
        raise KeyboardInterrupt

    original = RuntimeError("step failed")
    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(pm, None, train_iters=1, teardown=teardown) as run:
            loop(run, 1, _body_raising(original))
    assert excinfo.value is original
    assert "the host's teardown was interrupted by a Ctrl-C" in original.__notes__
    assert "the host's teardown was interrupted by a Ctrl-C" in caplog.text
    assert "Traceback" not in caplog.text
