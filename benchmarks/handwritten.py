"""The baseline: the example's training loop written by hand, with CUDA graphs inline.

No plugin, no hook, no ``hookspecs``: this is the loop a Megatron-LM user writes today.
It does the same work as ``examples/train_gpt.py`` (same GPT, data, loss, DDP, optimizer
and learning-rate schedule, the same timed region ``zero_grad + forward_backward_func +
optimizer.step + scheduler.step``, timed the same way: a pair of CUDA events around each
step, read once at the log interval or the end, never a device synchronisation per step;
the wall clock on the CPU) and applies CUDA graphs the way Megatron-LM's
``megatron/training/training.py`` does (megatron-core 0.19.2's copy):

* DDP is built on ``get_shared_capture_stream()`` for full-iteration graphs on
  megatron-core >= 0.18 (``get_model``, lines ~1870-1890; 0.16 has no such stream), on a
  side stream for TE graphs, and, unlike Megatron-LM, on the current stream without graphs,
  as the plugin's host does (:func:`ddp_build_stream`);
* ``forward_backward_func`` is wrapped in ``FullCudaGraphWrapper`` (``train``, ~3614-3622;
  ``use_single_mempool`` exists from 0.18);
* with ``optimizer_cuda_graph`` (megatron-core 0.17+), ``optimizer.step`` is replaced by an
  ``OptimizerCudaGraphWrapper`` around it (``train``, ~3633-3638), built from an
  ``OptimizerConfig(optimizer_cuda_graph=True)`` (a capturable Adam); the wrapper captures at
  its call number ``cuda_graph_warmup_steps`` and ``del optimizer.step`` ends it (~4103);
* ``TECudaGraphHelper`` is created before the loop (~3713-3721) and ``create_cudagraphs()``
  runs when ``iteration - start_iteration == cuda_graph_warmup_steps`` (~3784-3794), with
  the forward pre-hooks off around it when the distributed optimizer overlaps the param
  all-gather;
* forward pre-hooks come back after the first step (~3888-3913);
* TE graphs are deleted after the loop (~4098-4100).

Two things Megatron-LM itself does not do, which a hand-written loop must, for the optimizer
graph to capture and follow the schedule on the stacks the benchmark runs:

* megatron-core's clip-grad path falls back to host-reading kernels where neither Transformer
  Engine 2.14+'s nor Apex's multi-tensor kernels import (TE 2.11: the capture fails). A
  hand-written loop has to patch the same module globals the plugin patches; this one calls
  the plugin's ``cudagraph_plugin.compat.grad_norm`` (``install()``, then ``restore()``) as a
  library, once before the loop, with no hook and nothing per step;
* torch's capturable Adam bakes a Python-number learning rate into the graph: its param groups
  get the learning rate in a device tensor before the capture (Transformer Engine's and Apex's
  capturable FusedAdam hold one already; megatron-core 0.17+'s scheduler fills it in place).

Unlike Megatron-LM (which never frees full-iteration graphs), the graphs are freed in a
``finally`` at the end, so that several runs share one process, as the benchmark's runs do.

On the CPU (``cpu=True``, under ``examples/cpu_redirect.py``) nothing can be captured: the
full-iteration wrapper runs its eager warm-up path for every step, and the TE branch drives
a recording stand-in of ``TECudaGraphHelper`` (the real one needs Transformer Engine and a
GPU), so every branch of the loop runs and the losses match the plugin's eager CPU run. The
optimizer graph needs a CUDA device (a capturable Adam) and megatron-core 0.17+: elsewhere
:func:`optimizer_graph_unavailable` says why and :func:`run` refuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

# The example host's own step clock and learning-rate schedule (no plugin): both sides
# time and train alike.
from lr_schedule import lr_scheduler  # noqa: E402
from step_clock import StepClock  # noqa: E402

logger = logging.getLogger("handwritten")


@dataclasses.dataclass
class BaselineConfig:
    """The subset of ``train_gpt.py``'s flags the benchmark uses, with its defaults."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    vocab_size: int = 128
    transformer_impl: str = "local"
    bf16: bool = False
    seq_length: int = 32
    micro_batch_size: int = 2
    num_microbatches: int = 1
    train_iters: int = 10
    start_step: int = 0
    lr: float = 3e-3
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 10
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    cuda_graph_impl: str = "none"
    cuda_graph_scope: Sequence[str] = ()
    cuda_graph_warmup_steps: int = 3
    optimizer_cuda_graph: bool = False
    cpu: bool = False
    # torch.profiler over steps profile_first .. profile_first + profile_steps - 1 (GPU
    # activity on a GPU, CPU activity on the CPU), its Chrome trace written to trace_path.
    profile_first: int | None = None
    profile_steps: int = 0
    trace_path: str | None = None


# -------------------------------------------------------------------------------------------
# megatron-core version and the graph settings, spelled for it.
# -------------------------------------------------------------------------------------------


def mcore_new_generation() -> bool:
    """megatron-core >= 0.18: ``impl="full_iteration"``, ``cuda_graph_modules``, the shared
    capture stream, ``use_single_mempool`` and ``capture_finished()``."""
    import megatron.core
    from packaging.version import Version

    return Version(megatron.core.__version__) >= Version("0.18.0")


def optimizer_graph_unavailable(use_cuda: bool) -> str | None:
    """Why the optimizer step cannot be captured here (``None``: it can): megatron-core
    0.17+ has ``OptimizerCudaGraphWrapper``, and its capturable Adam needs a CUDA device."""
    import megatron.core

    try:
        from megatron.core.optimizer import optimizer_cuda_graph  # noqa: F401
    except ImportError:
        return (
            f"megatron-core {megatron.core.__version__} has no optimizer graph "
            "(OptimizerCudaGraphWrapper, megatron-core 0.17+)"
        )
    if not use_cuda:
        return "the optimizer graph needs a CUDA device (a capturable Adam, captured on a stream)"
    return None


def ddp_build_stream(graphs: bool, full_iteration: bool, new_generation: bool) -> str | None:
    """The stream DDP is built on: ``"shared"`` (megatron-core's shared capture stream),
    ``"side"`` (a new stream) or ``None`` (the current stream).

    The plugin's host builds it there (the plugin's ``DDPBuildContext``): with full-iteration
    graphs on the shared capture stream (0.18+; 0.16 has none), with TE graphs on a side
    stream, without graphs on the current stream (the plugin is not active). Megatron-LM 0.19
    (``get_model``, ~1870) uses a side stream without graphs too; that is not followed here:
    autograd runs every parameter's ``AccumulateGrad`` node, with DDP's gradient hook, on the
    stream DDP was built on, so a side stream would add cross-stream waits to every eager
    backward of this loop and not of the plugin's.
    """
    if not graphs:
        return None
    if full_iteration:
        return "shared" if new_generation else None
    return "side"


def graph_config_fields(impl: str, scope: Sequence[str], warmup_steps: int) -> dict[str, Any]:
    """``TransformerConfig`` fields for CUDA graphs, as Megatron-LM's arguments set them."""
    if impl == "none":
        return {"cuda_graph_impl": "none"}
    fields: dict[str, Any] = {
        "cuda_graph_impl": impl,
        "cuda_graph_warmup_steps": warmup_steps,
        "use_te_rng_tracker": True,
    }
    if mcore_new_generation():
        if "full_iteration" in scope:
            fields.update(cuda_graph_impl="full_iteration", cuda_graph_modules=[])
        else:
            fields["cuda_graph_modules"] = list(scope)
    else:
        fields["cuda_graph_scope"] = list(scope)
    return fields


# -------------------------------------------------------------------------------------------
# Data, loss and forward step: the same as train_gpt.py's.
# -------------------------------------------------------------------------------------------


def synthetic_batches(
    *, seed: int, micro_batch_size: int, seq_length: int, vocab_size: int, device: torch.device
) -> Iterator[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_length + 1)
    position_ids = torch.arange(seq_length).unsqueeze(0).repeat(micro_batch_size, 1)
    loss_mask = torch.ones(micro_batch_size, seq_length)
    while True:
        starts = torch.randint(0, vocab_size, (micro_batch_size, 1), generator=generator)
        sequence = (starts + offsets) % vocab_size
        yield {
            "tokens": sequence[:, :-1].to(device),
            "labels": sequence[:, 1:].to(device),
            "loss_mask": loss_mask.to(device),
            "position_ids": position_ids.to(device),
            "attention_mask": None,
        }


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[Any, Any]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _mean_loss(loss_dicts: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    # A new tensor: a full-iteration graph's outputs are overwritten by the next replay.
    totals = torch.stack([d["lm loss"] for d in loss_dicts]).sum(dim=0)
    return totals[0] / totals[1].clamp(min=1)


# -------------------------------------------------------------------------------------------
# Set-up: the same as train_gpt.py's.
# -------------------------------------------------------------------------------------------


def _init_distributed(use_cuda: bool) -> None:
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if use_cuda else "gloo"
    if "MASTER_ADDR" in os.environ:
        torch.distributed.init_process_group(
            backend,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    else:
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)


def _destroy_distributed() -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _transformer_config_fields(cfg: BaselineConfig, use_cuda: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    fields: dict[str, Any] = {
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "tensor_model_parallel_size": 1,
        "sequence_parallel": False,
        "use_cpu_initialization": not use_cuda,
        "bf16": cfg.bf16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
    }
    if cfg.ffn_hidden_size is not None:
        fields["ffn_hidden_size"] = cfg.ffn_hidden_size
    return fields


def _layer_spec(cfg: BaselineConfig) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if cfg.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec()


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _build_model(cfg: BaselineConfig, config: Any, ddp_stream: Any) -> list[Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    module: Any = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=True,
    )
    module.cuda(torch.cuda.current_device())
    if cfg.bf16:
        module = Float16Module(config, module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.bf16,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    # Megatron-LM: "DDP initialization must use the full-iteration capture stream so its
    # retained AccumulateGrad nodes do not reference a different, non-capturing stream."
    build_stream = _on_stream(ddp_stream) if ddp_stream is not None else contextlib.nullcontext()
    with build_stream:
        return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)]


def _build_optimizer(cfg: BaselineConfig, model: list[Any]) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    fields: dict[str, Any] = {}
    if cfg.optimizer_cuda_graph:
        fields["optimizer_cuda_graph"] = True  # Megatron-LM's --optimizer-cuda-graph
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=min(cfg.min_lr, cfg.lr),
        weight_decay=0.01,
        clip_grad=cfg.clip_grad,
        bf16=cfg.bf16,
        params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        **fields,
    )
    return get_megatron_optimizer(optimizer_config, model)


def _wire_grad_sync(cfg: BaselineConfig, config: Any, model: list[Any], optimizer: Any) -> None:
    from megatron.core.distributed import finalize_model_grads

    (chunk,) = model
    if cfg.overlap_grad_reduce:
        config.no_sync_func = chunk.no_sync
        config.grad_sync_func = chunk.start_grad_sync
    if cfg.overlap_param_gather:
        config.param_sync_func = chunk.start_param_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def _disable_forward_pre_hook(model: list[Any], param_sync: bool = True) -> None:
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def _enable_forward_pre_hook(model: list[Any]) -> None:
    for chunk in model:
        chunk.enable_forward_pre_hook()


# -------------------------------------------------------------------------------------------
# CUDA graph objects: freeing them, and the CPU stand-in of the TE helper.
# -------------------------------------------------------------------------------------------


def free_full_iteration_graphs() -> int:
    """Free the full-iteration graphs and reset ``FullCudaGraphWrapper``'s class state.

    megatron-core keeps graphs, results, step counters and static input buffers on the
    classes (0.16 has no API to reset them; 0.18+'s ``reset_cuda_graph()`` leaves the static
    buffers); without this, the next run in the process would never capture.
    """
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    freed = 0
    for stage in ("training", "validation"):
        graph = FullCudaGraphWrapper.cuda_graph[stage]
        if graph is not None:
            graph.reset()
            freed += 1
        FullCudaGraphWrapper.cuda_graph[stage] = None
        FullCudaGraphWrapper.result[stage] = None
        FullCudaGraphWrapper.curr_iteration[stage] = 0
        StaticBufferLoader.static_buffers[stage].clear()
    if mcore_new_generation():
        # The process-wide pool handle is stale once its graphs are gone (see compat).
        from megatron.core import full_cuda_graph

        full_cuda_graph._shared_graph_pool = None
    return freed


def free_optimizer_graph() -> int:
    """Free the optimizer graph and reset ``OptimizerCudaGraphWrapper``'s class state (its
    graph, result and call counter live on the class, as the full-iteration wrapper's do)."""
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper

    graph, OptimizerCudaGraphWrapper.cuda_graph = OptimizerCudaGraphWrapper.cuda_graph, None
    OptimizerCudaGraphWrapper.result = None
    OptimizerCudaGraphWrapper.curr_iteration = 0
    if graph is None:
        return 0
    graph.reset()
    return 1


def _lr_in_device_tensors(optimizer: Any) -> None:
    """A capturable torch Adam reads a tensor learning rate on the device at every replay but
    bakes a Python number into the graph: give its param groups tensors before the capture
    (megatron-core 0.17+'s scheduler fills them in place). Transformer Engine's and Apex's
    capturable FusedAdam hold tensors already."""
    for chained in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(chained, "optimizer", chained)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if group.get("capturable") and group["params"] and not torch.is_tensor(group["lr"]):
                device = group["params"][0].device
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


class CpuTeHelperStandIn:
    """Records what the loop asks of ``TECudaGraphHelper`` on a machine that cannot capture.

    Same constructor and methods as megatron-core's helper (both generations); nothing is
    captured, the layers stay eager.
    """

    def __init__(
        self,
        model: list[Any],
        config: Any,
        seq_length: int,
        micro_batch_size: int,
        optimizers: list[Any],
    ) -> None:
        self.calls: list[str] = ["__init__"]
        self._created = False

    def create_cudagraphs(self) -> None:
        self.calls.append("create_cudagraphs")
        self._created = True

    def cuda_graph_set_manual_hooks(self) -> None:
        self.calls.append("cuda_graph_set_manual_hooks")

    def graphs_created(self) -> bool:
        return self._created

    def capture_finished(self) -> bool:
        return self._created

    def delete_cuda_graphs(self) -> None:
        self.calls.append("delete_cuda_graphs")
        self._created = False


def _te_capture_finished(helper: Any, new_generation: bool) -> bool:
    # Megatron-LM 0.19 asks capture_finished(); 0.16's helper only has graphs_created().
    return helper.capture_finished() if new_generation else helper.graphs_created()


# -------------------------------------------------------------------------------------------
# The run.
# -------------------------------------------------------------------------------------------


def _synchronize(use_cuda: bool) -> None:
    if use_cuda:
        torch.cuda.synchronize()


class StepProfiler:
    """``torch.profiler`` over steps ``first .. first + count - 1``: started before the first
    one's work and stopped after the last one's, the device synchronised at both ends (as
    ``benchmarks/gpu_limit.py``'s profiler does around the plugin's steps)."""

    def __init__(self, first: int, count: int, use_cuda: bool, trace_path: str) -> None:
        self.first, self.last = first, first + count - 1
        self.use_cuda = use_cuda
        self.trace_path = trace_path
        self.profiler: Any = None
        self.done = False

    def before_step(self, iteration: int) -> None:
        if iteration != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        _synchronize(self.use_cuda)
        activity = ProfilerActivity.CUDA if self.use_cuda else ProfilerActivity.CPU
        self.profiler = profile(activities=[activity])
        self.profiler.start()

    def after_step(self, iteration: int) -> None:
        if self.profiler is None or iteration != self.last:
            return
        _synchronize(self.use_cuda)
        self.stop()
        self.done = True

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.export_chrome_trace(self.trace_path)
            self.profiler = None


def _train(cfg: BaselineConfig, use_cuda: bool, out: dict[str, Any]) -> None:
    from megatron.core import parallel_state
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    new_generation = mcore_new_generation()
    graphs = cfg.cuda_graph_impl != "none"
    full_iteration = cfg.cuda_graph_impl == "local" and "full_iteration" in cfg.cuda_graph_scope
    te_graphs = cfg.cuda_graph_impl == "transformer_engine"
    # Megatron-LM's should_disable_forward_pre_hook(args).
    toggle_pre_hooks = cfg.use_distributed_optimizer and cfg.overlap_param_gather

    _init_distributed(use_cuda)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    # Megatron-LM's start-up sets the global micro-batch calculator; TECudaGraphHelper reads it.
    init_num_microbatches_calculator(
        rank=torch.distributed.get_rank(),
        rampup_batch_size=None,
        global_batch_size=cfg.micro_batch_size * cfg.num_microbatches,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_size=1,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng: dict[str, Any] = {"seed": cfg.seed, "force_reset_rng": True}
    if not use_cuda:
        rng["inference_rng_tracker"] = True
    if graphs and use_cuda:
        # Megatron-LM: --te-rng-tracker, and graph-safe RNG states whenever graphs are on.
        rng.update(te_rng_tracker=True, use_cudagraphable_rng=True)
    model_parallel_cuda_manual_seed(**rng)

    fields = _transformer_config_fields(cfg, use_cuda)
    fields.update(
        graph_config_fields(
            cfg.cuda_graph_impl if use_cuda else "none",
            cfg.cuda_graph_scope,
            cfg.cuda_graph_warmup_steps,
        )
    )
    config = TransformerConfig(**fields)

    ddp_stream = None
    stream_kind = ddp_build_stream(graphs and use_cuda, full_iteration, new_generation)
    if stream_kind == "shared":
        from megatron.core.full_cuda_graph import get_shared_capture_stream

        ddp_stream = get_shared_capture_stream()
    elif stream_kind == "side":
        ddp_stream = torch.cuda.Stream()
    model = _build_model(cfg, config, ddp_stream)
    optimizer = _build_optimizer(cfg, model)
    _wire_grad_sync(cfg, config, model, optimizer)
    scheduler = lr_scheduler(cfg, optimizer)

    forward_backward_func = get_forward_backward_func()
    if full_iteration:
        # On the CPU the capture call can never come: the wrapper's warm-up path runs eagerly.
        warmup = cfg.cuda_graph_warmup_steps if use_cuda else cfg.train_iters + 1
        if new_generation:
            # Megatron-LM passes config.cuda_graph_use_single_mempool, True by default.
            forward_backward_func = FullCudaGraphWrapper(
                forward_backward_func, cuda_graph_warmup_steps=warmup, use_single_mempool=True
            )
        else:
            forward_backward_func = FullCudaGraphWrapper(
                forward_backward_func, cuda_graph_warmup_steps=warmup
            )
        out["graph_path"] = "FullCudaGraphWrapper" + ("" if use_cuda else " (CPU: eager warm-up)")

    batch_shape = {
        "micro_batch_size": cfg.micro_batch_size,
        "seq_length": cfg.seq_length,
        "vocab_size": cfg.vocab_size,
        "device": device,
    }
    dp_rank = parallel_state.get_data_parallel_rank()
    train_iter = synthetic_batches(seed=cfg.seed + 1 + dp_rank, **batch_shape)
    step_args = {
        "forward_step_func": forward_step,
        "model": model,
        "num_microbatches": cfg.num_microbatches,
        "seq_length": cfg.seq_length,
        "micro_batch_size": cfg.micro_batch_size,
    }

    start_iteration = cfg.start_step
    param_sync_func = config.param_sync_func
    if toggle_pre_hooks:
        _disable_forward_pre_hook(model, param_sync=False)
        config.param_sync_func = None

    clock = StepClock(use_cuda)
    profiler = None
    if cfg.profile_steps > 0 and cfg.profile_first is not None:
        trace_path = cfg.trace_path or "handwritten_trace.json"
        profiler = StepProfiler(cfg.profile_first, cfg.profile_steps, use_cuda, trace_path)
    cuda_graph_helper: Any = None
    grad_norm_kernels: Any = None
    optimizer_graph: Any = None  # OptimizerCudaGraphWrapper, whose class holds the graph
    try:
        if cfg.optimizer_cuda_graph:
            from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper

            from cudagraph_plugin.compat import grad_norm

            # The clip-grad path's host reads, replaced where megatron-core has them (see the
            # module's docstring): a library call, once, not a hook.
            grad_norm_kernels = grad_norm.install()
            if grad_norm_kernels.reads_host_after:
                raise RuntimeError(
                    "the optimizer graph cannot be captured: megatron-core's clip-grad path "
                    f"still reads the host ({grad_norm_kernels.reason})"
                )
            _lr_in_device_tensors(optimizer)
            free_optimizer_graph()  # an earlier run's class state, if any
            wrapper_args: dict[str, Any] = {"cuda_graph_warmup_steps": cfg.cuda_graph_warmup_steps}
            if new_generation:
                wrapper_args["use_single_mempool"] = True
            optimizer_graph = OptimizerCudaGraphWrapper
            optimizer.step = OptimizerCudaGraphWrapper(optimizer.step, **wrapper_args)
            out["optimizer_graph_path"] = "OptimizerCudaGraphWrapper"

        if te_graphs:
            from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

            helper_class = TECudaGraphHelper if use_cuda else CpuTeHelperStandIn
            cuda_graph_helper = helper_class(
                model=model,
                config=config,
                seq_length=cfg.seq_length,
                micro_batch_size=cfg.micro_batch_size,
                optimizers=[optimizer],
            )
            out["graph_path"] = helper_class.__name__

        losses: list[torch.Tensor] = out["losses_tensors"]
        step_ms: list[float] = out["step_ms"]
        step_end_time: list[float] = out["step_end_time"]
        for iteration in range(cfg.start_step, cfg.train_iters):
            if (
                te_graphs
                and not _te_capture_finished(cuda_graph_helper, new_generation)
                and iteration - start_iteration == cfg.cuda_graph_warmup_steps
            ):
                _synchronize(use_cuda)
                capture_start = time.perf_counter()
                if cfg.cuda_graph_warmup_steps > 0 and toggle_pre_hooks:
                    _disable_forward_pre_hook(model, param_sync=False)
                cuda_graph_helper.create_cudagraphs()
                if cfg.cuda_graph_warmup_steps > 0 and toggle_pre_hooks:
                    _enable_forward_pre_hook(model)
                    cuda_graph_helper.cuda_graph_set_manual_hooks()
                _synchronize(use_cuda)
                out["capture_seconds"] = time.perf_counter() - capture_start
                out["capture_step"] = iteration
            if profiler is not None:
                profiler.before_step(iteration)

            clock.start()
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            loss_dicts = forward_backward_func(
                data_iterator=train_iter, forward_only=False, **step_args
            )
            _update_successful, grad_norm_value, _ = optimizer.step()
            scheduler.step(increment=1)
            clock.stop()
            loss = _mean_loss(loss_dicts)
            losses.append(loss)
            step_end_time.append(time.perf_counter())
            if profiler is not None:
                profiler.after_step(iteration)
            if full_iteration and FullCudaGraphWrapper.cuda_graph["training"] is not None:
                out.setdefault("capture_step", iteration)
            if optimizer_graph is not None and optimizer_graph.cuda_graph is not None:
                out.setdefault("optimizer_capture_step", iteration)

            if iteration == start_iteration and toggle_pre_hooks:
                _enable_forward_pre_hook(model)
                config.param_sync_func = param_sync_func
                if te_graphs and cfg.cuda_graph_warmup_steps == 0:
                    assert _te_capture_finished(cuda_graph_helper, new_generation)
                    cuda_graph_helper.cuda_graph_set_manual_hooks()
            # The example's log line, and its one read of the device per interval.
            if cfg.log_interval and (iteration + 1) % cfg.log_interval == 0:
                times = clock.read()
                step_ms += times
                logger.info(
                    "step %d | loss %.4f | grad norm %.3f | lr %.3g | %.2f ms/step (last %d)",
                    iteration,
                    loss.item(),
                    float(grad_norm_value) if grad_norm_value is not None else float("nan"),
                    scheduler.get_lr(optimizer.param_groups[0]),
                    statistics.median(times),
                    len(times),
                )
        step_ms += clock.read()
        if profiler is not None:
            out["profiled"] = profiler.done
        if use_cuda:
            out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    finally:
        if profiler is not None:
            profiler.stop()
        freed = 0
        if cuda_graph_helper is not None:
            if cuda_graph_helper.graphs_created():
                cuda_graph_helper.delete_cuda_graphs()
                freed += 1
            out["te_helper_calls"] = list(getattr(cuda_graph_helper, "calls", []))
        if full_iteration:
            freed += free_full_iteration_graphs()
        if cfg.optimizer_cuda_graph:
            # Megatron-LM's "del optimizer.step" (the class's method again), then the graph.
            vars(optimizer).pop("step", None)
            freed += free_optimizer_graph()
        if grad_norm_kernels is not None:
            grad_norm_kernels.restore()
        out["graphs_freed"] = freed
        gc.collect()


def run(cfg: BaselineConfig) -> dict[str, Any]:
    """Train once; returns ``losses``, ``step_ms`` (per step, from the step clock),
    ``step_end_time`` (``time.perf_counter()`` at the end of each loop iteration),
    ``median_step_ms``, ``capture_seconds``/``capture_step`` (graphed runs),
    ``optimizer_capture_step`` (optimizer graph), ``peak_allocated_mib`` (CUDA),
    ``graphs_freed``, ``graph_path``, ``profiled`` (with a profile) and ``device``.

    :raises RuntimeError: ``optimizer_cuda_graph`` where :func:`optimizer_graph_unavailable`
        gives a reason.
    """
    from cpu_redirect import cpu_redirect, mcore_without_te_fixes

    use_cuda = torch.cuda.is_available() and not cfg.cpu
    if cfg.optimizer_cuda_graph and (reason := optimizer_graph_unavailable(use_cuda)):
        raise RuntimeError(f"optimizer_cuda_graph refused: {reason}")
    out: dict[str, Any] = {"losses_tensors": [], "step_ms": [], "step_end_time": []}
    device_context = contextlib.nullcontext() if use_cuda else cpu_redirect()
    with device_context, mcore_without_te_fixes():
        try:
            _train(cfg, use_cuda, out)
        finally:
            _destroy_distributed()
    out["losses"] = [float(loss) for loss in out.pop("losses_tensors")]
    out["median_step_ms"] = statistics.median(out["step_ms"]) if out["step_ms"] else None
    out["device"] = "cuda" if use_cuda else "cpu"
    return out
