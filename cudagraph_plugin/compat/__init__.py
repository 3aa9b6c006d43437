"""The only code that knows megatron-core's and Transformer Engine's runtime APIs and how
they differ between versions (imported lazily: nothing here imports torch or megatron at
import time).

| concept                  | megatron-core 0.16.x              | 0.18+ / 0.19.x                   |
|--------------------------|-----------------------------------|----------------------------------|
| full-iteration config    | impl="local", scope=[full_iter.]  | impl="full_iteration", modules=[]|
| TE scopes config         | cuda_graph_scope (CudaGraphScope) | cuda_graph_modules (...Module)   |
| free full-iteration graph| no API: reset class state by hand | reset_cuda_graph()               |
| TE capture done          | graphs_created()                  | capture_finished()               |
| DDP build stream (TE)    | a side stream                     | a side stream                    |
| DDP build stream (full)  | any                               | get_shared_capture_stream()      |
| FullCudaGraphWrapper     | (fn, cuda_graph_warmup_steps)     | + use_single_mempool             |
| TECudaGraphHelper        | (model, config, seq, mbs, opts)   | + pg_collection                  |

The runtime calls everything through this namespace (``compat.any_rank(...)``), so a test
can replace one function for the whole plugin. Modules: ``generation`` (the generation and
its config spelling), ``device`` (device, process group, RNG tracker), ``ddp`` (building
DDP, pre-hooks), ``full_iteration``, ``optimizer``, ``te`` (the three graph mechanisms).
"""

from __future__ import annotations

from cudagraph_plugin.compat.ddp import (
    DDPBuildContext,
    forward_pre_hooks_enabled,
    mark_param_gather_due,
    param_gather_groups,
    rearm_param_gather,
    uses_forward_pre_hooks,
)
from cudagraph_plugin.compat.device import (
    GroupAbort,
    abort_process_groups,
    any_rank,
    begin_abort_process_groups,
    clear_cublas_workspaces,
    cuda_available,
    current_stream_lookup,
    default_store,
    distributed_world,
    gather_across_ranks,
    max_across_ranks,
    nccl_initialized,
    rng_tracker_state,
    te_available,
)
from cudagraph_plugin.compat.full_iteration import (
    STAGES,
    clear_static_buffers,
    copy_problem,
    copy_waits_for_current_stream,
    forget_shared_graph_pool,
    free_full_iteration_graph,
    free_full_iteration_graphs,
    full_iteration_calls,
    full_iteration_captured,
    full_iteration_graphs,
    full_iteration_state_dirty,
    is_full_iteration_wrapper,
    loader_input,
    loader_orders_its_copy,
    make_full_iteration_wrapper,
    order_input_copy_after_replay,
    reset_full_iteration_counters,
    single_mempool,
    static_buffer,
)
from cudagraph_plugin.compat.generation import (
    model_config_kwargs,
    new_generation,
    scope_names_after_build,
    versions,
)
from cudagraph_plugin.compat.optimizer import (
    free_optimizer_graph,
    grad_norm_on_device,
    is_optimizer_graph_wrapper,
    make_optimizer_graph_wrapper,
    optimizer_config,
    optimizer_graph_calls,
    optimizer_graph_captured,
    optimizer_graph_holder,
    optimizer_graph_state_dirty,
    optimizer_is_capturable,
    reset_optimizer_graph_counters,
    torch_optimizers,
)
from cudagraph_plugin.compat.te import (
    end_stuck_te_capture,
    free_te_graphs,
    graphable_layers,
    make_te_helper,
    num_microbatches_calculator_ready,
    te_capture_done,
    te_captured_microbatches,
    te_graph_count,
    te_layer_count,
    te_skips_empty_stage,
)

# Pure facts kept under their old names here for one release (they live in config now).
from cudagraph_plugin.config.environment import (
    OPTIMIZER_GRAPH_FIRST_RELEASE,
    TE_DELAY_WGRAD_WITH_ATTN,
    TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS,
    has_optimizer_graph,
    mcore_version,
)
from cudagraph_plugin.config.environment import installed_te_version as te_version
from cudagraph_plugin.config.vocabulary import (
    SCOPE_FIELD_NAMES,
    canonical_impl_and_scope,
)

__all__ = [
    "OPTIMIZER_GRAPH_FIRST_RELEASE",
    "SCOPE_FIELD_NAMES",
    "STAGES",
    "TE_DELAY_WGRAD_WITH_ATTN",
    "TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS",
    "DDPBuildContext",
    "GroupAbort",
    "abort_process_groups",
    "any_rank",
    "begin_abort_process_groups",
    "canonical_impl_and_scope",
    "clear_cublas_workspaces",
    "clear_static_buffers",
    "copy_problem",
    "copy_waits_for_current_stream",
    "cuda_available",
    "current_stream_lookup",
    "default_store",
    "distributed_world",
    "end_stuck_te_capture",
    "forget_shared_graph_pool",
    "forward_pre_hooks_enabled",
    "free_full_iteration_graph",
    "free_full_iteration_graphs",
    "free_optimizer_graph",
    "free_te_graphs",
    "full_iteration_calls",
    "full_iteration_captured",
    "full_iteration_graphs",
    "full_iteration_state_dirty",
    "gather_across_ranks",
    "grad_norm_on_device",
    "graphable_layers",
    "has_optimizer_graph",
    "is_full_iteration_wrapper",
    "is_optimizer_graph_wrapper",
    "loader_input",
    "loader_orders_its_copy",
    "make_full_iteration_wrapper",
    "make_optimizer_graph_wrapper",
    "make_te_helper",
    "mark_param_gather_due",
    "max_across_ranks",
    "mcore_version",
    "model_config_kwargs",
    "nccl_initialized",
    "new_generation",
    "num_microbatches_calculator_ready",
    "optimizer_config",
    "optimizer_graph_calls",
    "optimizer_graph_captured",
    "optimizer_graph_holder",
    "optimizer_graph_state_dirty",
    "optimizer_is_capturable",
    "order_input_copy_after_replay",
    "param_gather_groups",
    "rearm_param_gather",
    "reset_full_iteration_counters",
    "reset_optimizer_graph_counters",
    "rng_tracker_state",
    "scope_names_after_build",
    "single_mempool",
    "static_buffer",
    "te_available",
    "te_capture_done",
    "te_captured_microbatches",
    "te_graph_count",
    "te_layer_count",
    "te_skips_empty_stage",
    "te_version",
    "torch_optimizers",
    "uses_forward_pre_hooks",
    "versions",
]
