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

The mechanisms themselves live in ``mechanisms`` (one object per run, behind one
interface). Graphs are freed in :meth:`CudaGraphPlugin.mcgraph_shutdown`, a
``wrapper=True`` implementation whose ``finally`` runs on every exit path, even when
another plugin's shutdown implementation raises; each resource is released in its own
guarded step (``cleanup``). When a multi-rank run ends by an exception or a signal, a peer
may be gone: shutdown then never waits on the device (no synchronisation, no cache
flush), so the failing rank reaches the host's teardown and exits.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.cleanup import ReleaseStep, release_each, settle
from cudagraph_plugin.config_check import check_config
from cudagraph_plugin.guard import FIX, ShapeGuard, StaticShapeError
from cudagraph_plugin.mechanisms import FullIterationGraphs, OptimizerGraphs, TEGraphs
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
from hookspecs import ShutdownReason, call_hook, hookimpl

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


_CAPTURABLE_PROBLEM = (
    "the optimizer graph needs the optimizer megatron-core builds for it (a capturable Adam), "
    "but the optimizer was built with OptimizerConfig.optimizer_cuda_graph=False"
)
_CAPTURABLE_FIX = (
    "build the optimizer with OptimizerConfig(..., optimizer_cuda_graph=True) (Megatron-LM: "
    "--optimizer-cuda-graph; Megatron-Bridge: optimizer.optimizer_cuda_graph=True)"
)


_GRAD_NORM_PROBLEM = (
    "megatron-core computes the gradient norm inside optimizer.step() with its local "
    "fallback (neither Transformer Engine's nor Apex's multi-tensor kernels could be "
    "imported), which reads the norm on the host: the optimizer step cannot be captured "
    '(it fails with "operation not permitted when stream is capturing")'
)
_GRAD_NORM_FIX = (
    "install Apex (amp_C) or a Transformer Engine whose transformer_engine.pytorch.optimizers "
    'provides the multi-tensor kernels megatron-core imports (megatron-core warns "Falling '
    'back to local implementations of multi_tensor_applier" when it has none), or turn the '
    "optimizer graph off"
)


_CALC_FIX = (
    "megatron-core's TECudaGraphHelper reads the global micro-batch calculator while it "
    "captures, and the host has not set it up",
    "call megatron.core.num_microbatches_calculator.init_num_microbatches_calculator(rank, "
    "None, global_batch_size, micro_batch_size, data_parallel_size) before run.model_built() "
    "(Megatron-LM's loop does this at start-up)",
)


_BUILD_PROBLEM = (
    "the DDP wrapper of model chunk(s) {chunks} was built outside run.model_build_context(); "
    "its gradient-accumulation nodes then belong to the default stream and the capture "
    'fails with "operation would make the legacy stream depend on a capturing blocking '
    'stream"'
)
_BUILD_FIX = (
    "construct DistributedDataParallel inside `with run.model_build_context():` (it enters "
    "the stream the capture needs, as Megatron-LM's loop does)"
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
        self.active = settings.enabled and cuda  # model graphs: full iteration or TE layers
        self.optimizer_graph = settings.optimizer_cuda_graph and cuda
        if not (settings.enabled or settings.optimizer_cuda_graph):
            self.no_graph_reason: str | None = "CUDA graphs are off (cuda_graph_impl=none)"
        elif not cuda:
            self.no_graph_reason = "no CUDA device (CUDA graphs need one; the run was eager)"
        else:
            self.no_graph_reason = None
        self.phase = Phase.CONFIGURED
        self.model: list[Any] | None = None
        self.seq_length: int | None = None
        self.micro_batch_size: int | None = None
        self.model_config: Any = None
        self.build = compat.DDPBuildContext(settings.full_iteration) if self.active else None
        self.te: TEGraphs | None = None
        self.full: FullIterationGraphs | None = None
        self.optim: OptimizerGraphs | None = None
        self._wrapped: dict[int, tuple[Any, _ForwardBackward]] = {}
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
        self.cleanup_failures: list[tuple[str, BaseException]] = []
        self._shutdown_entered = False
        self._eager_after_shutdown_logged = False

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
        if self.build is None:
            return None
        return self.build.enter()

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
        self.model_config = model_config
        if self.active:
            self._build_model_graphs(model, optimizer, model_config, seq_length, micro_batch_size)
        if self.optimizer_graph:
            self._build_optimizer_graph(optimizer, model_config)

    def _build_model_graphs(
        self, model: list[Any], optimizer: Any, model_config: Any, seq_length: int, mbs: int
    ) -> None:
        self._check_built_config(model_config, seq_length, mbs)
        if self._te and not compat.num_microbatches_calculator_ready():
            raise CudaGraphConfigError(
                [Violation(("num_microbatches_calculator",), "not initialised", *_CALC_FIX)]
            )
        assert self.build is not None  # active
        missing = self.build.missing(model)
        if missing:
            chunks = ", ".join(map(str, missing))
            raise CudaGraphConfigError(
                [
                    Violation(
                        ("run.model_build_context()",),
                        "entered" if self.build.entered else "never entered",
                        _BUILD_PROBLEM.format(chunks=chunks),
                        _BUILD_FIX,
                    )
                ]
            )
        if self._te:
            self.te = TEGraphs(model, model_config, seq_length, mbs, [optimizer])
            logger.info(
                "TE CUDA graphs: %d graphable layer(s) for scope %s; capture at step "
                "start_step + %d",
                self.te.layer_count(),
                ",".join(self.settings.scope),
                self.settings.warmup_steps,
            )

    def _build_optimizer_graph(self, optimizer: Any, model_config: Any) -> None:
        violations = []
        if compat.grad_norm_on_device() is False:
            violations.append(
                Violation(
                    ("megatron.core.optimizer.clip_grads.l2_norm_impl",),
                    "local_multi_tensor_l2_norm",
                    _GRAD_NORM_PROBLEM,
                    _GRAD_NORM_FIX,
                )
            )
        if compat.optimizer_is_capturable(optimizer) is False:
            violations.append(
                Violation(
                    ("OptimizerConfig.optimizer_cuda_graph",),
                    "False",
                    _CAPTURABLE_PROBLEM,
                    _CAPTURABLE_FIX,
                )
            )
        if violations:
            raise CudaGraphConfigError(violations)
        self.optim = OptimizerGraphs(
            optimizer, self.settings.warmup_steps, compat.single_mempool(model_config)
        )
        self.optim.install(_OptimizerStep(self, self.optim))
        logger.info(
            "optimizer CUDA graph: optimizer.step is captured at its call number %d "
            "(step start_step + %d)",
            self.settings.warmup_steps,
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
        # Idempotent: asking again for the same function returns the same callable (a new
        # wrapper would reset megatron-core's class state and free live graphs).
        known = self._wrapped.get(id(func))
        if known is not None:
            return known[1]
        if self._full_iteration and self.full is None:
            self.full = FullIterationGraphs(
                self.settings.warmup_steps,
                compat.single_mempool(self.model_config),
            )
        wrapped = _ForwardBackward(self, func)
        self._wrapped[id(func)] = (func, wrapped)
        return wrapped

    # -- training -----------------------------------------------------------------------------

    # Answered in every run mode (graphs off, no CUDA device too), so plugins see the
    # post-warmup step wherever they run; tryfirst, so the step TE graphs are captured at
    # is the configured one whatever else answers.
    @hookimpl(tryfirst=True)
    def mcgraph_warmup_steps(self, config: Any) -> int:
        return self.settings.warmup_steps

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
        te = self.te
        assert te is not None  # built in mcgraph_model_built
        if te.capture_done():
            raise RuntimeError(f"TE CUDA graphs were already captured before step {step}")
        uses_hooks = compat.uses_forward_pre_hooks(self.model)
        toggle = uses_hooks and compat.forward_pre_hooks_enabled(self.model)
        if toggle:
            call_hook(
                self.pm, "mcgraph_disable_forward_pre_hook", model=self.model, param_sync=False
            )
        try:
            self._capture("training", te.create)
        finally:
            if toggle:
                call_hook(self.pm, "mcgraph_enable_forward_pre_hook", model=self.model)
        if toggle:
            te.set_manual_hooks()
        elif uses_hooks:
            # The host keeps the pre-hooks off for now (Megatron-LM does for its first step);
            # the manual hooks are set when it enables them (mcgraph_enable_forward_pre_hook).
            self.manual_hooks_pending = True

    @hookimpl(wrapper=True)
    def mcgraph_enable_forward_pre_hook(self, model: list[Any]) -> Any:
        result = yield
        if self.manual_hooks_pending:
            self._set_pending_manual_hooks("forward pre-hooks enabled")
        return result

    def _set_pending_manual_hooks(self, why: str) -> None:
        assert self.te is not None
        self.manual_hooks_pending = False
        self.te.set_manual_hooks()
        logger.info("%s: set the CUDA graph manual hooks", why)

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
        impl = self.settings.impl
        scope = ["optimizer"] if stage == "optimizer" else list(self.settings.scope)
        call_hook(self.pm, "mcgraph_before_capture", step=step, impl=impl, scope=scope)
        torch.cuda.synchronize()
        before = MemorySnapshot.take()
        start = time.perf_counter()
        result = capture()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # The report's memory numbers span the captures of the first capture step (a
        # full-iteration or TE capture and the optimizer's, in the same step).
        if not self.captures:
            self.memory_before = before
        if not self.captures or self.captures[0]["step"] == step:
            self.memory_after = MemorySnapshot.take()
        self.captures.append({"stage": stage, "step": step, "seconds": seconds})
        self.graph_count = self._graphs_held()
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
        if self.phase is Phase.SHUT_DOWN:
            # Graphs are gone (e.g. Megatron-LM-style evaluation after training): eager.
            if not self._eager_after_shutdown_logged:
                self._eager_after_shutdown_logged = True
                logger.info("forward_backward_func called after shutdown: running eagerly")
            return eager(**kwargs)
        stage = "validation" if kwargs.get("forward_only") else "training"
        if self.full is not None and self.phase is not Phase.FALLEN_BACK:
            full = self.full
            wrapper = full.wrapper_for(eager)
            capturing = full.due(stage)
            kwargs["data_iterator"] = self.guard.check_call(
                stage, self.step, kwargs, record=capturing
            )
            if not capturing:
                return full.call(wrapper, kwargs)
            result = self._capture(stage, lambda: full.call(wrapper, kwargs))
            self.guard.commit(stage)
            return result
        if self.manual_hooks_pending and compat.forward_pre_hooks_enabled(self.model):
            # The host turned the pre-hooks back on without run.enable_forward_pre_hook().
            self._set_pending_manual_hooks("forward pre-hooks found enabled by the host")
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

    def _samples(self, sync: bool = True) -> tuple[list[int], list[int], dict[int, float]]:
        durations = self.timer.durations_ms(sync=sync)
        steps = sorted(durations)
        capture_step = self._training_capture_step()
        first = self.start_step
        if capture_step is None:
            return [s for s in steps if s != first], [], durations
        last_replay = self.fallback_step if self.fallback_step is not None else float("inf")
        eager = [s for s in steps if s < capture_step and s != first]
        replay = [s for s in steps if capture_step < s <= last_replay]
        return eager, replay, durations

    def _graphs_held(self) -> int:
        return sum(m.graph_count() for m in (self.te, self.full, self.optim) if m is not None)

    def _training_capture_step(self) -> int | None:
        """The step whose capture splits eager from replay steps: the training graph's
        (full iteration or TE), else the optimizer graph's."""
        for stage in ("training", "optimizer"):
            for capture in self.captures:
                if capture["stage"] == stage:
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
        # What a rank executes must not differ: every rank falls back if any rank measured
        # a slowdown (a rank replaying while another runs eagerly deadlocks a collective).
        if not compat.any_rank(result == "slower"):
            logger.info("fallback policy: keeping the full-iteration graph (%s)", text)
            return
        logger.warning(
            "fallback policy: %s; freeing the full-iteration graph at step %d and continuing "
            "with the plain forward_backward_func",
            text if result == "slower" else f"another rank measured a slowdown (here: {text})",
            step,
        )
        assert self.full is not None
        self.graphs_freed += release_each(self.full.graph_release_steps()).graphs_freed
        gc.collect()
        self.guard.disarm()
        self.graph_count = 0
        self.fallback_step = step
        self._advance((Phase.CAPTURED,), Phase.FALLEN_BACK)

    # -- shutdown -----------------------------------------------------------------------------

    # A plain wrapper, the documented middle layer (hookspecs.spec.mcgraph_shutdown): other
    # plugins' tryfirst wrappers are always outside it, their trylast wrappers and plain
    # implementations always inside, whatever the registration order.
    @hookimpl(wrapper=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        # The report goes out before the inner shutdown implementations run (they may close
        # the sinks it is written to); graphs are freed after them, whatever happened before.
        self._shutdown_entered = True
        quiet = self._device_may_block(reason)
        report_error: Exception | None = None
        try:
            self._emit_report(str(reason), sync=not quiet)
        except Exception as exc:
            report_error = exc
        try:
            result = yield
        except BaseException:
            if report_error is not None:
                logger.error("the run report also failed", exc_info=report_error)
            raise
        finally:
            self._release_all(str(reason), quiet=quiet, exception=exception)
        if report_error is not None:
            raise report_error
        return result

    # The safety net of the wrapper above: a wrapper between the two that raises before its
    # yield (which the hook contract forbids) makes pluggy skip the plain one; the report
    # and the cleanup then happen here, outside every plain and trylast wrapper.
    @hookimpl(wrapper=True, tryfirst=True, specname="mcgraph_shutdown")
    def shutdown_guard(self, reason: Any, exception: BaseException | None) -> Any:
        try:
            return (yield)
        except BaseException as error:
            if not self._shutdown_entered:
                self._shutdown_skipped(str(reason), exception or error)
            raise

    def _shutdown_skipped(self, reason: str, exception: BaseException) -> None:
        logger.error(
            "a mcgraph_shutdown wrapper raised before its yield and skipped the CUDA graph "
            "plugin's shutdown (%r): reporting and freeing the graphs from its guard",
            exception,
        )
        quiet = self._device_may_block(reason)
        try:
            self._emit_report(reason, sync=not quiet)
        except Exception as report_error:
            logger.error("the run report failed", exc_info=report_error)
        self._release_all(reason, quiet=quiet, exception=exception)

    @staticmethod
    def _device_may_block(reason: Any) -> bool:
        """After an abnormal end of a multi-rank run a peer may never join the collectives
        queued on this device: waiting on it (a synchronisation, a cache flush) can hang."""
        return ShutdownReason(reason).abnormal and compat.distributed_world()[1] > 1

    def _release_steps(self, quiet: bool) -> list[ReleaseStep]:
        steps: list[ReleaseStep] = []
        for mechanism in (self.optim, self.te, self.full):
            if mechanism is not None:
                steps += mechanism.release_steps()
        steps += [
            ReleaseStep("static-shape guard", self.guard.disarm),
            ReleaseStep("pending manual hooks", self._forget_manual_hooks),
            ReleaseStep("model and optimizer references", self._drop_references),
            ReleaseStep("Python garbage", gc.collect),
        ]
        if self.cuda and self.captures:
            steps.append(ReleaseStep("cuBLAS workspaces", compat.clear_cublas_workspaces))
        if self.cuda and not quiet:
            # cudaFree synchronises the device: only when no peer can leave it waiting.
            steps.append(ReleaseStep("cached device memory", _empty_cache))
        return steps

    def _forget_manual_hooks(self) -> None:
        self.manual_hooks_pending = False

    def _drop_references(self) -> None:
        # The run is over: nothing here may keep the model or optimizer alive.
        self.model = None
        self.model_config = None
        self._wrapped.clear()

    def _release_all(self, reason: str, *, quiet: bool, exception: BaseException | None) -> None:
        if self.phase is Phase.SHUT_DOWN:
            return
        self.phase = Phase.SHUT_DOWN
        result = release_each(self._release_steps(quiet))
        self.graphs_freed += result.graphs_freed
        self.cleanup_failures = result.failures
        self.te = None
        self.full = None
        self.optim = None
        if self.cuda:
            self.allocated_after_free_mib = _allocated_mib()
            before = self.memory_before.allocated_mib if self.memory_before else None
            logger.info(
                "shutdown (%s): %d CUDA graph(s) freed; allocated memory now %s MiB (before "
                "capture: %s MiB)%s",
                reason,
                self.graphs_freed,
                _fmt_mib(self.allocated_after_free_mib),
                _fmt_mib(before),
                "; device not synchronised (a peer may be gone)" if quiet else "",
            )
        else:
            logger.info("shutdown (%s): no CUDA graph to free on the CPU", reason)
        settle(result.failures, exception)

    def _emit_report(self, reason: str, *, sync: bool) -> None:
        peak_at_end = MemorySnapshot.take().peak_allocated_mib if self.captures else None
        self.report = self._build_report(reason, peak_at_end, sync=sync)
        rank, world_size = self.report.rank, self.report.world_size
        # One table per job, not one per rank; every rank still gets the hook and its JSON.
        logger.log(
            logging.INFO if rank == 0 else logging.DEBUG,
            "CUDA graph report%s:\n%s",
            f" (rank 0 of {world_size})" if world_size > 1 else "",
            self.report.format_table(),
        )
        if self.report.verdict in ("slower", "no_gain") and rank == 0:
            logger.warning("CUDA graphs did not pay off: %s", self.report.verdict_text)
        if self.settings.report_json:
            path = self.report.write_json(_rank_path(self.settings.report_json, rank))
            logger.info("CUDA graph report written to %s", path)
        call_hook(self.pm, "mcgraph_report", report=self.report)

    def _build_report(self, reason: str, peak_at_end: float | None, *, sync: bool) -> RunReport:
        rank, world_size = compat.distributed_world()
        eager, replay, durations = self._samples(sync=sync)
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
        capture_step = self._training_capture_step()
        return RunReport(
            impl=self.settings.impl,
            scope=list(self.settings.scope),
            graphs_captured=bool(self.captures),
            no_graph_reason=no_graph_reason,
            warmup_steps=self.settings.warmup_steps,
            start_step=self.start_step,
            capture_step=capture_step,
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
            rank=rank,
            world_size=world_size,
        )


def _rank_path(path: str, rank: int) -> str:
    """Rank 0 writes ``path``; rank N writes ``<stem>.rankN<suffix>`` beside it."""
    if rank == 0:
        return path
    from pathlib import Path

    target = Path(path)
    return str(target.with_name(f"{target.stem}.rank{rank}{target.suffix}"))


def _empty_cache() -> None:
    import torch

    torch.cuda.empty_cache()


def _allocated_mib() -> float:
    import torch

    return torch.cuda.memory_allocated() / MIB


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


class _OptimizerStep:
    """What ``optimizer.step`` is while the optimizer graph is installed: megatron-core's
    wrapper, with its capture call bracketed by the capture hooks, timing and memory."""

    def __init__(self, plugin: CudaGraphPlugin, graphs: OptimizerGraphs) -> None:
        self._plugin = plugin
        self._graphs = graphs

    def __call__(self) -> Any:
        if self._graphs.due():
            return self._plugin._capture("optimizer", self._graphs.call)
        return self._graphs.call()
