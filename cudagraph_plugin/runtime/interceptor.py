"""The callables the host gets in place of its own: the forward/backward function (and,
with the optimizer graph, ``optimizer.step``).

For each forward/backward call it decides what runs: after shutdown, the plain function;
with full-iteration graphs, megatron-core's wrapper (capture on its capture call, replay
after), every call checked by the static-shape guard; after a TE capture, the plain function
with its micro-batches checked against the captured shapes; otherwise the plain function.

The steady state (a training replay, a replayed optimizer step) runs on every step, so after
the first replay each callable remembers what it needs (:class:`_Replay`,
:class:`_OptimizerReplay`) and checks only what could have changed since: that megatron-core
still holds the same graph, the phase, the guard's reference. Anything else takes the full
path, which decides afresh.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.buckets import Action, BucketGraphs
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.guard import FIX, ShapeGuard, StaticShapeError
from cudagraph_plugin.runtime.mechanisms import FullIterationGraphs, OptimizerGraphs
from cudagraph_plugin.runtime.state import Phase, RunState
from cudagraph_plugin.runtime.te_capture import TECapture
from cudagraph_plugin.runtime.wiring import CudaGraphWiringError, Wiring

logger = logging.getLogger("cudagraph_plugin")

OWN_WRAPPER = (
    "megatron-core's FullCudaGraphWrapper counted {stage} calls of the run's "
    "forward_backward_func that did not come through it ({seen} counted, {ours} made): a "
    "FullCudaGraphWrapper of the host's own wraps the function run.forward_backward_func() "
    "returned (Megatron-LM's train() makes one), and both advance megatron-core's class-level "
    "step counters and graphs (the capture comes at the wrong step, or fails inside "
    "megatron-core). Fix: drop the host's FullCudaGraphWrapper(...) line and call the run's "
    "function directly: it captures and replays the full-iteration graph itself"
)


class ForwardBackwardInterceptor:
    def __init__(
        self,
        state: RunState,
        captures: Captures,
        guard: ShapeGuard,
        te_capture: TECapture,
        wiring: Wiring,
    ) -> None:
        self.state = state
        self.captures = captures
        self.guard = guard
        self.te_capture = te_capture
        self.wiring = wiring
        self.wrapped: dict[int, tuple[Any, ForwardBackward]] = {}
        self._eager_after_shutdown_logged = False
        self._replay: _Replay | None = None
        # this run's calls of megatron-core's wrapper per stage, and its counter before them
        self.full_calls = {"training": 0, "validation": 0}
        self._full_base: dict[str, int] = {}
        self.own_wrapper_seen = False  # a host's own wrapper moved the counter (refused)
        # compat.param_gather_groups of the model they were found for (_gather_groups)
        self._groups: tuple[Any, list[Any]] = (None, [])

    def wrap(self, func: Any) -> Any:
        """The callable the host gets for ``func``. Idempotent: asking again for the same
        function, or with the callable it returned, gives the same callable (a new wrapper
        would reset megatron-core's class state and free live graphs; a nested one would
        count each call twice). megatron-core's own ``FullCudaGraphWrapper`` is refused:
        two wrappers would share its class-level graphs and counters."""
        if isinstance(func, ForwardBackward):
            if func._interceptor is self:
                return func
            func = func._eager  # another run's: the host's function under it
        if compat.is_full_iteration_wrapper(func):
            raise CudaGraphWiringError(
                "run.forward_backward_func() was given megatron-core's FullCudaGraphWrapper: "
                "the CUDA graph plugin makes its own, and two would share megatron-core's "
                "class-level graphs and step counters (the capture would come a step early "
                "and then fail). Fix: pass the plain function "
                "(megatron.core.pipeline_parallel.get_forward_backward_func()), and drop the "
                "host's own FullCudaGraphWrapper(...) line (Megatron-LM's train() has one)"
            )
        known = self.wrapped.get(id(func))
        if known is not None:
            return known[1]
        if self.state.phase is not Phase.CONFIGURED:  # (else made by model_built: the config)
            self.make_full_graphs()
        wrapped = ForwardBackward(self, func)
        self.wrapped[id(func)] = (func, wrapped)
        return wrapped

    def make_full_graphs(self) -> None:
        """The full-iteration graphs' holder, once the model config is known (its memory-pool
        setting): at the first ``wrap`` after ``model_built``, or at ``model_built`` for a
        host that asked for its forward/backward function first."""
        state = self.state
        if state.full_iteration_mode and state.full is None and not state.settings.buckets:
            state.full = FullIterationGraphs(
                state.settings.warmup_steps, compat.single_mempool(state.model_config)
            )

    def forget(self) -> None:
        self.wrapped.clear()
        self._replay = None
        self._groups = (None, [])

    def free_own_wrapper_state(self) -> int:
        """With TE scopes, megatron-core's full-iteration state a refused host wrapper left
        (a graph it captured, its counters): freed at shutdown, outside any capture. (In
        full-iteration mode the run's own release frees that state.)"""
        if not self.own_wrapper_seen or self.state.full is not None:
            return 0
        return compat.free_full_iteration_graphs()

    def call(self, eager: Any, kwargs: dict[str, Any]) -> Any:
        """One call of the host's forward/backward; :meth:`ForwardBackward.__call__` takes
        the remembered replay's shortcut first, when it holds."""
        state = self.state
        if self._replay is not None and not self._replay.holds(state, self.guard):
            # stale: forgotten at once, so that it never keeps a graph megatron-core dropped
            # alive (megatron-core 0.18+'s reset_cuda_graph frees by refcount)
            self._replay = None
        if state.phase is Phase.SHUT_DOWN:
            # Graphs are gone (e.g. Megatron-LM-style evaluation after training): eager.
            if not self._eager_after_shutdown_logged:
                self._eager_after_shutdown_logged = True
                logger.info("forward_backward_func called after shutdown: running eagerly")
            return eager(**kwargs)
        stage = "validation" if kwargs.get("forward_only") else "training"
        if state.buckets is not None:
            return self._bucketed(state.buckets, eager, kwargs)
        if state.full is not None and state.phase is not Phase.FALLEN_BACK:
            return self._full_iteration(state.full, eager, stage, kwargs)
        if state.te_mode:  # (no call of this run moves the counter: a host's wrapper does)
            self._check_counter(stage)
        self.te_capture.check_host_enabled_pre_hooks()
        # (a TE capture that made no graph, accepted eager: nothing to guard)
        if (
            state.te_mode
            and state.phase is Phase.CAPTURED
            and self.captures.made_graphs("training")
        ):
            if stage == "training":
                record = not self.guard.is_armed(stage)
                if record:
                    self._check_te_microbatches(kwargs)
                    self._check_te_call(kwargs)
                kwargs["data_iterator"] = self.guard.check_call(
                    stage, state.step, kwargs, record=record
                )
                result = eager(**kwargs)
                if record:
                    self.guard.commit(stage)
                self.captures.replayed(stage)  # (counted once the call got through)
                return result
            if any(getattr(chunk, "training", False) for chunk in state.model or ()):
                # megatron-core replays the TE layer graphs for any call in training mode
                # (it decides by module.training), a forward-only one too (an RL host's
                # log-probs)
                self._check_te_call(kwargs, "forward-only (in training mode)", _TRAIN_MODE_FIX)
        return eager(**kwargs)

    def _check_counter(self, stage: str) -> None:
        """megatron-core's counter of ``stage`` moved by this run's calls alone (a counter
        reset, by a release, is taken as the new start)."""
        seen, ours = compat.full_iteration_calls(stage), self.full_calls[stage]
        base = self._full_base.setdefault(stage, seen - ours)
        if seen - base > ours:
            self.own_wrapper_seen = True  # (what it captured is freed at shutdown)
            raise CudaGraphWiringError(OWN_WRAPPER.format(stage=stage, seen=seen, ours=ours))
        if seen - base < ours:
            self._full_base[stage] = seen - ours

    def _full_iteration(
        self, full: FullIterationGraphs, eager: Any, stage: str, kwargs: dict[str, Any]
    ) -> Any:
        self._check_counter(stage)
        wrapper = full.wrapper_for(eager)
        capturing = full.due(stage)
        kwargs["data_iterator"] = self.guard.check_call(
            stage, self.state.step, kwargs, record=capturing, copied=True, static_buffers=True
        )
        if not capturing:
            if stage == "training":
                self._remember_replay(eager, wrapper)
            result = full.call(wrapper, kwargs)
            self.full_calls[stage] += 1
            if stage == "training":
                self.after_training_graph()
            # (counted once the call got through: the guard checks the micro-batches as the
            # schedule draws them, and a refused call replayed nothing)
            self.captures.replayed(stage)
            return result
        self.wiring.full_iteration_capture(stage)
        result = self.captures.bracket(stage, lambda: full.call(wrapper, kwargs))
        self.full_calls[stage] += 1
        self.guard.commit(stage)
        if stage == "training":
            self.after_training_graph()
        return result

    def after_training_graph(self) -> None:
        """After a training call of full-iteration graphs (a warm-up call too: its eager
        iteration left the same): DDP's Python state as an eager iteration leaves it
        (:func:`compat.mark_param_gather_due`)."""
        groups = self._gather_groups()
        if groups:
            compat.mark_param_gather_due(groups)

    def _gather_groups(self) -> list[Any]:
        """The run model's DDP bucket groups whose all-gather the pre-hooks run, found once
        per model (DDP makes them when it is built): every training graph call needs them."""
        model = self.state.model
        if model is None:
            return []
        if self._groups[0] is not model:
            self._groups = (model, compat.param_gather_groups(model))
        return self._groups[1]

    def _remember_replay(self, eager: Any, wrapper: Any) -> None:
        """After a training call that replays (not a warm-up call), the fast path of
        :meth:`call` may take the next ones."""
        graphs = compat.full_iteration_graphs()
        graph = graphs["training"]
        if graph is None or not self.guard.is_armed("training"):
            self._replay = None
            return
        self._replay = _Replay(
            eager=eager,
            wrapper=wrapper,
            graphs=graphs,
            graph=graph,
            guard_generation=self.guard.generation,
            order_copy=not compat.loader_orders_its_copy(),
            gather_groups=self._gather_groups(),
        )

    def _bucketed(self, buckets: BucketGraphs, eager: Any, kwargs: dict[str, Any]) -> Any:
        """Bucketed full-iteration graphs: their own routing, guard and capture sequence;
        the plugin brackets each capture and counts the replays."""
        step = self.state.step
        route = buckets.route(kwargs, step)
        if route.action is Action.CAPTURE:
            self.wiring.full_iteration_capture("training")
            result = self.captures.bracket(
                "training", lambda: buckets.run(route, eager, kwargs, step)
            )
            self.after_training_graph()
            return result
        result = buckets.run(route, eager, kwargs, step)
        if route.action is Action.REPLAY:
            self.captures.replayed("training")
            self.after_training_graph()
        return result

    def _check_te_microbatches(self, kwargs: dict[str, Any]) -> None:
        """A training call runs the micro-batches pipelined TE graphs were captured for (a
        forward-only call uses each graph's output before it replays again: not checked)."""
        te = self.state.te
        microbatches = None if te is None else compat.te_captured_microbatches(te.helper)
        if microbatches is not None and kwargs.get("num_microbatches") != microbatches:
            raise StaticShapeError(
                "training forward_backward_func called with num_microbatches="
                f"{kwargs.get('num_microbatches')!r} but megatron-core captured the TE CUDA "
                f"graphs for num_microbatches={microbatches} (one graph per micro-batch with "
                "pipeline parallelism, counted by its micro-batch calculator: replaying them "
                "for another count mixes the micro-batches' activations). Fix: pass the count "
                "megatron-core's get_num_microbatches() gives, or set its calculator "
                "(init_num_microbatches_calculator) to the count you pass"
            )

    def _check_te_call(
        self, kwargs: dict[str, Any], what: str = "training", fix: str = FIX
    ) -> None:
        for name, captured in (
            ("seq_length", self.state.seq_length),
            ("micro_batch_size", self.state.micro_batch_size),
        ):
            if kwargs.get(name) != captured:
                raise StaticShapeError(
                    f"{what} forward_backward_func called with {name}={kwargs.get(name)!r} "
                    f"but the TE CUDA graphs were captured for {name}={captured!r}. Fix: {fix}"
                )


_TRAIN_MODE_FIX = (
    "run forward-only passes with the model in eval mode (chunk.eval() for each model chunk, "
    "chunk.train() after; megatron-core then runs the layers eagerly), or at the captured shapes"
)


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Replay:
    """A training replay's fixed parts: valid while megatron-core holds ``graph`` in
    ``graphs`` (the class-level dict of the wrapper class this run's wrapper was made from,
    which is the one its replays read), the run is CAPTURED and the guard keeps the
    reference of ``guard_generation``. Forgotten as soon as any of that changes."""

    eager: Any
    wrapper: Any
    graphs: dict[str, Any]
    graph: Any
    guard_generation: int
    order_copy: bool  # megatron-core's loader does not order its copy itself (0.16)
    gather_groups: list[Any]  # (compat.mark_param_gather_due after each replay)

    def holds(self, state: RunState, guard: ShapeGuard) -> bool:
        return (
            self.graphs["training"] is self.graph
            and state.phase is Phase.CAPTURED
            and guard.generation == self.guard_generation
        )


class ForwardBackward:
    """The forward/backward callable the host gets: keyword-only, like megatron-core's.

    A training call like the last replayed one (:class:`_Replay` still holds, same host
    function) replays here directly: what :meth:`ForwardBackwardInterceptor.call` would do,
    without deciding again what cannot have changed. Anything else goes there.
    """

    def __init__(self, interceptor: ForwardBackwardInterceptor, eager: Any) -> None:
        self._interceptor = interceptor
        self._eager = eager

    def __call__(self, **kwargs: Any) -> Any:
        interceptor = self._interceptor
        replay = interceptor._replay
        guard = interceptor.guard
        if (
            replay is not None
            and replay.eager is self._eager
            and not kwargs.get("forward_only")
            # _Replay.holds, inline: this runs on every step
            and replay.graphs["training"] is replay.graph
            and interceptor.state.phase is Phase.CAPTURED
            and guard.generation == replay.guard_generation
        ):
            kwargs["data_iterator"] = guard.check_replay(kwargs)
            if replay.order_copy:
                compat.order_input_copy_after_replay(replay.wrapper)
            result = replay.wrapper(**kwargs)
            if replay.gather_groups:
                compat.mark_param_gather_due(replay.gather_groups)
            interceptor.full_calls["training"] += 1
            captures = interceptor.captures
            captures.replays["training"] += 1
            captures.last_step_replayed = interceptor.state.step
            return result
        return interceptor.call(self._eager, kwargs)


class OptimizerStep:
    """What ``optimizer.step`` is while the optimizer graph is installed: megatron-core's
    wrapper, with its capture call bracketed by the capture hooks, timing and memory."""

    def __init__(
        self,
        captures: Captures,
        graphs: OptimizerGraphs,
        on_moved: Callable[[str], None] | None = None,
    ) -> None:
        self._captures = captures
        self._graphs = graphs
        self._replay: _OptimizerReplay | None = None
        self._on_moved = on_moved  # frees the graphs when what they read moved (no buckets)

    def __call__(self) -> Any:
        graphs = self._graphs
        installed = vars(graphs.optimizer).get("step")
        if installed is not self and compat.is_optimizer_graph_wrapper(installed):
            # (a host's own wrapper of this step: they share megatron-core's class-level
            # counter and graph; a host's other wrappers, a timer say, are fine)
            raise CudaGraphWiringError(
                "optimizer.step was wrapped in the host's own OptimizerCudaGraphWrapper after "
                "run.model_built() installed the CUDA graph plugin's optimizer graph: the two "
                "share megatron-core's class-level step counter and graph. Fix: drop the "
                "host's `optimizer.step = OptimizerCudaGraphWrapper(...)` (Megatron-LM's "
                "train() makes one when --optimizer-cuda-graph is set)"
            )
        if graphs.moves is not None and self._on_moved is not None:
            moved = graphs.moved()
            if moved:
                # never a replay onto freed memory: the graphs go, the step runs eagerly
                optimizer, self._replay = graphs.optimizer, None
                self._on_moved(
                    "memory the optimizer graph reads moved since its capture: " + "; ".join(moved)
                )
                return optimizer.step()
        replay = self._replay
        if replay is not None:
            sync = graphs.sync
            if replay.holder.cuda_graph is replay.graph and sync is not None:
                # a replay like the last one (megatron-core holds the same graph):
                # graphs.before_replay(), one call less
                sync.before_replay()
                result = graphs.wrapper()
                captures = self._captures
                captures.replays["optimizer"] += 1
                captures.last_step_replayed = step = captures.state.step
                captures.optimizer_replay_steps.add(step)
                return result
            self._replay = None  # stale: never keeps a graph megatron-core dropped alive
        if graphs.due():
            graphs.watch_hyperparameters()
            result = self._captures.bracket("optimizer", graphs.call)
            graphs.captured()
            return result
        graphs.before_replay()
        holder = compat.optimizer_graph_holder()
        replaying = holder.cuda_graph is not None  # not a warm-up call after an invalidation
        # remembered only after a capture the plugin bracketed to its end, with the sync made
        if replaying and graphs.sync is not None and "optimizer" in self._captures.replays:
            self._replay = _OptimizerReplay(holder, holder.cuda_graph)
        result = graphs.call()
        if replaying:
            self._captures.replayed("optimizer")
        return result


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _OptimizerReplay:
    """Valid while ``holder`` (megatron-core's wrapper class) holds ``graph``: the wrapper
    and the hyperparameter sync are read from the mechanism on each call, never kept here
    (megatron-core 0.19's wrapper frees the class-level graph when it is collected)."""

    holder: Any
    graph: Any
