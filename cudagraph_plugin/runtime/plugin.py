"""The CUDA graph plugin: the hook implementations of one run, as a small state machine.

One :class:`CudaGraphPlugin` is created and registered per run by ``entry`` (from the
``mcgraph_configure`` hook), so nothing leaks from one run into the next. It is the phase
machine (:class:`~cudagraph_plugin.runtime.state.RunState`) and each hook implementation
is a few lines that hand the work to a small object:

* ``build``        — checks and set-up once the model exists (TE helper, optimizer graph);
* ``interceptor``  — the forward/backward (and ``optimizer.step``) the host calls;
* ``te_capture``   — the TE capture at the post-warmup step, with the DDP pre-hooks;
* ``capture``      — the capture bracket (hooks, timing, memory) and its records;
* ``guard``        — the static-shape guard;
* ``measurement``  — step timing, eager vs replay;
* ``steps``        — the per-step hooks, listened to only while a step needs them;
* ``fallback``     — the opt-in fallback when replay is slower;
* ``report``       — the run report; ``release`` — freeing everything exactly once.

Where the capture step is decided: TE scopes in :meth:`CudaGraphPlugin.mcgraph_post_warmup_step`
(``TrainingRun`` fires it when ``step - start_step == warmup_steps``); full iteration inside
megatron-core's ``FullCudaGraphWrapper`` on its ``warmup_steps``-th call per stage, seen
coming by :meth:`ForwardBackwardInterceptor.call`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.config.advice import warmup_warning
from cudagraph_plugin.config.check import check_config
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.config.settings import Settings
from cudagraph_plugin.runtime import agreement, build, job_watch, ranklog
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.fallback import Fallback
from cudagraph_plugin.runtime.guard import ShapeGuard
from cudagraph_plugin.runtime.interceptor import ForwardBackwardInterceptor, OptimizerStep
from cudagraph_plugin.runtime.invalidation import Invalidation
from cudagraph_plugin.runtime.measurement import Measurement
from cudagraph_plugin.runtime.release import ReleaseStep
from cudagraph_plugin.runtime.release_plan import ReleasePlan
from cudagraph_plugin.runtime.report import RunReport
from cudagraph_plugin.runtime.reporter import Reporter
from cudagraph_plugin.runtime.shutdown import Shutdown
from cudagraph_plugin.runtime.state import Phase, RunState
from cudagraph_plugin.runtime.steps import StepListener
from cudagraph_plugin.runtime.te_capture import TECapture
from cudagraph_plugin.runtime.wiring import Wiring
from hookspecs import SettledKwargs, StepProgress, hookimpl

logger = logging.getLogger("cudagraph_plugin")


class CudaGraphPlugin:
    """Hook implementations for one run; create it with :meth:`configure`."""

    def __init__(self, settings: Settings, pluginmanager: Any, *, cuda: bool) -> None:
        self.settings = settings
        self.state = RunState(settings, pluginmanager, cuda)
        state = self.state
        self.build = compat.DDPBuildContext(settings.full_iteration) if state.active else None
        self.capture = Captures(state)
        self.guard = ShapeGuard()
        self.te_capture = TECapture(state, self.capture)
        self.wiring = Wiring(state, self.capture)
        self.interceptor = ForwardBackwardInterceptor(
            state, self.capture, self.guard, self.te_capture, self.wiring
        )
        self.measurement = Measurement(state, self.capture)
        self.fallback = Fallback(state, self.capture, self.measurement, self.guard)
        self.invalidation = Invalidation(state, self.capture, self.guard)
        self.steps = StepListener(state, self.measurement, self.wiring, self.fallback)
        self.reporter = Reporter(state, self.measurement, self.capture, self.invalidation.events)
        self.release = ReleasePlan(state, self.capture)
        self.release_extra = _own_release_steps(self)
        self.shutdown = Shutdown(state, self.reporter, self._release_all)
        self.log_filter: ranklog.RankFilter | None = None
        self.job = job_watch.JobWatch(state)

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
        log_filter = ranklog.install(every_rank=result.settings.log_all_ranks)
        try:
            result.apply(config)
            _say_configured(result, cuda)
            plugin = cls(_paths_pinned(result.settings), pluginmanager, cuda=cuda)
        except BaseException:
            ranklog.remove(log_filter)  # (no run follows: no shutdown would take it off)
            raise
        plugin.log_filter = log_filter
        return plugin

    # -- what tests, the probe and the GPU suite read --------------------------------------

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def report(self) -> RunReport | None:
        return self.reporter.report

    @property
    def graphs_freed(self) -> int:
        return (
            self.release.graphs_freed
            + self.fallback.graphs_freed
            + self.invalidation.graphs_freed
            + self.te_capture.graphs_freed
        )

    @property
    def allocated_after_free_mib(self) -> float | None:
        return self.release.allocated_after_free_mib

    # -- configuration and build ----------------------------------------------------------

    @hookimpl
    def mcgraph_model_config_kwargs(self, config: Any) -> dict[str, Any]:
        return _model_config_answer(self.settings, self.state.active)

    @hookimpl
    def mcgraph_rng_options(self, config: Any) -> dict[str, Any] | None:
        if not self.state.active:
            return None
        return {"te_rng_tracker": True, "use_cudagraphable_rng": True, "force_reset_rng": True}

    @hookimpl
    def mcgraph_rng_initialized(self, config: Any) -> None:
        self.job.watch()
        agreement.check_once(self.state)
        if self.state.active:
            build.check_rng_tracker()

    @hookimpl
    def mcgraph_model_build_context(self, config: Any) -> Any:
        return None if self.build is None else self.build.enter()

    @hookimpl
    def mcgraph_model_built(
        self,
        model: list[Any],
        optimizer: Any,
        model_config: Any,
        seq_length: int,
        micro_batch_size: int,
    ) -> None:
        state = self.state
        state.advance((Phase.CONFIGURED,), Phase.BUILT)
        self.job.watch()
        agreement.check_once(self.state)
        state.model, state.model_config = model, model_config
        state.seq_length, state.micro_batch_size = seq_length, micro_batch_size
        if self.interceptor.wrapped:  # the host asked for its function first
            self.interceptor.make_full_graphs()
        if state.active:
            assert self.build is not None
            build.build_model_graphs(state, self.build, optimizer)
            if state.buckets is not None:
                state.buckets.on_invalidate.append(self.invalidation.bucket_invalidated)
                state.buckets.on_invalidate.append(self.wiring.buckets_invalidated)
            if state.te is not None:
                self.wiring.te_layers_found(state.te.layer_count(), state.te.skips_empty_stage())
        elif self.settings.enabled:
            build.rehearse_model_checks(state)
        if self.settings.device_grad_norm:
            build.install_device_grad_norm(state)
        if state.optimizer_graph:
            build.build_optimizer_graph(
                state,
                optimizer,
                lambda graphs: OptimizerStep(self.capture, graphs, self.invalidation.invalidate),
            )

    @hookimpl(wrapper=True)
    def mcgraph_forward_backward_func(self, forward_backward_func: Any) -> Any:
        func = yield
        return self.interceptor.wrap(func) if self.state.active else func

    # -- training -------------------------------------------------------------------------

    @hookimpl
    def mcgraph_train_start(
        self, start_step: int, train_iters: int, progress: StepProgress | None
    ) -> None:
        self.state.start_step, self.state.train_iters = start_step, train_iters
        self.state.progress = progress
        self.steps.start()
        self.job.watch()
        agreement.check_steps_agree(start_step, train_iters)
        self.wiring.training_starts()
        warning = warmup_warning(self.settings, start_step, train_iters)
        if warning:
            logger.warning("%s", warning, extra=JOB_WIDE)

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        self.state.post_warmup_fired = True
        own = self.settings.warmup_steps
        if step - start_step != own and self.state.active:  # (graphs off: no capture step)
            raise ValueError(
                f"the run's post-warmup step is step {step}, {step - start_step} step(s) after "
                f"its start, but the CUDA graph plugin answered mcgraph_warmup_steps with "
                f"{own}: another plugin changed the answer (a wrapper of the hook, or an "
                "implementation called before the plugin's), so the run's post-warmup step is "
                "not the capture step. Fix: set cuda_graph_warmup_steps "
                "(--cuda-graph-warmup-steps) to the warm-up you want; a wrapper may read the "
                "answer (`answer = yield; return answer`), not change it"
            )
        if self.state.te_mode:  # full-iteration graphs are captured inside forward_backward
            self.te_capture.capture(step)

    @hookimpl
    def mcgraph_step_padded(
        self, step: int, seq_length: int, real_tokens: int, padded_tokens: int
    ) -> None:
        if self.state.buckets is not None:
            self.state.buckets.record_padding(seq_length, real_tokens, padded_tokens, step=step)

    @hookimpl
    def mcgraph_invalidate_graphs(self, reason: str) -> None:
        if self.state.active or self.state.optimizer_graph:
            self.invalidation.invalidate(reason)

    @hookimpl(wrapper=True)
    def mcgraph_enable_forward_pre_hook(self, model: list[Any]) -> Any:
        result = yield
        self.te_capture.pre_hooks_enabled("forward pre-hooks enabled")
        return result

    # -- shutdown -------------------------------------------------------------------------

    # A plain wrapper, the documented middle layer (hookspecs.spec.mcgraph_shutdown): other
    # plugins' tryfirst wrappers are always outside it, their trylast wrappers and plain
    # implementations always inside, whatever the registration order.
    @hookimpl(wrapper=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        return (yield from self.shutdown.wrap(reason, exception))

    def guard_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        """The body of :class:`OutermostHooks`' shutdown wrapper (a generator). A shutdown
        fired again (by a plugin; during the first one, or after it) marks nothing and waits
        for nobody: the first one does both, in their places."""
        if self.shutdown.entered:
            return (yield from self.shutdown.guard(reason, exception))
        mark_error = self._end_job(self.shutdown.reason_of(reason), exception)
        try:
            result = yield from self.shutdown.guard(reason, exception)
        finally:
            self.job.wait_for_peers()
        if mark_error is not None:
            raise mark_error
        self.job.raise_told_at_end()
        return result

    def _end_job(self, reason: Any, exception: BaseException | None) -> BaseException | None:
        """``job.end``, tried a second time if interrupted (the other ranks learn of this
        rank's failure only from its mark); what interrupted it first, or None."""
        first: BaseException | None = None
        for attempt in ("", " again"):
            try:
                self.job.end(reason, exception)
                break
            except BaseException as exc:
                first = first or exc
                logger.error(
                    "marking the end of this rank's run for the other ranks failed%s (%r); "
                    "the shutdown goes on",
                    attempt,
                    exc,
                )
        return first

    def _release_all(self, reason: str, *, quiet: bool, exception: BaseException | None) -> None:
        try:
            self.release.release_all(reason, self.release_extra, quiet=quiet, exception=exception)
        finally:
            self.forget_log_filter()

    def forget_log_filter(self) -> None:
        """Take the run's rank filter off the plugin's logger (at shutdown, or when the
        plugin was refused before any run)."""
        if self.log_filter is not None:
            ranklog.remove(self.log_filter)
            self.log_filter = None

    def _drop_references(self) -> None:
        # The run is over: nothing here may keep the model or optimizer alive.
        self.state.model = None
        self.state.model_config = None
        self.interceptor.forget()


class OutermostHooks:
    """The hook implementations of :class:`CudaGraphPlugin` that must come first whatever
    registers later, registered beside it. A ``tryfirst`` implementation comes first only
    if registered last: ``mcgraph_outermost`` makes the plugin manager
    (``hookspecs.manager``) register this object again after every other registration (a
    third party's ``tryfirst`` one registered later included).

    * The shutdown guard, the safety net of the plugin's shutdown wrapper: a wrapper between
      the two that raises before its yield (which the hook contract forbids) makes pluggy
      skip the plain one; the report and the cleanup then happen here. Outermost for the
      job, too: a failing rank marks its failure first of all (every other rank then ends
      within seconds), and waits for them last. Whatever interrupts the mark (a Ctrl-C while
      the store is slow) waits until the graphs are freed, then goes on: raising before the
      yield would skip every shutdown.
    * The warm-up answer, in every run mode (graphs off, no CUDA device too), so plugins see
      the post-warmup step wherever they run; first, so the step TE graphs are captured at
      is the configured one whatever else answers (a wrapper still sees it).
    """

    mcgraph_outermost = True

    def __init__(self, plugin: CudaGraphPlugin) -> None:
        self.plugin = plugin

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        return (yield from self.plugin.guard_shutdown(reason, exception))

    @hookimpl(tryfirst=True)
    def mcgraph_warmup_steps(self, config: Any) -> int:
        return self.plugin.settings.warmup_steps


def _model_config_answer(settings: Settings, active: bool) -> SettledKwargs:
    """The ``TransformerConfig`` fields of the settings (graphs off where they cannot act),
    settled: they replace what a host's ``base`` holds for them (its whole ``cfg.model``)."""
    impl = settings.impl if active else "none"
    why = "the run's CUDA graph settings, spelled for the installed megatron-core"
    if settings.enabled and not active:
        why = "CUDA graphs off: this run cannot capture (no CUDA device)"
    kwargs = compat.model_config_kwargs(impl, settings.scope, settings.warmup_steps)
    return SettledKwargs(kwargs, why=why)


def _say_configured(result: Any, cuda: bool) -> None:
    """The configuration's advice and notes, and that graphs need a device."""
    settings = result.settings
    for note in result.advice:
        logger.warning("advice: %s", note, extra=JOB_WIDE)
    for note in result.notes:
        logger.info("note: %s", note, extra=JOB_WIDE)
    if settings.enabled and not cuda:
        logger.warning(
            "CUDA graphs need a CUDA device and none is available: this run is eager and "
            "captures nothing (cuda_graph_impl=%s, scope=%s%s was validated; of the loop's "
            "wiring, the device's set-up and how the loop drives the graphs are checked on a "
            "CUDA device only)",
            settings.impl,
            ",".join(settings.scope),
            f", buckets={','.join(map(str, settings.buckets))}" if settings.buckets else "",
            extra=JOB_WIDE,
        )


def _paths_pinned(settings: Settings) -> Settings:
    """The settings with the report path made absolute: it was checked against the working
    directory of the start, and the report goes there even if the host changes directory
    during the run (it is written at shutdown)."""
    path = settings.report_json
    if not path or os.path.isabs(path):
        return settings
    return dataclasses.replace(settings, report_json=os.path.abspath(path))


def _own_release_steps(plugin: CudaGraphPlugin) -> list[ReleaseStep]:
    """What the plugin's own objects hold, released at shutdown after the mechanisms'.
    (Made with the plugin, not at shutdown: the less runs before the release, the less a
    second Ctrl-C can land before it.)"""
    return [
        ReleaseStep(
            "a refused host FullCudaGraphWrapper's state",
            plugin.interceptor.free_own_wrapper_state,
            frees_graphs=True,
        ),
        ReleaseStep("static-shape guard", plugin.guard.disarm),
        ReleaseStep("pending manual hooks", plugin.te_capture.forget_manual_hooks),
        ReleaseStep("model and optimizer references", plugin._drop_references),
        ReleaseStep(
            "megatron-core's gradient-norm kernels",
            lambda: build.release_device_grad_norm(plugin.state),
        ),
    ]
