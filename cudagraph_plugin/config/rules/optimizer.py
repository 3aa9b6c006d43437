"""Rules on the optimizer graph (megatron-core 0.17+'s ``OptimizerCudaGraphWrapper``).

The captured ``optimizer.step()`` must stay on the device: everything megatron-core does
there that reads the host is refused, with its switch and the fix (facts read in
megatron-core 0.19.2's ``optimizer/optimizer.py``, ``optimizer/clip_grads.py``,
``optimizer_param_scheduler.py`` and Transformer Engine 2.11's ``FusedAdam``):

* zero counting (``log_num_zeros_in_grad``: ``count_zeros_fp32`` calls ``.item()``);
* loss scaling (``fp16``, or a constant ``loss_scale``: ``found_inf.item()``);
* a finite ``grad_norm_skip_threshold`` (the norm compared on the host);
* megatron-core's timers (``timing_log_level`` >= 1: they synchronise the device);
* MoE without the distributed optimizer (separate gradient-norm groups combined on the host);
* what the capturable Adam refuses: precision-aware storage other than fp32, param
  remainders, FP8 model weights; and any optimizer but Adam;
* a weight decay that changes during the run (``weight_decay_incr_style``): the captured
  kernels keep the value they were captured with.

:func:`optimizer_step_problems` is also applied at run time to the optimizer the host
built (its ``OptimizerConfig``), whatever the host's own configuration said.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import Note, Violation
from cudagraph_plugin.config.rules.base import rule, violation
from cudagraph_plugin.config.settings import Settings

TE = "Transformer Engine FusedAdam"
OFF = "turn the optimizer graph off"


@rule
def _optimizer_graph(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    if not s.optimizer_cuda_graph:
        return
    available = environment.has_optimizer_graph()
    if available is False:
        yield violation(
            s,
            ("optimizer_cuda_graph",),
            True,
            "the optimizer CUDA graph needs megatron-core's OptimizerCudaGraphWrapper, first "
            f"released in megatron-core {environment.OPTIMIZER_GRAPH_FIRST_RELEASE} (installed: "
            f"{_installed_mcore()})",
            f"install megatron-core >= {environment.OPTIMIZER_GRAPH_FIRST_RELEASE} (Python 3.12), "
            f"or {s.set_text('optimizer_cuda_graph', False)}",
        )
    elif available is None:
        yield Note(
            "megatron-core is not installed here: the optimizer graph's release is not checked"
        )
    if s.warmup_steps == 0:
        yield violation(
            s,
            ("warmup_steps", "optimizer_cuda_graph"),
            (0, True),
            "with no warm-up the optimizer graph captures the first optimizer step, which "
            "creates Adam's state",
            f"set {s.field('warmup_steps')} to 1 or more",
        )
    yield from optimizer_step_problems(s)


def optimizer_step_problems(s: Settings) -> Iterator[Violation]:
    """What in ``s`` would read the host (or be frozen) inside a captured optimizer step."""
    if s.optimizer != "adam":
        yield violation(
            s,
            ("optimizer",),
            s.optimizer,
            "megatron-core makes only Adam capturable (OptimizerConfig.optimizer_cuda_graph "
            "builds Adam with capturable=True)",
            f"use optimizer=adam, or {s.set_text('optimizer_cuda_graph', False)}",
        )
    if s.fp16:
        yield violation(
            s,
            ("fp16", "optimizer_cuda_graph"),
            (True, True),
            "fp16's loss scaler (dynamic or constant) checks the gradients for inf/NaN on the "
            "host inside the optimizer step, which a capture forbids",
            "train in bf16, or turn the optimizer graph off",
        )
    elif s.loss_scale:  # megatron-core: `if config.loss_scale:` (0 means no constant scale)
        yield violation(
            s,
            ("loss_scale", "optimizer_cuda_graph"),
            (s.loss_scale, True),
            "a loss scale makes megatron-core check the gradients for inf/NaN on the host "
            "inside optimizer.step() (found_inf.item())",
            f"unset {s.field('loss_scale')} (bf16 needs no loss scaling), or {OFF}",
        )
    if s.optimizer_cpu_offload:
        yield violation(
            s,
            ("optimizer_cpu_offload", "optimizer_cuda_graph"),
            (True, True),
            "an optimizer step offloaded to the CPU cannot be captured in a CUDA graph",
            "turn optimizer_cpu_offload or the optimizer graph off",
        )
    if s.log_num_zeros_in_grad:
        yield violation(
            s,
            ("log_num_zeros_in_grad", "optimizer_cuda_graph"),
            (True, True),
            "counting the zeros in the gradients reads the count on the host inside "
            "optimizer.step() (count_zeros_fp32 calls .item())",
            f"{s.set_text('log_num_zeros_in_grad', False)}, or {OFF}",
        )
    threshold = s.grad_norm_skip_threshold
    if threshold is not None and math.isfinite(threshold):
        yield violation(
            s,
            ("grad_norm_skip_threshold", "optimizer_cuda_graph"),
            (threshold, True),
            "skipping a step whose gradient norm exceeds the threshold compares the norm on "
            "the host inside optimizer.step()",
            f"leave {s.field('grad_norm_skip_threshold')} at inf (megatron-core's default), "
            f"or {OFF}",
        )
    if s.timing_log_level:
        yield violation(
            s,
            ("timing_log_level", "optimizer_cuda_graph"),
            (s.timing_log_level, True),
            "megatron-core's timers synchronise the device (and barrier) inside "
            "optimizer.step() at timing log level 1 and above",
            f"set {s.field('timing_log_level')} to 0, or {OFF}",
        )
    if s.weight_decay_incr_style not in (None, "constant"):
        yield violation(
            s,
            ("weight_decay_incr_style", "optimizer_cuda_graph"),
            (s.weight_decay_incr_style, True),
            "the captured Adam keeps the weight decay it was captured with (a number baked into "
            "its kernels), so a weight decay that changes during the run would be frozen",
            f"use weight_decay_incr_style=constant, or {OFF}",
        )
    if s.is_moe and not s.use_distributed_optimizer:
        yield violation(
            s,
            ("num_moe_experts", "use_distributed_optimizer", "optimizer_cuda_graph"),
            (s.num_moe_experts, False, True),
            "an MoE model without the distributed optimizer gets separate optimizers for dense "
            "and expert parameters, whose gradient norms megatron-core combines on the host",
            f"use the distributed optimizer ({s.set_text('use_distributed_optimizer', True)}), "
            f"or {OFF}",
        )
    if s.use_precision_aware_optimizer:
        yield from _capturable_adam(s)
    if s.fp8_param:
        yield violation(
            s,
            ("fp8_param", "optimizer_cuda_graph"),
            (True, True),
            "the capturable Adam refuses FP8 model weights",
            f"keep the model weights in bf16 (drop {s.field('fp8_param')}), or {OFF}",
            (TE, "FusedAdam does not support FP8 model weights with capturable=True."),
        )


def _capturable_adam(s: Settings) -> Iterator[Violation]:
    """Transformer Engine's FusedAdam with ``capturable=True`` (megatron-core's precision-aware
    optimizer) keeps its master weights and moments in fp32 and stores no remainders."""
    for name, phrase in (
        ("main_params_dtype", "Capturable mode only supports fp32 master weights"),
        ("exp_avg_dtype", "Capturable mode only supports fp32 exp_avg"),
        ("exp_avg_sq_dtype", "Capturable mode only supports fp32 exp_avg_sq"),
    ):
        dtype = getattr(s, name)
        if dtype not in (None, "fp32"):
            yield violation(
                s,
                (name, "use_precision_aware_optimizer", "optimizer_cuda_graph"),
                (dtype, True, True),
                f"the capturable Adam keeps {name.removesuffix('_dtype')} in fp32 only",
                f"set {s.field(name)}=fp32, or {OFF}",
                (TE, phrase),
            )
    if s.store_param_remainders:
        yield violation(
            s,
            ("store_param_remainders", "use_precision_aware_optimizer", "optimizer_cuda_graph"),
            (True, True, True),
            "the capturable Adam stores no parameter remainders, and megatron-core's "
            "precision-aware optimizer asks for them by default",
            f"{s.set_text('store_param_remainders', False)}, or {OFF}",
            (TE, "Capturable mode doesn't support storing param remainders"),
        )


def _installed_mcore() -> str:
    try:
        return str(environment.mcore_version())
    except RuntimeError:
        return "none"
