"""The state of one run that the runtime's small objects share: its phase, the step, what
the host built, and the capture mechanisms in use.

Phases (the plugin is the machine; :meth:`RunState.advance` refuses hooks out of order)::

    CONFIGURED --model_built--> BUILT --capture--> CAPTURED --fallback--> FALLEN_BACK
         \\___________________________\\__________________\\______________________\\
                                                                       shutdown--> SHUT_DOWN
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from cudagraph_plugin.config.settings import Settings

if TYPE_CHECKING:
    from cudagraph_plugin.runtime.buckets import BucketGraphs
    from cudagraph_plugin.runtime.mechanisms import (
        FullIterationGraphs,
        OptimizerGraphs,
        TEGraphs,
    )


class Phase(enum.Enum):
    CONFIGURED = "configured"
    BUILT = "built"
    CAPTURED = "captured"
    FALLEN_BACK = "fallen_back"
    SHUT_DOWN = "shut_down"


@dataclasses.dataclass(eq=False)
class RunState:
    """What one run knows. ``active``: model graphs (full iteration or TE layers) are on and
    a CUDA device exists; ``optimizer_graph``: the optimizer step is captured too."""

    settings: Settings
    pm: Any
    cuda: bool
    phase: Phase = Phase.CONFIGURED
    # The run's hookspecs.StepProgress (from mcgraph_train_start): the step, read live, also
    # on the steps the plugin no longer listens to (runtime/steps.py); ``step`` reads it.
    progress: Any = None
    start_step: int | None = None
    model: list[Any] | None = None
    model_config: Any = None
    seq_length: int | None = None
    micro_batch_size: int | None = None
    te: TEGraphs | None = None
    full: FullIterationGraphs | None = None
    optim: OptimizerGraphs | None = None
    buckets: BucketGraphs | None = None
    train_iters: int | None = None
    # the device-side gradient-norm kernels put into megatron-core (compat.grad_norm), if any
    kernels: Any = None
    # (rank, world size) as seen while the process group lived: an aborted group forgets them
    ranks: tuple[int, int] | None = None
    # TE scopes: some rank's model chunks have a graphable layer (a pipeline stage may have
    # none); without any, no rank captures (accepted eager)
    te_layers_anywhere: bool = True
    # the run's post-warmup step fired (TE graphs are captured there)
    post_warmup_fired: bool = False
    # the ranks' settings were compared (runtime.agreement: once the process group exists)
    settings_agreed: bool = False
    # this rank's clean end came after it went on past a peer's early end: its last steps'
    # collectives wait for that peer (runtime.peer_early), as after a peer's failure
    past_peer_early_end: bool = False

    # the step as the step hooks last said it, for a host that fires them without a
    # TrainingRun (no progress)
    _step: int | None = None

    @property
    def step(self) -> int | None:
        """The training step running now (or the last one); None before the first."""
        progress = self.progress
        return self._step if progress is None else progress.step

    @step.setter
    def step(self, value: int | None) -> None:
        self._step = value

    @property
    def active(self) -> bool:
        return self.settings.enabled and self.cuda

    @property
    def optimizer_graph(self) -> bool:
        return self.settings.optimizer_cuda_graph and self.cuda

    @property
    def te_mode(self) -> bool:
        return self.active and self.settings.impl == "transformer_engine"

    @property
    def full_iteration_mode(self) -> bool:
        return self.active and self.settings.full_iteration

    def advance(self, expected: tuple[Phase, ...], new: Phase) -> None:
        if self.phase not in expected:
            raise RuntimeError(
                f"cudagraph plugin: cannot go from {self.phase.value} to {new.value} "
                f"(expected {', '.join(p.value for p in expected)}); the host fired the "
                "hooks out of order"
            )
        self.phase = new

    def rank_and_world(self) -> tuple[int, int]:
        """This rank and the job's size: as cached while the process group lived, else the
        default process group's now ((0, 1) without one)."""
        if self.ranks is not None:
            return self.ranks
        from cudagraph_plugin import compat

        return compat.distributed_world()

    def mechanisms(self) -> list[Any]:
        """The mechanisms in use, in release order (optimizer, TE, full iteration, buckets)."""
        return [m for m in (self.optim, self.te, self.full, self.buckets) if m is not None]

    def graphs_held(self) -> int:
        return sum(m.graph_count() for m in self.mechanisms())

    def no_graph_reason(self) -> str | None:
        """Why this run cannot capture at all, or None when it can."""
        if not (self.settings.enabled or self.settings.optimizer_cuda_graph):
            return "CUDA graphs are off (cuda_graph_impl=none)"
        if not self.cuda:
            return "no CUDA device (CUDA graphs need one; the run was eager)"
        return None
