"""The run's release plan, carried out exactly once: what each mechanism holds, then the
plugin's own references, Python garbage, cuBLAS workspaces and the allocator's cache, each
in its own guarded step (:mod:`~cudagraph_plugin.runtime.release`).
"""

from __future__ import annotations

import gc
import logging

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.release import ReleaseStep, release_each, settle
from cudagraph_plugin.runtime.state import Phase, RunState
from cudagraph_plugin.runtime.timing import MIB

logger = logging.getLogger("cudagraph_plugin")


class ReleasePlan:
    """The run's release plan, carried out once (:meth:`release_all`).

    ``extra`` steps come from the plugin's other objects (the guard, the pending manual
    hooks, its references to the model), in the order given, before the garbage collection.
    """

    def __init__(self, state: RunState, captures: Captures) -> None:
        self.state = state
        self.captures = captures
        self.graphs_freed = 0
        self.allocated_after_free_mib: float | None = None
        self.failures: list[tuple[str, BaseException]] = []

    def steps(self, extra: list[ReleaseStep], quiet: bool) -> list[ReleaseStep]:
        steps: list[ReleaseStep] = []
        for mechanism in self.state.mechanisms():
            steps += mechanism.release_steps()
        steps += [*extra, ReleaseStep("Python garbage", gc.collect)]
        if self.state.cuda and self.captures.records:
            steps.append(ReleaseStep("cuBLAS workspaces", compat.clear_cublas_workspaces))
        if self.state.cuda and not quiet:
            # cudaFree synchronises the device: only when no peer can leave it waiting.
            steps.append(ReleaseStep("cached device memory", empty_cache))
        return steps

    def release_all(
        self,
        reason: str,
        extra: list[ReleaseStep],
        *,
        quiet: bool,
        exception: BaseException | None,
    ) -> None:
        state = self.state
        if state.phase is Phase.SHUT_DOWN:
            return
        state.phase = Phase.SHUT_DOWN
        # the plan is drawn up inside release_each's guard: a second Ctrl-C while it is
        # (each mechanism lists its steps) draws it up again rather than skip every step
        result = release_each(lambda: self.steps(extra, quiet))
        self.graphs_freed += result.graphs_freed
        self.failures = result.failures
        state.te = None
        state.full = None
        state.optim = None
        if state.cuda:
            self.allocated_after_free_mib = allocated_mib()
            before = self.captures.memory_before
            logger.info(
                "shutdown (%s): %d CUDA graph(s) freed; allocated memory now %s MiB (before "
                "capture: %s MiB)%s",
                reason,
                self.graphs_freed,
                _fmt_mib(self.allocated_after_free_mib),
                _fmt_mib(before.allocated_mib if before else None),
                "; device not synchronised (a peer may be gone)" if quiet else "",
            )
        else:
            logger.info("shutdown (%s): no CUDA graph to free on the CPU", reason)
        settle(result.failures, exception)


def empty_cache() -> None:
    import torch

    torch.cuda.empty_cache()


def allocated_mib() -> float:
    import torch

    return torch.cuda.memory_allocated() / MIB


def _fmt_mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"
