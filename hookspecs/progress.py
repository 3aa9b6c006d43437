"""Where a training run is, for plugins that need the step without the per-step hooks."""

from __future__ import annotations


class StepProgress:
    """Where a run is, read live: ``step`` is the training step running now (from the
    moment :meth:`TrainingRun.train_step` is entered, before any hook), or the last one
    that ran; ``None`` before the first. Given to plugins by ``mcgraph_train_start``, so
    that a plugin can know the step without implementing the per-step hooks (which are
    not dispatched when nobody implements them). Written only by the run."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: int | None = None

    def __repr__(self) -> str:
        return f"StepProgress(step={self.step})"
