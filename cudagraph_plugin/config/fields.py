"""Where each setting lives in a host's configuration, and how to read and write it there.

Owns the field table: for every setting, the attribute paths under which hosts keep it (a
Megatron-Bridge-style nested config, a megatron-core ``TransformerConfig``, a
Megatron-LM-style argparse namespace, a dict, an OmegaConf, pydantic, attrs or
ml_collections object: :mod:`cudagraph_plugin.config.libraries`), the lookup, the in-place
assignment (used only by :mod:`cudagraph_plugin.config.fixes` and the harness overrides;
its trial on copies by the check) and the display name used in messages
(``--cuda-graph-scope`` for a command line, ``model.cuda_graph_scope`` for a nested config).

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from enum import Enum
from typing import Any

from cudagraph_plugin.config.libraries import (
    UNKNOWN,
    aliased,
    library_of,
    trial_copy,
    trial_write,
)
from cudagraph_plugin.config.vocabulary import SCOPE_FIELD_NAMES

MISSING = object()


class Unreadable:
    """What :func:`resolve` gives for a field whose reading raised (a host's property that
    raises, a mapping whose ``get`` does): a value no rule accepts and no fix writes over;
    :func:`~cudagraph_plugin.config.settings.read_settings` lists it as a problem."""

    __slots__ = ("error", "where")

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.where: str | None = None  # the part of the path whose reading raised

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "<unreadable>"


# setting name -> candidate attribute paths, first match wins. Bridge-style nested paths
# come first; flat paths serve TransformerConfig and argparse namespaces alike.
FIELD_PATHS: dict[str, tuple[str, ...]] = {
    "impl": ("model.cuda_graph_impl", "cuda_graph_impl"),
    "scope": tuple(f"{prefix}{name}" for prefix in ("model.", "") for name in SCOPE_FIELD_NAMES),
    "warmup_steps": ("model.cuda_graph_warmup_steps", "cuda_graph_warmup_steps"),
    "model_te_rng_tracker": ("model.use_te_rng_tracker", "use_te_rng_tracker"),
    "rng_te_rng_tracker": ("rng.te_rng_tracker", "te_rng_tracker"),
    "check_for_nan_in_loss": (
        "rerun_state_machine.check_for_nan_in_loss",
        "check_for_nan_in_loss",
        "check_for_nan_in_loss_and_grad",
    ),
    "check_for_nan_in_grad": (
        "ddp.check_for_nan_in_grad",
        "check_for_nan_in_grad",
        "check_for_nan_in_loss_and_grad",
    ),
    "check_for_large_grads": ("ddp.check_for_large_grads", "check_for_large_grads"),
    "check_for_spiky_loss": (
        "rerun_state_machine.check_for_spiky_loss",
        "check_for_spiky_loss",
    ),
    "enable_cuda_graph": ("model.enable_cuda_graph", "enable_cuda_graph"),
    "external_cuda_graph": ("model.external_cuda_graph", "external_cuda_graph"),
    "seq_length": ("model.seq_length", "dataset.sequence_length", "seq_length"),
    "micro_batch_size": ("train.micro_batch_size", "micro_batch_size"),
    # (a GPTModel argument, not a TransformerConfig field: Megatron-LM's args and
    # Megatron-Bridge's model provider hold it; its learned table ends at
    # max_position_embeddings, Megatron-LM's flag, else at seq_length)
    "position_embedding_type": ("model.position_embedding_type", "position_embedding_type"),
    "max_position_embeddings": ("model.max_position_embeddings", "max_position_embeddings"),
    "variable_seq_lengths": ("model.variable_seq_lengths", "variable_seq_lengths"),
    "num_moe_experts": ("model.num_moe_experts", "num_moe_experts", "num_experts"),
    "moe_expert_capacity_factor": (
        "model.moe_expert_capacity_factor",
        "moe_expert_capacity_factor",
    ),
    "moe_pad_expert_input_to_capacity": (
        "model.moe_pad_expert_input_to_capacity",
        "moe_pad_expert_input_to_capacity",
    ),
    "moe_token_dispatcher_type": ("model.moe_token_dispatcher_type", "moe_token_dispatcher_type"),
    "moe_router_padding_for_fp8": (
        "model.moe_router_padding_for_fp8",
        "moe_router_padding_for_fp8",
    ),
    "moe_layer_freq": ("model.moe_layer_freq", "moe_layer_freq"),
    "moe_permute_fusion": ("model.moe_permute_fusion", "moe_permute_fusion"),
    "moe_shared_expert_intermediate_size": (
        "model.moe_shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
    ),
    "moe_shared_expert_overlap": (
        "model.moe_shared_expert_overlap",
        "moe_shared_expert_overlap",
    ),
    "moe_input_jitter_eps": ("model.moe_input_jitter_eps", "moe_input_jitter_eps"),
    "recompute_granularity": ("model.recompute_granularity", "recompute_granularity"),
    "recompute_modules": ("model.recompute_modules", "recompute_modules"),
    "moe_layer_recompute": ("model.moe_layer_recompute", "moe_layer_recompute"),
    "recompute_num_layers": ("model.recompute_num_layers", "recompute_num_layers"),
    "recompute_method": ("model.recompute_method", "recompute_method"),
    "attention_dropout": ("model.attention_dropout", "attention_dropout"),
    "hidden_dropout": ("model.hidden_dropout", "hidden_dropout"),
    "cpu_offloading": ("model.cpu_offloading", "cpu_offloading"),
    # (Megatron-Bridge's CommOverlapConfig also holds these two: None there leaves the
    # model's, a value is written over the model's when the config is finalised)
    "overlap_moe_expert_parallel_comm": (
        "comm_overlap.overlap_moe_expert_parallel_comm",
        "model.overlap_moe_expert_parallel_comm",
        "overlap_moe_expert_parallel_comm",
    ),
    "delay_wgrad_compute": (
        "comm_overlap.delay_wgrad_compute",
        "model.delay_wgrad_compute",
        "delay_wgrad_compute",
    ),
    "gradient_accumulation_fusion": (
        "model.gradient_accumulation_fusion",
        "gradient_accumulation_fusion",
    ),
    "add_qkv_bias": ("model.add_qkv_bias", "add_qkv_bias"),
    "add_bias_linear": ("model.add_bias_linear", "add_bias_linear"),
    "fp16": ("model.fp16", "optimizer.fp16", "fp16"),
    # (the model's: Bridge's optimizer.bf16 differs from it until a mixed_precision recipe
    # sets both, and the layers' precision is the model's)
    "bf16": ("model.bf16", "bf16"),
    "params_dtype": ("model.params_dtype", "params_dtype"),
    "mixed_precision": ("mixed_precision",),
    "pipeline_model_parallel_size": (
        "model.pipeline_model_parallel_size",
        "pipeline_model_parallel_size",
    ),
    "tensor_model_parallel_size": (
        "model.tensor_model_parallel_size",
        "tensor_model_parallel_size",
    ),
    "context_parallel_size": ("model.context_parallel_size", "context_parallel_size"),
    "sequence_parallel": ("model.sequence_parallel", "sequence_parallel"),
    "virtual_pipeline_model_parallel_size": (
        "model.virtual_pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
    ),
    "batch_p2p_comm": ("model.batch_p2p_comm", "batch_p2p_comm"),
    "batch_p2p_sync": ("model.batch_p2p_sync", "batch_p2p_sync"),
    # Megatron-LM's args: no batch_p2p_comm there, it passes ``not overlap_p2p_comm``
    "overlap_p2p_comm": ("overlap_p2p_comm",),
    "overlap_param_gather_with_optimizer_step": (
        "optimizer.overlap_param_gather_with_optimizer_step",
        "overlap_param_gather_with_optimizer_step",
    ),
    "optimizer_cuda_graph": ("optimizer.optimizer_cuda_graph", "optimizer_cuda_graph"),
    "optimizer": ("optimizer.optimizer", "optimizer"),
    "optimizer_cpu_offload": ("optimizer.optimizer_cpu_offload", "optimizer_cpu_offload"),
    "log_num_zeros_in_grad": ("optimizer.log_num_zeros_in_grad", "log_num_zeros_in_grad"),
    "loss_scale": ("optimizer.loss_scale", "loss_scale"),
    "grad_norm_skip_threshold": (
        "optimizer.grad_norm_skip_threshold",
        "grad_norm_skip_threshold",
    ),
    "use_precision_aware_optimizer": (
        "optimizer.use_precision_aware_optimizer",
        "use_precision_aware_optimizer",
    ),
    "store_param_remainders": ("optimizer.store_param_remainders", "store_param_remainders"),
    "main_params_dtype": ("optimizer.main_params_dtype", "main_params_dtype"),
    "exp_avg_dtype": ("optimizer.exp_avg_dtype", "exp_avg_dtype"),
    "exp_avg_sq_dtype": ("optimizer.exp_avg_sq_dtype", "exp_avg_sq_dtype"),
    "fp8_param": ("model.fp8_param", "fp8_param", "fp8_param_gather"),
    "timing_log_level": ("logger.timing_log_level", "timing_log_level"),
    "weight_decay_incr_style": (
        "scheduler.weight_decay_incr_style",
        "weight_decay_incr_style",
    ),
    "use_distributed_optimizer": (
        "ddp.use_distributed_optimizer",
        "optimizer.use_distributed_optimizer",
        "use_distributed_optimizer",
    ),
    # the plugin's own fields (cuda_graph_<setting>): at the top, or beside the model's CUDA
    # graph fields
    **{
        setting: (f"cuda_graph_{setting}", f"model.cuda_graph_{setting}")
        for setting in (
            "report_json",
            "fallback_on_slowdown",
            "baseline_steps",
            "accept_eager",
            "device_grad_norm",
            "log_all_ranks",
            "peer_exit_deadline",
        )
    },
    "buckets": ("model.cuda_graph_buckets", "cuda_graph_buckets"),
    "transformer_impl": ("model.transformer_impl", "transformer_impl"),
}

# Settings whose None value means "not set" (the lookup then tries the next path).
_SKIP_NONE = {
    "impl", "scope", "warmup_steps", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
}  # fmt: skip


def _get(obj: Any, name: str, leaf: bool = True) -> Any:
    try:
        if isinstance(obj, Mapping):
            value = obj.get(name, MISSING)
            if value is MISSING and leaf and is_omegaconf(obj) and name in obj.keys():
                # a key that ``get`` answers with the default: OmegaConf's mandatory value
                # (``???``); its item access says why (MissingMandatoryValue). Read as absent,
                # it let ``cuda_graph_impl: ???`` run eagerly (user trial, 2026-12-05). (A
                # ``???`` section stays absent: the lookup goes on to the flat paths.)
                value = obj[name]
            return value
        value = getattr(obj, name, MISSING)
        if value is MISSING and (attribute := aliased(obj, name)) is not None:
            value = getattr(obj, attribute, MISSING)  # (the field by its alias: user trial)
        return value
    except Exception as exc:  # a property of the host's that raises: a listed problem
        return Unreadable(exc)


def resolve(config: Any, path: str) -> Any:
    """The value at ``path`` in ``config``, the ``MISSING`` sentinel, or :class:`Unreadable`
    where reading a part of the path raised."""
    obj = config
    parts = path.split(".")
    for at, part in enumerate(parts):
        obj = _get(obj, part, leaf=at == len(parts) - 1)
        if isinstance(obj, Unreadable):
            obj.where = ".".join(parts[: at + 1])
        if obj is MISSING or isinstance(obj, Unreadable):
            return obj
    return obj


def is_omegaconf(obj: Any) -> bool:
    """``obj`` is one of OmegaConf's containers or nodes (no dependency: asked by module)."""
    return library_of(obj) == "omegaconf"


# Megatron-LM flags that store False into a positively named field.
INVERTED_FLAGS = {
    "add_bias_linear": "--disable-bias-linear",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
    # (Megatron-LM's one flag for both checks: it has no --no-check-for-nan-in-loss)
    "check_for_nan_in_loss": "--no-check-for-nan-in-loss-and-grad",
    "check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
    "overlap_p2p_comm": "--no-overlap-p2p-communication",
    # (no Megatron-LM flag; examples/train_gpt.py's --batch-p2p-comm is on by default)
    "batch_p2p_comm": "--no-batch-p2p-comm",
    "store_param_remainders": "--no-store-param-remainders",
}

# Fields a Megatron-LM command line sets through another flag (its validate_args derives
# them): how to turn them off there.
OFF_THROUGH = {"cpu_offloading": "set --cpu-offloading-num-layers 0"}


def display_name(config: Any, path: str) -> str:
    """How the user knows the field: its flag on a command line, else the path."""
    if isinstance(config, argparse.Namespace) and "." not in path:
        if path in INVERTED_FLAGS:
            return f"{path} ({INVERTED_FLAGS[path]})"
        return "--" + path.replace("_", "-")
    return path


def assignment(from_command_line: bool, path: str | None, name: str, value: Any) -> str:
    """The words that set a field to ``value``: ``set name=value``, or, for a boolean
    on a command line, the switch to pass or to drop (a Megatron-LM switch takes no value:
    ``--te-rng-tracker=True`` is refused by argparse)."""
    if not (from_command_line and path and "." not in path and isinstance(value, bool)):
        return f"set {name}={value!r}"
    if path in INVERTED_FLAGS:
        return f"{'drop' if value else 'pass'} {INVERTED_FLAGS[path]}"
    if not value and path in OFF_THROUGH:
        return OFF_THROUGH[path]
    flag = "--" + path.replace("_", "-")
    return f"{'pass' if value else 'drop'} {flag}"


def set_words(config: Any, path: str, value: Any) -> str:
    """How an auto-fix's log line says what it wrote: ``set model.fp16=False``; a switch of
    a command line also with the flag that gives the value (it takes no ``=True``)."""
    if isinstance(config, argparse.Namespace) and "." not in path and isinstance(value, bool):
        return f"set {path}={value!r} (on the command line: {assignment(True, path, path, value)})"
    return f"set {display_name(config, path)}={value!r}"


def lookup(config: Any, setting: str) -> tuple[Any, str | None]:
    """The value of ``setting`` in ``config`` and the path it came from (None if absent).

    For settings where ``None`` means "not set" the lookup moves on to the next path, but a
    field that exists and holds ``None`` is still reported as the source when no later
    path has a value, so messages name the field the user wrote.
    """
    first_none: str | None = None
    paths = FIELD_PATHS[setting]
    for path in paths:
        value = resolve(config, path)
        if value is MISSING:
            continue
        if _section(value) and any(other.startswith(path + ".") for other in paths):
            continue  # (``optimizer``: the section the setting was looked for in, not a value)
        if value is None and setting in _SKIP_NONE:
            first_none = first_none or path
            continue
        return value, path
    return None, first_none


def _section(value: Any) -> bool:
    """A part of a nested config (a mapping, a dataclass or other object), not a value."""
    return not isinstance(value, (str, bytes, int, float, Enum)) and value is not None


def existing_paths(config: Any, setting: str) -> list[str]:
    """Every path of ``setting`` that exists in ``config`` (auto-fixes write all of them)."""
    return [path for path in FIELD_PATHS[setting] if resolve(config, path) is not MISSING]


def _parent(config: Any, path: str) -> tuple[Any, str]:
    """The object that holds ``path``'s last part, and that part."""
    parent, _, leaf = path.rpartition(".")
    return (resolve(config, parent) if parent else config), leaf


def assign(config: Any, path: str, value: Any) -> None:
    """Set ``path`` in ``config`` (attribute or mapping item, nested by dots); a read-only
    mapping raises ``TypeError`` (setting an attribute on it would be read by nobody)."""
    _write_into(*_parent(config, path), value)


def _write_into(obj: Any, leaf: str, value: Any) -> None:
    if isinstance(obj, MutableMapping):  # (any mutable mapping: a UserDict's too)
        obj[leaf] = value
    elif isinstance(obj, Mapping):
        raise TypeError(f"{type(obj).__name__} is a read-only mapping")
    else:
        attribute = leaf if hasattr(obj, leaf) else (aliased(obj, leaf) or leaf)
        setattr(obj, attribute, value)


def write_refusal(config: Any, path: str) -> str | None:
    """Why :func:`assign` would be refused at ``path``, seen without writing: a field of a
    frozen dataclass, an item of a read-only mapping or OmegaConf container; None where
    nothing says so (a config library's object is tried by :func:`trial_writes`; a setter
    may still refuse: the write says that)."""
    obj, leaf = _parent(config, path)
    if isinstance(obj, Mapping) and not isinstance(obj, MutableMapping):
        return f"{type(obj).__name__} is a read-only mapping"
    if _omegaconf_read_only(obj):
        return f"{type(obj).__name__} is read-only (OmegaConf.set_readonly)"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        frozen = type(obj).__dataclass_params__.frozen  # type: ignore[attr-defined]
        if frozen and leaf in {field.name for field in dataclasses.fields(obj)}:
            return f"{type(obj).__name__} is a frozen dataclass"
    return None


def trial_writes(config: Any, writes: Sequence[tuple[str, Any]]) -> list[tuple[str | None, Any]]:
    """The ``(path, value)`` writes made in order on copies of the config library objects
    that hold them (OmegaConf, pydantic, attrs, ml_collections; one copy per object, so a
    validator that looks at a field written before sees it, as in the run), the host's
    config untouched: for each, why it was refused (None: taken, or not known) and what the
    field holds after it (``MISSING`` where not known: a converter, a coercing validator or
    a typed field show here)."""
    copies: dict[int, tuple[Any, Any]] = {}  # (the object kept: its id stays its own)
    results: list[tuple[str | None, Any]] = []
    for path, value in writes:
        obj, leaf = _parent(config, path)
        if id(obj) not in copies:
            copies[id(obj)] = (obj, trial_copy(obj))
        trial = copies[id(obj)][1]
        if trial is UNKNOWN:
            results.append((None, MISSING))
            continue
        why, held = trial_write(trial, leaf, value, _write_into, _get)
        known = held is not UNKNOWN and not isinstance(held, Unreadable)
        results.append((why, held if known else MISSING))
    return results


def _omegaconf_read_only(obj: Any) -> bool:
    """``obj`` is an OmegaConf container made read-only (``OmegaConf.set_readonly`` on it or
    a parent): a ``MutableMapping`` whose writes raise ``ReadonlyConfigError``. Asked of
    OmegaConf itself, already imported where its containers exist (it is no dependency)."""
    if not is_omegaconf(obj):
        return False
    omegaconf = sys.modules.get("omegaconf")
    try:
        return bool(omegaconf.OmegaConf.is_readonly(obj))  # type: ignore[union-attr]
    except Exception:  # (another version's API: the write says it, as before)
        return False
