"""The smallest Megatron-Core training loop that hosts mcgraph plugins (docs/guide.md).

Every ``run.*`` call is one line the host adds to its own loop; the plugins do the rest.
Without CUDA it runs on the CPU under ``cpu_redirect`` (eager: graphs need a GPU)::

    python examples/minimal_loop.py --trace
    python examples/minimal_loop.py --cuda-graph-impl local --cuda-graph-scope full_iteration
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from cudagraph_plugin import JobArgumentParser  # says a usage error once per job, exit 2
from hookspecs import (
    PLAIN_ENDINGS,
    ConfigurationError,
    TrainingRun,
    get_plugin_manager,
    print_ending,
    print_refusal,
)

SEQ, MBS, VOCAB = 32, 2, 128  # static shapes: CUDA graphs replay fixed-size buffers


def batches():
    pos = torch.arange(SEQ).repeat(MBS, 1)
    while True:
        seq = (torch.randint(0, VOCAB, (MBS, 1)) + torch.arange(SEQ + 1)) % VOCAB
        yield {"tokens": seq[:, :-1].cuda(), "labels": seq[:, 1:].cuda(), "pos": pos.cuda()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["pos"], None, labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def train(run: TrainingRun, args: argparse.Namespace, cuda: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    store = torch.distributed.HashStore()  # one process; use torchrun's env:// for more
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()
    # RNG: the plugins add te_rng_tracker/use_cudagraphable_rng, then check the tracker.
    model_parallel_cuda_manual_seed(
        **run.rng_options(base={"seed": 1234, "inference_rng_tracker": not cuda})
    )
    run.rng_initialized()
    # Config: the plugins add cuda_graph_impl, cuda_graph_scope, cuda_graph_warmup_steps.
    fields = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=not cuda
    )
    config = TransformerConfig(**run.model_config_kwargs(base=fields))
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    gpt.cuda(torch.cuda.current_device())
    with run.model_build_context():  # full_iteration graphs need DDP built on their stream
        model = [DDP(config=config, ddp_config=DistributedDataParallelConfig(), module=gpt)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3), model)
    config.finalize_model_grads_func = finalize_model_grads
    run.model_built(
        model=model, optimizer=optimizer, model_config=config, seq_length=SEQ, micro_batch_size=MBS
    )
    fwd_bwd = run.forward_backward_func(get_forward_backward_func())  # wrapped for full_iteration
    step_args = {
        "forward_step_func": forward_step,
        "data_iterator": batches(),
        "model": model,
        "num_microbatches": 1,
        "seq_length": SEQ,
        "micro_batch_size": MBS,
    }

    for step in range(run.start_step, args.train_iters):
        with run.train_step(step) as metrics:  # per-layer (TE) graphs are captured on entry
            model[0].zero_grad_buffer()
            optimizer.zero_grad()
            losses = fwd_bwd(forward_only=False, **step_args)  # full_iteration capture/replay
            optimizer.step()
            metrics["loss"] = losses[0]["lm loss"].clone()  # a graph overwrites its outputs
        print(f"step {step}: loss {metrics['loss'].item():.4f}")
    with run.evaluation() as metrics, torch.no_grad():
        model[0].eval()
        metrics["loss"] = fwd_bwd(forward_only=True, **step_args)[0]["lm loss"].item()
        model[0].train()


@record  # a failure's traceback in torchrun's summary of the failed job
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    try:
        pm = get_plugin_manager()  # a fresh manager with every installed plugin, once per run
    except ConfigurationError as refused:  # (two installed plugins of one name)
        return print_refusal(refused)
    parser = JobArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--train-iters", type=int, default=5)
    parser.add_argument("--trace", action="store_true", help="print each hook call")
    pm.hook.mcgraph_add_arguments(parser=parser)  # --cuda-graph-impl, --cuda-graph-scope ...
    args = parser.parse_args(argv)
    if args.train_iters < 0:
        parser.error("--train-iters must not be negative")
    if args.trace:
        pm.add_hookcall_monitoring(
            lambda name, impls, kwargs: print("hook:", name), lambda *a: None
        )
    cuda = torch.cuda.is_available()
    if cuda:
        device = contextlib.nullcontext()
    else:
        from cpu_redirect import cpu_redirect  # examples/: makes "cuda" mean the CPU

        device = cpu_redirect()
    # the process groups go in the run's shutdown, once the graphs (which hold NCCL buffers)
    # are freed: a launcher's SIGTERM then waits until the run said how it ended
    run = TrainingRun(pm, config=args, train_iters=args.train_iters, teardown=end_distributed)
    try:
        with device, run:
            train(run, args, cuda)  # shutdown fires on every exit, frees the graphs
    except PLAIN_ENDINGS as ended:  # a refusal, a peer's failure, a Ctrl-C: no traceback
        return print_ending(ended)
    return 0


def end_distributed(run: TrainingRun) -> None:
    from megatron.core import parallel_state

    from cudagraph_plugin import abort_process_groups

    dist = torch.distributed
    failed = run.shutdown_reason is not None and run.shutdown_reason.abnormal
    if failed and dist.is_initialized() and dist.get_world_size() > 1:
        # A peer may never join a pending collective: a graceful teardown would wait
        # forever. Abort every process group at once, so this rank exits now.
        if not abort_process_groups(timeout_s=10):
            return  # a communicator's teardown still waits: exit without the rest
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
