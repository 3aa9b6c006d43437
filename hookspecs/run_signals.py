"""What a signal does during a :class:`~hookspecs.run.TrainingRun`: the handled signals
(SIGTERM) become :class:`SignalReceived`, a Ctrl-C during shutdown waits until it ends, and
afterwards the previous handler's behaviour applies. A mixin of ``TrainingRun``: the run's
``_finish`` and ``__exit__`` stay there (``peer_mark.run_is_shutting_down`` looks for their
code on the stack). A handler of the run left installed after it ended (by a host that set
its own during the run, or a run left from another thread) acts as the previous one did."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from hookspecs.reasons import SignalReceived

logger = logging.getLogger("hookspecs.run")  # (the run's log lines keep their logger)


class RunSignals:
    """The signal policy of one run; the state it uses is set by ``TrainingRun.__init__``."""

    _handle_signals: tuple[int, ...]
    _previous_handlers: dict[int, Any]
    _pending_signal: int | None
    _pending_sigint: bool
    _sigint_deferrer: Any
    _shutting_down: bool
    _finished: bool

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

    def _act_on_deferred_sigint(self) -> None:
        """The Ctrl-C held during shutdown, now that it ended: what the host's handler does
        (by default, ``KeyboardInterrupt``)."""
        logger.warning("the Ctrl-C received during shutdown is acted on now")
        self._pass_sigint_on(self._sigint_previous, None)

    @staticmethod
    def _pass_sigint_on(previous: Any, frame: Any) -> None:
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(previous):
            previous(signal.SIGINT, frame)
            return
        _terminate_by(signal.SIGINT)  # SIG_DFL: the process ends by the signal

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

    def _restore_signal_handlers(self) -> None:
        """Put the host's handlers back, except where the host installed one of its own
        during the run (that one stays: it is the host's latest word)."""
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
        if self._shutting_down:
            logger.warning("%s received during shutdown: acted on once shutdown ends", name)
            return
        logger.warning("%s received: ending the run cleanly (shutdown hooks run first)", name)
        raise SignalReceived(signum)

    def _chain(self, signum: int, frame: Any) -> None:
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        _terminate_by(signum)

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
        _terminate_by(signum)
        return False  # not reached for terminating signals


def _terminate_by(signum: int) -> None:
    """SIG_DFL (or a handler not set from Python): die by the same signal, as the process
    would have without the run's handler."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
