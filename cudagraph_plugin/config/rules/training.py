"""Rules on how the run trains: static shapes, NaN checks, offloading, warm-up, fp16, the
fallback policy, pipeline parallelism (the optimizer graph's are in ``optimizer``)."""

from __future__ import annotations

from collections.abc import Iterator

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import BRIDGE, MCORE, MLM, Note, Violation
from cudagraph_plugin.config.rules.base import rule, scope_value, violation
from cudagraph_plugin.config.settings import Settings

# -- static shapes, NaN checks, offloading ----------------------------------------------------


@rule
def _static_shapes(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.variable_seq_lengths:
        drop = s.set_text("variable_seq_lengths", False)
        if s.buckets:  # (user trial, 2026-12-05: the fix did not say the buckets are the way)
            fix = (
                f"{drop}: with {s.field('buckets')} each step is padded to a bucket "
                "(pad_step, run.step_padded), which serves lengths that change"
            )
        else:
            fix = (
                "fix seq_length and micro_batch_size; pad packed sequences to a fixed width "
                f"and {drop}; for lengths that change from step to step, pad each step to a "
                f"bucket ({s.field('buckets')}: one full-iteration graph per length)"
            )
        yield violation(
            s,
            ("variable_seq_lengths",),
            True,
            "CUDA graphs need static tensor shapes; variable-length sequences do not work",
            fix,
            (BRIDGE, "Offline packing with CUDA graphs requires dataset pad_to_max_length=True"),
        )


@rule
def _nan_loss_check(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.impl == "local" and s.full_iteration and s.check_for_nan_in_loss:
        yield violation(
            s,
            ("check_for_nan_in_loss",),
            True,
            "full_iteration CUDA graph requires check_for_nan_in_loss=False: the whole "
            "forward and backward is captured, so the loss cannot be inspected in between",
            s.set_text("check_for_nan_in_loss", False),
            (BRIDGE, "check_for_nan_in_loss must be disabled when using full_iteration CUDA graph"),
            (
                MLM,
                "--no-check-for-nan-in-loss-and-grad should be set with "
                "--cuda-graph-impl=full_iteration for training",
            ),
        )


@rule
def _cpu_offloading(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    if not (s.enabled and s.cpu_offloading):
        return
    if s.full_iteration and environment.mcore_offloads_with_full_iteration():
        yield Note(
            f"CPU offloading with the full-iteration graph: megatron-core "
            f"{environment.mcore_version()} accepts it (it refuses offloading only with "
            "per-layer graphs); this plugin has not run that pair on a GPU, so compare the "
            "first run's losses with an eager run's"
        )
        return
    yield violation(
        s,
        ("cpu_offloading",),
        True,
        "activations offloaded to the CPU cannot live in a captured graph",
        f"{s.set_text('cpu_offloading', False)}, or turn CUDA graphs off"
        + (
            " (megatron-core 0.19 accepts offloading with the full-iteration graph)"
            if s.full_iteration
            else ""
        ),
        (MCORE, "CUDA graphs not supported with CPU offloading"),
    )


@rule
def _nan_grad_check(s: Settings, env: Environment) -> Iterator[Violation]:
    same_field = s.paths.get("check_for_nan_in_grad") == s.paths.get("check_for_nan_in_loss")
    if s.impl == "local" and s.full_iteration and s.check_for_nan_in_grad and not same_field:
        yield violation(
            s,
            ("check_for_nan_in_grad",),
            True,
            "full_iteration CUDA graph with the gradient NaN check on: DDP inspects the "
            "reduced gradients on the host (a device synchronisation) inside the captured "
            "iteration",
            s.set_text("check_for_nan_in_grad", False),
            (
                MLM,
                "--no-check-for-nan-in-loss-and-grad should be set with "
                "--cuda-graph-impl=full_iteration for training",
            ),
        )


@rule
def _history_checks(s: Settings, env: Environment) -> Iterator[Violation]:
    if not (s.impl == "local" and s.full_iteration):
        return
    for setting, what in (
        ("check_for_large_grads", "DDP compares the reduced gradients' norm"),
        ("check_for_spiky_loss", "the loss function compares the loss"),
    ):
        if getattr(s, setting):
            yield violation(
                s,
                (setting,),
                True,
                f"full_iteration CUDA graph with {setting}: {what} with its history on the "
                "host (megatron-core's rerun state machine, a device synchronisation) inside "
                "the captured iteration",
                f"{s.set_text(setting, False)}, or use TE scopes such as attn,mlp on bf16 layers",
            )


@rule
def _full_iteration_warmup(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.full_iteration and s.warmup_steps == 0:
        yield violation(
            s,
            ("warmup_steps",),
            0,
            "full_iteration with no warm-up captures the very first step, while cuBLAS handles "
            "and NCCL communicators are still created lazily on first use, which a capture "
            "forbids (seen on an H200 with DP=2)",
            f"set {s.field('warmup_steps')} to 1 or more (megatron-core's default: 3)",
            ("CUDA", "CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
        )


@rule
def _fp16_full_iteration(s: Settings, env: Environment) -> Iterator[Violation]:
    # A constant loss_scale keeps one scale tensor for the whole run (megatron-core's
    # ConstantGradScaler), which the captured iteration may read; megatron-core tests
    # `if config.loss_scale:`, so 0 (a common spelling of "dynamic") is the dynamic scaler.
    if s.enabled and s.full_iteration and s.fp16 and not s.loss_scale:
        yield violation(
            s,
            ("fp16", "loss_scale"),
            (True, s.loss_scale),
            "fp16 training without a constant loss scale scales the loss dynamically: the "
            "scaler checks the gradients for inf/NaN on the host and replaces its scale tensor "
            "when it changes the scale, so a captured iteration would go on using the scale it "
            "was captured with",
            f"set a constant {s.field('loss_scale')} (e.g. 4096), or train in bf16 "
            f"({s.set_text('fp16', False)}, bf16 on; TE scopes such as attn,mlp then work too: "
            "they need bf16 layers)",
        )


# -- the settings for graphs only (the fallback policy among them) ----------------------------


@rule
def _graphs_only_settings(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    """The plugin's settings that act on graphs only. Given with graphs off, each is said,
    not refused (a recipe that sets one by default must still run its eager baseline; the
    switches have no off form on a command line); the fallback policy needs a
    full-iteration graph."""
    if not s.enabled:
        given = {
            "fallback_on_slowdown": s.fallback_on_slowdown,
            "baseline_steps": s.baseline_steps is not None,
            "accept_eager": s.accept_eager,
        }
        for setting in (setting for setting, on in given.items() if on):
            yield Note(
                f"{s.field(setting)} has nothing to do with CUDA graphs off "
                f"({s.field('impl')}={s.impl})"
            )
    elif s.fallback_on_slowdown and not (s.impl == "local" and s.full_iteration):
        yield violation(
            s,
            ("fallback_on_slowdown", "impl", "scope"),
            (True, s.impl, scope_value(s)),
            "the fallback policy frees the full-iteration graph when its replay is slower "
            "than eager; without a full-iteration graph it does nothing",
            "use cuda_graph_impl=local with scope full_iteration, or drop "
            "cuda_graph_fallback_on_slowdown",
        )


# -- pipeline parallelism ---------------------------------------------------------------------


@rule
def _pipeline_full_iteration(s: Settings, env: Environment) -> Iterator[Violation]:
    if not (s.enabled and s.full_iteration):
        return
    if s.pipeline_parallel and s.batch_p2p_comm and s.batch_p2p_sync:
        problem = (
            "full_iteration with pipeline parallelism: megatron-core synchronises the device "
            "after every batched p2p exchange between stages, which a capture forbids (seen on "
            'an H200: "operation not permitted when stream is capturing")'
        )
        reference = (MCORE, "To protect against race condition when using batch_isend_irecv()")
        if s.p2p_from_overlap:  # Megatron-LM: batch_p2p_comm = not overlap_p2p_comm
            yield violation(
                s,
                (
                    "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size",
                    "overlap_p2p_comm",
                ),
                (
                    s.pipeline_model_parallel_size,
                    s.virtual_pipeline_model_parallel_size,
                    s.overlap_p2p_comm,
                ),
                problem + "; Megatron-LM batches them unless it overlaps them, which it does "
                "only with virtual pipeline stages",
                "use virtual pipeline stages (--num-layers-per-virtual-pipeline-stage or "
                "--num-virtual-stages-per-pipeline-rank) without --no-overlap-p2p-communication, "
                "or use TE scopes such as attn,mlp on bf16 layers (the virtual stages are read "
                "from the args validate_args returns, which derives them)",
                reference,
            )
        else:
            yield violation(
                s,
                ("pipeline_model_parallel_size", "batch_p2p_comm", "batch_p2p_sync"),
                (s.pipeline_model_parallel_size, True, True),
                problem,
                f"{s.set_text('batch_p2p_comm', False)} or {s.set_text('batch_p2p_sync', False)}, "
                "or use TE scopes such as attn,mlp on bf16 layers (Megatron-LM passes "
                "batch_p2p_comm=False with virtual pipeline stages, unless "
                "--no-overlap-p2p-communication)",
                reference,
            )
    if s.overlap_param_gather_with_optimizer_step:
        yield violation(
            s,
            ("overlap_param_gather_with_optimizer_step",),
            True,
            "full_iteration with the parameter all-gather overlapped with the optimizer step: "
            "the gather is dispatched from the preceding optimizer step, outside the captured "
            "iteration, so the graph would wait for work it never launched",
            f"{s.set_text('overlap_param_gather_with_optimizer_step', False)}, or use TE scopes",
            (
                BRIDGE,
                "incompatible with full-iteration capture because the parameter gather is "
                "dispatched from the preceding optimizer step",
            ),
        )
