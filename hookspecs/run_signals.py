"""What a signal does during a :class:`~hookspecs.run.TrainingRun`: the handled signals
(SIGTERM) become :class:`SignalReceived`, a Ctrl-C during shutdown waits until it ends, and
afterwards the previous handler's behaviour applies. A mixin of ``TrainingRun``: the run's
``_finish`` and ``__exit__`` stay there (``peer_mark.run_is_shutting_down`` looks for their
code on the stack). A handler of the run left installed after it ended (by a host that set
its own during the run, or a run left from another thread) acts as the previous one did."""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from hookspecs.errors import end_by_signal, say_ending_anyway, write_stderr
from hookspecs.ranks import RankTagged, rank_tag
from hookspecs.reasons import SignalReceived
from hookspecs.teardown import TeardownBound

logger = RankTagged("hookspecs.run")  # (the run's log lines keep their logger)

STUCK_SIGNAL_S = 5.0
"""How long a handled signal may wait at least for the main thread to come back to Python
before the process ends without its shutdown (see :class:`StuckSignalWatch`);
``MCGRAPH_STUCK_SIGNAL_S`` sets it for a run (0: never). Well inside torchrun's 30 s
between its SIGTERM and its SIGKILL. Once training steps ran, the wait is at least twice
the longest of them: a main thread waits in C for a whole step's device work where a graph
replays it (a full-iteration graph launches in microseconds, and the step's first host read
waits for all of it), and that is no hang."""
STUCK_SIGNAL_VAR = "MCGRAPH_STUCK_SIGNAL_S"


class StuckSignalWatch:
    """Ends the process when a handled signal cannot be acted on.

    Python runs a signal handler only when the main thread comes back to the interpreter.
    A rank blocked in C (a collective or a store wait whose peer is gone, a rendezvous that
    never completes) never does: torchrun's SIGTERM is caught and never handled, the rank
    runs on until torchrun's SIGKILL 30 s later, and a rank whose launcher died first runs
    on for good. The watch learns of each signal from the interpreter's wakeup file
    descriptor (written by its C-level handler, whatever the main thread does) and, where
    the run's handler has not run after its wait (:meth:`wait_s`: :data:`STUCK_SIGNAL_S`, or
    twice the run's longest training step after its warm-up), writes why to stderr, in one
    line with where the main thread is (:func:`main_thread_place`), and ends the process
    with status 128 + the signal number, as a shell reports a death by that signal: nothing
    can be freed from here, and the process's end frees its device memory. Before that, a
    release a plugin offered (:func:`offer_release`) gets one chance to end the blocked call
    instead, under a bound of its own, so that the handler and the shutdown hooks run.

    It acts only on a main thread that has run no Python code since the signal (one that
    did would have run the handler first: the signal was another process's, a forked
    child's), and where that end is what the signal would have brought anyway (:meth:`_acts`):
    the run's own handler is the signal's handler (not one the host installed during the
    run, not the Ctrl-C deferral of shutdown), the handler before the run ended the process
    (no host handler of its own to run after the shutdown, a checkpoint's say), the run is
    not shutting down (a shutdown stuck in C is bounded elsewhere: the peer watch's
    deadline, the launcher's SIGKILL), and no plugin has taken the process's end over with
    a bound of its own (:func:`end_bounded_elsewhere`). Not started where a wakeup
    descriptor is already set (an asyncio loop's); a forked child's copy of the descriptor
    is taken off in the child (its signals are not the parent's), once the interpreter's own
    fork handling ends: a signal that reaches the child in its first moments
    (``Process.terminate()`` right after ``start()``, the parent then waiting for it in C
    past the wait) is still written into the parent's pipe.
    """

    def __init__(self, run: RunSignals, seconds: float) -> None:
        self.run = run
        self.seconds = seconds
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="mcgraph-signal", daemon=True)

    @classmethod
    def start(cls, run: RunSignals) -> StuckSignalWatch | None:
        end_bounded_elsewhere(None)  # (an earlier run's plugin handed nothing back: in charge)
        offer_release(None)  # (nor an earlier run's offer)
        seconds = stuck_signal_seconds()
        if not seconds or not run._handle_signals:
            return None
        watch = cls(run, seconds)
        try:
            previous = signal.set_wakeup_fd(watch._write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)  # (the host's own: left to it)
            watch._close()
            return None
        global _WATCHED_FD
        _WATCHED_FD = watch._write
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """Off (the main thread, as the run's handlers are taken off); a descriptor the host
        set during the run (an asyncio loop's) stays."""
        global _WATCHED_FD
        self._stopping = True
        _WATCHED_FD = None
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, self._write):
            signal.set_wakeup_fd(current)
        try:
            os.write(self._write, b"\0")  # (wakes the watch, which then ends)
        except OSError:
            pass
        os.close(self._write)

    def _close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass

    def _watch(self) -> None:
        try:
            while not self._stopping:
                data = os.read(self._read, 64)
                if not data:
                    return
                for signum in data:
                    if signum in self.run._handle_signals and not self._stopping:
                        self._wait_for_handler(signum)
        finally:
            try:
                os.close(self._read)
            except OSError:
                pass

    def wait_s(self) -> float:
        """The wait for this signal: the floor, or twice the run's longest training step
        after its warm-up (the first steps set up communicators and capture graphs)."""
        return max(self.seconds, 2.0 * self.run._longest_step_s)

    def _acts(self, signum: int) -> bool:
        """Whether ending the process is still the signal's own outcome (see the class)."""
        run = self.run
        return (
            not self._stopping
            and _BOUNDED_ELSEWHERE is None
            and run._pending_signal is None
            and (not run._shutting_down or run._tearing_down)
            and signal.getsignal(signum) == run._on_signal
            and run._ends_process(signum)
        )

    def _wait_for_handler(self, signum: int) -> None:
        waited = self.wait_s()
        # Where the main thread is: once it has run Python code, a signal of this process's
        # has had its handler run first; where it moved on and the run's handler did not run,
        # the signal was another process's (a forked child's, before it took the descriptor
        # off: that window is in the interpreter's own fork handling)
        where = _main_thread_position()
        if not self._still_blocked(signum, waited, where):
            return
        released = _release_main_thread(signum, waited)
        if not self._acts(signum):
            return  # (released with a bound of its own, or a plugin bounded the end meanwhile)
        if released:  # (said so without a bound of its own: this watch keeps its own)
            if not self._still_blocked(signum, waited, where):
                return
            waited *= 2
        hooks = "without the shutdown hooks"
        if self.run._tearing_down:  # (the graphs are freed: say how the run ended)
            say_ending_anyway(self.run._ending)
            hooks = "in the host's teardown, after the shutdown hooks"
        write_stderr(
            f"{_stuck_words(signum, waited)}: a collective or a store wait whose peer is "
            f"gone?): ending the process now with status {128 + signum}, {hooks} (the "
            f"wait: {STUCK_SIGNAL_VAR}, {self.seconds:g} s, or twice the longest training "
            "step after the warm-up; 0: never)\n"
        )
        os._exit(128 + signum)

    def _still_blocked(self, signum: int, seconds: float, where: tuple[int, int] | None) -> bool:
        """Whether, ``seconds`` from now, the signal's end is still this watch's to act on
        and the main thread has not moved from ``where``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self._acts(signum) or _main_thread_position() != where:
                return False
            time.sleep(0.05)
        return self._acts(signum) and _main_thread_position() == where


def _stuck_words(signum: int, waited: float) -> str:
    """How a line about a signal the blocked main thread could not act on begins, up to
    where it was blocked (the parenthesis left open)."""
    return (
        f"hookspecs.run: {rank_tag()}{signal.Signals(signum).name} received, but the main "
        f"thread has not come back to Python for {waited:.3g} s (blocked in "
        f"C{main_thread_place()}"
    )


_WATCHED_FD: int | None = None
"""The wakeup descriptor of the running watch (a forked child takes it off)."""

_BOUNDED_ELSEWHERE: str | None = None


def end_bounded_elsewhere(what: str | None) -> None:
    """A plugin that has begun to end the run by its own means, with its own bound on the
    process's life, takes the process's end over from :class:`StuckSignalWatch`: ``what``
    names that bound (for a reader of this module's state), ``None`` hands it back.

    The CUDA graph plugin's peer watch does this when another rank failed: it aborts this
    rank's collectives, interrupts the main thread and arms its exit deadline
    (``cuda_graph_peer_exit_deadline``). A signal from the launcher that the main thread
    cannot act on meanwhile (blocked in a collective the abort is ending, or over gloo one
    that only the failed peer's exit ends) then no longer ends the process before that
    release: the shutdown hooks still run, and the deadline still ends a process they
    cannot reach. Every run starts with the watch in charge."""
    global _BOUNDED_ELSEWHERE
    _BOUNDED_ELSEWHERE = what


_RELEASE: Callable[[int], bool] | None = None


def offer_release(release: Callable[[int], bool] | None) -> None:
    """A plugin that can release a main thread blocked in C offers it here; ``None`` takes
    the offer back (:func:`withdraw_release` takes back only one's own).

    Where a handled signal finds the main thread blocked past its wait,
    :class:`StuckSignalWatch` calls ``release(signum)`` (from its own thread, once) instead
    of ending the process at once without its shutdown. The release begins what ends the
    blocked call (the CUDA graph plugin's peer watch: the abort of the process groups, when
    a peer that died without a word left this rank in a collective), so that the signal's
    handler runs and the shutdown hooks with it, and returns True once it has taken the
    process's end over with a bound of its own (:func:`end_bounded_elsewhere`), saying so
    in its own log line; False where it cannot: the watch then ends the process as before.
    A release that raises counts as False (written to stderr). A True without such a bound
    does not take the end over: the watch waits once more for the handler, then ends the
    process itself."""
    global _RELEASE
    _RELEASE = release


def withdraw_release(release: Callable[[int], bool]) -> None:
    """Take back ``release`` if it is still the one offered (a later offer stays)."""
    global _RELEASE
    if _RELEASE is not None and _RELEASE == release:
        _RELEASE = None


def _release_main_thread(signum: int, waited: float) -> bool:
    global _RELEASE
    release, _RELEASE = _RELEASE, None  # (once a run: what it began bounds the rest)
    if release is None:
        return False
    # said first: a release that works ends the process by the signal, maybe before a line
    # written after it
    write_stderr(
        f"{_stuck_words(signum, waited)}): asking the release a plugin offered to end the "
        "blocked call, so that the shutdown hooks run\n"
    )
    try:
        return bool(release(signum))
    except Exception as exc:
        write_stderr(f"hookspecs.run: {rank_tag()}the release failed: {exc!r}\n")
        return False


def _forget_watch_in_child() -> None:
    # A forked child (a multiprocessing worker) keeps the wakeup descriptor, which writes
    # into the parent's pipe: a SIGTERM to the child would be taken for one of the parent's.
    global _WATCHED_FD, _RELEASE
    _RELEASE = None  # (the parent's peer watch: not the child's to call)
    if _WATCHED_FD is not None:
        _WATCHED_FD = None
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass


os.register_at_fork(after_in_child=_forget_watch_in_child)


def _main_thread_frame() -> Any:
    """The main thread's innermost Python frame (None: not running)."""
    return sys._current_frames().get(threading.main_thread().ident or -1)


def _main_thread_position() -> tuple[int, int] | None:
    """The main thread's innermost Python frame and its last instruction: unchanged while it
    waits in one C call."""
    frame = _main_thread_frame()
    return None if frame is None else (id(frame), frame.f_lasti)


def main_thread_place() -> str:
    """`` at file:line (function)`` of the main thread's innermost Python frame, and of the
    innermost one outside the standard library and the installed packages (the host's own
    code) where that is another: one line, not a traceback."""
    frame = _main_thread_frame()
    if frame is None:
        return ""
    places = [_place(frame)]
    roots = tuple(path for path in map(_library_path, ("stdlib", "purelib", "platlib")) if path)
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame = frame.f_back
    if frame is not None and _place(frame) != places[0]:
        places.append(_place(frame))
    return " at " + ", called from ".join(places)


def _place(frame: Any) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"


def _library_path(name: str) -> str:
    try:
        return sysconfig.get_path(name) or ""
    except KeyError:
        return ""


def stuck_signal_seconds() -> float:
    """:data:`STUCK_SIGNAL_S`, or ``MCGRAPH_STUCK_SIGNAL_S`` where set (a bad value is
    logged and the default kept)."""
    text = os.environ.get(STUCK_SIGNAL_VAR, "").strip()
    if not text:
        return STUCK_SIGNAL_S
    try:
        seconds = float(text)
        if seconds < 0 or seconds != seconds:
            raise ValueError
    except ValueError:
        logger.warning(
            "%s=%r is not a number of seconds >= 0: %g s is used (0: never end a process "
            "whose main thread cannot act on a signal)",
            STUCK_SIGNAL_VAR,
            text,
            STUCK_SIGNAL_S,
        )
        return STUCK_SIGNAL_S
    return seconds


class RunSignals:
    """The signal policy of one run; the state it uses is set by ``TrainingRun.__init__``."""

    _handle_signals: tuple[int, ...]
    _previous_handlers: dict[int, Any]
    _pending_signal: int | None
    _pending_sigint: bool
    _sigint_deferrer: Any
    _shutting_down: bool
    _finished: bool
    _stuck_watch: StuckSignalWatch | None = None
    _held_in_shutdown: bool = False  # (the pending signal came during shutdown: held)
    _tearing_down: bool = False  # (the host's teardown runs, inside the shutdown)
    _teardown_bound: TeardownBound | None = None
    _ending: BaseException | None = None  # (what the run is ending by, in its shutdown)
    _longest_step_s: float = 0.0  # (the run's longest training step so far, by TrainingRun)
    _step_began: float = 0.0

    def _ends_process(self, signum: int) -> bool:
        """Whether ``signum``'s outcome after the run is the process's end: the handler
        before the run was not a callable of the host's own (which may let the program go
        on: a checkpoint's say)."""
        return not callable(self._previous_handlers.get(signum))

    def _begin_shutdown(self) -> None:
        global _IN_SHUTDOWN
        self._shutting_down = True
        _IN_SHUTDOWN = weakref.ref(self)

    def _defer_sigint(self) -> Any:
        """Hold a Ctrl-C (SIGINT) that arrives while the shutdown hook runs, so that every
        implementation finishes and the graphs are freed; a second Ctrl-C interrupts at
        once. A host's own SIGINT handler is deferred the same way and called once shutdown
        ends (``act_on_deferred_sigint``), and with ``SIG_DFL`` the process then ends by the
        signal; an ignored SIGINT stays ignored, and a handler not set from Python is left
        alone. Returns what restores the host's handler."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGINT)
        if self._sigint_deferrer is not None and previous is self._sigint_deferrer:
            # again, after a Ctrl-C cut the first call short (see __exit__): the deferrer it
            # installed is replaced, and the host's handler it held is what comes back
            previous = self._sigint_previous
        elif previous == self._on_signal:
            # SIGINT is one of handle_signals: the handler before the run's comes back
            previous = self._previous_handlers.get(signal.SIGINT)
            if previous is None:
                previous = signal.SIG_DFL
        elif previous is signal.SIG_IGN or previous is None:
            return lambda: None  # ignored, or a handler not set from Python: left alone
        self._sigint_previous = previous

        def on_sigint(signum: int, frame: Any) -> None:
            if self._pending_sigint:
                self._pass_sigint_on(previous, frame)
                return
            self._pending_sigint = True
            logger.warning(
                "Ctrl-C received during shutdown: acted on once shutdown ends (press it "
                "again to interrupt the shutdown)"
            )

        self._sigint_deferrer = on_sigint
        signal.signal(signal.SIGINT, on_sigint)
        return lambda: signal.signal(signal.SIGINT, previous)

    def _act_on_deferred_sigint(self, ending: BaseException | None = None) -> None:
        """The Ctrl-C held during shutdown, now that it ended: what the host's handler does
        (by default, ``KeyboardInterrupt``, which then carries what the run was ending by,
        ``ending``, as ``run_ended_by``: ``hookspecs.print_interrupted`` says that)."""
        logger.warning("the Ctrl-C received during shutdown is acted on now")
        try:
            self._pass_sigint_on(self._sigint_previous, None)
        except KeyboardInterrupt as interrupt:
            interrupt.run_ended_by = ending  # type: ignore[attr-defined]
            raise

    @staticmethod
    def _pass_sigint_on(previous: Any, frame: Any) -> None:
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(previous):
            previous(signal.SIGINT, frame)
            return
        end_by_signal(signal.SIGINT)  # SIG_DFL: the process ends by the signal

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "TrainingRun entered outside the main thread: signals (%s) cannot be handled "
                "here, so a SIGTERM ends the process without the shutdown hooks. Fix: run "
                "the training loop in the main thread",
                ", ".join(signal.Signals(s).name for s in self._handle_signals) or "none",
            )
            return
        for signum in self._handle_signals:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue
            # (recorded once installed: a failure part-way restores only what went in)
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        if self._previous_handlers:
            self._stuck_watch = StuckSignalWatch.start(self)

    def _restore_signal_handlers(self) -> None:
        """Put the host's handlers back, except where the host installed one of its own
        during the run (that one stays: it is the host's latest word)."""
        if self._stuck_watch is not None and threading.current_thread() is threading.main_thread():
            self._stuck_watch.stop()
            self._stuck_watch = None
        if not self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "TrainingRun left from another thread than the one that entered it: its "
                "signal handlers cannot be taken off from here; they act as the previous "
                "handlers did"
            )
            return
        for signum, previous in self._previous_handlers.items():
            current = signal.getsignal(signum)
            if self._sigint_deferrer is not None and current is self._sigint_deferrer:
                continue  # (SIGINT, held during shutdown: put back last, by the deferral)
            if current != self._on_signal:
                logger.info(
                    "%s: the handler set during the run is left in place (the host's own)",
                    signal.Signals(signum).name,
                )
                continue
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._finished:
            self._chain(signum, frame)  # (left installed after the run: see the module)
            return
        name = signal.Signals(signum).name
        if self._pending_signal is not None:
            # A second signal while the first is still being handled (shutdown may be stuck,
            # e.g. on a dead peer): it goes to the host's own handler now, which by default
            # terminates the process.
            logger.warning("%s received again while the first is handled: passing it on", name)
            self._chain(signum, frame)
            return
        self._pending_signal = signum
        # (also where the handler runs as the run's __exit__ is entered, before it marks the
        # shutdown: raised there, the exception would leave __exit__ without any shutdown)
        if self._shutting_down or _entering_exit(self, frame):
            self._held_in_shutdown = True
            logger.warning("%s received during shutdown: acted on once shutdown ends", name)
            if self._tearing_down and self._ends_process(signum):
                seconds = stuck_signal_seconds()
                if seconds:
                    self._teardown_bound = TeardownBound(self, signum, seconds, STUCK_SIGNAL_VAR)
            return
        logger.warning("%s received: ending the run cleanly (shutdown hooks run first)", name)
        raise SignalReceived(signum)

    def _chain(self, signum: int, frame: Any) -> None:
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        end_by_signal(signum)

    def _apply_previous_signal_behaviour(self, exc: BaseException | None) -> bool:
        signum = self._pending_signal
        if signum is None:
            return False
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, None)
            logger.info(
                "the previous %s handler returned: the program continues",
                signal.Signals(signum).name,
            )
            return isinstance(exc, SignalReceived)
        # (the launcher's SIGTERM after another rank exited, during this rank's shutdown:
        # the host, which says the told rank's line, the job's Ctrl-C or the refusal, and
        # Python, which prints a failure's traceback, never get the exception)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the process ends here)
        say_ending_anyway(exc)
        end_by_signal(signum)


_IN_SHUTDOWN: weakref.ref[RunSignals] | None = None
"""The run of this process whose shutdown began last (:func:`held_signal` reads it)."""


def held_signal() -> int | None:
    """The signal that this process's run received during its shutdown and holds until the
    shutdown ends, where it then ends the process (a launcher's SIGTERM, a Ctrl-C: the job
    is being ended), else None (no run, not shutting down, a signal that ended the run
    itself, or one the host's own handler takes after the shutdown). A plugin's shutdown may then
    skip a wait that serves only a job that goes on: the CUDA graph plugin's wait for the
    other ranks to hear of this rank's failure."""
    active = _IN_SHUTDOWN() if _IN_SHUTDOWN is not None else None
    if active is None or not active._shutting_down or active._finished:
        return None
    if active._pending_sigint:  # (a Ctrl-C, which torchrun passes on to every rank)
        return signal.SIGINT
    signum = active._pending_signal
    if not active._held_in_shutdown or signum is None:
        return None
    return signum if active._ends_process(signum) else None


def _entering_exit(run: RunSignals, frame: Any) -> bool:
    """The handler runs in ``run.__exit__`` itself (a signal handled at its entry: the
    interpreter runs pending handlers when a function is called)."""
    return (
        frame is not None
        and frame.f_code.co_name == "__exit__"
        and frame.f_locals.get("self") is run
    )
