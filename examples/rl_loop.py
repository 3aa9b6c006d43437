"""An RL-style Megatron-Core host: rollouts and a few training steps per round, sequence
lengths that change every step, training state offloaded between phases.

This module owns the example of a loop whose shapes change, as reinforcement-learning
trainers written on megatron-core as a library run it. Each round:

1. **rollout** (forward only, eager, inside ``run.evaluation()``): ``--rollout-batches``
   micro-batches, each of its own random length, unpadded, through the model in eval mode;
   their mean loss stands in for the policy's log-probabilities;
2. the training state comes back if it was offloaded (gradient buffers through megatron-core's
   ``DistributedDataParallel.restore_grad_buffers``, optimizer state through
   ``MegatronOptimizer.restore_from_cpu``) and, with ``--invalidate-after-reload``, the host
   says so (``run.invalidate_graphs``);
3. ``--steps-per-round`` **training steps**: each micro-batch gets a random length, the ranks
   of the data-parallel group agree on the step's longest (one all-reduce), every micro-batch
   is padded to that length's bucket (``cudagraph_plugin.pad_step``:
   tokens, labels, a zero loss mask and continued position ids on the right), the host
   reports the padding (``run.step_padded``) and calls ``forward_backward_func`` with the
   bucket as ``seq_length``;
4. every ``--offload-interval`` training steps the gradient buffers and the optimizer state
   are offloaded (megatron-core's ``offload_grad_buffers`` / ``offload_to_cpu``) for the next
   rollout.

With ``--cuda-graph-buckets`` the CUDA graph plugin keeps one full-iteration graph per
bucket; memory that moved at a reload is noticed by its address fingerprint (or told by the
host) and the graphs are captured again after their warm-up. ``--pad-to-buckets`` alone
pads the same way without graphs: the eager twin for loss comparisons. Graphs without
``--cuda-graph-buckets`` hold one shape for the whole run: lengths that would change it are
refused before the model is built (full-iteration graphs take the unpadded rollouts too;
Transformer Engine's per-layer graphs, captured for ``--seq-length``, only the training
steps, which ``--pad-to-buckets`` with that one length keeps to it).

Every ``train_gpt.py`` flag applies (model, parallelism, optimizer, schedule, plugins'
flags) except ``--eval-interval`` (the rollouts are this loop's forward-only passes);
``--seq-length`` is the model's longest sequence (its position embeddings). With
``--sequence-parallel`` every length drawn is a multiple of ``--tensor-model-parallel-size``
(megatron-core splits each sequence over those ranks; the rollouts are not padded)::

    python examples/rl_loop.py --cuda-graph-impl local --cuda-graph-scope full_iteration \\
        --cuda-graph-buckets 16,32,48 --seq-length 48 --train-iters 60 --offload-interval 10 \\
        --bf16
    torchrun --nproc-per-node 2 examples/rl_loop.py ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from step_clock import StepClock
from torch.distributed.elastic.multiprocessing.errors import record

import train_gpt
from cudagraph_plugin import (
    JobArgumentParser,
    bucket_for,
    check_config,
    pad_step,
    padding_waste_percent,
    parse_buckets,
)
from hookspecs import (
    PLAIN_ENDINGS,
    TrainingRun,
    print_ending,
)

logger = logging.getLogger("rl_loop")

PAD_TOKEN = 0


def build_parser(pluginmanager: Any) -> JobArgumentParser:
    """``train_gpt.py``'s parser (every plugin's options included) with the loop's own."""
    parser = train_gpt.build_parser(pluginmanager)
    parser.prog = "rl_loop.py"
    parser.description = (
        "Alternate forward-only rollouts with a few training steps on sequences of changing "
        "length, offloading the training state in between; hosting mcgraph plugins."
    )
    rl = parser.add_argument_group("RL loop")
    rl.add_argument("--min-length", type=int, default=4, help="shortest sequence drawn")
    rl.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="longest sequence drawn (default: --seq-length)",
    )
    rl.add_argument("--steps-per-round", type=int, default=5, help="training steps per round")
    rl.add_argument(
        "--rollout-batches", type=int, default=2, help="forward-only micro-batches per rollout"
    )
    rl.add_argument(
        "--offload-interval",
        type=int,
        default=0,
        help="offload gradient buffers and optimizer state after every N training steps (a "
        "multiple of --steps-per-round; 0: never), bring them back after the next rollout",
    )
    rl.add_argument(
        "--invalidate-after-reload",
        action="store_true",
        help="tell the plugins after each reload that graphs may point at moved memory "
        "(run.invalidate_graphs) instead of relying on their own check",
    )
    rl.add_argument(
        "--pad-to-buckets",
        default=None,
        metavar="LENGTHS",
        help="pad each step to the smallest of these lengths that fits (default: "
        "--cuda-graph-buckets when given, else the step's longest sequence); a step longer "
        "than all of them keeps its length (and runs eagerly)",
    )
    return parser


def _check(parser: JobArgumentParser, args: argparse.Namespace, use_cuda: bool) -> None:
    """The loop's own checks alone (:func:`_problems`), said at once (exit status 2)."""
    parser.refuse(_problems(args, use_cuda))


def _problems(args: argparse.Namespace, use_cuda: bool) -> list[str]:
    """What is wrong with the loop's own flags (``train_gpt``'s host says them with its own).
    Sets ``args.max_length``, ``args.length_multiple`` and ``args.buckets``."""
    problems: list[str] = []
    if args.eval_interval:
        problems.append(
            "--eval-interval does not apply to rl_loop.py: its rollouts are the forward-only "
            "passes (--rollout-batches)"
        )
    args.max_length = args.seq_length if args.max_length is None else args.max_length
    args.length_multiple = (
        args.tensor_model_parallel_size
        if args.sequence_parallel and args.tensor_model_parallel_size > 1
        else 1
    )
    args.buckets = None
    lengths = []  # (the checks below compute with these)
    if not 1 <= args.min_length <= args.max_length <= args.seq_length:
        lengths.append(
            f"need 1 <= --min-length ({args.min_length}) <= --max-length ({args.max_length}) "
            f"<= --seq-length ({args.seq_length}, the model's longest sequence)"
        )
    if args.steps_per_round < 1 or args.rollout_batches < 1:
        lengths.append("--steps-per-round and --rollout-batches must be at least 1")
    if lengths:
        return problems + lengths
    # sequence parallelism splits each sequence over the tensor-parallel ranks: every
    # length drawn (the rollouts' too, which no bucket pads) is a multiple of their number
    if args.max_length // args.length_multiple * args.length_multiple < args.min_length:
        lengths.append(
            f"--sequence-parallel with --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} needs a length between --min-length "
            f"({args.min_length}) and --max-length ({args.max_length}) that is a multiple of "
            f"{args.length_multiple}; widen the range"
        )
    if args.offload_interval < 0 or args.offload_interval % args.steps_per_round:
        problems.append(
            f"--offload-interval {args.offload_interval} must be 0 or a positive multiple of "
            f"--steps-per-round {args.steps_per_round} (the state is offloaded between rounds)"
        )
    if args.offload_interval and not args.bf16:
        needs_bf16 = (
            "--offload-interval needs --bf16 on a GPU: without it megatron-core's optimizer "
            "holds the model's own parameters (or, distributed, views of them), and its "
            "offload_to_cpu() would move the weights the rollout needs to the host"
        )
        if use_cuda:
            problems.append(needs_bf16)
        elif int(os.environ.get("RANK", "0")) == 0:  # (CPU: says it only, once per job)
            logger.warning(
                "%s; on the CPU the offload moves nothing, so this run goes on", needs_bf16
            )
    lengths += _bucket_problems(args)
    if not lengths:  # (it reads the lengths and buckets checked above)
        lengths += _one_shape_problems(args)
    return problems + lengths


def _bucket_problems(args: argparse.Namespace) -> list[str]:
    """The padding buckets (into ``args.buckets``, which :func:`_problems` set to None) and
    what is wrong with them."""
    source = "--pad-to-buckets" if args.pad_to_buckets else "--cuda-graph-buckets"
    lengths = args.pad_to_buckets or getattr(args, "cuda_graph_buckets", None)
    try:
        args.buckets = None if lengths is None else parse_buckets(lengths, source)
    except ValueError as error:
        message = str(error)  # check_buckets' messages start with the field's name
        return [message if message.startswith(source) else f"{source}: {message}"]
    problems = []
    uneven = [b for b in args.buckets or () if b % args.length_multiple]
    if uneven:
        problems.append(
            f"{source}: {', '.join(map(str, uneven))} not a multiple of "
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: with "
            "--sequence-parallel megatron-core splits each sequence over those ranks"
        )
    if args.buckets is not None and args.buckets[-1] > args.seq_length:
        problems.append(
            f"{source}: the largest bucket ({args.buckets[-1]}) exceeds --seq-length "
            f"({args.seq_length}, the model's position embeddings); raise --seq-length"
        )
    return problems


def _one_shape_problems(args: argparse.Namespace) -> list[str]:
    """CUDA graphs without ``--cuda-graph-buckets`` hold one shape for the whole run: refuse
    up front the lengths this loop would draw that change it (the plugin would refuse the
    first changed call, after the model build). Full-iteration graphs take the rollouts too
    (forward-only calls get a graph of their own), and those are never padded. Transformer
    Engine's per-layer graphs run in training mode only and are captured for the model's
    ``--seq-length``: every training step must come at that length (``--pad-to-buckets``).
    The settings are read as the plugin reads them (either megatron-core spelling)."""
    settings = check_config(args).settings
    # (buckets given, valid or not, or a value it cannot read: the plugin judges them)
    if settings.impl == "none" or settings.input_problems:
        return []
    if getattr(args, "cuda_graph_buckets", None) is not None:
        return []
    full_iteration = settings.impl == "local" and "full_iteration" in settings.scope
    if not full_iteration and settings.impl != "transformer_engine":
        return []  # (what the plugin refuses, with its own fix)
    multiple = args.length_multiple
    drawn = range(-(-args.min_length // multiple) * multiple, args.max_length + 1, multiple)
    # each step's length after the padding (one above every bucket keeps its own)
    padded = sorted({bucket_for(n, args.buckets or ()) or n for n in drawn})
    if full_iteration:
        lengths = list(drawn)
        if len(lengths) < 2:
            return []
        also = " and training steps" if len(padded) > 1 else ""
        what = (
            "a full-iteration graph holds one shape, and its rollouts (forward only, never "
            f"padded){also}"
        )
        fix = (
            "add --cuda-graph-buckets LENGTHS (one full-iteration graph per bucket, rollouts "
            "eager), or draw one length (--min-length = --max-length)"
        )
    else:
        lengths = padded
        if lengths == [args.seq_length]:
            return []
        what = (
            "Transformer Engine's per-layer graphs are captured for the model's --seq-length "
            f"({args.seq_length}), and its training steps"
            + (" (after --pad-to-buckets)" if args.pad_to_buckets else "")
        )
        fix = (
            f"pad every training step to it (--pad-to-buckets {args.seq_length}), or draw "
            f"that length alone (--min-length = --max-length = {args.seq_length}); "
            "--cuda-graph-buckets needs full-iteration graphs"
        )
    shown = ", ".join(map(str, lengths[:3])) + (f", ... {lengths[-1]}" if len(lengths) > 3 else "")
    return [
        f"--cuda-graph-impl {args.cuda_graph_impl} without --cuda-graph-buckets: {what} "
        f"would come at length(s) {shown} (--min-length {args.min_length}, --max-length "
        f"{args.max_length}). Fix: {fix}"
    ]


@dataclasses.dataclass
class _RLRecord(train_gpt._Record):
    rollout_losses: list[float] = dataclasses.field(default_factory=list)
    seq_lengths: list[int] = dataclasses.field(default_factory=list)
    real_tokens: int = 0
    padded_tokens: int = 0
    offloads: int = 0
    reloads_moved: int = 0

    def summary(self, device: str, shutdown_reason: str) -> dict[str, Any]:
        return {
            **super().summary(device, shutdown_reason),
            "rollout_losses": list(self.rollout_losses),
            "seq_lengths": list(self.seq_lengths),
            "padding_waste_percent": padding_waste_percent(self.real_tokens, self.padded_tokens),
            "offloads": self.offloads,
            "reloads_moved": self.reloads_moved,
        }


class _Data:
    """Synthetic token sequences (counting up from a random token, as ``train_gpt``'s) of
    random lengths. Lengths and tokens depend on the seed and the data-parallel rank only,
    so the stages and tensor-parallel ranks of one replica draw the same micro-batches."""

    def __init__(self, args: argparse.Namespace, setup: train_gpt.Setup) -> None:
        self.args = args
        self.device = setup.device
        self.lengths = random.Random(args.seed * 1_000_003 + setup.dp_rank)
        self.tokens = torch.Generator().manual_seed(args.seed + 1 + setup.dp_rank)

    def micro_batch(self) -> dict[str, Any]:
        args = self.args
        multiple = args.length_multiple  # (sequence parallelism: see _check)
        length = (
            self.lengths.randint(-(-args.min_length // multiple), args.max_length // multiple)
            * multiple
        )
        rows = args.micro_batch_size
        starts = torch.randint(0, args.vocab_size, (rows, 1), generator=self.tokens)
        sequence = (starts + torch.arange(length + 1)) % args.vocab_size
        return {
            "tokens": sequence[:, :-1].to(self.device),
            "labels": sequence[:, 1:].to(self.device),
            "loss_mask": torch.ones(rows, length, device=self.device),
            "position_ids": torch.arange(length).repeat(rows, 1).to(self.device),
            "attention_mask": None,  # causal
        }


def _agreed_longest(length: int, device: torch.device) -> int:
    """The longest sequence of the step over the data-parallel group: every rank pads to
    the same bucket, so every rank runs the same graph."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return length
    value = torch.tensor([length], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(
        value, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
    )
    return int(value.item())


def _iterators(model: list[Any], batches: list[dict[str, Any]]) -> Any:
    """One iterator per model chunk over the same micro-batches."""
    iterators = [iter(batches) for _ in model]
    return iterators[0] if len(iterators) == 1 else iterators


class _Offload:
    """Gradient buffers and optimizer state off the device between phases, megatron-core's
    way (its RL offload API). Says after each reload whether the gradient buffers came back
    at new addresses (what captured graphs would then miss)."""

    def __init__(self, setup: train_gpt.Setup) -> None:
        self.setup = setup
        self.away = False
        self._addresses: list[int] = []

    def _grad_addresses(self) -> list[int]:
        return [
            buffer.grad_data.data_ptr()
            for chunk in self.setup.model
            for buffer in chunk.buffers + chunk.expert_parallel_buffers
        ]

    def offload(self) -> None:
        self._addresses = self._grad_addresses()
        with _storage_warning_silenced():
            for chunk in self.setup.model:
                chunk.offload_grad_buffers()
        self.setup.optimizer.offload_to_cpu()
        self.away = True

    def reload(self) -> bool:
        """Bring the state back; True when the gradient buffers moved."""
        self.setup.optimizer.restore_from_cpu()
        with _storage_warning_silenced():
            for chunk in self.setup.model:
                chunk.restore_grad_buffers()
        self.away = False
        return self._grad_addresses() != self._addresses


@contextlib.contextmanager
def _storage_warning_silenced() -> Iterator[None]:
    # megatron-core resizes the buffers through tensor.storage(), which torch deprecates
    # with a warning on every call; nothing for the user to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        yield


def _rollout(
    training: TrainingRun, args: argparse.Namespace, setup: train_gpt.Setup, data: _Data
) -> float | None:
    """Forward-only passes over micro-batches of their own lengths; the mean loss (on the
    last pipeline stage, else ``None``)."""

    def losses() -> list[Any]:
        results = []
        for _ in range(args.rollout_batches):
            batch = data.micro_batch()
            loss_dicts = setup.fwd_bwd(
                forward_step_func=train_gpt.forward_step,
                data_iterator=_iterators(setup.model, [batch]),
                model=setup.model,
                num_microbatches=1,
                seq_length=batch["tokens"].shape[-1],
                micro_batch_size=args.micro_batch_size,
                forward_only=True,
            )
            results.append(train_gpt._mean_loss(loss_dicts))
        return results

    return train_gpt.forward_only_pass(training, setup.model, losses)


def _train_step(
    training: TrainingRun,
    args: argparse.Namespace,
    setup: train_gpt.Setup,
    data: _Data,
    step: int,
    record: _RLRecord,
) -> tuple[torch.Tensor | None, Any]:
    with training.train_step(step) as metrics:
        start = time.perf_counter()
        batches = [data.micro_batch() for _ in range(args.num_microbatches)]
        longest = _agreed_longest(max(b["tokens"].shape[-1] for b in batches), setup.device)
        # above every bucket: the step keeps its length and runs eagerly (the plugin logs
        # each new such shape once)
        padded = pad_step(
            batches,
            args.buckets or (longest,),
            pad_token_id=PAD_TOKEN,
            length=longest,
            overflow="keep",
        )
        real = padded.tokens - padded.padding
        training.step_padded(
            seq_length=padded.seq_length, real_tokens=real, padded_tokens=padded.padding
        )
        loss_dicts, grad_norm, update_successful = train_gpt.optimizer_step(
            setup,
            forward_step_func=train_gpt.forward_step,
            data_iterator=_iterators(setup.model, padded.batches),
            model=setup.model,
            num_microbatches=args.num_microbatches,
            seq_length=padded.seq_length,
            micro_batch_size=args.micro_batch_size,
        )
        loss = train_gpt._mean_loss(loss_dicts)
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            update_successful=update_successful,
            step_time_ms=(time.perf_counter() - start) * 1000.0,
        )
    record.seq_lengths.append(padded.seq_length)
    record.real_tokens += real
    record.padded_tokens += padded.padding
    return loss, grad_norm


def _train(
    training: TrainingRun, args: argparse.Namespace, use_cuda: bool, record: _RLRecord
) -> None:
    setup = train_gpt.set_up(training, args, use_cuda)
    graphed = getattr(args, "cuda_graph_buckets", None)
    others = sorted(set(args.buckets or ()) - set(parse_buckets(graphed) if graphed else ()))
    if args.pad_to_buckets and graphed and others:
        logger.warning(
            "--pad-to-buckets %s pads some steps to %s, not a --cuda-graph-buckets length (%s): "
            "those steps run eagerly (leave --pad-to-buckets out to pad to the graph buckets)",
            args.pad_to_buckets,
            ", ".join(map(str, others)),
            graphed,
        )
    data = _Data(args, setup)
    pre_hooks = train_gpt.PreHookToggle(training, args, setup)
    offload = _Offload(setup)
    clock = StepClock(use_cuda)
    step = args.start_step
    while step < args.train_iters:
        rollout_loss = _rollout(training, args, setup, data)
        if rollout_loss is not None:
            record.rollout_losses.append(rollout_loss)
        if offload.away:
            moved = offload.reload()
            record.reloads_moved += moved
            logger.info(
                "step %d: training state reloaded, gradient buffers %s",
                step - 1,
                "at new addresses" if moved else "at the same addresses",
            )
            if args.invalidate_after_reload:
                training.invalidate_graphs(
                    "gradient buffers and optimizer state reloaded after the rollout"
                )
        for _ in range(min(args.steps_per_round, args.train_iters - step)):
            clock.start()
            loss, grad_norm = _train_step(training, args, setup, data, step, record)
            clock.stop()
            if loss is not None:
                record.losses.append(loss)
            record.steps += 1
            pre_hooks.after_step()
            step += 1
            if args.log_interval and step % args.log_interval == 0:
                times = clock.read()
                record.step_ms += times
                if setup.log_here:
                    logger.info(
                        "step %d | seq %d | loss %.4f | grad norm %.3f | %.2f ms/step (last %d)",
                        step - 1,
                        record.seq_lengths[-1],
                        float("nan") if loss is None else loss.item(),
                        float("nan") if grad_norm is None else float(grad_norm),
                        statistics.median(times),
                        len(times),
                    )
            if args.exit_interval and step % args.exit_interval == 0:
                record.step_ms += clock.read()
                return
        done = step - args.start_step
        if args.offload_interval and done % args.offload_interval == 0 and step < args.train_iters:
            offload.offload()
            record.offloads += 1
            if setup.log_here:
                logger.info("step %d: gradient buffers and optimizer state offloaded", step - 1)
    record.step_ms += clock.read()


def run(argv: Sequence[str] | None = None, plugins: Sequence[Any] = ()) -> dict[str, Any]:
    """Run the loop once and return ``train_gpt.run``'s summary plus ``rollout_losses``,
    ``seq_lengths`` (each step's padded length), ``padding_waste_percent``, ``offloads`` and
    ``reloads_moved`` (reloads that put the gradient buffers at new addresses)."""
    return train_gpt.host_run(
        argv, plugins, parser=build_parser, train=_train, record=_RLRecord(), problems=_problems
    )


@record  # a failure's traceback in torchrun's summary of the failed job
def main() -> int:
    """Command-line entry point: run, print a short summary, return the exit code."""
    train_gpt.configure_logging()
    try:
        summary = run()
    except PLAIN_ENDINGS as ended:  # a refusal, a peer's failure, a Ctrl-C: no traceback
        return print_ending(ended)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    lengths = sorted(set(summary["seq_lengths"]))
    print(
        f"trained {summary['steps']} step(s) on {summary['device']} at lengths "
        f"{', '.join(map(str, lengths)) or '-'} ({summary['offloads']} offload(s), "
        f"{summary['reloads_moved']} reload(s) at new addresses)"
    )
    if summary["losses"]:
        print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    waste = summary["padding_waste_percent"]
    if waste is not None:
        print(f"padding: {waste:.1f}% of the positions computed")
    print(f"shutdown: {summary['shutdown_reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
