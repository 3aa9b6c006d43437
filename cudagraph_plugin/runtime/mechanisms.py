"""The capture mechanisms, behind one small interface.

* :class:`FullIterationGraphs` — megatron-core's ``FullCudaGraphWrapper`` around the
  whole forward/backward; it captures on its ``warmup_steps``-th call per stage
  (training, validation) and keeps graphs, counters and static buffers on its classes.
* :class:`TEGraphs` — megatron-core's ``TECudaGraphHelper``: per-layer Transformer Engine
  graphs, captured when the plugin calls :meth:`TEGraphs.create`.
* :class:`OptimizerGraphs` — megatron-core 0.17+'s ``OptimizerCudaGraphWrapper`` around the
  host's ``optimizer.step``; it captures on its ``warmup_steps``-th call and keeps the graph
  on its class. Installing it replaces ``optimizer.step`` on the host's optimizer (as
  Megatron-LM and Megatron-Bridge do); releasing it puts the original back.

Each answers :meth:`graph_count` and lists the resources it holds as
:class:`~cudagraph_plugin.runtime.release.ReleaseStep` s, one per resource, so that shutdown can
release each in its own guarded step. None fires hooks, times or measures anything:
the plugin brackets their captures. All megatron-core access goes through ``compat``.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.fingerprint import AddressFingerprint, MoveWatch
from cudagraph_plugin.runtime.optimizer_sync import HyperparameterSync, promote_lr_to_tensor
from cudagraph_plugin.runtime.release import ReleaseStep

logger = logging.getLogger("cudagraph_plugin")


class FullIterationGraphs:
    """Full-iteration graphs: one ``FullCudaGraphWrapper`` per forward/backward function the
    host hands over (they share megatron-core's class-level graphs and counters)."""

    def __init__(self, warmup_steps: int, use_single_mempool: bool) -> None:
        self.warmup_steps = warmup_steps
        self.use_single_mempool = use_single_mempool
        if compat.full_iteration_state_dirty():
            logger.warning(
                "megatron-core's FullCudaGraphWrapper holds state from an earlier run in this "
                "process (a graph or a non-zero step counter); resetting it so this run "
                "captures after its own %d warm-up step(s)",
                warmup_steps,
            )
            compat.free_full_iteration_graphs()
        self._wrappers: dict[int, tuple[Any, Any]] = {}

    def wrapper_for(self, func: Any) -> Any:
        """The megatron-core wrapper of ``func`` (the same one each time for one function)."""
        key = id(func)
        if key not in self._wrappers:
            wrapper = compat.make_full_iteration_wrapper(
                func, self.warmup_steps, self.use_single_mempool
            )
            self._wrappers[key] = (func, wrapper)  # func kept alive: its id stays unique
        return self._wrappers[key][1]

    def due(self, stage: str) -> bool:
        """The next call of ``stage`` is the capture call."""
        return (
            not compat.full_iteration_captured(stage)
            and compat.full_iteration_calls(stage) == self.warmup_steps
        )

    @staticmethod
    def call(wrapper: Any, kwargs: dict[str, Any]) -> Any:
        compat.order_input_copy_after_replay(wrapper)
        return wrapper(**kwargs)

    def graph_count(self) -> int:
        return sum(compat.full_iteration_captured(stage) for stage in compat.STAGES)

    @staticmethod
    def graph_release_steps() -> list[ReleaseStep]:
        """The graphs alone (the opt-in fallback frees them and carries on eagerly)."""
        return [
            ReleaseStep(
                f"full-iteration {stage} graph",
                functools.partial(compat.free_full_iteration_graph, stage),
                frees_graphs=True,
            )
            for stage in compat.STAGES
        ]

    def release_steps(self) -> list[ReleaseStep]:
        return [
            *self.graph_release_steps(),
            ReleaseStep(
                "FullCudaGraphWrapper step counters and results",
                compat.reset_full_iteration_counters,
            ),
            ReleaseStep("full-iteration static input buffers", compat.clear_static_buffers),
            ReleaseStep("shared CUDA graph pool handle", compat.forget_shared_graph_pool),
            ReleaseStep("FullCudaGraphWrapper objects", self._wrappers.clear),
        ]


class TEGraphs:
    """Per-layer Transformer Engine graphs through megatron-core's ``TECudaGraphHelper``."""

    def __init__(
        self,
        model: list[Any],
        model_config: Any,
        seq_length: int,
        micro_batch_size: int,
        optimizers: list[Any],
    ) -> None:
        self.helper: Any = compat.make_te_helper(
            model, model_config, seq_length, micro_batch_size, optimizers
        )

    def layer_count(self) -> int:
        return compat.te_layer_count(self.helper)

    def skips_empty_stage(self) -> bool:
        return compat.te_skips_empty_stage(self.helper)

    def capture_done(self) -> bool:
        return compat.te_capture_done(self.helper)

    def create(self) -> None:
        self.helper.create_cudagraphs()

    def set_manual_hooks(self) -> None:
        self.helper.cuda_graph_set_manual_hooks()

    def graph_count(self) -> int:
        return 0 if self.helper is None else compat.te_graph_count(self.helper)

    def release_steps(self) -> list[ReleaseStep]:
        return [*self.undo_steps(), ReleaseStep("TECudaGraphHelper", self._drop)]

    def undo_steps(self) -> list[ReleaseStep]:
        """What a capture that raised leaves (megatron-core's capture flag, the graphs the
        layers already hold): undone at once, the helper kept for the report and shutdown."""
        return [
            ReleaseStep("megatron-core's TE capture flag", self._end_stuck_capture),
            ReleaseStep("TE per-layer graphs", self._free, frees_graphs=True),
        ]

    @staticmethod
    def _end_stuck_capture() -> None:
        if compat.end_stuck_te_capture():
            logger.warning("the TE capture failed midway; cleared megatron-core's capture flag")

    def _free(self) -> int:
        return 0 if self.helper is None else compat.free_te_graphs(self.helper)

    def _drop(self) -> None:
        self.helper = None


class OptimizerGraphs:
    """The optimizer step in a CUDA graph (megatron-core's ``OptimizerCudaGraphWrapper``)."""

    def __init__(self, optimizer: Any, warmup_steps: int, use_single_mempool: bool) -> None:
        # megatron-core's wrapper frees the class-level graph in its __del__, whichever
        # instance captured it: wrappers of earlier runs left in reference cycles (a host's
        # own, refused: optimizer.step = wrapper(optimizer.step) is one) are collected now,
        # before this run captures, not when the collector reaches them in its middle
        gc.collect()
        if compat.optimizer_graph_state_dirty():
            logger.warning(
                "megatron-core's OptimizerCudaGraphWrapper holds state from an earlier run in "
                "this process; resetting it so this run captures after its own %d warm-up "
                "step(s)",
                warmup_steps,
            )
            compat.free_optimizer_graph()
            compat.reset_optimizer_graph_counters()
        self.optimizer: Any = optimizer
        self._own_step = vars(optimizer).get("step")  # an instance attribute the host set
        self.wrapper: Any = compat.make_optimizer_graph_wrapper(
            optimizer.step, warmup_steps, use_single_mempool
        )
        self.warmup_steps = warmup_steps
        self.sync: HyperparameterSync | None = None  # made right before the capture
        self._released_description: str | None = None  # the sync's, once an invalidation freed it
        self.on_capture: list[Callable[[], None]] = []  # called after each capture
        # Without buckets (whose address check covers this graph): where the optimizer's
        # state lies at the capture, and what moved it since (watch_moves)
        self.moves: MoveWatch | None = None

    def watch_hyperparameters(self) -> None:
        """Right before the capture: the learning rate in device tensors, each watched."""
        promote_lr_to_tensor(self.optimizer)
        self.sync = HyperparameterSync.watch(self.optimizer)

    def before_replay(self) -> None:
        """A value the host wrote into the param groups since the last step reaches the
        captured step (or is refused with the fix) before it replays."""
        if self.sync is not None:
            self.sync.before_replay()

    def install(self, step: Callable[[], Any]) -> None:
        """Make ``optimizer.step`` call ``step`` (which calls :meth:`call`)."""
        self.optimizer.step = step

    def due(self) -> bool:
        """The next ``optimizer.step()`` is the capture call."""
        return (
            not compat.optimizer_graph_captured()
            and compat.optimizer_graph_calls() == self.warmup_steps
        )

    def call(self) -> Any:
        return self.wrapper()

    def graph_count(self) -> int:
        return int(compat.optimizer_graph_captured())

    def captured(self) -> None:
        """The capture call ended (bracketed by the plugin)."""
        if self.moves is not None:
            self.moves.mark()
        for callback in self.on_capture:
            callback()

    def watch_moves(self, fingerprint: AddressFingerprint) -> None:
        """Notice memory the captured step reads being moved: ``fingerprint`` (of the
        optimizer's state) taken at the capture, and any call of megatron-core's optimizer
        offload API (a checkpoint load or an offload gives the state new memory; a replay
        would then write into freed memory). :meth:`moved` says what moved."""
        self.moves = MoveWatch(fingerprint, "optimizer state")
        self.moves.watch_offload(self.optimizer)

    def moved(self) -> list[str]:
        """What moved since the capture (nothing before one, or without :meth:`watch_moves`)."""
        return [] if self.moves is None else self.moves.moved()

    def _forget_moves(self) -> None:
        if self.moves is not None:
            self.moves.unwatch()
            self.moves.forget()
            self.moves = None

    def invalidate(self) -> int:
        """Free the graph (what it reads moved) so that megatron-core's wrapper captures
        again after ``warmup_steps`` eager calls: its counter starts over; the learning
        rate is watched afresh at that capture. Returns the graphs freed.

        The next capture gets a fresh pool handle: into megatron-core's cached shared one
        (``cuda_graph_use_single_mempool``, 0.19's default) it would trip the caching
        allocator while a host still holds an output of the freed graph (the step's
        gradient norm). Bucket graphs, the only ones tied to this, keep their own pool."""
        freed = compat.free_optimizer_graph()
        compat.reset_optimizer_graph_counters()
        compat.forget_shared_graph_pool()
        self._release_sync()
        return freed

    def release_steps(self) -> list[ReleaseStep]:
        return [
            ReleaseStep("optimizer graph", compat.free_optimizer_graph, frees_graphs=True),
            ReleaseStep(
                "OptimizerCudaGraphWrapper step counter and result",
                compat.reset_optimizer_graph_counters,
            ),
            # (the optimizer graph alone may have made megatron-core's shared pool handle:
            # the next run in the process would capture into a released pool)
            ReleaseStep("shared CUDA graph pool handle", compat.forget_shared_graph_pool),
            ReleaseStep("optimizer hyperparameter sync", self._release_sync),
            ReleaseStep("the optimizer's offload methods and address check", self._forget_moves),
            ReleaseStep("the host's optimizer.step", self._restore_step),
        ]

    def sync_description(self) -> str | None:
        """The hyperparameter sync's line for the report (the last one after an
        invalidation freed it)."""
        return self.sync.description if self.sync is not None else self._released_description

    def _release_sync(self) -> None:
        if self.sync is not None:
            self._released_description = self.sync.description
            self.sync.release()
            self.sync = None

    def _restore_step(self) -> None:
        if self.optimizer is None:
            return
        if self._own_step is not None:
            self.optimizer.step = self._own_step
        else:
            vars(self.optimizer).pop("step", None)  # the class's method again
        self.optimizer = None
        self.wrapper = None
        self.on_capture = []
