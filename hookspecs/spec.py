"""Hook specifications: every hook a host fires or a plugin may implement, by lifecycle.

Conventions (they matter, pluggy enforces only some of them):

* Hosts call hooks with keyword arguments only; specs take plain named parameters with no
  defaults and no ``*``.
* A plugin may accept any subset of a hook's parameters.
* Each spec says how its result is used: *notification* (results ignored), *collected*
  (the host receives a list with one entry per implementation that returned non-``None``),
  *firstresult* (the first non-``None`` result wins) or *historic* (replayed to plugins
  registered later).
* "Perform" hooks are ``firstresult``: a default implementation (the host's, registered
  ``trylast``) performs the operation and other plugins wrap it with
  ``@hookimpl(wrapper=True)`` and ``try: return (yield) finally: ...``.
* No hook is ever called from inside a captured or replayed CUDA graph. Hooks are Python
  and cost about 1-3 µs each; they run between graph replays, never inside them. The
  capture itself happens between :func:`mcgraph_before_capture` and
  :func:`mcgraph_after_capture`.
* Steps are numbered from 0: a fresh run's first step is step 0, a resumed run's is
  ``start_step`` (the number of steps done before), and ``train_iters`` is the step at which
  training completes (exclusive). Every hook, the run report and the example hosts' log
  lines use these numbers.
* A plugin has one name, its entry-point name: it is blocked by that name
  (``MCGRAPH_BLOCK_PLUGINS``), and log lines and error notes name it so, with its
  distribution. Objects a plugin registers from its hooks (a per-run object, without a
  ``name``) are named ``<plugin>:<ClassName>`` and count as that plugin.

The order in which :class:`hookspecs.TrainingRun` fires them is documented in
``docs/hooks.md`` and checked by the tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookspecs.markers import hookspec

if TYPE_CHECKING:
    import argparse
    from contextlib import AbstractContextManager

    import pluggy

    from hookspecs.progress import StepProgress
    from hookspecs.reasons import ShutdownReason
    from hookspecs.report_schema import Report


# -------------------------------------------------------------------------------------------
# Configuration: before anything is built or any device memory is touched.
# -------------------------------------------------------------------------------------------


@hookspec
def mcgraph_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add command-line options to the host's argument parser.

    Fired by the host before it parses its command line (outside :class:`TrainingRun`).

    :param parser: The host's ``argparse.ArgumentParser``; add options or groups to it.

    Result: notification; return values are ignored.
    """


@hookspec(historic=True)
def mcgraph_configure(config: Any, pluginmanager: pluggy.PluginManager) -> None:
    """Validate and complete the host's configuration before anything is built.

    Fired once per run when :class:`TrainingRun` is entered, before distributed
    initialisation, RNG seeding and model build. A plugin that finds the configuration
    unusable raises (``ValueError`` or a subclass) and the run ends with
    :func:`mcgraph_shutdown` (reason ``exception``). The first implementation to raise ends
    the call (pluggy's rule): the implementations after it are not called, so their own
    problems show only once it passes, and :func:`mcgraph_shutdown` can reach a plugin whose
    ``mcgraph_configure`` never ran (keep its shutdown safe without it). A plugin may
    change the host's config in place only to apply a documented auto-fix, and must log
    each change.

    :param config: The host's configuration object, whatever its shape (an argparse
        namespace, a Megatron-Bridge-style nested config, a ``TransformerConfig``).
    :param pluginmanager: The run's plugin manager; a plugin may register per-run helper
        plugins on it here, and may call hooks through ``pluginmanager.hook`` (not
        :func:`mcgraph_shutdown`, which ``TrainingRun`` fires: to end a run, raise).

    Result: historic notification; plugins registered later receive the call on
    registration; return values are ignored.
    """


@hookspec
def mcgraph_model_config_kwargs(config: Any) -> dict[str, Any] | None:
    """Contribute keyword arguments for the host's ``TransformerConfig``.

    Fired by the host (:meth:`TrainingRun.model_config_kwargs`) after configure, before it
    constructs its ``TransformerConfig``. Field names must be those of the installed
    megatron-core (a plugin translates its own settings).

    :param config: The host's configuration object, as given to :func:`mcgraph_configure`.

    Result: collected; the host merges the dicts with :func:`hookspecs.merge_kwargs`, which
    refuses two plugins setting the same field to different values. A plugin whose fields
    are settings it read from ``config`` answers a :class:`hookspecs.SettledKwargs`: its
    values then replace the host's ``base`` ones (logged on rank 0), since a host may pass its
    whole model config, the plugin's own fields included, as ``base``.
    """


@hookspec
def mcgraph_rng_options(config: Any) -> dict[str, Any] | None:
    """Contribute keyword arguments for ``model_parallel_cuda_manual_seed``.

    Fired by the host (:meth:`TrainingRun.rng_options`) after distributed initialisation,
    before it seeds the RNG.

    :param config: The host's configuration object.

    Result: collected; merged like :func:`mcgraph_model_config_kwargs`.
    """


@hookspec
def mcgraph_rng_initialized(config: Any) -> None:
    """Inspect the RNG state after the host has seeded it.

    Fired by the host (:meth:`TrainingRun.rng_initialized`) right after
    ``model_parallel_cuda_manual_seed``. A plugin raises if the active RNG tracker cannot
    serve what it configured (for example a tracker that is not CUDA-graph safe).

    :param config: The host's configuration object.

    Result: notification.
    """


# -------------------------------------------------------------------------------------------
# Model build.
# -------------------------------------------------------------------------------------------


@hookspec
def mcgraph_model_build_context(config: Any) -> AbstractContextManager[Any] | None:
    """Provide a context manager the host enters while it wraps the model in DDP.

    Fired by the host (:meth:`TrainingRun.model_build_context`) before it constructs
    ``DistributedDataParallel``; the host enters every returned context manager, in order,
    for the duration of the DDP construction (for example a CUDA stream that later graph
    captures must share).

    :param config: The host's configuration object.

    Result: collected; ``None`` means "nothing to enter".
    """


@hookspec
def mcgraph_model_built(
    model: list[Any],
    optimizer: Any,
    model_config: Any,
    seq_length: int,
    micro_batch_size: int,
) -> None:
    """The model (DDP-wrapped chunks) and optimizer exist; training has not started.

    Fired by the host (:meth:`TrainingRun.model_built`) once per run.

    :param model: The list of model chunks, each wrapped in megatron-core DDP.
    :param optimizer: The megatron-core optimizer.
    :param model_config: The ``TransformerConfig`` the model was built with.
    :param seq_length: The fixed sequence length of every micro-batch.
    :param micro_batch_size: The fixed micro-batch size.

    Result: notification.
    """


@hookspec(firstresult=True)
def mcgraph_forward_backward_func(forward_backward_func: Any) -> Any:
    """Return the forward/backward callable the host must use for training and evaluation.

    Fired by the host (:meth:`TrainingRun.forward_backward_func`) once, after
    :func:`mcgraph_model_built`, with megatron-core's ``get_forward_backward_func()``.
    A perform hook: the host's default implementation returns the callable unchanged; a
    plugin wraps it with ``@hookimpl(wrapper=True)`` (``func = yield; return wrap(func)``).
    The returned callable keeps megatron-core's keyword-only signature. Where a wrapper
    lands matters with full-iteration graphs: the CUDA graph plugin's wrapper (plain,
    registered when the run is configured) captures the callable it gets, so a plain
    wrapper registered before it is inside the captured iteration and its Python runs only
    on the steps that do not replay (warm-up, capture, a step that runs eagerly), never on a
    replay; a wrapper that must run on every
    step (timing, logging) declares ``tryfirst=True``, which keeps it outside. The answer
    must be callable (refused where the run takes it, naming the plugins that implement
    the hook).

    :param forward_backward_func: megatron-core's forward/backward schedule.

    Result: firstresult.
    """


# -------------------------------------------------------------------------------------------
# Training loop.
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def mcgraph_warmup_steps(config: Any) -> int | None:
    """Number of eager training steps before the post-warmup step.

    Asked by :class:`TrainingRun` when it starts training. The CUDA graph plugin answers it
    in every run mode (graphs on, graphs off, no CUDA device) with the configured
    ``cuda_graph_warmup_steps`` (default 3), from a ``tryfirst`` implementation that the
    plugin manager keeps first whatever registers later, so its answer is the one a run
    uses. Answer it yourself only where the CUDA graph plugin is not
    loaded (blocked, or in your plugin's own tests); to see the answer, wrap the hook
    (``answer = yield``) and return it unchanged: the CUDA graph plugin refuses, at the
    post-warmup step, a run whose answer another plugin changed (its capture step would not
    be the post-warmup step). An answer that is not a non-negative int or ``None`` is
    refused naming the plugins that implement the hook. If no plugin answers, the run has
    no post-warmup step and :func:`mcgraph_post_warmup_step` never fires.

    :param config: The host's configuration object.

    Result: firstresult; a non-negative int.
    """


@hookspec
def mcgraph_train_start(start_step: int, train_iters: int, progress: StepProgress | None) -> None:
    """Training begins (first call of :meth:`TrainingRun.train_step`).

    :param start_step: The first step of this run (greater than 0 when resuming).
    :param train_iters: The step at which training completes (exclusive).
    :param progress: The run's :class:`hookspecs.StepProgress`: ``progress.step`` is the
        step running now, read live, so a plugin that needs the step only now and then
        need not implement the per-step hooks (each implemented per-step hook is a dispatch
        on every step). ``None`` from a host that fires the hooks itself and keeps no such
        object: plugins then learn the step from the per-step hooks only.

    Result: notification.
    """


@hookspec
def mcgraph_train_step_start(step: int) -> None:
    """A training step begins, before its forward/backward.

    :class:`TrainingRun` dispatches this hook and :func:`mcgraph_train_step_end` only while
    some registered plugin implements them (it looks again whenever a plugin is registered
    or unregistered): a plugin that needs them for part of a run can register an object
    implementing them and unregister it when done, and the steps after cost nothing. Hook
    call monitoring (``pm.add_hookcall_monitoring``) sees no call that was not dispatched.

    :param step: The step about to run.

    Result: notification.
    """


@hookspec
def mcgraph_post_warmup_step(step: int, start_step: int) -> None:
    """The first step after the warm-up steps begins, before its forward/backward.

    Fired exactly once per run, right after :func:`mcgraph_train_step_start`, for the step
    where ``step - start_step == warmup_steps`` (counted from the start step, so a resumed
    run warms up again; with ``warmup_steps == 0`` the first step), in every run mode:
    graphs on, graphs off and on a machine without CUDA. Per-layer CUDA graphs are captured
    here; the step then runs on the captured graphs.

    It cannot fire in two cases: no plugin answered :func:`mcgraph_warmup_steps` (the CUDA
    graph plugin is blocked or not installed, and no other plugin answers;
    ``run.warmup_steps`` is then ``None``), or the run ends before that step
    (``train_iters - start_step <= warmup_steps``, an early exit or an exception first).

    :param step: The step about to run.
    :param start_step: The first step of this run.

    Result: notification.
    """


@hookspec
def mcgraph_train_step_end(step: int, metrics: dict[str, Any]) -> None:
    """A training step has finished (forward/backward and optimizer step).

    Not fired for a step that raised. Do not synchronise the device here: metric values
    may be device tensors still being computed.

    :param step: The step that finished.
    :param metrics: What the host reports for the step (host-defined keys).

    Result: notification.
    """


@hookspec
def mcgraph_step_padded(step: int, seq_length: int, real_tokens: int, padded_tokens: int) -> None:
    """The host padded this step's micro-batches to a sequence-length bucket.

    Fired by :meth:`hookspecs.TrainingRun.step_padded` (``cudagraph_plugin.runtime.padding.
    pad_step`` says what to pass). The CUDA graph plugin counts the padding waste of each
    bucket for its report.

    :param step: The current training step.
    :param seq_length: The bucket length every micro-batch of the step was padded to.
    :param real_tokens: Token positions of the step before padding (all micro-batches).
    :param padded_tokens: Positions the padding added.

    Result: notification.
    """


@hookspec
def mcgraph_invalidate_graphs(reason: str) -> None:
    """What captured graphs point at may have moved: the host loaded a checkpoint into the
    model, offloaded parameters, gradients or optimizer state and brought them back, or
    replaced tensors some other way.

    Fired by :meth:`hookspecs.TrainingRun.invalidate_graphs`, after the move and before
    the next training call: between steps, or in a step before its forward/backward (never
    inside a capture). The CUDA graph plugin frees its graphs before their next replay: bucketed
    full-iteration graphs are captured again after their warm-up; other graphs are freed and
    the run goes on eagerly (said in the log).

    :param reason: The host's words, for the log and the report.

    Result: notification.
    """


@hookspec(firstresult=True)
def mcgraph_disable_forward_pre_hook(model: list[Any], param_sync: bool) -> bool | None:
    """Disable the DDP forward pre-hooks (the param all-gather overlap hooks).

    A perform hook fired by the host or by a plugin around a CUDA graph capture. The host's
    default implementation calls ``disable_forward_pre_hook(param_sync=...)`` on every DDP
    chunk; another plugin may take over by returning ``True`` first or wrap it.

    :param model: The list of DDP-wrapped model chunks.
    :param param_sync: Whether to force a synchronous parameter all-gather now.

    Result: firstresult; ``True`` once performed.
    """


@hookspec(firstresult=True)
def mcgraph_enable_forward_pre_hook(model: list[Any]) -> bool | None:
    """Enable the DDP forward pre-hooks again.

    A perform hook, the counterpart of :func:`mcgraph_disable_forward_pre_hook`. The host's
    default implementation calls ``enable_forward_pre_hook()`` on every DDP chunk.

    :param model: The list of DDP-wrapped model chunks.

    Result: firstresult; ``True`` once performed.
    """


# -------------------------------------------------------------------------------------------
# Evaluation.
# -------------------------------------------------------------------------------------------


@hookspec
def mcgraph_evaluation_start(step: int) -> None:
    """Evaluation begins (the model is about to be put in eval mode).

    :param step: The last training step that finished (``start_step - 1`` before the first).

    Result: notification.
    """


@hookspec
def mcgraph_evaluation_end(step: int, metrics: dict[str, Any]) -> None:
    """Evaluation finished without error.

    :param step: The last training step that finished (``start_step - 1`` before the first).
    :param metrics: What the host reports for the evaluation (host-defined keys).

    Result: notification.
    """


# -------------------------------------------------------------------------------------------
# CUDA graph events (fired by the CUDA graph plugin through the plugin manager).
# -------------------------------------------------------------------------------------------


@hookspec
def mcgraph_before_capture(step: int, impl: str, scope: list[str]) -> None:
    """A CUDA graph capture is about to start.

    For per-layer (``transformer_engine``) graphs this is inside
    :func:`mcgraph_post_warmup_step`, with the forward pre-hooks already disabled; for
    ``full_iteration`` graphs it is inside the forward/backward call of the capture step.

    :param step: The training step of the capture (evaluation captures report the last
        training step).
    :param impl: ``"local"`` or ``"transformer_engine"`` (the optimizer graph, megatron-core's
        own capture: ``"local"``).
    :param scope: The captured scopes, e.g. ``["full_iteration"]`` or ``["attn", "mlp"]``
        (``["optimizer"]`` for the optimizer graph).

    Result: notification. A hook that raises aborts the capture.
    """


@hookspec
def mcgraph_after_capture(
    step: int, impl: str, scope: list[str], seconds: float, graph_count: int
) -> None:
    """A CUDA graph capture finished successfully.

    :param step: As in :func:`mcgraph_before_capture`.
    :param impl: As in :func:`mcgraph_before_capture`.
    :param scope: As in :func:`mcgraph_before_capture`.
    :param seconds: Wall-clock capture time (device synchronised before and after).
    :param graph_count: Number of CUDA graphs now held.

    Result: notification.
    """


@hookspec
def mcgraph_report(report: Report) -> None:
    """The run report: what CUDA graphs bought this run.

    Fired once per run by the CUDA graph plugin (whenever it is loaded, in every run mode)
    when its ``mcgraph_shutdown`` wrapper is entered: after the ``tryfirst`` shutdown
    wrappers are entered, before any ``trylast`` wrapper or plain implementation of
    ``mcgraph_shutdown`` runs, and while the graphs are still held (see
    :func:`mcgraph_shutdown`). The report is logged and its JSON written before the hook is
    called (a JSON that cannot be written then, its folder gone since the run started, does
    not stop the call: its error, naming the setting and the fix, ends a run that completed
    once every implementation had the report). An implementation that raises ends the call
    (pluggy's rule): the ones after it do not receive the report, and the run then ends with
    that exception, its plugin named in a note.

    :param report: The run report. ``report.to_dict()`` gives its fields as JSON-ready
        values, following the schema in "The run report" above (versioned by its
        ``schema_version`` key; ``hookspecs.report_schema`` has it as data);
        ``report.format_table()`` gives the table the plugin logs, for people. Nothing
        else of the object is public.

    Result: notification.
    """


# -------------------------------------------------------------------------------------------
# Shutdown.
# -------------------------------------------------------------------------------------------


@hookspec
def mcgraph_shutdown(reason: ShutdownReason, exception: BaseException | None) -> None:
    """The run ends: free everything that was created for it.

    Fired exactly once per run by :class:`TrainingRun`, on every exit path, from a
    ``finally``. Implement cleanup with ``@hookimpl(wrapper=True)`` and
    ``try: return (yield) finally: cleanup()`` so it runs even if another plugin's
    implementation raises; never raise before the ``yield``: pluggy would skip the wrappers
    and implementations inside yours. (The CUDA graph plugin keeps a ``tryfirst`` guard
    outside every other wrapper, whatever registers later (the plugin manager registers it
    again after each registration): it still reports and frees the graphs when a wrapper
    raises before its ``yield``.) Never fire this hook from a plugin: the CUDA graph plugin
    reports and frees once, at the first shutdown, and says so if fired again.

    The implementations run in three layers, whatever order the plugins were installed,
    loaded or registered in:

    1. Wrappers marked ``tryfirst=True`` (outermost): entered first, finished last. Their
       code before ``yield`` runs before the report; their ``finally`` runs after the CUDA
       graph plugin has freed its graphs, so the report has arrived by then.
    2. The CUDA graph plugin's wrapper (a plain ``wrapper=True``): on entry it fires
       :func:`mcgraph_report`; in its ``finally`` it frees the graphs (and the memory
       they hold), whatever happened inside.
    3. Inside it: wrappers marked ``trylast=True`` and every non-wrapper implementation.
       They run after the report has arrived and while the graphs are still held.

    A wrapper without a mark sits on either side of the CUDA graph plugin's, depending on
    registration order: mark yours ``tryfirst`` or ``trylast`` when the side matters. Among
    wrappers with the same mark, the one registered later is outer.

    :param reason: Why the run ended: ``completed``, ``early_exit``, ``exception``,
        ``interrupted`` (KeyboardInterrupt), ``signal`` (SIGTERM) or ``peer_failed``
        (another rank of the job failed first: :class:`hookspecs.PeerFailed`;
        :class:`hookspecs.PeerRefused` when that rank refused its configuration).
    :param exception: The exception that ended the run, or ``None``.

    Result: notification.
    """
