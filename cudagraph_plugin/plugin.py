"""The CUDA graph plugin: the hook implementations of one run, as a small state machine.

One :class:`CudaGraphPlugin` is created and registered per run by ``entry`` (from the
``mcgraph_configure`` hook), so nothing leaks from one run into the next. Its phases::

    CONFIGURED --model_built--> BUILT --capture--> CAPTURED --fallback--> FALLEN_BACK
         \\___________________________\\__________________\\______________________\\
                                                                       shutdown--> SHUT_DOWN

Where the capture step is decided:

* ``transformer_engine`` scopes: :meth:`CudaGraphPlugin.mcgraph_post_warmup_step`, which
  ``TrainingRun`` fires when ``step - start_step == warmup_steps``;
* ``full_iteration``: megatron-core's ``FullCudaGraphWrapper`` captures on its
  ``warmup_steps``-th call per stage; :meth:`CudaGraphPlugin._forward_backward` sees it
  coming and brackets it with the capture hooks, timing and memory snapshots.

Graphs are freed in :meth:`CudaGraphPlugin.mcgraph_shutdown`, a ``wrapper=True``
implementation whose ``finally`` runs on every exit path, even when another plugin's
shutdown implementation raises.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.config_check import check_config
from cudagraph_plugin.guard import FIX, ShapeGuard, StaticShapeError
from cudagraph_plugin.report import (
    MIB,
    MemorySnapshot,
    RunReport,
    StepTimer,
    median_or_none,
    verdict,
)
from cudagraph_plugin.settings import Settings, read_settings
from cudagraph_plugin.validation import CudaGraphConfigError, Violation, warmup_warning
from hookspecs import call_hook, hookimpl

logger = logging.getLogger("cudagraph_plugin")

FALLBACK_REPLAY_STEPS = 5
"""Replay steps measured before the opt-in fallback policy decides."""


_RNG_PROBLEM = (
    "CUDA graphs need a graph-safe RNG tracker, but the active one is not (with "
    "te_rng_tracker=True and no Transformer Engine, megatron-core silently falls back to its "
    "own tracker, which is graph-safe only with use_cudagraphable_rng=True)"
)
_RNG_FIX = (
    "seed with model_parallel_cuda_manual_seed(**run.rng_options(...)) so it gets "
    "te_rng_tracker=True and use_cudagraphable_rng=True"
)


_CALC_FIX = (
    "megatron-core's TECudaGraphHelper reads the global micro-batch calculator while it "
    "captures, and the host has not set it up",
    "call megatron.core.num_microbatches_calculator.init_num_microbatches_calculator(rank, "
    "None, global_batch_size, micro_batch_size, data_parallel_size) before run.model_built() "
    "(Megatron-LM's loop does this at start-up)",
)


class Phase(enum.Enum):
    CONFIGURED = "configured"
    BUILT = "built"
    CAPTURED = "captured"
    FALLEN_BACK = "fallen_back"
    SHUT_DOWN = "shut_down"


class CudaGraphPlugin:
    """Hook implementations for one run; create it with :meth:`configure`."""

    def __init__(self, settings: Settings, pluginmanager: Any, *, cuda: bool) -> None:
        self.settings = settings
        self.pm = pluginmanager
        self.cuda = cuda
        self.active = settings.enabled and cuda
        if not settings.enabled:
            self.no_graph_reason: str | None = "CUDA graphs are off (cuda_graph_impl=none)"
        elif not cuda:
            self.no_graph_reason = "no CUDA device (CUDA graphs need one; the run was eager)"
        else:
            self.no_graph_reason = None
        self.phase = Phase.CONFIGURED
        self.model: list[Any] | None = None
        self.seq_length: int | None = None
        self.micro_batch_size: int | None = None
        self.te_helper: Any = None
        self.fi_wrapper: Any = None
        self.guard = ShapeGuard()
        self.timer = StepTimer(use_cuda=cuda)
        self.step: int | None = None
        self.start_step: int | None = None
        self.captures: list[dict[str, Any]] = []
        self.graph_count = 0
        self.graphs_held_max = 0
        self.graphs_freed = 0
        self.memory_before: MemorySnapshot | None = None
        self.memory_after: MemorySnapshot | None = None
        self.manual_hooks_pending = False
        self.fallback_decided = False
        self.fallback_step: int | None = None
        self.report: RunReport | None = None
        self.allocated_after_free_mib: float | None = None

    @classmethod
    def configure(cls, config: Any, pluginmanager: Any) -> CudaGraphPlugin:
        """Check the host's configuration (``check_config``: the same verdict as
        ``python -m cudagraph_plugin check``) and apply its auto-fixes only if it has no
        problems; otherwise raise, leaving ``config`` and the environment untouched."""
        cuda = compat.cuda_available()
        result = check_config(
            config,
            te_available=compat.te_available if cuda else None,
            nccl_initialized=compat.nccl_initialized,
        )
        result.apply(config)
        settings = result.settings
        for note in result.advice:
            logger.warning("advice: %s", note)
        for note in result.notes:
            logger.info("note: %s", note)
        if settings.enabled and not cuda:
            logger.warning(
                "CUDA graphs need a CUDA device and none is available: this run is eager and "
                "captures nothing (cuda_graph_impl=%s, scope=%s was validated)",
                settings.impl,
                ",".join(settings.scope),
            )
        return cls(settings, pluginmanager, cuda=cuda)

    # -- state machine ------------------------------------------------------------------------

    def _advance(self, expected: tuple[Phase, ...], new: Phase) -> None:
        if self.phase not in expected:
            raise RuntimeError(
                f"cudagraph plugin: cannot go from {self.phase.value} to {new.value} "
                f"(expected {', '.join(p.value for p in expected)}); the host fired the "
                "hooks out of order"
            )
        self.phase = new

    @property
    def _te(self) -> bool:
        return self.active and self.settings.impl == "transformer_engine"

    @property
    def _full_iteration(self) -> bool:
        return self.active and self.settings.full_iteration

    # -- configuration and build --------------------------------------------------------------

    @hookimpl
    def mcgraph_model_config_kwargs(self, config: Any) -> dict[str, Any]:
        impl = self.settings.impl if self.active else "none"
        return compat.model_config_kwargs(impl, self.settings.scope, self.settings.warmup_steps)

    @hookimpl
    def mcgraph_rng_options(self, config: Any) -> dict[str, Any] | None:
        if not self.active:
            return None
        return {"te_rng_tracker": True, "use_cudagraphable_rng": True, "force_reset_rng": True}

    @hookimpl
    def mcgraph_rng_initialized(self, config: Any) -> None:
        if not self.active:
            return
        safe, tracker = compat.rng_tracker_state()
        if not safe:
            raise CudaGraphConfigError(
                [Violation(("RNG tracker",), tracker, _RNG_PROBLEM, _RNG_FIX)]
            )
        logger.info("RNG tracker is CUDA-graph safe: %s", tracker)

    @hookimpl
    def mcgraph_model_build_context(self, config: Any) -> Any:
        if not self.active:
            return None
        return compat.ddp_build_context(full_iteration=self.settings.full_iteration)

    @hookimpl
    def mcgraph_model_built(
        self,
        model: list[Any],
        optimizer: Any,
        model_config: Any,
        seq_length: int,
        micro_batch_size: int,
    ) -> None:
        self._advance((Phase.CONFIGURED,), Phase.BUILT)
        self.model = model
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        if not self.active:
            return
        self._check_built_config(model_config, seq_length, micro_batch_size)
        if self._te and not compat.num_microbatches_calculator_ready():
            raise CudaGraphConfigError(
                [Violation(("num_microbatches_calculator",), "not initialised", *_CALC_FIX)]
            )
        if self._te:
            self.te_helper = compat.make_te_helper(
                model, model_config, seq_length, micro_batch_size, [optimizer]
            )
            logger.info(
                "TE CUDA graphs: %d graphable layer(s) for scope %s; capture at step "
                "start_step + %d",
                compat.te_layer_count(self.te_helper),
                ",".join(self.settings.scope),
                self.settings.warmup_steps,
            )

    def _check_built_config(self, model_config: Any, seq_length: int, mbs: int) -> None:
        built = read_settings(model_config)
        violations = []
        if (built.impl, built.scope) != (self.settings.impl, self.settings.scope):
            violations.append(
                Violation(
                    ("TransformerConfig.cuda_graph_impl", "TransformerConfig.cuda_graph_scope"),
                    repr((built.impl, ",".join(built.scope))),
                    f"the model was built for ({built.impl}, {','.join(built.scope)}) but the "
                    f"plugin configured ({self.settings.impl}, {','.join(self.settings.scope)})",
                    "build the TransformerConfig with run.model_config_kwargs(base=...)",
                )
            )
        for name, have in (("seq_length", seq_length), ("micro_batch_size", mbs)):
            want = getattr(self.settings, name)
            if want is not None and want != have:
                violations.append(
                    Violation(
                        (self.settings.field(name), f"model_built({name}=...)"),
                        repr((want, have)),
                        f"the configuration says {name}={want} but the model was built for {have}",
                        f"pass the configured {name} to run.model_built()",
                    )
                )
        if violations:
            raise CudaGraphConfigError(violations)

    @hookimpl(wrapper=True)
    def mcgraph_forward_backward_func(self, forward_backward_func: Any) -> Any:
        func = yield
        if not self.active:
            return func
        if self._full_iteration:
            self.fi_wrapper = compat.make_full_iteration_wrapper(func, self.settings.warmup_steps)
        return _ForwardBackward(self, func)

    # -- training -----------------------------------------------------------------------------

    @hookimpl
    def mcgraph_warmup_steps(self, config: Any) -> int | None:
        return self.settings.warmup_steps if self.active else None

    @hookimpl
    def mcgraph_train_start(self, start_step: int, train_iters: int) -> None:
        self.start_step = start_step
        warning = warmup_warning(self.settings, start_step, train_iters)
        if warning:
            logger.warning("%s", warning)

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        self.step = step
        self.timer.start(step)

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        if not self._te:
            return  # full-iteration graphs are captured inside forward_backward_func
        if compat.te_capture_done(self.te_helper):
            raise RuntimeError(f"TE CUDA graphs were already captured before step {step}")
        uses_hooks = compat.uses_forward_pre_hooks(self.model)
        toggle = uses_hooks and compat.forward_pre_hooks_enabled(self.model)
        if toggle:
            call_hook(
                self.pm, "mcgraph_disable_forward_pre_hook", model=self.model, param_sync=False
            )
        try:
            self._capture("training", self.te_helper.create_cudagraphs)
        finally:
            if toggle:
                call_hook(self.pm, "mcgraph_enable_forward_pre_hook", model=self.model)
        if toggle:
            self.te_helper.cuda_graph_set_manual_hooks()
        elif uses_hooks:
            # The host keeps the pre-hooks off for now (Megatron-LM does for its first step);
            # the manual hooks are set when it enables them (mcgraph_enable_forward_pre_hook).
            self.manual_hooks_pending = True

    @hookimpl(wrapper=True)
    def mcgraph_enable_forward_pre_hook(self, model: list[Any]) -> Any:
        result = yield
        if self.manual_hooks_pending:
            self.manual_hooks_pending = False
            self.te_helper.cuda_graph_set_manual_hooks()
            logger.info("forward pre-hooks enabled: set the CUDA graph manual hooks")
        return result

    @hookimpl
    def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.timer.stop(step)
        if (
            self.settings.fallback_on_slowdown
            and self._full_iteration
            and self.phase is Phase.CAPTURED
            and not self.fallback_decided
        ):
            self._maybe_fall_back(step)

    def _capture(self, stage: str, capture: Any) -> Any:
        """Run ``capture`` bracketed by the capture hooks, timing and memory snapshots."""
        import torch

        step = self.step
        impl, scope = self.settings.impl, list(self.settings.scope)
        call_hook(self.pm, "mcgraph_before_capture", step=step, impl=impl, scope=scope)
        torch.cuda.synchronize()
        before = MemorySnapshot.take()
        start = time.perf_counter()
        result = capture()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if not self.captures:  # the report's memory numbers are the first capture's
            self.memory_before, self.memory_after = before, MemorySnapshot.take()
        self.captures.append({"stage": stage, "step": step, "seconds": seconds})
        if self._te:
            self.graph_count = compat.te_graph_count(self.te_helper)
        else:
            self.graph_count += 1
        self.graphs_held_max = max(self.graphs_held_max, self.graph_count)
        if self.phase is Phase.BUILT:
            self._advance((Phase.BUILT,), Phase.CAPTURED)
        logger.info(
            "captured %s CUDA graph(s) for %s at step %s in %.3f s",
            ",".join(scope),
            stage,
            step,
            seconds,
        )
        call_hook(
            self.pm,
            "mcgraph_after_capture",
            step=step,
            impl=impl,
            scope=scope,
            seconds=seconds,
            graph_count=self.graph_count,
        )
        return result

    def _forward_backward(self, eager: Any, kwargs: dict[str, Any]) -> Any:
        stage = "validation" if kwargs.get("forward_only") else "training"
        if self._full_iteration and self.phase is not Phase.FALLEN_BACK:
            capturing = (
                not compat.full_iteration_captured(stage)
                and compat.full_iteration_calls(stage) == self.settings.warmup_steps
            )
            kwargs["data_iterator"] = self.guard.check_call(
                stage, self.step, kwargs, record=capturing
            )
            if not capturing:
                return self.fi_wrapper(**kwargs)
            result = self._capture(stage, lambda: self.fi_wrapper(**kwargs))
            self.guard.commit(stage)
            return result
        if self._te and stage == "training" and self.phase is Phase.CAPTURED:
            record = not self.guard.is_armed(stage)
            if record:
                self._check_te_call(kwargs)
            kwargs["data_iterator"] = self.guard.check_call(stage, self.step, kwargs, record=record)
            result = eager(**kwargs)
            if record:
                self.guard.commit(stage)
            return result
        return eager(**kwargs)

    def _check_te_call(self, kwargs: dict[str, Any]) -> None:
        for name, captured in (
            ("seq_length", self.seq_length),
            ("micro_batch_size", self.micro_batch_size),
        ):
            if kwargs.get(name) != captured:
                raise StaticShapeError(
                    f"training forward_backward_func called with {name}={kwargs.get(name)!r} "
                    f"but the TE CUDA graphs were captured for {name}={captured!r}. Fix: {FIX}"
                )

    def _samples(self) -> tuple[list[int], list[int], dict[int, float]]:
        durations = self.timer.durations_ms()
        steps = sorted(durations)
        capture_step = self._training_capture_step()
        first = self.start_step
        if capture_step is None:
            return [s for s in steps if s != first], [], durations
        last_replay = self.fallback_step if self.fallback_step is not None else float("inf")
        eager = [s for s in steps if s < capture_step and s != first]
        replay = [s for s in steps if capture_step < s <= last_replay]
        return eager, replay, durations

    def _training_capture_step(self) -> int | None:
        for capture in self.captures:
            if capture["stage"] == "training":
                return capture["step"]
        return None

    def _maybe_fall_back(self, step: int) -> None:
        # Counted from the step numbers: reading the timings synchronises the device, which
        # must happen once, at the decision, not on every replay step before it.
        capture_step = self._training_capture_step()
        if capture_step is None or step - capture_step < FALLBACK_REPLAY_STEPS:
            return
        self.fallback_decided = True
        eager, replay, durations = self._samples()
        result, _, _, text = verdict([durations[s] for s in eager], [durations[s] for s in replay])
        if result != "slower":
            logger.info("fallback policy: keeping the full-iteration graph (%s)", text)
            return
        logger.warning(
            "fallback policy: %s; freeing the full-iteration graph at step %d and continuing "
            "with the plain forward_backward_func",
            text,
            step,
        )
        self.graphs_freed += compat.free_full_iteration_graphs(self.fi_wrapper)
        gc.collect()
        self.guard.disarm()
        self.graph_count = 0
        self.fallback_step = step
        self._advance((Phase.CAPTURED,), Phase.FALLEN_BACK)

    # -- shutdown -----------------------------------------------------------------------------

    # tryfirst: outermost among the wrappers, so another plugin's wrapper that raises before
    # its yield cannot skip this cleanup.
    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        # The report goes out before the other plugins' shutdown implementations run (they
        # may close the sinks it is written to); graphs are freed after them, whatever
        # happened before.
        report_error: Exception | None = None
        try:
            self._emit_report(str(reason))
        except Exception as exc:
            report_error = exc
        try:
            result = yield
        except BaseException:
            if report_error is not None:
                logger.error("the run report also failed", exc_info=report_error)
            raise
        finally:
            self._release_all(str(reason))
        if report_error is not None:
            raise report_error
        return result

    def _release(self) -> int:
        """Free every graph this run holds; safe to call in any phase."""
        freed = 0
        if self.te_helper is not None:
            if compat.end_stuck_te_capture():
                logger.warning("the TE capture failed midway; cleared megatron-core's capture flag")
            freed += compat.free_te_graphs(self.te_helper)
            self.te_helper = None
        if self.fi_wrapper is not None:
            freed += compat.free_full_iteration_graphs(self.fi_wrapper)
            self.fi_wrapper = None
        self.guard.disarm()
        self.manual_hooks_pending = False
        gc.collect()
        return freed

    def _release_all(self, reason: str) -> None:
        if self.phase is Phase.SHUT_DOWN:
            return
        self.phase = Phase.SHUT_DOWN
        self.graphs_freed += self._release()
        # The run is over: nothing here may keep the model or optimizer alive.
        self.model = None
        if self.cuda:
            import torch

            if self.captures:
                compat.clear_cublas_workspaces()
            torch.cuda.empty_cache()
            self.allocated_after_free_mib = torch.cuda.memory_allocated() / MIB
        if not self.cuda:
            logger.info("shutdown (%s): no CUDA graph to free on the CPU", reason)
            return
        before = self.memory_before.allocated_mib if self.memory_before else None
        logger.info(
            "shutdown (%s): %d CUDA graph(s) freed; allocated memory now %s MiB (before "
            "capture: %s MiB)",
            reason,
            self.graphs_freed,
            _fmt_mib(self.allocated_after_free_mib),
            _fmt_mib(before),
        )

    def _emit_report(self, reason: str) -> None:
        peak_at_end = MemorySnapshot.take().peak_allocated_mib if self.captures else None
        self.report = self._build_report(reason, peak_at_end)
        logger.info("CUDA graph report:\n%s", self.report.format_table())
        if self.report.verdict in ("slower", "no_gain"):
            logger.warning("CUDA graphs did not pay off: %s", self.report.verdict_text)
        if self.settings.report_json:
            path = self.report.write_json(self.settings.report_json)
            logger.info("CUDA graph report written to %s", path)
        call_hook(self.pm, "mcgraph_report", report=self.report)

    def _build_report(self, reason: str, peak_at_end: float | None) -> RunReport:
        eager, replay, durations = self._samples()
        if self.captures:
            result, speedup, noise, text = verdict(
                [durations[s] for s in eager], [durations[s] for s in replay]
            )
            no_graph_reason = None
        else:
            result, speedup, noise = "unknown", None, 0.0
            no_graph_reason = self.no_graph_reason or (
                f"the run ended (after step {self.step}) before the capture step "
                f"(start_step + {self.settings.warmup_steps})"
            )
            text = f"no graph captured: {no_graph_reason}"
        training_capture = next((c for c in self.captures if c["stage"] == "training"), None)
        return RunReport(
            impl=self.settings.impl,
            scope=list(self.settings.scope),
            graphs_captured=bool(self.captures),
            no_graph_reason=no_graph_reason,
            warmup_steps=self.settings.warmup_steps if self.active else None,
            start_step=self.start_step,
            capture_step=training_capture["step"] if training_capture else None,
            capture_seconds=sum(c["seconds"] for c in self.captures) if self.captures else None,
            graph_count=self.graphs_held_max,
            steps_timed=len(durations),
            eager_steps=eager,
            eager_step_ms=median_or_none([durations[s] for s in eager]),
            replay_steps=replay,
            replay_step_ms=median_or_none([durations[s] for s in replay]),
            speedup=speedup,
            verdict=result,
            verdict_text=text,
            noise=noise,
            memory_before_capture=self.memory_before,
            memory_after_capture=self.memory_after,
            peak_allocated_at_end_mib=peak_at_end,
            fallback_step=self.fallback_step,
            graphs_held=self.graph_count,
            shutdown_reason=reason,
            device=_device_name(self.cuda),
            versions=compat.versions(),
        )


def _fmt_mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


class _ForwardBackward:
    """The forward/backward callable the host gets: keyword-only, like megatron-core's."""

    def __init__(self, plugin: CudaGraphPlugin, eager: Any) -> None:
        self._plugin = plugin
        self._eager = eager

    def __call__(self, **kwargs: Any) -> Any:
        return self._plugin._forward_backward(self._eager, kwargs)
