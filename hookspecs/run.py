"""The host-side training-run helper: fires the hooks in order and guarantees shutdown.

:class:`TrainingRun` is a context manager around one training run. Entering it fires
``mcgraph_configure``; leaving it, by any path, fires ``mcgraph_shutdown`` exactly once with
the reason: normal end (``completed``), ``break``/``sys.exit(0)`` before the last step
(``early_exit``), an exception (``exception``), ``KeyboardInterrupt`` (``interrupted``),
SIGTERM (``signal``) or another rank's failure (``peer_failed``: a :class:`PeerFailed` raised
in this rank by a plugin watching the job). SIGTERM is turned into a :class:`SignalReceived`
exception so the stack unwinds through the host's ``finally`` blocks and the shutdown hook;
afterwards the previous handler's behaviour applies (the default one terminates the process
by the same signal). A failing shutdown hook never hides the exception that ended the run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pluggy

from hookspecs import answers
from hookspecs.answers import merge_kwargs
from hookspecs.errors import traceback_without
from hookspecs.manager import McgraphPluginManager, describe_plugin
from hookspecs.progress import StepProgress
from hookspecs.ranks import RankTagged
from hookspecs.reasons import PeerFailed, ShutdownReason, SignalReceived
from hookspecs.run_args import catchable_signals, count, step_number
from hookspecs.run_signals import RunSignals

logger = RankTagged(__name__)

# Managers that already served a run: configure is historic, so reusing one would replay
# the old run's configuration to late plugins. Weak, so finished runs' managers go away.
_USED_MANAGERS: weakref.WeakSet[pluggy.PluginManager] = weakref.WeakSet()

# The run entered and not yet shut down in this process, if any. Runs may follow each other
# but not overlap: the plugins' graphs, the signal handlers and megatron-core's graph state
# belong to the process, not to one run. (Weak, but a run entered and never left holds its
# signal handlers, which hold it: such a run must be left, `with` does it.)
_ACTIVE_LOCK = threading.Lock()
_active: weakref.ref[TrainingRun] | None = None


def blame(pluginmanager: pluggy.PluginManager, hook_name: str, exc: BaseException) -> None:
    """Add a note naming the plugin whose ``hook_name`` implementation raised ``exc``.

    pluggy propagates a plugin's exception unchanged; the traceback tells which
    implementation raised it. Only the innermost hook call adds the note. The note names
    the plugin as blocking and log lines do (an object a plugin registered is named by that
    plugin), with its distribution where one installed it.
    """
    if not isinstance(exc, Exception) or getattr(exc, "_mcgraph_blamed", False):
        return
    impls = getattr(pluginmanager.hook, hook_name).get_hookimpls()
    culprit = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        for impl in impls:
            if getattr(impl.function, "__code__", None) is not frame.f_code:
                continue
            # Two instances of one plugin class share the code: the frame's self decides.
            owner = getattr(impl.function, "__self__", None)
            if owner is None or frame.f_locals.get("self") is owner:
                culprit = impl.plugin_name
        tb = tb.tb_next
    if culprit is not None:
        who = describe_plugin(pluginmanager, culprit)
        exc.add_note(f"raised by plugin {who} in its {hook_name} implementation")
        exc._mcgraph_blamed = True  # type: ignore[attr-defined]


def call_hook(pluginmanager: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> Any:
    """Call ``hook_name`` with keyword arguments; an exception gets a note naming the
    plugin that raised it (see :func:`blame`)."""
    try:
        return getattr(pluginmanager.hook, hook_name)(**kwargs)
    except BaseException as exc:
        blame(pluginmanager, hook_name, exc)
        raise


def _classify(exc: BaseException | None, completed: bool) -> ShutdownReason:
    if exc is None:
        return ShutdownReason.COMPLETED if completed else ShutdownReason.EARLY_EXIT
    if isinstance(exc, SignalReceived):
        return ShutdownReason.SIGNAL
    if isinstance(exc, PeerFailed):
        return ShutdownReason.PEER_FAILED
    if isinstance(exc, KeyboardInterrupt):
        return ShutdownReason.INTERRUPTED
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return ShutdownReason.COMPLETED if completed else ShutdownReason.EARLY_EXIT
    return ShutdownReason.EXCEPTION


def _claim_the_process(run: TrainingRun) -> None:
    global _active
    with _ACTIVE_LOCK:
        other = _active() if _active is not None else None
        if other is not None and other is not run:
            raise RuntimeError(
                "another TrainingRun is active in this process (entered and not yet left): "
                "runs cannot overlap, since the CUDA graphs, the signal handlers and "
                "megatron-core's graph state belong to the process. Fix: leave the first "
                "run's `with` block before entering the next"
            )
        _active = weakref.ref(run)


def _release_the_process(run: TrainingRun) -> None:
    global _active
    with _ACTIVE_LOCK:
        if _active is not None and _active() is run:
            _active = None


class TrainingRun(RunSignals):
    """Fires the lifecycle hooks of one training run in order.

    Typical host code::

        pm = get_plugin_manager()
        with TrainingRun(pm, config=args, train_iters=args.train_iters) as run:
            model_parallel_cuda_manual_seed(**run.rng_options(base={"seed": 1234}))
            run.rng_initialized()
            config = TransformerConfig(**run.model_config_kwargs(base=my_fields))
            ... build the model; with run.model_build_context(): wrap it in DDP ...
            run.model_built(model=model, optimizer=opt, model_config=config,
                            seq_length=S, micro_batch_size=B)
            fwd_bwd = run.forward_backward_func(get_forward_backward_func())
            for step in range(run.start_step, args.train_iters):
                with run.train_step(step) as metrics:
                    ... fwd_bwd(...); optimizer.step(); metrics["loss"] = loss

    :param pluginmanager: A manager from :func:`hookspecs.get_plugin_manager`.
    :param config: The host's configuration object, passed to the configuration hooks.
    :param train_iters: The step at which training completes (exclusive); ending earlier
        without an exception is an ``early_exit``.
    :param start_step: The first step of this run (greater than 0 when resuming).
    :param handle_signals: Signals turned into a clean shutdown (SIGTERM by default).
        Installed only from the main thread, and never over a handler set to ``SIG_IGN``.
        A signal that arrives while ``mcgraph_configure`` runs (inside ``__enter__``)
        propagates as :class:`SignalReceived` even when a previous Python handler returns,
        since the ``with`` body cannot be skipped.
    :param teardown: The host's teardown of its process groups, called with the run right
        after the shutdown hook freed the graphs, still inside the shutdown: a signal
        arriving there (torchrun's SIGTERM once another rank exited) is held, and ends the
        process after the run said its ending (after the ``with`` block it would end the
        process mid-teardown without a word). Raising, it is handled as a raising shutdown
        hook is; reached by a signal and not returned after the stuck-signal wait
        (``MCGRAPH_STUCK_SIGNAL_S``), it ends with the process (128 + the signal number).

    One plugin manager serves one run: create a new one with ``get_plugin_manager()``.
    """

    def __init__(
        self,
        pluginmanager: pluggy.PluginManager,
        config: Any,
        *,
        train_iters: int,
        start_step: int = 0,
        handle_signals: tuple[int, ...] = (signal.SIGTERM,),
        teardown: Callable[[TrainingRun], Any] | None = None,
    ) -> None:
        train_iters = step_number("TrainingRun", "train_iters", train_iters)
        start_step = step_number("TrainingRun", "start_step", start_step)
        handle_signals = catchable_signals(handle_signals)
        if start_step < 0 or train_iters < start_step:
            raise ValueError(
                f"TrainingRun: need 0 <= start_step <= train_iters, got start_step={start_step}"
                f" and train_iters={train_iters}"
            )
        self.pluginmanager = pluginmanager
        self.hook = pluginmanager.hook
        self.config = config
        self.train_iters = train_iters
        self.start_step = start_step
        if teardown is not None and not callable(teardown):
            raise TypeError(f"TrainingRun: teardown must be callable, got {teardown!r}")
        self.shutdown_reason: ShutdownReason | None = None
        self._teardown = teardown
        self._handle_signals = handle_signals
        self._previous_handlers: dict[int, Any] = {}
        self._pending_signal: int | None = None
        self._pending_sigint = False
        self._sigint_deferrer: Any = None
        self._sigint_previous: Any = signal.default_int_handler
        self._entered = False
        self._shutting_down = False
        self._finished = False
        self._train_started = False
        self._warmup_steps: int | None = None
        self._model_built = False
        self._post_warmup_fired = False
        self._next_step = start_step
        self._running_step: int | None = None  # the step whose train_step is entered
        self.progress = StepProgress()
        # Which per-step hooks have an implementation (start, end), as of the manager's
        # registration count ``_seen`` (McgraphPluginManager.registrations); a manager
        # without that count is asked nothing and every step hook is dispatched.
        self._counted = pluginmanager if isinstance(pluginmanager, McgraphPluginManager) else None
        self._seen = -1
        self._listened = (True, True)

    def _call(self, hook_name: str, **kwargs: Any) -> Any:
        return call_hook(self.pluginmanager, hook_name, **kwargs)

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> TrainingRun:
        if self._entered:
            raise RuntimeError("a TrainingRun can be entered only once; create a new one")
        if self.pluginmanager in _USED_MANAGERS:
            raise RuntimeError(
                "this plugin manager already served a TrainingRun (its configure history and "
                "per-run plugins belong to that run); call get_plugin_manager() for each run"
            )
        _claim_the_process(self)
        _USED_MANAGERS.add(self.pluginmanager)
        self._entered = True
        try:
            self._install_signal_handlers()
            self.hook.mcgraph_configure.call_historic(
                kwargs={"config": self.config, "pluginmanager": self.pluginmanager}
            )
            # Per-run plugins registered during configure are validated like the ones loaded
            # from entry points (an unknown hook name would otherwise be ignored silently).
            self.pluginmanager.check_pending()
        except BaseException as exc:
            try:
                blame(self.pluginmanager, "mcgraph_configure", exc)
            finally:
                # (as leaving the run does, a second Ctrl-C or signal on the way included;
                # the failure propagates whatever a previous handler would do)
                self.__exit__(type(exc), exc, None)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            return self._finish(exc)
        except SignalReceived as late:
            if self.shutdown_reason is not None:
                raise
            # The signal arrived in the instant before shutdown could defer it: the run ends
            # by it, and the shutdown hook still fires (once).
            return self._finish(late) and exc is None
        except KeyboardInterrupt as late:
            if self.shutdown_reason is not None:
                raise
            # The same for a Ctrl-C: the shutdown hook fires (interrupted), then it goes on.
            self._finish(late)
            raise

    @property
    def last_step(self) -> int | None:
        """The last training step that finished, or ``None`` before the first one."""
        return self._next_step - 1 if self._next_step > self.start_step else None

    @property
    def warmup_steps(self) -> int | None:
        """The warm-up length the plugins answered (known once training started)."""
        return self._warmup_steps

    # -- set-up hooks ------------------------------------------------------------------------

    def model_config_kwargs(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """``TransformerConfig`` keyword arguments: ``base`` plus the plugins' contributions."""
        self._check_active()
        results = self._call("mcgraph_model_config_kwargs", config=self.config)
        who = answers.answered_by(self.pluginmanager, "mcgraph_model_config_kwargs")
        return merge_kwargs(results, "TransformerConfig", base, who=who)

    def rng_options(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """``model_parallel_cuda_manual_seed`` keyword arguments: ``base`` plus the plugins'."""
        self._check_active()
        results = self._call("mcgraph_rng_options", config=self.config)
        who = answers.answered_by(self.pluginmanager, "mcgraph_rng_options")
        return merge_kwargs(results, "model_parallel_cuda_manual_seed", base, who=who)

    def rng_initialized(self) -> None:
        """Tell the plugins the RNG has been seeded (they check the active tracker)."""
        self._check_active()
        self._call("mcgraph_rng_initialized", config=self.config)

    @contextlib.contextmanager
    def model_build_context(self) -> Iterator[None]:
        """Enter every context manager the plugins ask for while the host builds DDP."""
        self._check_active()
        with contextlib.ExitStack() as stack:
            managers = self._call("mcgraph_model_build_context", config=self.config)
            who = answers.answered_by(self.pluginmanager, "mcgraph_model_build_context")
            for manager in answers.context_managers(managers, who):
                stack.enter_context(manager)
            yield

    def model_built(
        self,
        *,
        model: list[Any],
        optimizer: Any,
        model_config: Any,
        seq_length: int,
        micro_batch_size: int,
    ) -> None:
        """Tell the plugins the DDP-wrapped model chunks and the optimizer exist (once)."""
        self._check_active()
        if self._model_built:
            raise RuntimeError(
                "run.model_built() was called a second time: call it once, after the model "
                "chunks are DDP-wrapped and the optimizer exists (a model built anew needs a "
                "TrainingRun of its own)"
            )
        self._model_built = True
        self._call(
            "mcgraph_model_built",
            model=model,
            optimizer=optimizer,
            model_config=model_config,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
        )

    def forward_backward_func(self, forward_backward_func: Any) -> Any:
        """The forward/backward callable to use, possibly wrapped by plugins."""
        self._check_active()
        hook = "mcgraph_forward_backward_func"
        function = self._call(hook, forward_backward_func=forward_backward_func)
        who = answers.answered_by(self.pluginmanager, hook)
        return answers.forward_backward_answer(function, forward_backward_func, who)

    # -- the loop -----------------------------------------------------------------------------

    def train_step(self, step: int) -> _TrainStep:
        """One training step: start (and post-warmup) hooks on entry, end hook on success.

        A context manager whose value is a dict the host fills with the step's metrics for
        ``mcgraph_train_step_end``. Steps are integers, run one at a time, consecutive from
        ``start_step``: the capture step depends on it. ``progress.step`` is the step on
        entry, before any hook.

        It runs on every step, so it costs what it must and no more: a small class rather
        than a generator, and a step hook that no registered plugin implements is not
        dispatched at all (with a manager from :func:`hookspecs.get_plugin_manager`, which
        counts registrations; the check is redone only when that count moved, so a plugin
        registered or unregistered mid-run is heard, or left alone, from the next hook on).
        """
        if type(step) is not int:  # the one test an int step pays
            step = step_number("TrainingRun.train_step", "step", step)
        return _TrainStep(self, step)

    def _look_for_step_listeners(self, counted: McgraphPluginManager) -> None:
        """Which of ``mcgraph_train_step_start``/``_end`` have an implementation, as of the
        manager's registration count now (called when it moved)."""
        self._seen = counted.registrations
        self._listened = (
            bool(self.hook.mcgraph_train_step_start.get_hookimpls()),
            bool(self.hook.mcgraph_train_step_end.get_hookimpls()),
        )

    def _step_started(self, step: int) -> dict[str, Any]:
        """:class:`_TrainStep`'s entry (what ``with run.train_step(step)`` runs first)."""
        if not self._entered or self.shutdown_reason is not None:
            self._check_active()  # raises; inline otherwise, as this runs on every step
        if self._running_step is not None:
            raise RuntimeError(
                f"TrainingRun.train_step(step={step}) entered while step {self._running_step} "
                "is still running; leave one train_step before entering the next"
            )
        if step != self._next_step:
            raise ValueError(
                f"TrainingRun.train_step(step={step}): the next step is {self._next_step}; "
                "steps must run consecutively from start_step (resume with a new TrainingRun "
                "and start_step instead)"
            )
        self.progress.step = step
        self._step_began = time.monotonic()  # (the stuck-signal watch's wait: run_signals)
        if not self._train_started:
            self._start_training()
        counted = self._counted
        if counted is not None and counted.registrations != self._seen:
            self._look_for_step_listeners(counted)
        # Called directly rather than through call_hook: this runs on every step.
        if self._listened[0]:
            try:
                self.hook.mcgraph_train_step_start(step=step)
            except BaseException as exc:
                blame(self.pluginmanager, "mcgraph_train_step_start", exc)
                raise
        if (
            self._warmup_steps is not None
            and step - self.start_step == self._warmup_steps
            and not self._post_warmup_fired
        ):
            # Marked before the call: a host retrying a failed capture step must not capture
            # twice (the hook fires exactly once per run).
            self._post_warmup_fired = True
            self._call("mcgraph_post_warmup_step", step=step, start_step=self.start_step)
        # last: a start hook that raised leaves no step running (__exit__ is not called then)
        self._running_step = step
        return {}

    def step_padded(self, *, seq_length: int, real_tokens: int, padded_tokens: int) -> None:
        """Tell the plugins this step's micro-batches were padded to ``seq_length`` (call it
        inside ``train_step``, the step whose training call takes them; once per micro-batch
        is fine, the counts add up). The numbers reach the plugins as ints: a token count
        held as a whole float or in a one-element tensor is taken (``loss_mask.sum()``), a
        fraction, ``None`` or a negative count is refused; ``seq_length`` is an int."""
        self._check_active()
        where = "TrainingRun.step_padded"
        if self._running_step is None:
            raise RuntimeError(
                f"{where} called between steps (the next is step {self._next_step}): it counts "
                "for the step whose training call takes the padded micro-batches, which is not "
                "known here. Fix: call it inside `with run.train_step(step)`, where that step "
                "pads them"
            )
        counts = {
            "seq_length": step_number(where, "seq_length", seq_length),
            "real_tokens": count(where, "real_tokens", real_tokens),
            "padded_tokens": count(where, "padded_tokens", padded_tokens),
        }
        least = {"seq_length": 1, "real_tokens": 0, "padded_tokens": 0}
        bad = {name: n for name, n in counts.items() if n < least[name]}
        if bad:
            raise ValueError(
                f"{where}: "
                + ", ".join(f"{name}={n}" for name, n in bad.items())
                + ": seq_length must be positive, the token counts not negative. Fix: pass "
                "the padded length, the real positions and the padded ones (pad_step's "
                "seq_length, tokens - padding, padding)"
            )
        self._call("mcgraph_step_padded", step=self._running_step, **counts)

    def invalidate_graphs(self, reason: str) -> None:
        """Tell the plugins that what captured graphs point at may have moved (a checkpoint
        load, parameters or optimizer state offloaded and brought back): call it after the
        move and before the next training call, between steps or in a step before its
        forward/backward."""
        self._check_active()
        self._call("mcgraph_invalidate_graphs", reason=reason)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[dict[str, Any]]:
        """An evaluation pass: start hook on entry, end hook (with the metrics) on success."""
        self._check_active()
        step = self._next_step - 1
        self._call("mcgraph_evaluation_start", step=step)
        metrics: dict[str, Any] = {}
        yield metrics
        self._call("mcgraph_evaluation_end", step=step, metrics=metrics)

    def disable_forward_pre_hook(self, model: list[Any], param_sync: bool) -> bool | None:
        """Disable the DDP forward pre-hooks through the perform hook (True once done)."""
        self._check_active()
        return self._call("mcgraph_disable_forward_pre_hook", model=model, param_sync=param_sync)

    def enable_forward_pre_hook(self, model: list[Any]) -> bool | None:
        """Enable the DDP forward pre-hooks through the perform hook (True once done)."""
        self._check_active()
        return self._call("mcgraph_enable_forward_pre_hook", model=model)

    def _start_training(self) -> None:
        warmup = self._call("mcgraph_warmup_steps", config=self.config)
        who = answers.answered_by(self.pluginmanager, "mcgraph_warmup_steps")
        self._warmup_steps = answers.warmup_answer(warmup, who)
        self._train_started = True
        self._call(
            "mcgraph_train_start",
            start_step=self.start_step,
            train_iters=self.train_iters,
            progress=self.progress,
        )

    def _check_active(self) -> None:
        if not self._entered:
            raise RuntimeError("use the TrainingRun as a context manager: `with run: ...`")
        if self.shutdown_reason is not None:
            raise RuntimeError(f"this TrainingRun has shut down ({self.shutdown_reason})")

    # -- shutdown -----------------------------------------------------------------------------

    def _finish(self, exc: BaseException | None) -> bool:
        """Fire the shutdown hook once; return True to swallow ``exc`` (see signals)."""
        if self.shutdown_reason is not None:
            return False
        # First of all: from here on a handled signal, and Ctrl-C, wait until shutdown ends.
        self._begin_shutdown()
        self._ending = exc
        restore_sigint = self._defer_sigint()
        try:
            try:
                self._shut_down(exc)
            finally:
                # SIGINT last: a Ctrl-C while the others go back is still held
                try:
                    self._restore_signal_handlers()
                finally:
                    self._finished = True
                    _release_the_process(self)
                    restore_sigint()
        except BaseException as raised:  # (a step raised where the run ended cleanly)
            if raised is not exc and self._held_in_shutdown and self._pending_signal is not None:
                # the signal held meanwhile still ends the process, saying what was raised
                self._apply_previous_signal_behaviour(raised)
            raise
        if self._pending_sigint and not isinstance(exc, KeyboardInterrupt):
            self._act_on_deferred_sigint(exc)
        return self._apply_previous_signal_behaviour(exc)

    def _shut_down(self, exc: BaseException | None) -> None:
        """The shutdown hook, then the host's teardown (the graphs hold NCCL buffers: freed
        first), a signal held throughout (a teardown that a signal reached is bounded: see
        :class:`~hookspecs.teardown.TeardownBound`)."""
        reason = _classify(exc, completed=self._next_step >= self.train_iters)
        self.shutdown_reason = reason
        try:
            self._ending_step("mcgraph_shutdown", exc, self._call, "mcgraph_shutdown",
                              reason=reason, exception=exc)  # fmt: skip
        finally:
            if self._teardown is not None:
                self._tearing_down = True
                try:
                    self._ending_step("the host's teardown", exc, self._teardown, self)
                finally:
                    self._tearing_down = False
                    if self._teardown_bound is not None:
                        self._teardown_bound.cancel()

    @staticmethod
    def _ending_step(
        what: str, exc: BaseException | None, call: Any, *args: Any, **kwargs: Any
    ) -> None:
        """``call(*args, **kwargs)``, one step of the shutdown: what it raises goes on where
        the run ended cleanly (``sys.exit(0)`` too), else it is logged and noted on ``exc``."""
        try:
            call(*args, **kwargs)
        except BaseException as step_exc:
            if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
                raise
            if isinstance(step_exc, KeyboardInterrupt):  # (a Ctrl-C cut it short: one line)
                logger.warning("%s was interrupted by a Ctrl-C", what)
                exc.add_note(f"{what} was interrupted by a Ctrl-C")
                return
            # (its own traceback only: its context is the original, which the host
            # prints when it receives it)
            logger.error(
                "%s raised while the run was ending with %r; the original exception is "
                "re-raised:\n%s",
                what,
                exc,
                traceback_without(step_exc, exc),
            )
            exc.add_note(f"during {what}, another exception occurred: {step_exc!r}")


class _TrainStep:
    """The context manager of :meth:`TrainingRun.train_step`."""

    __slots__ = ("_metrics", "_run", "_step")

    def __init__(self, run: TrainingRun, step: int) -> None:
        self._run = run
        self._step = step
        self._metrics: dict[str, Any] | None = None

    def __enter__(self) -> dict[str, Any]:
        self._metrics = self._run._step_started(self._step)
        return self._metrics

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        # TrainingRun's step end, here: it runs on every step, one call less
        run = self._run
        run._running_step = None  # on both paths: a failed step may be run again
        if self._step - run.start_step > (run._warmup_steps or 0) + 1:  # (past the captures)
            run._longest_step_s = max(run._longest_step_s, time.monotonic() - run._step_began)
        if exc_type is None:
            step = self._step
            run._next_step = step + 1
            counted = run._counted
            if counted is not None and counted.registrations != run._seen:
                run._look_for_step_listeners(counted)
            if run._listened[1]:
                try:
                    run.hook.mcgraph_train_step_end(step=step, metrics=self._metrics)
                except BaseException as exc_in_hook:
                    blame(run.pluginmanager, "mcgraph_train_step_end", exc_in_hook)
                    raise
        return False
