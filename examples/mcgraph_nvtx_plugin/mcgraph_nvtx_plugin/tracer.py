"""The hook implementations of one run: NVTX ranges, memory log lines, the event timeline.

One :class:`RunTracer` is created per run (from ``mcgraph_configure``) and does three things
at every hook it implements:

* **NVTX** (only with CUDA; a no-op otherwise): a range around each training step, each
  evaluation, each capture (``mcgraph_before_capture`` to ``mcgraph_after_capture``) and the
  shutdown, and a mark at the start of every step that runs with CUDA graphs held (replay),
  so an Nsight Systems timeline shows where capture and replay happened;
* **memory**: one log line with allocated/reserved MiB on CUDA, else the process's peak
  resident set size (``resource``); per-step lines are DEBUG, the others INFO;
* **timeline**: an event (hook, step, seconds since configure, memory) kept in memory and
  written to the JSONL sink at shutdown, after the run report that ``mcgraph_report`` wrote.

Hooks run on the host, between graph replays, never inside a capture; nothing here
synchronises the device (the memory counters are host-side).

Set ``MCGRAPH_NVTX_FAIL_AT`` to a hook name (e.g. ``mcgraph_train_step_end``) to make the
tracer raise there: a rehearsal of a plugin error, to see that the host's run still ends
with a clean shutdown (this package's tests do).
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

from hookspecs import ShutdownReason, hookimpl
from mcgraph_nvtx_plugin.sink import REPORT_ENV_VAR, JsonlSink, report_path

logger = logging.getLogger("mcgraph_nvtx_plugin")

FAIL_ENV_VAR = "MCGRAPH_NVTX_FAIL_AT"
MAX_STEP_EVENTS = 1000
"""Step events kept in the timeline; later ones are counted, not kept (long runs)."""

MIB = 1024 * 1024
_STEP_HOOKS = frozenset({"mcgraph_train_step_start", "mcgraph_train_step_end"})


def memory_mib(cuda: bool) -> dict[str, float]:
    """Allocated and reserved device memory with CUDA, else the peak RSS of the process."""
    if cuda:
        import torch

        return {
            "allocated_mib": round(torch.cuda.memory_allocated() / MIB, 1),
            "reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1),
        }
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return {"max_rss_mib": round(max_rss / (MIB if sys.platform == "darwin" else 1024), 1)}


def _format_memory(memory: dict[str, float]) -> str:
    if "allocated_mib" in memory:
        return (
            f"allocated {memory['allocated_mib']:.1f} MiB, "
            f"reserved {memory['reserved_mib']:.1f} MiB"
        )
    return f"max RSS {memory['max_rss_mib']:.1f} MiB"


class RunTracer:
    """The tracer of one run; create it with :meth:`from_config`.

    :param nvtx: ``torch.cuda.nvtx`` (or anything with ``range_push``, ``range_pop`` and
        ``mark``), or ``None`` for no NVTX.
    :param cuda: Whether memory is read from the CUDA allocator (else the process RSS).
    :param sink: Where the report and the timeline go, or ``None``.
    :param fail_at: A hook name to raise in (see ``MCGRAPH_NVTX_FAIL_AT``), or ``None``.
    """

    def __init__(
        self, *, nvtx: Any, cuda: bool, sink: JsonlSink | None, fail_at: str | None = None
    ) -> None:
        self.nvtx = nvtx
        self.cuda = cuda
        self.sink = sink
        self.fail_at = fail_at
        self.events: list[dict[str, Any]] = []
        self.step_events = 0
        self.step_events_dropped = 0
        self.ranges: list[str] = []
        self.graphs_held = 0
        self.shutdown_reason: str | None = None
        self._t0 = time.perf_counter()
        self._event("mcgraph_configure")

    @classmethod
    def from_config(cls, config: Any) -> RunTracer:
        import torch

        cuda = torch.cuda.is_available()
        path = report_path(config)
        sink = JsonlSink(path) if path is not None else None
        tracer = cls(
            nvtx=torch.cuda.nvtx if cuda else None,
            cuda=cuda,
            sink=sink,
            fail_at=os.environ.get(FAIL_ENV_VAR) or None,
        )
        logger.info(
            "NVTX ranges %s; report sink: %s",
            "on" if cuda else "off (no CUDA device)",
            sink.path if sink else f"none (set --nvtx-report-jsonl or ${REPORT_ENV_VAR})",
        )
        return tracer

    # -- the three outputs --------------------------------------------------------------------

    def _event(self, hook: str, **details: Any) -> None:
        if hook == self.fail_at:
            raise RuntimeError(
                f"mcgraph-nvtx-plugin fails in {hook} because {FAIL_ENV_VAR}={hook} "
                "(a rehearsal of a plugin error)"
            )
        memory = memory_mib(self.cuda)
        per_step = hook in _STEP_HOOKS
        logger.log(
            logging.DEBUG if per_step else logging.INFO,
            "%s%s: %s",
            hook,
            "".join(f" {key}={value}" for key, value in details.items()),
            _format_memory(memory),
        )
        if per_step:
            if self.step_events >= MAX_STEP_EVENTS:
                self.step_events_dropped += 1
                return
            self.step_events += 1
        seconds = round(time.perf_counter() - self._t0, 6)
        self.events.append({"hook": hook, **details, "seconds": seconds, "memory": memory})

    def _push(self, label: str) -> None:
        self.ranges.append(label)
        if self.nvtx is not None:
            self.nvtx.range_push(label)

    def _pop(self, label: str) -> None:
        """Close ``label`` and every range opened inside it (a step that raised leaves its
        ranges open; they are closed here or at shutdown, so NVTX stays balanced)."""
        if label not in self.ranges:
            return
        while self.ranges:
            top = self.ranges.pop()
            if self.nvtx is not None:
                self.nvtx.range_pop()
            if top == label:
                return

    def _mark(self, label: str) -> None:
        if self.nvtx is not None:
            self.nvtx.mark(label)

    # -- set-up -------------------------------------------------------------------------------

    @hookimpl
    def mcgraph_rng_options(self) -> None:
        self._event("mcgraph_rng_options")

    @hookimpl
    def mcgraph_rng_initialized(self) -> None:
        self._event("mcgraph_rng_initialized")

    @hookimpl
    def mcgraph_model_config_kwargs(self) -> None:
        self._event("mcgraph_model_config_kwargs")

    @hookimpl
    def mcgraph_model_build_context(self) -> None:
        self._event("mcgraph_model_build_context")

    @hookimpl
    def mcgraph_model_built(self, seq_length: int, micro_batch_size: int) -> None:
        self._event("mcgraph_model_built", seq_length=seq_length, micro_batch_size=micro_batch_size)

    # Perform and query hooks (firstresult) are wrapped, not implemented: an implementation
    # would not be called once another plugin answered first.

    @hookimpl(wrapper=True)
    def mcgraph_forward_backward_func(self) -> Iterator[None]:
        self._event("mcgraph_forward_backward_func")
        return (yield)

    @hookimpl(wrapper=True)
    def mcgraph_warmup_steps(self) -> Iterator[None]:
        warmup_steps = yield
        self._event("mcgraph_warmup_steps", answer=warmup_steps)
        return warmup_steps

    # -- training and evaluation --------------------------------------------------------------

    @hookimpl
    def mcgraph_train_start(self, start_step: int, train_iters: int) -> None:
        self._event("mcgraph_train_start", start_step=start_step, train_iters=train_iters)

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        self._event("mcgraph_train_step_start", step=step)
        self._pop_steps()
        if self.graphs_held:
            self._mark(f"mcgraph replay step {step}")
        self._push(f"mcgraph step {step}")

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        self._event("mcgraph_post_warmup_step", step=step, start_step=start_step)

    @hookimpl
    def mcgraph_train_step_end(self, step: int) -> None:
        self._event("mcgraph_train_step_end", step=step)
        self._pop(f"mcgraph step {step}")

    @hookimpl(wrapper=True)
    def mcgraph_disable_forward_pre_hook(self, param_sync: bool) -> Iterator[None]:
        self._event("mcgraph_disable_forward_pre_hook", param_sync=param_sync)
        return (yield)

    @hookimpl(wrapper=True)
    def mcgraph_enable_forward_pre_hook(self) -> Iterator[None]:
        self._event("mcgraph_enable_forward_pre_hook")
        return (yield)

    @hookimpl
    def mcgraph_evaluation_start(self, step: int) -> None:
        self._event("mcgraph_evaluation_start", step=step)
        self._push("mcgraph evaluation")

    @hookimpl
    def mcgraph_evaluation_end(self, step: int) -> None:
        self._event("mcgraph_evaluation_end", step=step)
        self._pop("mcgraph evaluation")

    def _pop_steps(self) -> None:
        # A host that caught a failed step and goes on never fired its train_step_end.
        for label in [label for label in self.ranges if label.startswith("mcgraph step ")]:
            self._pop(label)

    # -- CUDA graph events (fired by the CUDA graph plugin) -----------------------------------

    @hookimpl
    def mcgraph_before_capture(self, step: int, impl: str, scope: list[str]) -> None:
        self._event("mcgraph_before_capture", step=step, impl=impl, scope=list(scope))
        self._push(_capture_label(step, impl, scope))

    @hookimpl
    def mcgraph_after_capture(
        self, step: int, impl: str, scope: list[str], seconds: float, graph_count: int
    ) -> None:
        self._pop(_capture_label(step, impl, scope))
        self.graphs_held = graph_count
        self._event(
            "mcgraph_after_capture",
            step=step,
            impl=impl,
            scope=list(scope),
            capture_seconds=seconds,
            graph_count=graph_count,
        )

    @hookimpl
    def mcgraph_report(self, report: Any) -> None:
        data = report.to_dict()
        self._event("mcgraph_report", graphs_captured=data.get("graphs_captured"))
        if self.sink is not None:
            self.sink.write({"kind": "report", "report": data})

    # -- shutdown -----------------------------------------------------------------------------

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(
        self, reason: ShutdownReason, exception: BaseException | None
    ) -> Iterator[None]:
        # tryfirst: outside the CUDA graph plugin's shutdown wrapper whatever the
        # registration order (docs/hooks.md, mcgraph_shutdown), so the shutdown range
        # encloses the graphs being freed, and the run report (sent when that wrapper is
        # entered) is written before the file closes. Nothing may raise before the yield:
        # pluggy would then skip the implementations inside this one.
        self.shutdown_reason = str(reason)
        error: Exception | None = None
        try:
            self._push(f"mcgraph shutdown ({reason})")
            self._event(
                "mcgraph_shutdown",
                reason=str(reason),
                exception=None if exception is None else repr(exception),
            )
        except Exception as exc:
            error = exc
        try:
            result = yield
        finally:
            self._finish()
        if error is not None:
            raise error
        return result

    def _finish(self) -> None:
        """Close every NVTX range, write the timeline, close the file; exactly once."""
        while self.ranges:
            self._pop(self.ranges[-1])
        if self.sink is None or self.sink.closed:
            return
        try:
            self.sink.write(
                {
                    "kind": "timeline",
                    "shutdown_reason": self.shutdown_reason,
                    "events": self.events,
                    "step_events_dropped": self.step_events_dropped,
                }
            )
        finally:
            self.sink.close()
            logger.info("hook timeline written to %s", self.sink.path)


def _capture_label(step: int, impl: str, scope: list[str]) -> str:
    return f"mcgraph capture {impl} {','.join(scope)} step {step}"
