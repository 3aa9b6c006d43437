"""The learning-rate schedule of the example hosts (``train_gpt.py``, ``rl_loop.py``) and of
the hand-written baseline (``benchmarks/handwritten.py``): one schedule, so that both sides
of a comparison train alike by construction. No plugin, no hook: megatron-core only.
"""

from __future__ import annotations

from typing import Any


def lr_scheduler(settings: Any, optimizer: Any) -> Any:
    """megatron-core's ``OptimizerParamScheduler`` (linear warm-up, then ``lr_decay_style``),
    set up as Megatron-LM sets it up and stepped once per training step after
    ``optimizer.step()``; a resumed run starts at its ``start_step``.

    ``settings`` has ``lr``, ``min_lr``, ``lr_warmup_iters``, ``lr_decay_iters`` (0 or
    ``None``: ``train_iters``), ``lr_decay_style``, ``train_iters`` and ``start_step`` (the
    example's parsed arguments, the baseline's config).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_iters = settings.lr_decay_iters or settings.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=min(settings.min_lr, settings.lr),
        lr_warmup_steps=min(settings.lr_warmup_iters, max(decay_iters - 1, 0)),
        lr_decay_steps=max(decay_iters, 1),
        lr_decay_style=settings.lr_decay_style,
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=max(settings.train_iters, 1),
        wd_incr_style="constant",
    )
    if settings.start_step:
        scheduler.step(increment=settings.start_step)
    return scheduler
