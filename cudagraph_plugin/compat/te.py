"""megatron-core's per-layer Transformer Engine graphs (``TECudaGraphHelper``)."""

from __future__ import annotations

import inspect
from typing import Any


def make_te_helper(
    model: list[Any], model_config: Any, seq_length: int, micro_batch_size: int, optimizers: list
) -> Any:
    """megatron-core's ``TECudaGraphHelper``. Where it takes ``pg_collection`` (0.19) it gets
    the model's own process groups, as Megatron-Bridge passes them; a model without them
    leaves the helper's default (the global parallel state)."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    kwargs: dict[str, Any] = {}
    if "pg_collection" in inspect.signature(TECudaGraphHelper.__init__).parameters:
        pg_collection = _model_pg_collection(model)
        if pg_collection is not None:
            kwargs["pg_collection"] = pg_collection
    return TECudaGraphHelper(
        model=model,
        config=model_config,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        optimizers=optimizers,
        **kwargs,
    )


def _model_pg_collection(model: list[Any]) -> Any:
    module = model[0] if model else None
    # DDP and Float16Module wrap the model in ``.module``.
    while module is not None and getattr(module, "pg_collection", None) is None:
        module = getattr(module, "module", None)
    return None if module is None else module.pg_collection


def graphable_layers(model: list[Any]) -> list[Any]:
    """The model chunks' layers megatron-core's TE helper graphs: its innermost
    ``GraphableMegatronModule``s (transformer and Mamba layers, not the block that holds
    them), in the model's own order."""
    from megatron.core.transformer.module import GraphableMegatronModule

    def graphable(module: Any) -> bool:
        return isinstance(module, GraphableMegatronModule)

    return [
        module
        for chunk in model
        if callable(getattr(chunk, "modules", None))
        for module in chunk.modules()
        if graphable(module) and not any(map(graphable, list(module.modules())[1:]))
    ]


def te_capture_done(helper: Any) -> bool:
    """``create_cudagraphs()`` has run (0.19 separates this from "graphs exist")."""
    if hasattr(helper, "capture_finished"):
        return helper.capture_finished()
    return helper.graphs_created()


def te_graph_count(helper: Any) -> int:
    return sum(len(layer.cuda_graphs) for layers in helper.callables_per_chunk for layer in layers)


def te_skips_empty_stage(helper: Any) -> bool:
    """The helper captures on a rank whose chunks have no graphable layer (0.19: its
    ``create_cudagraphs`` tests ``self.flattened_callables``, logs "No graphable layers
    found" and still meets the other ranks at its barriers); 0.16's hands TE's
    make_graphed_callables nothing, which fails. Read from the method's source, which says
    it whatever the version number; without the source, from 0.19's ``capture_finished``."""
    import re

    try:
        source = inspect.getsource(type(helper).create_cudagraphs)
    except (OSError, TypeError):
        return hasattr(helper, "capture_finished")
    return re.search(r"if (not )?self\.flattened_callables\s*:", source) is not None


def te_captured_microbatches(helper: Any) -> int | None:
    """How many micro-batches the helper captured one graph each for, when a training
    forward/backward must run exactly that many: with pipeline parallelism (or expert-parallel
    overlap) the layers replay graph ``micro-batch % count`` and Transformer Engine reuses
    their buffers in the captured order. None when one graph serves every micro-batch (no
    pipeline parallelism: megatron-core then captures one) or the helper does not say."""
    count = getattr(helper, "num_microbatches", None)
    if isinstance(count, bool) or not isinstance(count, int):
        return None
    from megatron.core import parallel_state

    try:
        pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    except (AssertionError, AttributeError, RuntimeError):
        pipelined = False
    if pipelined or getattr(helper.config, "overlap_moe_expert_parallel_comm", False):
        return count
    return None


def te_layer_count(helper: Any) -> int:
    return len(helper.flattened_callables)


def num_microbatches_calculator_ready() -> bool:
    """megatron-core's global micro-batch calculator is set up (``TECudaGraphHelper`` reads
    it while capturing, as Megatron-LM's loop always has it)."""
    from megatron.core import num_microbatches_calculator as calc

    return calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None


def end_stuck_te_capture() -> bool:
    """Clear megatron-core's "capturing" flag if a failed ``create_cudagraphs()`` left it
    set (it is global: every later forward would take the capture path). Returns whether
    it was stuck."""
    import gc as _gc

    from megatron.core.transformer import cuda_graphs

    if not cuda_graphs.is_graph_capturing():
        return False
    cuda_graphs._set_capture_end()
    # _start_capturing froze the garbage collector before failing where megatron-core's
    # FREEZE_GC is on (off with torch >= 2.9); otherwise leave the host's own frozen objects.
    if getattr(cuda_graphs, "FREEZE_GC", False):
        _gc.unfreeze()
    return True


def free_te_graphs(helper: Any) -> int:
    """Delete the graphs the helper's layers hold; returns how many were held.

    Also after a capture that failed in megatron-core's ``_finish_capturing``: the layers
    hold their graphs before its barrier, gradient zeroing and garbage collection, and
    ``_graphs_created`` is set only after them. A failed barrier (a peer gone, the
    communicators aborted) or an interrupt there left every graph held, replayed by the
    layers, and kept alive what it captured (an NCCL teardown waits for it)."""
    count = te_graph_count(helper)
    if not helper.graphs_created():
        if count == 0:
            return 0
        helper._graphs_created = True  # delete_cuda_graphs() asserts it; the layers hold graphs
    helper.delete_cuda_graphs()
    return count
