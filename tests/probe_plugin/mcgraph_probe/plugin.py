"""The entry-point module (group ``mcgraph``, name ``probe``) and the per-run objects."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from hookspecs import hookimpl

logger = logging.getLogger("mcgraph_probe")

OUT_ENV_VAR = "MCGRAPH_PROBE_OUT"
FAIL_ENV_VAR = "MCGRAPH_PROBE_FAIL_AT"


class Sink:
    """The run's JSON Lines file; every event is flushed at once, so the order is kept."""

    def __init__(self) -> None:
        path = os.environ.get(OUT_ENV_VAR)
        self.file = open(path, "a", encoding="utf-8") if path else None
        self.fail_at = os.environ.get(FAIL_ENV_VAR) or None

    def event(self, hook: str, **details: Any) -> None:
        logger.info("%s %s", hook, json.dumps(details, sort_keys=True, default=str))
        if self.file is not None:
            self.file.write(json.dumps({"hook": hook, **details}, default=str) + "\n")
            self.file.flush()
        if hook == self.fail_at:
            raise RuntimeError(f"mcgraph-probe fails in {hook} ({FAIL_ENV_VAR})")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@hookimpl
def mcgraph_configure(config: Any, pluginmanager: Any) -> None:
    # Per-run objects, registered without a name: they count as plugin `probe`.
    sink = Sink()
    try:
        sink.event("mcgraph_configure")
    except Exception:
        sink.close()
        raise
    pluginmanager.register(Recorder(sink))
    pluginmanager.register(Outermost(sink))
    pluginmanager.register(Innermost(sink))


class Recorder:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    @hookimpl
    def mcgraph_rng_options(self) -> None:
        self.sink.event("mcgraph_rng_options")

    @hookimpl
    def mcgraph_rng_initialized(self) -> None:
        self.sink.event("mcgraph_rng_initialized")

    @hookimpl
    def mcgraph_model_config_kwargs(self) -> None:
        self.sink.event("mcgraph_model_config_kwargs")

    @hookimpl
    def mcgraph_model_build_context(self) -> None:
        self.sink.event("mcgraph_model_build_context")

    @hookimpl
    def mcgraph_model_built(self) -> None:
        self.sink.event("mcgraph_model_built")

    @hookimpl(wrapper=True)
    def mcgraph_forward_backward_func(self) -> Iterator[None]:
        self.sink.event("mcgraph_forward_backward_func")
        return (yield)

    @hookimpl(wrapper=True)
    def mcgraph_warmup_steps(self) -> Iterator[None]:
        answer = yield
        self.sink.event("mcgraph_warmup_steps", answer=answer)
        return answer

    @hookimpl
    def mcgraph_train_start(self, start_step: int, train_iters: int) -> None:
        self.sink.event("mcgraph_train_start", start_step=start_step, train_iters=train_iters)

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        self.sink.event("mcgraph_train_step_start", step=step)

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        self.sink.event("mcgraph_post_warmup_step", step=step, start_step=start_step)

    @hookimpl
    def mcgraph_train_step_end(self, step: int) -> None:
        self.sink.event("mcgraph_train_step_end", step=step)

    @hookimpl
    def mcgraph_evaluation_start(self, step: int) -> None:
        self.sink.event("mcgraph_evaluation_start", step=step)

    @hookimpl
    def mcgraph_evaluation_end(self, step: int) -> None:
        self.sink.event("mcgraph_evaluation_end", step=step)

    @hookimpl
    def mcgraph_before_capture(self, step: int) -> None:
        self.sink.event("mcgraph_before_capture", step=step)

    @hookimpl
    def mcgraph_after_capture(self, step: int) -> None:
        self.sink.event("mcgraph_after_capture", step=step)

    @hookimpl
    def mcgraph_report(self, report: Any) -> None:
        self.sink.event("mcgraph_report", report=report.to_dict())

    @hookimpl
    def mcgraph_shutdown(self, reason: Any) -> None:
        self.sink.event("mcgraph_shutdown", layer="plain", reason=str(reason))


class Outermost:
    """The layer outside the CUDA graph plugin's: closes the file, after everything."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason: Any) -> Iterator[None]:
        try:
            self.sink.event("mcgraph_shutdown", layer="tryfirst", reason=str(reason))
        except Exception as exc:  # never raise before the yield
            error: Exception | None = exc
        else:
            error = None
        try:
            result = yield
        finally:
            self.sink.event("mcgraph_shutdown.finally", layer="tryfirst")
            self.sink.close()
        if error is not None:
            raise error
        return result


class Innermost:
    """The layer inside the CUDA graph plugin's: runs while the graphs are held."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    @hookimpl(wrapper=True, trylast=True)
    def mcgraph_shutdown(self) -> Iterator[None]:
        self.sink.event("mcgraph_shutdown", layer="trylast")
        try:
            return (yield)
        finally:
            self.sink.event("mcgraph_shutdown.finally", layer="trylast")
