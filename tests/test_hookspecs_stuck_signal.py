"""A handled signal that the main thread cannot act on ends the process (``StuckSignalWatch``).

(2026-12-05, a review of multi-rank failure paths on gloo: a rank blocked in C, in the
process group's rendezvous after its peer had refused the run, caught torchrun's SIGTERM
and never handled it: torchrun waited its 30 s and SIGKILLed it, and a rank whose launcher
had died first ran on for good.)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from blocked_child import sigterm_and_wait, start_blocked

from hookspecs import TrainingRun, get_plugin_manager, run_signals

ROOT = Path(__file__).resolve().parent.parent

# A run whose main thread blocks in C: a store wait that nothing will ever answer (torch's
# TCPStore, as a rank's rendezvous or a collective's store wait; no Python code runs there).
BLOCKED = textwrap.dedent(
    """
    import datetime
    import torch.distributed as dist
    from hookspecs import TrainingRun, get_plugin_manager, hookimpl

    class Shutdown:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            print("shutdown", reason, flush=True)

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Shutdown())
    with TrainingRun(pm, config={}, train_iters=1):
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        print("blocking", flush=True)
        store.wait(["never"], datetime.timedelta(seconds=60))
    """
)


def _blocked_process(
    tmp_path: Path, env: dict[str, str], seconds: str, script: str = BLOCKED, *args: str
) -> subprocess.Popen:
    path = tmp_path / "blocked.py"
    path.write_text(script)
    return start_blocked(
        [sys.executable, str(path), *args],
        {**env, "PYTHONPATH": str(ROOT), run_signals.STUCK_SIGNAL_VAR: seconds},
    )


@pytest.mark.slow
def test_a_sigterm_the_blocked_main_thread_cannot_handle_ends_the_process(tmp_path, subprocess_env):
    # (as rank 1 of a launcher's job: the line says whose it is, as the run's others do)
    proc = _blocked_process(tmp_path, {**subprocess_env, "RANK": "1", "WORLD_SIZE": "2"}, "1")
    sent = time.monotonic()
    out, err = sigterm_and_wait(proc, 20)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert (
        "hookspecs.run: [rank 1] SIGTERM received, but the main thread has not come back to "
        "Python for 1 s"
    ) in err
    assert "(blocked in C at blocked.py:" in err  # where the main thread was, one line
    assert "Traceback" not in err and "Current thread" not in err
    assert "shutdown" not in out  # (nothing can run the hooks from there)
    assert took < 15  # the wait and the exit, not the store's 60 s


@pytest.mark.slow
def test_without_the_watch_the_blocked_process_runs_on(tmp_path, subprocess_env):
    """The failure the watch ends: with it off (0), the same SIGTERM is caught and never
    handled, and the process is still there seconds later."""
    proc = _blocked_process(tmp_path, subprocess_env, "0")
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=4)
    finally:
        proc.kill()
        proc.communicate()


def test_a_handled_signal_is_not_ended_by_the_watch(monkeypatch):
    """A main thread in Python acts on the signal at once: the run's shutdown runs and the
    watch, which saw the same signal, leaves the process alone."""
    monkeypatch.setenv(run_signals.STUCK_SIGNAL_VAR, "0.2")
    reasons = []

    class Shutdown:
        from hookspecs import hookimpl

        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            reasons.append(str(reason))

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Shutdown())
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        # (the host's handler returns: the run's SignalReceived ends the block, no further)
        with TrainingRun(pm, config={}, train_iters=1) as run:
            assert run._stuck_watch is not None
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # (the handler raised before this: the run ends)
            raise AssertionError("not reached")
        time.sleep(0.5)  # past the watch's wait: still alive
        assert reasons == ["signal"]
        # the wakeup descriptor is off again once the run ended
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_host_wakeup_descriptor_is_left_to_the_host(monkeypatch):
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    try:
        with TrainingRun(get_plugin_manager(load_entrypoints=False), {}, train_iters=0) as run:
            assert run._stuck_watch is None
            assert signal.set_wakeup_fd(write) == write  # (still the host's)
        assert signal.set_wakeup_fd(-1) == write
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("text, seconds", [("", 5.0), ("2.5", 2.5), ("0", 0.0), ("soon", 5.0)])
def test_the_wait_is_read_from_the_environment(monkeypatch, caplog, text, seconds):
    monkeypatch.setenv(run_signals.STUCK_SIGNAL_VAR, text)
    with caplog.at_level(logging.WARNING, logger="hookspecs.run"):
        assert run_signals.stuck_signal_seconds() == seconds
    assert ("is not a number of seconds" in caplog.text) == (text == "soon")


def test_the_wait_is_at_least_twice_the_longest_step(monkeypatch):
    """A replayed graph keeps the main thread in C for a whole step (the step's first host
    read waits for all its device work): no hang, so the wait covers twice the longest step."""
    monkeypatch.setenv(run_signals.STUCK_SIGNAL_VAR, "0.1")
    with TrainingRun(get_plugin_manager(load_entrypoints=False), {}, train_iters=4) as run:
        assert run._stuck_watch is not None
        assert run._stuck_watch.wait_s() == pytest.approx(0.1)
        for step in (0, 1):  # (the first steps set up and capture: not counted)
            with run.train_step(step):
                time.sleep(0.3)
        assert run._stuck_watch.wait_s() == pytest.approx(0.1)
        with run.train_step(2):
            time.sleep(0.3)
        with run.train_step(3):
            pass
        assert run._stuck_watch.wait_s() >= 0.6


# -- where ending the process is not the signal's outcome: the watch stays out ---------------

CASES = textwrap.dedent(
    """
    import datetime, os, signal, sys, threading, time
    import multiprocessing as mp
    import torch.distributed as dist
    from hookspecs import TrainingRun, get_plugin_manager, hookimpl

    mode = sys.argv[1]
    store = dist.TCPStore("127.0.0.1", 0, 1, True)

    def sigterm_soon():  # from another thread: the main thread is in C by then
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()

    def wait_in_c(seconds):  # a store wait that returns by itself (timeout)
        try:
            store.wait(["never"], datetime.timedelta(seconds=seconds))
        except Exception:
            pass

    class Shutdown:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            if mode == "shutdown_in_c":
                sigterm_soon()
                wait_in_c(2.0)
            print("shutdown done", reason, flush=True)

    if mode == "previous_handler":
        signal.signal(signal.SIGTERM, lambda *a: print("host handler after shutdown", flush=True))
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Shutdown())
    with TrainingRun(pm, config={}, train_iters=1):
        if mode == "host_handler":
            flag = []
            signal.signal(signal.SIGTERM, lambda *a: flag.append(1))  # (Megatron-LM's kind)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.5)  # the host's clean exit, in Python, past the watch's wait
            print("host saw", flag, flush=True)
        elif mode == "child":
            child = mp.get_context("fork").Process(target=time.sleep, args=(30,))
            child.start()
            time.sleep(0.5)  # (a worker that runs: see StuckSignalWatch on the first moments)
            child.terminate()
            child.join()
            time.sleep(1.5)
            print("parent alive", flush=True)
        elif mode == "previous_handler":
            sigterm_soon()
            wait_in_c(2.0)
    print("end", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, said, rc",
    [
        # a handler the host installed during the run (review of 2026-12-05: killed with 143
        # in the middle of its clean exit)
        ("host_handler", "host saw [1]", 0),
        # a forked child's SIGTERM (the child kept the wakeup descriptor: the parent died)
        ("child", "parent alive", 0),
        # a host handler from before the run, to run after the shutdown (a checkpoint's say)
        ("previous_handler", "host handler after shutdown", 0),
        # a shutdown hook waiting in C: the shutdown is not cut (the signal ends it after)
        ("shutdown_in_c", "shutdown done", -signal.SIGTERM),
    ],
)
def test_the_watch_leaves_a_signal_whose_outcome_is_not_the_end(
    tmp_path, subprocess_env, mode, said, rc
):
    script = tmp_path / "cases.py"
    script.write_text(CASES)
    proc = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**subprocess_env, "PYTHONPATH": str(ROOT), run_signals.STUCK_SIGNAL_VAR: "0.5"},
        check=False,
    )
    assert said in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert "has not come back to Python" not in proc.stderr


def test_a_descriptor_the_host_set_during_the_run_stays(monkeypatch):
    monkeypatch.setenv(run_signals.STUCK_SIGNAL_VAR, "5")
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        with TrainingRun(get_plugin_manager(load_entrypoints=False), {}, train_iters=0) as run:
            assert run._stuck_watch is not None
            signal.set_wakeup_fd(write)  # (an asyncio loop made during the run)
        assert signal.set_wakeup_fd(-1) == write
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read)
        os.close(write)


def test_a_plugin_that_bounds_the_end_elsewhere_keeps_the_watch_out_for_that_run_only(monkeypatch):
    """``end_bounded_elsewhere``: a plugin's own bound on the process's end (the peer exit
    deadline) takes over; the next run starts with the watch in charge again."""
    monkeypatch.setenv(run_signals.STUCK_SIGNAL_VAR, "0.2")
    pm = get_plugin_manager(load_entrypoints=False)
    with TrainingRun(pm, config={}, train_iters=0) as run:
        assert run._stuck_watch is not None and run._stuck_watch._acts(signal.SIGTERM)
        run_signals.end_bounded_elsewhere("a plugin's deadline")
        assert not run._stuck_watch._acts(signal.SIGTERM)
    with TrainingRun(get_plugin_manager(load_entrypoints=False), config={}, train_iters=0) as run:
        assert run._stuck_watch is not None and run._stuck_watch._acts(signal.SIGTERM)


# -- a plugin's release of the blocked main thread (run_signals.offer_release) ----------------

RELEASED = textwrap.dedent(
    """
    import datetime, sys, threading
    import torch.distributed as dist
    from hookspecs import TrainingRun, get_plugin_manager, hookimpl, run_signals

    mode = sys.argv[1]

    class Shutdown:
        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            print("shutdown", reason, flush=True)

    def release(signum):  # (the peer watch's: begin what ends the blocked call, bound it)
        if mode == "raises":
            raise RuntimeError("no")
        if mode == "declines":
            return None
        if mode == "claims_without_a_bound":  # (a third party's release breaking the contract)
            return True
        if mode == "ends_without_a_bound":
            client = dist.TCPStore("127.0.0.1", store.port, 1, False)
            threading.Timer(0.2, client.set, ("never", "later")).start()
            return True
        if mode == "bounded_meanwhile":  # (a plugin's own abort began as the watch asked)
            run_signals.end_bounded_elsewhere("another bound")
            client = dist.TCPStore("127.0.0.1", store.port, 1, False)
            threading.Timer(0.5, client.set, ("never", "later")).start()
            return False
        # (said and bounded first: once the wait returns, the handler may end the process)
        print(f"released on signal {signum}", flush=True)
        run_signals.end_bounded_elsewhere("the test's bound")
        client = dist.TCPStore("127.0.0.1", store.port, 1, False)
        client.set("never", "now")  # (what an abort of the process groups is to a collective)
        return True

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Shutdown())
    with TrainingRun(pm, config={}, train_iters=1):
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        run_signals.offer_release(release)
        print("blocking", flush=True)
        store.wait(["never"], datetime.timedelta(seconds=60))
        print("the wait returned", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        "releases",
        "bounded_meanwhile",
        "ends_without_a_bound",
        "declines",
        "raises",
        "claims_without_a_bound",
    ],
)
def test_an_offered_release_ends_the_blocked_call_so_that_the_shutdown_runs(
    tmp_path, subprocess_env, mode
):
    """A release offered by a plugin gets the one chance to end the blocked call before the
    watch ends the process without its shutdown: where it does, the signal's handler runs as
    soon as the main thread is back in Python, then the shutdown hooks, and the process ends
    by the signal; where it declines or fails, the watch ends the process as before, unless a
    plugin bounded the end meanwhile (review of 2026-12-05: a peer watch that acted on a
    mark as the watch asked declined, and the watch ended the process anyway). A release
    that says True without a bound of its own gets one more wait, not the process's end
    (review of 2026-12-05, second session: the watch trusted it, and the process hung)."""
    proc = _blocked_process(tmp_path, subprocess_env, "0.5", RELEASED, mode)
    out, err = sigterm_and_wait(proc, 20)
    if mode in ("releases", "bounded_meanwhile", "ends_without_a_bound"):
        assert proc.returncode == -signal.SIGTERM, err
        assert "shutdown signal" in out, out + err
        assert "the wait returned" not in out  # (the handler ran first)
        assert ("released on signal 15" in out) == (mode == "releases")
        assert "ending the process now" not in err
    else:
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "shutdown" not in out
        assert "ending the process now with status 143" in err
        assert ("the release failed: RuntimeError('no')" in err) == (mode == "raises"), err
        # (the whole wait named: the first, and the one more a release without a bound gets)
        waited = "1 s" if mode == "claims_without_a_bound" else "0.5 s"
        assert f"for {waited} (blocked in C at blocked.py:" in err, err
    # said in either case, before the release ran (where the main thread was, one line)
    assert (
        "SIGTERM received, but the main thread has not come back to Python for 0.5 s (blocked "
        "in C at blocked.py:"
    ) in err
    assert "asking the release a plugin offered to end the blocked call" in err


def test_a_new_run_and_a_forked_child_start_without_an_earlier_offer(monkeypatch):
    monkeypatch.setenv(run_signals.STUCK_SIGNAL_VAR, "5")
    try:
        run_signals.offer_release(lambda signum: True)
        with TrainingRun(get_plugin_manager(load_entrypoints=False), {}, train_iters=0):
            assert run_signals._RELEASE is None
            run_signals.offer_release(lambda signum: True)
            run_signals._forget_watch_in_child()  # (what a fork runs in the child)
            assert run_signals._RELEASE is None
    finally:
        run_signals.offer_release(None)


def test_a_release_is_used_once_and_withdrawn_only_by_its_owner():
    calls = []

    def mine(signum):
        calls.append(signum)
        return True

    def other(signum):
        return False

    try:
        run_signals.offer_release(mine)
        run_signals.withdraw_release(other)  # (not the one offered: stays)
        assert run_signals._release_main_thread(signal.SIGTERM, 5.0) is True
        assert run_signals._release_main_thread(signal.SIGTERM, 5.0) is False  # (once)
        assert calls == [signal.SIGTERM]
        run_signals.offer_release(mine)
        run_signals.withdraw_release(mine)
        assert run_signals._release_main_thread(signal.SIGTERM, 5.0) is False
        assert calls == [signal.SIGTERM]
    finally:
        run_signals.offer_release(None)


# A run ended by a Ctrl-C whose host's teardown (``TrainingRun(teardown=...)``, after the graphs
# are freed) waits for good: in C (a store wait, as a graceful ``destroy_process_group()``
# whose peer is gone) or in a wait that lets Python run the handler (the signal is then held
# as during the shutdown hook).
TEARDOWN_WAITS = textwrap.dedent(
    """
    import datetime, sys, threading
    import torch.distributed as dist
    from hookspecs import TrainingRun, get_plugin_manager

    def teardown(run):
        print("blocking", flush=True)
        if sys.argv[1] == "in-c":
            store = dist.TCPStore("127.0.0.1", 0, 1, True)
            store.wait(["never"], datetime.timedelta(seconds=60))
        else:
            threading.Event().wait(60)
        print("teardown returned", flush=True)

    pm = get_plugin_manager(load_entrypoints=False)
    error = KeyboardInterrupt()
    error.said_here = True
    with TrainingRun(pm, config={}, train_iters=1, teardown=teardown):
        raise error
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in-c", "in-python"])
def test_a_sigterm_held_by_a_teardown_that_waits_for_good_ends_the_process_in_time(
    tmp_path, subprocess_env, where
):
    """(2026-12-06, a review: held in the run's teardown, a SIGTERM waited for a teardown that
    never returns until the launcher's SIGKILL, or for ever under a plain kill, where after
    the run it ended the process at once.) After the stuck-signal wait the run's ending is
    said and the process ends with 128 + the signal number."""
    env = {**subprocess_env, "RANK": "1", "WORLD_SIZE": "2"}
    proc = _blocked_process(tmp_path, env, "1", TEARDOWN_WAITS, where)
    sent = time.monotonic()
    out, err = sigterm_and_wait(proc, 20)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "[rank 1] interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)" in err.splitlines()
    assert "teardown returned" not in out
    if where == "in-c":
        assert "[rank 1] SIGTERM received, but the main thread has not come back" in err, err
        assert "in the host's teardown, after the shutdown hooks" in err, err
    else:
        assert "[rank 1] SIGTERM received during the host's teardown, which has not returned" in err
    assert "Traceback" not in err, err
    assert took < 15, took  # the wait and the exit, not the store's or the event's 60 s
