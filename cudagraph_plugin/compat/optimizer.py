"""megatron-core 0.17+'s optimizer graph (``OptimizerCudaGraphWrapper``) and what the
optimizer step needs to be capturable."""

from __future__ import annotations

import inspect
import sys
from typing import Any


def make_optimizer_graph_wrapper(step: Any, warmup_steps: int, use_single_mempool: bool) -> Any:
    """megatron-core's ``OptimizerCudaGraphWrapper`` around a bound ``optimizer.step``;
    ``use_single_mempool`` where it takes it (0.18+)."""
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper

    if "use_single_mempool" in inspect.signature(OptimizerCudaGraphWrapper.__init__).parameters:
        return OptimizerCudaGraphWrapper(
            step, cuda_graph_warmup_steps=warmup_steps, use_single_mempool=use_single_mempool
        )
    return OptimizerCudaGraphWrapper(step, cuda_graph_warmup_steps=warmup_steps)


def optimizer_graph_holder() -> Any:
    """The class that holds megatron-core's optimizer graph (``cuda_graph``, class level)."""
    # read on every optimizer step: the module from sys.modules rather than an import
    # statement each time (the class itself is read each time: tests replace it)
    module = sys.modules.get("megatron.core.optimizer.optimizer_cuda_graph")
    if module is None:
        from megatron.core.optimizer import optimizer_cuda_graph as module
    return module.OptimizerCudaGraphWrapper


def is_optimizer_graph_wrapper(obj: Any) -> bool:
    """``obj`` is a megatron-core ``OptimizerCudaGraphWrapper`` (a host's own, say:
    Megatron-LM's ``train()`` wraps ``optimizer.step`` in one); False where megatron-core
    has none."""
    try:
        holder = optimizer_graph_holder()
    except (ImportError, AttributeError):
        return False
    return isinstance(obj, holder)


def optimizer_graph_captured() -> bool:
    return optimizer_graph_holder().cuda_graph is not None


def optimizer_graph_calls() -> int:
    return optimizer_graph_holder().curr_iteration


def optimizer_graph_state_dirty() -> bool:
    cls = optimizer_graph_holder()
    return cls.cuda_graph is not None or cls.curr_iteration != 0 or cls.result is not None


def free_optimizer_graph() -> int:
    """Free the class-level optimizer graph (``reset()``) and forget it; 1 if one was held."""
    cls = optimizer_graph_holder()
    graph, cls.cuda_graph = cls.cuda_graph, None
    if graph is None:
        return 0
    graph.reset()
    return 1


def reset_optimizer_graph_counters() -> None:
    cls = optimizer_graph_holder()
    cls.result = None
    cls.curr_iteration = 0


def grad_norm_on_device() -> bool | None:
    """Whether megatron-core computes the gradient norm with fused multi-tensor kernels
    (Transformer Engine's or Apex's), on the device. Without either it falls back to
    ``megatron.core.utils.local_multi_tensor_l2_norm``, which reads the norm on the host
    (``float(...)``): an optimizer step that does so cannot be captured (seen on an H200,
    megatron-core 0.19.2 with Transformer Engine 2.11 and no Apex). None: not known."""
    try:
        from megatron.core.optimizer import clip_grads
    except ImportError:
        return None
    implementation = getattr(clip_grads, "l2_norm_impl", None)
    if implementation is None:
        return None
    return getattr(implementation, "__module__", None) != "megatron.core.utils"


def optimizer_config(optimizer: Any) -> Any:
    """The ``OptimizerConfig`` megatron-core built ``optimizer`` from (a chained optimizer's
    first), or None for an optimizer without one."""
    config = getattr(optimizer, "config", None)
    if config is None:
        chained = getattr(optimizer, "chained_optimizers", None) or []
        config = getattr(chained[0], "config", None) if chained else None
    return config


def optimizer_is_capturable(optimizer: Any) -> bool | None:
    """``OptimizerConfig.optimizer_cuda_graph`` of the built optimizer (it makes megatron-core
    build a capturable Adam); None when the optimizer has no megatron-core config."""
    config = optimizer_config(optimizer)
    if config is None:
        return None
    return bool(getattr(config, "optimizer_cuda_graph", False))


def torch_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside megatron-core's wrappers (``ChainedOptimizer`` →
    ``chained_optimizers``, nested ones too; ``MegatronOptimizer`` → ``.optimizer``), or
    ``optimizer`` itself."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for part in chained for inner in torch_optimizers(part)]
    inner = vars(optimizer).get("optimizer") if hasattr(optimizer, "__dict__") else None
    if inner is None:
        return []
    return torch_optimizers(inner)
