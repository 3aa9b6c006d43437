"""The shutdown sequence: the report goes out, the inner shutdown implementations run, and
the graphs are freed, whatever happened before.

:meth:`Shutdown.wrap` is the body of the plugin's plain ``mcgraph_shutdown`` wrapper (the
documented middle layer); :meth:`Shutdown.guard` is the body of its ``tryfirst`` safety net,
which does the same if a wrapper in between raised before its ``yield`` and pluggy skipped
the plain one. When a multi-rank run ends by an exception or a signal a peer may be gone:
shutdown then never waits on the device (no synchronisation, no cache flush), so the
failing rank reaches the host's teardown and exits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

from cudagraph_plugin.runtime.reporter import Reporter
from cudagraph_plugin.runtime.state import RunState
from hookspecs import ShutdownReason

logger = logging.getLogger("cudagraph_plugin")

ReleaseAll = Callable[..., None]


class Shutdown:
    def __init__(self, state: RunState, reporter: Reporter, release_all: ReleaseAll) -> None:
        self.state = state
        self.reporter = reporter
        self.release_all = release_all
        self.entered = False
        self._said_reason = False
        self._first_reason: ShutdownReason | None = None
        self._said_again = False
        self.released = False  # the first shutdown's release ran (entered: it began)

    def reason_of(self, reason: Any) -> ShutdownReason:
        """``reason`` as a :class:`~hookspecs.ShutdownReason`. A host firing
        ``mcgraph_shutdown`` itself with a reason of its own gets an abnormal end
        (``exception``: the graphs freed without waiting on the device, the failure marked
        for the other ranks), said once."""
        try:
            return ShutdownReason(reason)
        except (ValueError, TypeError):
            if not self._said_reason:
                self._said_reason = True
                logger.warning(
                    "mcgraph_shutdown: reason %r is not one of hookspecs.ShutdownReason's "
                    "values (%s); it is taken as %r. Fix: pass a ShutdownReason (TrainingRun "
                    "does)",
                    reason,
                    ", ".join(r.value for r in ShutdownReason),
                    ShutdownReason.EXCEPTION.value,
                )
            return ShutdownReason.EXCEPTION

    def wrap(self, reason: Any, exception: BaseException | None) -> Generator[None, Any, Any]:
        # The report goes out before the inner shutdown implementations run (they may close
        # the sinks it is written to); graphs are freed after them, whatever happened before.
        # Anything the report raises, a KeyboardInterrupt or SystemExit included (a second
        # Ctrl-C during its device sync, a plugin's mcgraph_report, the JSON write), waits
        # until the inner implementations ran and the graphs are freed, then goes on; its
        # traceback is printed once: by whoever receives it, or here where it is not raised
        # (an inner implementation raised too), or as the context of a failed release.
        # (``entered`` is set last before the ``try``: anything raised before it leaves the
        # release to the guard; anything raised after it meets the ``finally`` that frees
        # the graphs: an interruption while the report's failure is logged too, though
        # pluggy then skips the inner implementations, since this wrapper never yielded)
        reason = self.reason_of(reason)
        if self.entered:  # fired again (by a plugin): reported and freed the first time
            self._again(reason)
            return (yield)
        self._first_reason = reason
        quiet = device_may_block(reason, self.state)
        report_error: BaseException | None = None
        self.entered = True
        try:
            try:
                self.reporter.emit(str(reason), sync=not quiet)
            except BaseException as exc:
                report_error = exc
                logger.error("the run report failed: %r (the CUDA graphs are freed first)", exc)
            result = yield
        except BaseException:
            if report_error is not None:
                logger.error("the run report also failed", exc_info=report_error)
                report_error = None  # (said here: the inner implementation's error goes on)
            raise
        finally:
            try:
                self.release_all(str(reason), quiet=quiet, exception=exception)
            except BaseException as release_error:
                if report_error is not None:
                    if release_error.__context__ is None:
                        release_error.__context__ = report_error  # (printed with it)
                    else:  # (its context taken: said here, or never)
                        logger.error("the run report failed", exc_info=report_error)
                raise
            finally:
                self.released = True
        if report_error is not None:
            raise report_error
        return result

    def _again(self, reason: ShutdownReason) -> None:
        if self._said_again:
            return
        self._said_again = True
        logger.warning(
            "mcgraph_shutdown fired again (reason %s) %s this run's shutdown (reason %s), "
            "which %s: nothing more to report or free here. Fix: TrainingRun fires "
            "mcgraph_shutdown once; a plugin must not fire it (raise an exception to end a "
            "run)",
            reason,
            "after" if self.released else "during",
            self._first_reason,
            "reported the run and freed its CUDA graphs"
            if self.released
            else "reports the run and frees its CUDA graphs once it ends",
        )

    def guard(self, reason: Any, exception: BaseException | None) -> Generator[None, Any, Any]:
        try:
            return (yield)
        except BaseException as error:
            if not self.entered:
                self._skipped(str(self.reason_of(reason)), exception or error)
            raise

    def _skipped(self, reason: str, exception: BaseException) -> None:
        logger.error(
            "a mcgraph_shutdown wrapper raised before its yield and skipped the CUDA graph "
            "plugin's shutdown (%r): reporting and freeing the graphs from its guard",
            exception,
        )
        quiet = True  # (until known: never wait on a device a peer may have left)
        self.entered, self._first_reason = True, self.reason_of(reason)  # (once, as wrap)
        try:
            quiet = device_may_block(reason, self.state)
            self.reporter.emit(reason, sync=not quiet)
        except BaseException as report_error:
            logger.error("the run report failed", exc_info=report_error)
        finally:
            try:
                self.release_all(reason, quiet=quiet, exception=exception)
            finally:
                self.released = True


def device_may_block(reason: Any, state: RunState) -> bool:
    """After an abnormal end of a multi-rank run a peer may never join the collectives
    queued on this device: waiting on it (a synchronisation, a cache flush) can hang. A
    peer's failure always is such an end (its process groups are aborted by then, so the
    world size is the one cached while they lived)."""
    reason = ShutdownReason(reason)
    if reason is ShutdownReason.PEER_FAILED or state.past_peer_early_end:
        return True
    return reason.abnormal and state.rank_and_world()[1] > 1
