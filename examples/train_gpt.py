"""A real Megatron-Core training loop that hosts mcgraph plugins: the project's main job.

This module owns the example host: a tiny GPT (megatron-core ``GPTModel``) trained on
synthetic, fixed-shape token batches with megatron-core's DDP, optimizer and
``get_forward_backward_func()``, firing the plugin hooks through :class:`hookspecs.TrainingRun`.
It uses only the public hook contract (``hookspecs``), never the CUDA graph plugin's
internals: whatever plugins are installed (the CUDA graph plugin among them) add their
command-line flags, contribute config and RNG options, and wrap the forward/backward.

On a machine without CUDA (or with ``--cpu``) the same loop runs eagerly on the CPU under
:func:`cpu_redirect.cpu_redirect`; CUDA graphs then stay off and one log line says so.

Run it::

    python examples/train_gpt.py --train-iters 10
    torchrun --nproc-per-node 2 examples/train_gpt.py --use-distributed-optimizer

or import it (with ``examples/`` on ``sys.path``, as a script has it) and call :func:`run`,
which returns a summary dict; the tests and benchmarks do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lr_schedule import lr_scheduler
from step_clock import StepClock
from torch.distributed.elastic.multiprocessing.errors import record

from cpu_redirect import cpu_redirect, cpu_run_blocker, mcore_without_te_fixes
from cudagraph_plugin import JobArgumentParser
from hookspecs import (
    PLAIN_ENDINGS,
    ShutdownReason,
    TrainingRun,
    get_plugin_manager,
    print_ending,
)

# megatron-core is imported inside the functions that use it, so importing this module (for
# its parser, or to call run()) stays cheap and free of megatron's import-time warnings.

logger = logging.getLogger("train_gpt")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# -------------------------------------------------------------------------------------------
# Command line.
# -------------------------------------------------------------------------------------------


def build_parser(pluginmanager: Any) -> JobArgumentParser:
    """The example's argument parser, with every plugin's options added to it."""
    parser = JobArgumentParser(  # a usage error in two lines, once per job, exit 2
        prog="train_gpt.py",
        description="Train a tiny Megatron-Core GPT on synthetic tokens, hosting mcgraph plugins.",
        formatter_class=_DefaultsOnce,
        # as Megatron-LM's: a shortened or misspelt flag is an error, not a prefix that
        # argparse completes (`--cuda-graph-bucket` ran with buckets; `check` refused it)
        allow_abbrev=False,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    model.add_argument("--vocab-size", type=int, default=128)
    model.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="layer spec: megatron-core's own modules, or Transformer Engine's (needs TE + CUDA)",
    )
    model.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
        help="rope: rotary tables, which megatron-core caches per sequence length",
    )
    precision = model.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 parameters and compute")
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 parameters and compute, the loss scaled (dynamically unless --loss-scale)",
    )
    model.add_argument("--loss-scale", type=float, default=None, help="fp16: a constant loss scale")
    model.add_argument(
        "--fp8-format",
        choices=["hybrid", "e4m3"],
        default=None,
        help="FP8 GEMMs through Transformer Engine (needs --transformer-impl transformer_engine)",
    )
    model.add_argument(
        "--fp8-recipe",
        choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
        default="delayed",
        help="Transformer Engine FP8 recipe (megatron-core 0.16.1 and 0.19.2 default: delayed "
        "scaling, TE's DelayedScaling with an amax history)",
    )
    model.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    model.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    model.add_argument("--recompute-num-layers", type=int, default=1)
    model.add_argument(
        "--recompute-modules",
        nargs="+",
        default=None,
        help="selective recompute's modules (megatron-core's default: core_attn)",
    )
    # megatron-core's defaults; the plugin reads these fields to check a recomputed module
    # inside a graph (its dropout mask would be replayed)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--hidden-dropout", type=float, default=0.1)

    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument("--num-experts", type=int, default=None, help="MoE layers when set")
    moe.add_argument("--moe-router-topk", type=int, default=2)
    moe.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    moe.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    moe.add_argument(
        "--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather"
    )
    moe.add_argument(
        "--moe-permute-fusion", action="store_true", help="TE's fused token permutation"
    )

    data = parser.add_argument_group("data (synthetic, fixed shape)")
    data.add_argument("--seq-length", type=int, default=32)
    data.add_argument("--micro-batch-size", type=int, default=2)
    data.add_argument("--num-microbatches", type=int, default=1)

    train = parser.add_argument_group("training")
    train.add_argument(
        "--train-iters", type=int, default=10, help="train steps up to this one (exclusive)"
    )
    train.add_argument(
        "--start-step",
        type=int,
        default=0,
        help="the first step (steps are numbered from 0): start here, as a run resumed after "
        "that many steps would (no checkpoint is loaded)",
    )
    train.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop once the number of finished steps is a multiple of this",
    )
    train.add_argument(
        "--eval-interval", type=int, default=None, help="evaluate after every N training steps"
    )
    train.add_argument("--eval-iters", type=int, default=2)
    train.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate")
    train.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine"],
        default="cosine",
        help="megatron-core's OptimizerParamScheduler: decay from --lr to --min-lr",
    )
    train.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    train.add_argument(
        "--lr-decay-iters", type=int, default=None, help="decay steps (default: --train-iters)"
    )
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument(
        "--capturable-optimizer",
        action="store_true",
        help="build megatron-core's capturable Adam (OptimizerConfig.optimizer_cuda_graph=True, "
        "megatron-core 0.17+) without capturing it: the eager twin of an optimizer-graph run",
    )
    train.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping norm")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="log every N steps (0: never); step times and losses are read from the device "
        "only then, as Megatron-LM's timers do, so steps in between never wait for it",
    )

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    virtual = parallel.add_mutually_exclusive_group()
    virtual.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved pipeline schedule: layers per virtual stage (Megatron-LM's older flag)",
    )
    virtual.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="interleaved pipeline schedule: model chunks per pipeline rank (Megatron-LM's flag)",
    )
    parallel.add_argument(
        "--batch-p2p-comm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pipeline stages exchange activations with batched p2p (megatron-core's default; "
        "it synchronises the device after each exchange)",
    )
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--use-distributed-optimizer", action="store_true")
    parallel.add_argument("--overlap-grad-reduce", action="store_true")
    parallel.add_argument("--overlap-param-gather", action="store_true")
    parallel.add_argument(
        "--cpu", action="store_true", help="run on the CPU even when CUDA is available"
    )

    pluginmanager.hook.mcgraph_add_arguments(parser=parser)
    for action in parser._actions:  # (a flag without help still shows its default)
        if action.option_strings and not action.help and _shown_default(action):
            action.help = "default: %(default)s"
    return parser


def _shown_default(action: argparse.Action) -> bool:
    return action.default not in (None, False, argparse.SUPPRESS)


class _DefaultsOnce(argparse.HelpFormatter):
    """Each flag's default, once: appended to its help unless the help says it already, or
    the default is nothing to show (None: not set; a switch's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _shown_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


# Counts the loop reads, with their least value (a negative one ran, or failed elsewhere).
_AT_LEAST = {
    "train_iters": 0, "start_step": 0, "log_interval": 0, "eval_iters": 0,
    "eval_interval": 0, "seq_length": 1, "micro_batch_size": 1, "num_microbatches": 1,
    "num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "vocab_size": 1,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "num_experts": 1,
    "moe_router_topk": 1, "lr": 0, "min_lr": 0, "num_layers_per_virtual_pipeline_stage": 1,
    "num_virtual_stages_per_pipeline_rank": 1,
}  # fmt: skip


def _check_args(
    parser: JobArgumentParser,
    args: argparse.Namespace,
    use_cuda: bool,
    more: Callable[[argparse.Namespace, bool], list[str]] | None = None,
) -> None:
    """The host's own checks, and a loop's ``more(args, use_cuda)`` problems: every problem
    found is said at once (exit status 2)."""
    problems: list[str] = []
    for name, least in _AT_LEAST.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            problems.append(f"--{name.replace('_', '-')} {value}: give a number >= {least}")
    parser.refuse(problems)  # (the checks below divide by these counts)
    if args.transformer_impl == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            problems.append(
                "--transformer-impl transformer_engine needs Transformer Engine, which is not "
                "installed (the te extra: pip install -e '.[te]' in this checkout, as the README "
                "says); use --transformer-impl "
                "local"
            )
        elif not use_cuda:
            problems.append("--transformer-impl transformer_engine needs a CUDA device")
    if not use_cuda and (blocker := cpu_run_blocker()) is not None:
        problems.append(("--cpu: " if args.cpu else "no CUDA device: ") + blocker)
    problems += _layout_problems(args)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer")
    if args.loss_scale is not None and not args.fp16:
        problems.append("--loss-scale needs --fp16 (bf16 and fp32 scale no loss)")
    if args.fp8_format is not None and args.transformer_impl != "transformer_engine":
        problems.append("--fp8-format needs --transformer-impl transformer_engine (TE's FP8 GEMMs)")
    args.virtual_pipeline_model_parallel_size = _virtual_stages(args, problems)
    if args.start_step > args.train_iters:
        problems.append(
            f"--start-step {args.start_step} must not exceed --train-iters {args.train_iters}"
        )
    if more is not None:
        problems += more(args, use_cuda)
    parser.refuse(problems)


def _layout_problems(args: argparse.Namespace) -> list[str]:
    """What megatron-core would refuse later, with a traceback, after the run started."""
    problems = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp):
        problems.append(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = "
            f"{tp * pp} ranks per model replica must divide the job's {world} process(es) "
            f"(WORLD_SIZE); launch {tp * pp} (or a multiple: torchrun --nproc-per-node "
            f"{tp * pp}), or lower the sizes"
        )
    if args.sequence_parallel and tp == 1:
        problems.append(
            "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits each "
            "sequence over the tensor-parallel ranks)"
        )
    if args.num_experts is not None and args.moe_router_topk > args.num_experts:
        problems.append(
            f"--moe-router-topk {args.moe_router_topk} must not exceed --num-experts "
            f"{args.num_experts} (each token is routed to that many experts)"
        )
    if args.eval_interval and args.eval_iters < 1:
        problems.append(f"--eval-interval {args.eval_interval} needs --eval-iters >= 1")
    if args.capturable_optimizer and "optimizer_cuda_graph" not in _optimizer_config_fields():
        problems.append(
            "--capturable-optimizer needs megatron-core 0.17+ (its OptimizerConfig has no "
            "optimizer_cuda_graph field here); install a newer megatron-core or drop the flag"
        )
    return problems


def _optimizer_config_fields() -> set[str]:
    from megatron.core.optimizer import OptimizerConfig

    return {field.name for field in dataclasses.fields(OptimizerConfig)}


def _virtual_stages(args: argparse.Namespace, problems: list[str]) -> int | None:
    """Model chunks per pipeline rank (None: no interleaving), as Megatron-LM derives it;
    what is wrong with the flags is added to ``problems``."""
    pp = args.pipeline_model_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is None:
        vpp = args.num_virtual_stages_per_pipeline_rank
    else:
        per_stage = args.num_layers // pp
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
        if args.num_layers % pp:
            problems.append(
                f"--num-layers {args.num_layers} must be divisible by "
                f"--pipeline-model-parallel-size {pp}"
            )
            vpp = None  # (what it gives once fixed is not known: no more problems from it)
        elif per_stage % args.num_layers_per_virtual_pipeline_stage:
            problems.append(
                f"the {per_stage} layers per pipeline stage must be divisible by "
                f"--num-layers-per-virtual-pipeline-stage "
                f"{args.num_layers_per_virtual_pipeline_stage}"
            )
            vpp = None
    if vpp is not None and pp == 1:
        problems.append("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if vpp is not None and vpp > 1 and args.num_microbatches % pp:
        problems.append(
            f"the interleaved schedule needs --num-microbatches ({args.num_microbatches}) "
            f"divisible by --pipeline-model-parallel-size ({pp})"
        )
    return vpp if vpp != 1 else None


# -------------------------------------------------------------------------------------------
# Synthetic data and the forward step.
# -------------------------------------------------------------------------------------------


def synthetic_batches(
    *, seed: int, micro_batch_size: int, seq_length: int, vocab_size: int, device: torch.device
) -> Iterator[dict[str, Any]]:
    """Endless micro-batches of one fixed shape, deterministic from ``seed``.

    Each sample counts up from a random token (``t, t+1, ...`` modulo the vocabulary), so
    the next token is learnable and the loss falls within a few steps.
    """
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
            # Causal masking is implied by the layer specs' attention mask type.
            "attention_mask": None,
        }


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    # The (loss, num_tokens, report) form: megatron-core divides by the token count, and the
    # report stays a device tensor (no host sync, so the step is capturable).
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[Any, Any]:
    """megatron-core's ``forward_step_func``: one micro-batch through the model."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _mean_loss(loss_dicts: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """Token-weighted mean over the micro-batches, still on the device; ``None`` on pipeline
    stages other than the last (only the last one computes the loss).

    Always a new tensor: under a full-iteration CUDA graph ``loss_dicts`` are the graph's
    static outputs, which the next replay overwrites.
    """
    if not loss_dicts:
        return None
    totals = torch.stack([d["lm loss"] for d in loss_dicts]).sum(dim=0)
    return totals[0] / totals[1].clamp(min=1)


# -------------------------------------------------------------------------------------------
# Distributed set-up.
# -------------------------------------------------------------------------------------------


def _init_distributed(use_cuda: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if use_cuda else "gloo"
    if "MASTER_ADDR" in os.environ:
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
    elif world_size == 1:
        # One process, no launcher: an in-process store needs no port.
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    else:
        raise RuntimeError(f"WORLD_SIZE={world_size} without MASTER_ADDR: launch with torchrun")


ABORT_TIMEOUT_S = 10.0


def _end_distributed(reason: ShutdownReason | None) -> None:
    """Tear the process groups down, after the run's shutdown hook (graphs hold NCCL
    buffers and are freed first).

    After an exception or a signal in a multi-rank job a peer may be gone, or stuck in a
    collective this rank will never join: a graceful ``destroy_process_group()`` then waits
    for it forever (seen on 2 H200s over NCCL). The communicators are aborted instead, every
    group at once (``cudagraph_plugin.abort_process_groups``: torch's own abort, one group
    after the other, can wait for good), so this rank exits at once, non-zero.
    """
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from cudagraph_plugin import abort_process_groups

    dist = torch.distributed
    abnormal = reason is not None and reason.abnormal
    if abnormal and dist.is_initialized() and dist.get_world_size() > 1:
        rank = dist.get_rank()
        logger.warning(
            "rank %d: the run ended abnormally (%s); aborting the process groups instead of a "
            "graceful teardown (a peer may never join a pending collective)",
            rank,
            reason,
        )
        if not abort_process_groups(timeout_s=ABORT_TIMEOUT_S):
            logger.warning(
                "rank %d: the abort of the process groups did not end within %.0f s; "
                "exiting without the rest of the teardown",
                rank,
                ABORT_TIMEOUT_S,
            )
            return
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------------
# The run.
# -------------------------------------------------------------------------------------------


def _params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _transformer_config_fields(args: argparse.Namespace, use_cuda: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "batch_p2p_comm": args.batch_p2p_comm,
        "sequence_parallel": args.sequence_parallel,
        "attention_dropout": args.attention_dropout,
        "hidden_dropout": args.hidden_dropout,
        "use_cpu_initialization": not use_cuda,
        "bf16": args.bf16,
        "fp16": args.fp16,
        "params_dtype": _params_dtype(args),
        "pipeline_dtype": _params_dtype(args),
    }
    if args.ffn_hidden_size is not None:
        fields["ffn_hidden_size"] = args.ffn_hidden_size
    if args.fp8_format is not None:
        fields.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    if args.recompute_granularity is not None:
        fields["recompute_granularity"] = args.recompute_granularity
        if args.recompute_modules is not None:
            fields["recompute_modules"] = args.recompute_modules
        if args.recompute_granularity == "full":
            fields["recompute_method"] = args.recompute_method
            fields["recompute_num_layers"] = args.recompute_num_layers
    if args.num_experts is not None:
        fields.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_permute_fusion=args.moe_permute_fusion,
            # megatron-core 0.16's local experts add their bias in place to the output of an
            # autograd Function that returns its input as-is (tensor parallel size 1), which
            # autograd forbids; MoE models are trained without linear biases anyway.
            add_bias_linear=False,
        )
    return fields


def _layer_spec(args: argparse.Namespace) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=args.num_experts)


def _build_model(training: TrainingRun, args: argparse.Namespace, config: Any) -> list[Any]:
    """One GPT chunk per virtual pipeline stage (one without interleaving), each on its
    pipeline stage's layers, each wrapped in megatron-core's DDP as Megatron-LM does."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    vpp = args.virtual_pipeline_model_parallel_size
    chunks: list[Any] = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp is not None else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        module: Any = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(args),
            vocab_size=args.vocab_size,
            max_sequence_length=args.seq_length,
            position_embedding_type=args.position_embedding_type,
            share_embeddings_and_output_weights=True,
            pre_process=first,
            post_process=last,
            vp_stage=stage,
        )
        module.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            # Without the wrapper the first matmul sees float inputs and half weights.
            module = Float16Module(config, module)
        chunks.append(module)
    ddp_config = DistributedDataParallelConfig(
        # Megatron-LM's default for bf16: accumulate and reduce the gradients in fp32.
        grad_reduce_in_fp32=args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    with training.model_build_context():
        return [
            # Megatron-LM buckets only the first chunk's gradients.
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=chunk,
                disable_bucketing=index > 0,
            )
            for index, chunk in enumerate(chunks)
        ]


def _build_optimizer(args: argparse.Namespace, model: list[Any]) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    fields: dict[str, Any] = {}
    if getattr(args, "optimizer_cuda_graph", False) or args.capturable_optimizer:
        # A plugin's --optimizer-cuda-graph (megatron-core 0.17+): a capturable Adam.
        fields["optimizer_cuda_graph"] = True
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=min(args.min_lr, args.lr),  # the scheduler reads both from the param groups
        weight_decay=0.01,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        params_dtype=_params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        **fields,
    )
    return get_megatron_optimizer(optimizer_config, model)


def _wire_grad_sync(
    args: argparse.Namespace, config: Any, model: list[Any], optimizer: Any
) -> None:
    """Set the sync callbacks on the model config the way Megatron-LM's ``setup`` does."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(name: str) -> Any:
        funcs = [getattr(chunk, name) for chunk in model]
        return funcs[0] if len(funcs) == 1 else funcs

    if args.overlap_grad_reduce:
        config.no_sync_func = per_chunk("no_sync")
        config.grad_sync_func = per_chunk("start_grad_sync")
    if args.overlap_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    # Finishes the (possibly overlapped) grad reduction every step; without it an overlapped
    # reduce stays outstanding and the next step asserts.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


@dataclasses.dataclass
class _Record:
    """What the loop has done so far; read even when the run ended early."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    steps: int = 0
    step_ms: list[float] = dataclasses.field(default_factory=list)
    eval_losses: list[float] = dataclasses.field(default_factory=list)

    def summary(self, device: str, shutdown_reason: str) -> dict[str, Any]:
        losses = [float(value) for value in self.losses]
        return {
            # Steps run; ``losses`` is empty on pipeline stages other than the last.
            "steps": self.steps,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "losses": losses,
            "median_step_ms": statistics.median(self.step_ms) if self.step_ms else None,
            # The step clock's time of each step run (CUDA events on a GPU), in order.
            "step_ms": list(self.step_ms),
            "eval_losses": list(self.eval_losses),
            "device": device,
            "shutdown_reason": shutdown_reason,
        }


@dataclasses.dataclass
class Setup:
    """What a host loop needs once the model is built and wired (see :func:`set_up`)."""

    model: list[Any]
    optimizer: Any
    config: Any
    fwd_bwd: Any
    scheduler: Any
    device: torch.device
    log_here: bool
    """This rank logs the loss: the first rank of the last pipeline stage."""
    dp_rank: int


def set_up(training: TrainingRun, args: argparse.Namespace, use_cuda: bool) -> Setup:
    """Everything before the first step, as Megatron-LM orders it: process groups, the
    micro-batch calculator, seeds, the model (DDP), the optimizer and its sync callbacks,
    ``run.model_built``, the forward/backward function through the plugins, the schedule."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    _init_distributed(use_cuda)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
    )
    # megatron-core's global micro-batch calculator, as Megatron-LM sets it up (its
    # TECudaGraphHelper reads it while capturing).
    dp_size = parallel_state.get_data_parallel_world_size()
    init_num_microbatches_calculator(
        rank=torch.distributed.get_rank(),
        rampup_batch_size=None,
        global_batch_size=args.micro_batch_size * args.num_microbatches * dp_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=dp_size,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    # The loss exists on the last pipeline stage: its first rank logs.
    log_here = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng_base: dict[str, Any] = {"seed": args.seed, "force_reset_rng": True}
    if not use_cuda:
        # The training tracker saves and restores CUDA generator states; the inference one
        # does not touch them, and dropout then draws from the (seeded) CPU generator.
        rng_base["inference_rng_tracker"] = True
    model_parallel_cuda_manual_seed(**training.rng_options(base=rng_base))
    training.rng_initialized()

    config = TransformerConfig(
        **training.model_config_kwargs(base=_transformer_config_fields(args, use_cuda))
    )
    model = _build_model(training, args, config)
    optimizer = _build_optimizer(args, model)
    _wire_grad_sync(args, config, model, optimizer)
    training.model_built(
        model=model,
        optimizer=optimizer,
        model_config=config,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
    )
    fwd_bwd = training.forward_backward_func(get_forward_backward_func())
    return Setup(
        model=model,
        optimizer=optimizer,
        config=config,
        fwd_bwd=fwd_bwd,
        scheduler=lr_scheduler(args, optimizer),
        device=device,
        log_here=log_here,
        dp_rank=parallel_state.get_data_parallel_rank(),
    )


class PreHookToggle:
    """Megatron-LM starts training with the param all-gather pre-hooks off, so that a bad
    initialisation or checkpoint on one rank does not spread through the first all-gather;
    they come back after the first step (distributed optimizer with overlapped gathers)."""

    def __init__(self, training: TrainingRun, args: argparse.Namespace, setup: Setup) -> None:
        self.training = training
        self.setup = setup
        self.pending = args.use_distributed_optimizer and args.overlap_param_gather
        self.param_sync_func = setup.config.param_sync_func
        if self.pending:
            training.disable_forward_pre_hook(setup.model, param_sync=False)
            setup.config.param_sync_func = None

    def after_step(self) -> None:
        if self.pending:
            self.pending = False
            self.training.enable_forward_pre_hook(self.setup.model)
            self.setup.config.param_sync_func = self.param_sync_func


def _train(
    training: TrainingRun, args: argparse.Namespace, use_cuda: bool, record: _Record
) -> None:
    setup = set_up(training, args, use_cuda)
    model, optimizer, scheduler = setup.model, setup.optimizer, setup.scheduler
    fwd_bwd, log_here, dp_rank = setup.fwd_bwd, setup.log_here, setup.dp_rank
    clock = StepClock(use_cuda)
    device = setup.device

    batch_shape = {
        "micro_batch_size": args.micro_batch_size,
        "seq_length": args.seq_length,
        "vocab_size": args.vocab_size,
        "device": device,
    }

    def batches(seed: int) -> Any:
        # Every pipeline stage and model chunk draws the same micro-batches (the first
        # stage uses the tokens, the last the labels): one iterator per chunk.
        iterators = [synthetic_batches(seed=seed, **batch_shape) for _ in model]
        return iterators[0] if len(iterators) == 1 else iterators

    train_iter = batches(args.seed + 1 + dp_rank)
    eval_iter = batches(args.seed + 1_000_003 + dp_rank)
    step_args = {
        "forward_step_func": forward_step,
        "model": model,
        "num_microbatches": args.num_microbatches,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
    }

    pre_hooks = PreHookToggle(training, args, setup)

    if log_here:
        logger.info("training steps %d to %d", args.start_step, args.train_iters - 1)
    for step in range(args.start_step, args.train_iters):
        with training.train_step(step) as metrics:
            start = time.perf_counter()
            clock.start()
            loss_dicts, grad_norm, update_successful = optimizer_step(
                setup, data_iterator=train_iter, **step_args
            )
            clock.stop()
            loss = _mean_loss(loss_dicts)
            metrics.update(
                loss=loss,
                # (a replayed optimizer graph writes its norm into the same tensor each step)
                grad_norm=grad_norm.clone() if hasattr(grad_norm, "clone") else grad_norm,
                update_successful=update_successful,
                # the host's time for the step: the device may still be working on it
                step_time_ms=(time.perf_counter() - start) * 1000.0,
            )
        if loss is not None:
            record.losses.append(loss)
        record.steps += 1
        pre_hooks.after_step()

        # Intervals count finished steps (Megatron-LM's iterations); log lines name the step
        # as the hooks and the run report do, from 0.
        iteration = step + 1
        if args.log_interval and iteration % args.log_interval == 0:
            times = clock.read()
            record.step_ms += times
            if log_here:
                logger.info(
                    "step %d | loss %.4f | grad norm %.3f | lr %.3g | %.2f ms/step (last %d)",
                    step,
                    float("nan") if loss is None else loss.item(),
                    float(grad_norm) if grad_norm is not None else float("nan"),
                    scheduler.get_lr(optimizer.param_groups[0]),
                    statistics.median(times),
                    len(times),
                )
        if args.eval_interval and iteration % args.eval_interval == 0:
            eval_loss = _evaluate(training, args, fwd_bwd, model, eval_iter, step_args)
            if eval_loss is not None:
                record.eval_losses.append(eval_loss)
            if log_here and eval_loss is not None:
                logger.info("step %d | eval loss %.4f", step, record.eval_losses[-1])
        if args.exit_interval and iteration % args.exit_interval == 0:
            if log_here:
                logger.info("exit interval (%d steps) reached after step %d", iteration, step)
            break
    record.step_ms += clock.read()


def _evaluate(
    training: TrainingRun,
    args: argparse.Namespace,
    fwd_bwd: Any,
    model: list[Any],
    eval_iter: Iterator[dict[str, Any]],
    step_args: dict[str, Any],
) -> float | None:
    return forward_only_pass(
        training,
        model,
        lambda: [
            _mean_loss(fwd_bwd(data_iterator=eval_iter, forward_only=True, **step_args))
            for _ in range(args.eval_iters)
        ],
    )


def optimizer_step(setup: Setup, **fwd_bwd_kwargs: Any) -> tuple[Any, Any, Any]:
    """One training step's work as Megatron-LM's ``train_step`` does it: gradients zeroed,
    the forward/backward over the step's micro-batches (``fwd_bwd_kwargs``), the optimizer
    step, the schedule stepped. Returns the loss dicts, the gradient norm and whether the
    update was applied."""
    for chunk in setup.model:
        chunk.zero_grad_buffer()
    setup.optimizer.zero_grad()
    loss_dicts = setup.fwd_bwd(forward_only=False, **fwd_bwd_kwargs)
    update_successful, grad_norm, _ = setup.optimizer.step()
    setup.scheduler.step(increment=1)
    return loss_dicts, grad_norm, update_successful


def forward_only_pass(
    training: TrainingRun, model: list[Any], losses: Callable[[], list[Any]]
) -> float | None:
    """One ``run.evaluation()``: the chunks in eval mode, without autograd, while
    ``losses()`` makes the forward-only calls and returns each call's mean loss; their mean
    (``None`` on pipeline stages other than the last)."""
    with training.evaluation() as metrics:
        for chunk in model:
            chunk.eval()
        try:
            with torch.no_grad():
                batches = losses()
        finally:
            for chunk in model:
                chunk.train()
        if batches[0] is None:  # not the last pipeline stage
            return None
        loss = float(torch.stack(batches).mean())
        metrics["loss"] = loss
    return loss


def run(argv: Sequence[str] | None = None, plugins: Sequence[Any] = ()) -> dict[str, Any]:
    """Train once and return a summary.

    :param argv: Command-line arguments (``sys.argv[1:]`` when ``None``).
    :param plugins: Extra plugin objects registered on this run's plugin manager before the
        command line is parsed (so they may add options too).
    :returns: ``steps`` (training steps run), ``first_loss``, ``last_loss``, ``losses``
        (floats, one per step), ``median_step_ms``, ``step_ms`` (the step clock's
        milliseconds, one per step: CUDA events on a GPU, read at the log interval and at the
        end), ``eval_losses``, ``device`` (``"cuda"`` or ``"cpu"``) and ``shutdown_reason``
        (as :class:`hookspecs.ShutdownReason` names it).
    """
    return host_run(argv, plugins, parser=build_parser, train=_train, record=_Record())


def host_run(
    argv: Sequence[str] | None,
    plugins: Sequence[Any],
    *,
    parser: Any,
    train: Any,
    record: Any,
    problems: Callable[[argparse.Namespace, bool], list[str]] | None = None,
) -> dict[str, Any]:
    """One run of a host loop: the plugin manager, the command line (every plugin's options
    included), the :class:`hookspecs.TrainingRun` around ``train(training, args, use_cuda,
    record)``, the process groups torn down after the run's shutdown hook; returns
    ``record.summary(device, shutdown_reason)``. ``problems(args, use_cuda)`` adds the
    loop's own argument checks (said with the host's, at once)."""
    pm = get_plugin_manager()
    for plugin in plugins:
        pm.register(plugin)
    argument_parser = parser(pm)
    args = argument_parser.parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    _check_args(argument_parser, args, use_cuda, more=problems)

    # On the CPU the CUDA graph plugin still validates the requested configuration, then
    # says in one line that graphs need a CUDA device and runs eagerly; nothing to do here.
    # The process groups go in the run's own shutdown, after its hook freed the graphs
    # (they hold NCCL buffers): a launcher's SIGTERM during that teardown (torchrun's, as
    # another rank exited) is then held, and the run says its ending before it ends the
    # process; after the run it would end the process mid-teardown without a word.
    training = TrainingRun(
        pm,
        config=args,
        train_iters=args.train_iters,
        start_step=args.start_step,
        teardown=lambda run: _end_distributed(run.shutdown_reason),
    )
    device_context = contextlib.nullcontext() if use_cuda else cpu_redirect()
    with device_context, mcore_without_te_fixes(), training:
        train(training, args, use_cuda, record)
    return record.summary("cuda" if use_cuda else "cpu", str(training.shutdown_reason))


def configure_logging() -> None:
    """The examples' log format; megatron-core's chattiest loggers at WARNING."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # At INFO these log their whole config and every parameter name.
    for noisy in ("megatron.core.distributed", "megatron.core.optimizer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@record  # a failure's traceback in torchrun's summary of the failed job
def main() -> int:
    """Command-line entry point: train, print a short summary, return the exit code."""
    configure_logging()
    try:
        summary = run()
    except PLAIN_ENDINGS as ended:  # a refusal, a peer's failure, a Ctrl-C: no traceback
        return print_ending(ended)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if summary["losses"]:
        print(
            f"trained {summary['steps']} step(s) on {summary['device']}: loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
            f"median step {summary['median_step_ms']:.2f} ms (of every step timed, the first "
            "and any capture step included; the CUDA graph report's eager and replay figures "
            "leave them out)"
        )
    else:  # no step, or a pipeline stage that computes no loss
        print(f"trained {summary['steps']} step(s) on {summary['device']}")
    if summary["eval_losses"]:
        print("eval losses: " + ", ".join(f"{loss:.4f}" for loss in summary["eval_losses"]))
    print(f"shutdown: {summary['shutdown_reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
