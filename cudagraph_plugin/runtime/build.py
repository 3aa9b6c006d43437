"""What the plugin checks and sets up once the host has built its model: the model given as
a list of chunks, the RNG tracker (again: a host may skip ``run.rng_initialized()`` or
reseed after it), the model config against the configured settings, the DDP build stream,
megatron-core's micro-batch calculator, DDP-wrapped chunks and bf16 layers (TE graphs), the
optimizer graph's prerequisites; then the TE helper and the optimizer graph.

The model-build checks raise one
:class:`~cudagraph_plugin.config.errors.CudaGraphConfigError` listing every problem with
its fix, before anything is captured.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.compat import buckets as bucket_compat
from cudagraph_plugin.compat import grad_norm
from cudagraph_plugin.config import environment
from cudagraph_plugin.config.errors import MCORE, CudaGraphConfigError, Violation
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.config.rules.model import TE_SAMPLE_DTYPE_FIX, TE_SAMPLE_DTYPE_PROBLEM
from cudagraph_plugin.config.rules.optimizer import optimizer_step_problems
from cudagraph_plugin.config.settings import Settings, read_settings
from cudagraph_plugin.runtime.buckets import BucketGraphs
from cudagraph_plugin.runtime.fingerprint import AddressFingerprint
from cudagraph_plugin.runtime.mechanisms import OptimizerGraphs, TEGraphs
from cudagraph_plugin.runtime.state import RunState

logger = logging.getLogger("cudagraph_plugin")

_RNG_PROBLEM = (
    "CUDA graphs need a graph-safe RNG tracker, but the active one is not (with "
    "te_rng_tracker=True and no Transformer Engine, megatron-core silently falls back to its "
    "own tracker, which is graph-safe only with use_cudagraphable_rng=True)"
)
_RNG_FIX = (
    "seed with model_parallel_cuda_manual_seed(**run.rng_options(...)) so it gets "
    "te_rng_tracker=True and use_cudagraphable_rng=True"
)

_CAPTURABLE_PROBLEM = (
    "the optimizer graph needs the optimizer megatron-core builds for it (a capturable Adam), "
    "but the optimizer was built with OptimizerConfig.optimizer_cuda_graph=False"
)
_CAPTURABLE_FIX = (
    "build the optimizer with OptimizerConfig(..., optimizer_cuda_graph=True) (Megatron-LM: "
    "--optimizer-cuda-graph; Megatron-Bridge: optimizer.optimizer_cuda_graph=True)"
)

_GRAD_NORM_PROBLEM = (
    "megatron-core's clip-grad path reads the gradient norm on the host inside "
    "optimizer.step() (get_grad_norm_fp32 calls .item()), even with the plugin's device-side "
    "kernels in place: the optimizer step cannot be captured"
)
_HOST_WRAPPER_PROBLEM = (
    "optimizer.step is already megatron-core's OptimizerCudaGraphWrapper: the plugin makes "
    "its own, and the two would share megatron-core's class-level graph and step counter "
    "(the counter moves twice per step; the capture comes at the wrong step or inside the "
    "other's)"
)
_HOST_WRAPPER_FIX = (
    "drop the host's own `optimizer.step = OptimizerCudaGraphWrapper(...)` (Megatron-LM's "
    "train() makes one when --optimizer-cuda-graph is set) and keep the plain optimizer.step"
)
_GRAD_NORM_FIX = (
    "use a megatron-core whose clip_grads has multi_tensor_scale_tensor_impl (0.17+: the "
    "plugin then supplies the kernels itself), or turn the optimizer graph off"
)

_CALC_FIX = (
    "megatron-core's TECudaGraphHelper reads the global micro-batch calculator while it "
    "captures, and the host has not set it up",
    "call megatron.core.num_microbatches_calculator.init_num_microbatches_calculator(rank, "
    "None, global_batch_size, micro_batch_size, data_parallel_size) before run.model_built() "
    "(Megatron-LM's loop does this at start-up)",
)

_BUILD_PROBLEM = (
    "the DDP wrapper of model chunk(s) {chunks} was built outside run.model_build_context(); "
    "its gradient-accumulation nodes then belong to the default stream and the capture "
    'fails with "operation would make the legacy stream depend on a capturing blocking '
    'stream"'
)
_BUILD_FIX = (
    "construct DistributedDataParallel inside `with run.model_build_context():` (it enters "
    "the stream the capture needs, as Megatron-LM's loop does)"
)


def check_rng_tracker() -> None:
    problem = rng_tracker_problem()
    if problem is not None:
        raise CudaGraphConfigError([problem])
    logger.info("RNG tracker is CUDA-graph safe: %s", compat.rng_tracker_state()[1], extra=JOB_WIDE)


def rng_tracker_problem() -> Violation | None:
    """The active RNG tracker's problem for graphs, if it has one."""
    safe, tracker = compat.rng_tracker_state()
    if safe:
        return None
    return Violation(
        ("RNG tracker",),
        tracker,
        _RNG_PROBLEM,
        _RNG_FIX,
        ((MCORE, "RNG tracker does not support cudagraphs"),),
    )


_CHUNKS_PROBLEM = (
    "run.model_built() takes the model as megatron-core's schedules return it from "
    "get_model(): a list of model chunks (one per virtual pipeline stage), got a {kind}"
)
_CHUNKS_FIX = "pass model=[model] (or the list get_model() returned)"

_UNWRAPPED_PROBLEM = (
    "model chunk(s) {chunks} have no zero_grad_buffer(): megatron-core's TECudaGraphHelper "
    "calls it on every chunk once the layer graphs are captured, so the capture would fail "
    "after it finished"
)
_UNWRAPPED_FIX = "wrap each model chunk in megatron-core's DistributedDataParallel"


def _layer_dtype_problems(model: list[Any]) -> list[Violation]:
    """TE graphs, where the config did not say the precision: a graphable layer none of
    whose floating-point parameters is bfloat16 fails at the capture (megatron-core's sample
    inputs are bfloat16). Where no layer is megatron-core's (a host's own modules), each
    chunk is judged as a whole."""
    layers = compat.graphable_layers(model)
    groups = layers or [chunk for chunk in model if callable(getattr(chunk, "parameters", None))]
    failing: list[set[str]] = []
    for group in groups:
        dtypes = {
            str(param.dtype).removeprefix("torch.")
            for param in group.parameters()
            if param.is_floating_point()
        }
        if dtypes and "bfloat16" not in dtypes:
            failing.append(dtypes)
    if not failing:
        return []
    held = ", ".join(sorted(set().union(*failing)))
    what = "graphable layer(s)" if layers else "model chunk(s)"
    return [
        Violation(
            ("run.model_built(model=...)",),
            f"{len(failing)} of {len(groups)} {what} with parameters in {held}",
            TE_SAMPLE_DTYPE_PROBLEM.format(dtype=held),
            TE_SAMPLE_DTYPE_FIX.format(
                bf16="bf16=True in the TransformerConfig and the model wrapped in "
                "megatron-core's Float16Module, as Megatron-LM's get_model does, or "
                "params_dtype=torch.bfloat16",
                impl="cuda_graph_impl",
                scope="cuda_graph_scope",
            ),
        )
    ]


def _check_chunks(model: Any) -> None:
    if not isinstance(model, (list, tuple)):
        raise CudaGraphConfigError(
            [
                Violation(
                    ("run.model_built(model=...)",),
                    type(model).__name__,
                    _CHUNKS_PROBLEM.format(kind=type(model).__name__),
                    _CHUNKS_FIX,
                )
            ]
        )


def rehearse_model_checks(state: RunState) -> None:
    """Without a CUDA device, graphs asked for: the checks of the built model that need no
    device (the chunks a list, the TE-graphed layers' precision, the buckets against the
    learned position embeddings), so that a loop wired on a laptop learns there what its
    first GPU run would refuse (user trials, 2026-12-05). The rest (the DDP build stream, the
    model config's CUDA graph fields, the RNG tracker) needs the device's set-up."""
    _check_chunks(state.model)
    violations = _device_free_problems(state.settings, state.model)
    if violations:
        raise CudaGraphConfigError(violations)


def _device_free_problems(settings: Settings, model: list[Any]) -> list[Violation]:
    """The build checks that need no device, the CPU's and the GPU's alike: the TE-graphed
    layers' precision, the buckets against the learned position embeddings."""
    violations: list[Violation] = []
    if settings.impl == "transformer_engine" and environment.te_layers_need_bf16():
        violations += _layer_dtype_problems(model)
    if settings.buckets:
        violations += _bucket_position_problems(settings, model)
    return violations


def build_model_graphs(state: RunState, build: compat.DDPBuildContext, optimizer: Any) -> None:
    """Check what the host built for model graphs (every problem in one error); create the
    TE helper for TE scopes, the bucket graphs for ``cuda_graph_buckets``."""
    model = state.model
    assert model is not None and state.seq_length is not None
    assert state.micro_batch_size is not None
    _check_chunks(model)
    violations = _built_config_problems(
        state.settings, state.model_config, state.seq_length, state.micro_batch_size
    )
    # (checked again here: a host may skip run.rng_initialized(), or reseed after it)
    rng = rng_tracker_problem()
    if rng is not None:
        violations.append(rng)
    if state.te_mode and not compat.num_microbatches_calculator_ready():
        violations.append(
            Violation(("num_microbatches_calculator",), "not initialised", *_CALC_FIX)
        )
    violations += _device_free_problems(state.settings, model)
    if state.te_mode:
        unwrapped = [
            index
            for index, chunk in enumerate(model)
            if not callable(getattr(chunk, "zero_grad_buffer", None))
        ]
        if unwrapped:
            violations.append(
                Violation(
                    ("run.model_built(model=...)",),
                    ", ".join(type(model[index]).__name__ for index in unwrapped),
                    _UNWRAPPED_PROBLEM.format(chunks=", ".join(map(str, unwrapped))),
                    _UNWRAPPED_FIX,
                )
            )
    missing = build.missing(model)
    if missing:
        chunks = ", ".join(map(str, missing))
        violations.append(
            Violation(
                ("run.model_build_context()",),
                "entered" if build.entered else "never entered",
                _BUILD_PROBLEM.format(chunks=chunks),
                _BUILD_FIX,
            )
        )
    if violations:
        raise CudaGraphConfigError(violations)
    if state.settings.buckets:
        # the optimizer graph reads the optimizer's state: its addresses are checked too
        fingerprint = AddressFingerprint(model, optimizer, optimizer_state=state.optimizer_graph)
        state.buckets = BucketGraphs(
            state.settings.buckets,
            state.settings.warmup_steps,
            model=model,
            optimizer=optimizer,
            fingerprint=fingerprint,
        )
        # the offload API moves what the optimizer graph reads, and without a main copy the
        # weights every bucket graph reads (a moved gradient buffer is the fingerprint's)
        if optimizer is not None and (
            state.optimizer_graph or bucket_compat.optimizer_holds_model_params(optimizer, model)
        ):
            state.buckets.watch_optimizer_offload(optimizer)
    if state.te_mode:
        # (megatron-core's helper zeroes each optimizer's gradients after its capture)
        optimizers = [] if optimizer is None else [optimizer]
        state.te = TEGraphs(
            list(model), state.model_config, state.seq_length, state.micro_batch_size, optimizers
        )
        logger.info(
            "TE CUDA graphs: %d graphable layer(s) for scope %s; capture at step start_step + %d",
            state.te.layer_count(),
            ",".join(state.settings.scope),
            state.settings.warmup_steps,
        )


def build_optimizer_graph(
    state: RunState, optimizer: Any, make_step: Callable[[OptimizerGraphs], Any]
) -> None:
    """Check the optimizer can be captured; where megatron-core's clip-grad path would read
    the gradient norm on the host, put device-side kernels in its place; install
    megatron-core's optimizer graph as ``optimizer.step`` (``make_step`` gives the callable
    that brackets its capture)."""
    violations = list(optimizer_graph_problems(state.settings, optimizer))
    kernels = install_device_grad_norm(state)
    if kernels.reads_host_after is True:
        violations.append(
            Violation(
                ("megatron.core.optimizer.clip_grads",),
                kernels.reason,
                _GRAD_NORM_PROBLEM,
                _GRAD_NORM_FIX,
            )
        )
    if compat.is_optimizer_graph_wrapper(vars(optimizer).get("step")):
        violations.append(
            Violation(
                ("optimizer.step",),
                "OptimizerCudaGraphWrapper",
                _HOST_WRAPPER_PROBLEM,
                _HOST_WRAPPER_FIX,
            )
        )
    if compat.optimizer_is_capturable(optimizer) is False:
        violations.append(
            Violation(
                ("OptimizerConfig.optimizer_cuda_graph",),
                "False",
                _CAPTURABLE_PROBLEM,
                _CAPTURABLE_FIX,
            )
        )
    if violations:
        release_device_grad_norm(state)
        raise CudaGraphConfigError(violations)
    warmup = state.settings.warmup_steps
    state.optim = OptimizerGraphs(optimizer, warmup, compat.single_mempool(state.model_config))
    state.optim.install(make_step(state.optim))
    if state.buckets is not None:
        # moved memory frees the optimizer graph with the bucket graphs; it is captured again
        state.buckets.tie(state.optim)
        state.optim.on_capture.append(state.buckets.tied_captured)
    else:
        # (a checkpoint load or an offload gives the optimizer's state new memory)
        state.optim.watch_moves(AddressFingerprint([], optimizer, optimizer_state=True))
    logger.info(
        "optimizer CUDA graph: optimizer.step is captured at its call number %d "
        "(step start_step + %d)",
        warmup,
        warmup,
        extra=JOB_WIDE,
    )


def install_device_grad_norm(state: RunState) -> Any:
    """Device-side gradient-norm kernels in megatron-core's clip-grad path where it would
    read the host (once per run; :func:`release_device_grad_norm` puts megatron-core's back)."""
    if state.kernels is None:
        state.kernels = grad_norm.install()
    return state.kernels


def release_device_grad_norm(state: RunState) -> None:
    if state.kernels is not None:
        state.kernels.restore()
        state.kernels = None


# The OptimizerConfig fields that decide what runs inside optimizer.step().
OPTIMIZER_FIELDS = (
    "optimizer",
    "fp16",
    "loss_scale",
    "optimizer_cpu_offload",
    "log_num_zeros_in_grad",
    "grad_norm_skip_threshold",
    "use_precision_aware_optimizer",
    "store_param_remainders",
    "main_params_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
)


def optimizer_graph_problems(settings: Settings, optimizer: Any) -> list[Violation]:
    """The optimizer-graph rules applied to the optimizer the host built: its
    ``OptimizerConfig`` decides what runs inside ``optimizer.step()``, whatever the host's
    own configuration said."""
    config = compat.optimizer_config(optimizer)
    if config is None:
        return []
    built = read_settings(config)
    found = [name for name in OPTIMIZER_FIELDS if name in built.paths]
    merged = dataclasses.replace(
        settings,
        **{name: getattr(built, name) for name in found},
        sources={
            **settings.sources,
            **{name: f"OptimizerConfig.{built.paths[name]}" for name in found},
        },
    )
    return list(optimizer_step_problems(merged))


def _built_config_problems(
    settings: Settings, model_config: Any, seq_length: int, mbs: int
) -> list[Violation]:
    built = read_settings(model_config)
    violations = []
    # (megatron-core reads the scope as a set: its order is no difference)
    if (built.impl, set(built.scope)) != (settings.impl, set(settings.scope)):
        violations.append(
            Violation(
                ("TransformerConfig.cuda_graph_impl", "TransformerConfig.cuda_graph_scope"),
                repr((built.impl, ",".join(built.scope))),
                f"the model was built for ({built.impl}, {','.join(built.scope)}) but the "
                f"plugin configured ({settings.impl}, {','.join(settings.scope)})",
                "build the TransformerConfig with run.model_config_kwargs(base=...)",
            )
        )
    field, names = compat.scope_names_after_build(model_config)
    if names:
        violations.append(
            Violation(
                (f"TransformerConfig.{field}",),
                repr(names),
                "the built TransformerConfig's scope holds names, not megatron-core's enum "
                "members: it was set after the config was built (its __post_init__ converts "
                "them), and megatron-core's own checks do not find them (a full-iteration "
                "model is taken for a per-layer one)",
                "set the CUDA graph fields before the TransformerConfig is built "
                "(run.model_config_kwargs, or the harness overrides on the recipe)",
            )
        )
    for name, have in (("seq_length", seq_length), ("micro_batch_size", mbs)):
        want = getattr(settings, name)
        if want is not None and want != have:
            violations.append(
                Violation(
                    (settings.field(name), f"model_built({name}=...)"),
                    repr((want, have)),
                    f"the configuration says {name}={want} but the model was built for {have}",
                    f"pass the configured {name} to run.model_built()",
                )
            )
    return violations


def _bucket_position_problems(settings: Settings, model: Any) -> list[Violation]:
    """Buckets longer than the learned position embeddings of the chunk that has them
    (``position_embedding_type="learned_absolute"``): a step padded to one fails in the
    embedding's lookup. Rotary embeddings are computed for any length."""
    for index, chunk in enumerate(model):
        limit = bucket_compat.learned_position_limit(chunk)
        if limit is None:
            continue
        over = [bucket for bucket in settings.buckets or () if bucket > limit]
        if over:
            return [
                Violation(
                    (settings.field("buckets"),),
                    ",".join(map(str, over)),
                    f"longer than model chunk {index}'s learned position embeddings "
                    f"(max_sequence_length={limit}): a step padded to "
                    f"{'them' if len(over) > 1 else 'it'} fails in the embedding's lookup "
                    "(index out of range; on a GPU, a device-side assert)",
                    f"drop the buckets above {limit}, or build the model with "
                    f"max_sequence_length >= {max(over)} (or position_embedding_type='rope')",
                )
            ]
    return []
