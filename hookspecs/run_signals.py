"""What a signal does during a :class:`~hookspecs.run.TrainingRun`: the handled signals
(SIGTERM) become :class:`SignalReceived`, a Ctrl-C during shutdown waits until it ends, and
afterwards the previous handler's behaviour applies. A mixin of ``TrainingRun``: the run's
``_finish`` and ``__exit__`` stay there (``peer_mark.run_is_shutting_down`` looks for their
code on the stack)."""

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

    def _defer_sigint(self) -> Any:
        """Hold a Ctrl-C (SIGINT) that arrives while the shutdown hook runs, so that every
        implementation finishes and the graphs are freed; a second Ctrl-C interrupts at
        once. Returns what restores the host's handler."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGINT)
        if previous is self._sigint_deferrer:
            # again, after a Ctrl-C cut the first call short (see __exit__): the deferrer it
            # installed is replaced, and the host's default handler is what comes back
            previous = signal.default_int_handler
        elif previous is not signal.default_int_handler:
            return lambda: None  # the host's own policy (ignored, or its own handler)

        def on_sigint(signum: int, frame: Any) -> None:
            if self._pending_sigint:
                raise KeyboardInterrupt
            self._pending_sigint = True
            logger.warning(
                "Ctrl-C received during shutdown: acted on once shutdown ends (press it "
                "again to interrupt the shutdown)"
            )

        self._sigint_deferrer = on_sigint
        signal.signal(signal.SIGINT, on_sigint)
        return lambda: signal.signal(signal.SIGINT, previous)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("TrainingRun outside the main thread: signals are not handled")
            return
        for signum in self._handle_signals:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
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
