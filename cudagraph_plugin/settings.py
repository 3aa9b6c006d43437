"""Read the CUDA-graph settings from whatever configuration the host has.

Owns the field table: for every setting, the attribute paths under which hosts keep it
(a Megatron-Bridge-style nested config, a megatron-core ``TransformerConfig``, a
Megatron-LM-style argparse namespace), the lookup, the in-place assignment used by the
documented auto-fixes, and the display name used in error messages (``--cuda-graph-scope``
for a command line, ``model.cuda_graph_scope`` for a nested config).

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from cudagraph_plugin import compat

IMPLS = ("none", "local", "transformer_engine")
SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
DEFAULT_WARMUP_STEPS = 3  # megatron-core's TransformerConfig default

MISSING = object()

# setting name -> candidate attribute paths, first match wins. Bridge-style nested paths
# come first; flat paths serve TransformerConfig and argparse namespaces alike.
FIELD_PATHS: dict[str, tuple[str, ...]] = {
    "impl": ("model.cuda_graph_impl", "cuda_graph_impl"),
    "scope": tuple(
        f"{prefix}{name}" for prefix in ("model.", "") for name in compat.SCOPE_FIELD_NAMES
    ),
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
    "enable_cuda_graph": ("model.enable_cuda_graph", "enable_cuda_graph"),
    "external_cuda_graph": ("model.external_cuda_graph", "external_cuda_graph"),
    "seq_length": ("model.seq_length", "dataset.sequence_length", "seq_length"),
    "micro_batch_size": ("train.micro_batch_size", "micro_batch_size"),
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
    "moe_input_jitter_eps": ("model.moe_input_jitter_eps", "moe_input_jitter_eps"),
    "recompute_granularity": ("model.recompute_granularity", "recompute_granularity"),
    "recompute_modules": ("model.recompute_modules", "recompute_modules"),
    "recompute_num_layers": ("model.recompute_num_layers", "recompute_num_layers"),
    "recompute_method": ("model.recompute_method", "recompute_method"),
    "attention_dropout": ("model.attention_dropout", "attention_dropout"),
    "hidden_dropout": ("model.hidden_dropout", "hidden_dropout"),
    "cpu_offloading": ("model.cpu_offloading", "cpu_offloading"),
    "overlap_moe_expert_parallel_comm": (
        "model.overlap_moe_expert_parallel_comm",
        "overlap_moe_expert_parallel_comm",
    ),
    "delay_wgrad_compute": ("model.delay_wgrad_compute", "delay_wgrad_compute"),
    "gradient_accumulation_fusion": (
        "model.gradient_accumulation_fusion",
        "gradient_accumulation_fusion",
    ),
    "add_qkv_bias": ("model.add_qkv_bias", "add_qkv_bias"),
    "add_bias_linear": ("model.add_bias_linear", "add_bias_linear"),
    "report_json": ("cuda_graph_report_json",),
    "fallback_on_slowdown": ("cuda_graph_fallback_on_slowdown",),
}

# Settings whose None value means "not set" (the lookup then tries the next path).
_SKIP_NONE = {"impl", "scope", "warmup_steps"}


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, MISSING)
    return getattr(obj, name, MISSING)


def resolve(config: Any, path: str) -> Any:
    """The value at ``path`` in ``config``, or the ``MISSING`` sentinel."""
    obj = config
    for part in path.split("."):
        obj = _get(obj, part)
        if obj is MISSING:
            return MISSING
    return obj


# Megatron-LM flags that store False into a positively named field.
INVERTED_FLAGS = {
    "add_bias_linear": "--disable-bias-linear",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
    "check_for_nan_in_loss": "--no-check-for-nan-in-loss",
    "check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
}


def display_name(config: Any, path: str) -> str:
    """How the user knows the field: its flag on a command line, else the path."""
    if isinstance(config, argparse.Namespace) and "." not in path:
        if path in INVERTED_FLAGS:
            return f"{path} ({INVERTED_FLAGS[path]})"
        return "--" + path.replace("_", "-")
    return path


def lookup(config: Any, setting: str) -> tuple[Any, str | None]:
    """The value of ``setting`` in ``config`` and the path it came from (None if absent).

    For settings where ``None`` means "not set" the lookup moves on to the next path, but a
    field that exists and holds ``None`` is still reported as the source when no later
    path has a value, so messages name the field the user wrote.
    """
    first_none: str | None = None
    for path in FIELD_PATHS[setting]:
        value = resolve(config, path)
        if value is MISSING:
            continue
        if value is None and setting in _SKIP_NONE:
            first_none = first_none or path
            continue
        return value, path
    return None, first_none


def existing_paths(config: Any, setting: str) -> list[str]:
    """Every path of ``setting`` that exists in ``config`` (auto-fixes write all of them)."""
    return [path for path in FIELD_PATHS[setting] if resolve(config, path) is not MISSING]


def assign(config: Any, path: str, value: Any) -> None:
    """Set ``path`` in ``config`` (attribute or mapping item, nested by dots)."""
    *parents, leaf = path.split(".")
    obj = config
    for part in parents:
        obj = _get(obj, part)
    if isinstance(obj, dict):
        obj[leaf] = value
    else:
        setattr(obj, leaf, value)


def parse_scope(value: Any) -> tuple[str, ...]:
    """Scope names from a list, a comma-separated string or enum members (either MCore
    generation's ``CudaGraphScope``/``CudaGraphModule``). Unknown names are kept as given
    for validation to report; spaces around names are dropped."""
    if value is None:
        return ()
    items: Iterable[Any]
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, Iterable):
        items = value
    else:
        items = [value]
    names = []
    for item in items:
        name = getattr(item, "name", item)
        name = str(name).strip()
        if name:
            names.append(name)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The CUDA-graph settings and the model facts the constraints depend on.

    ``impl`` and ``scope`` are normalised to the plugin's vocabulary (megatron-core 0.16's:
    ``impl="local"`` + ``scope=("full_iteration",)`` for full-iteration graphs) whatever
    spelling the host used. ``sources`` maps each setting found in the host config to the
    name the user knows it by.
    """

    impl: Any = "none"
    scope: tuple[str, ...] = ()
    warmup_steps: Any = DEFAULT_WARMUP_STEPS
    model_te_rng_tracker: bool | None = None
    rng_te_rng_tracker: bool | None = None
    check_for_nan_in_loss: bool | None = None
    check_for_nan_in_grad: bool | None = None
    enable_cuda_graph: bool = False
    external_cuda_graph: bool = False
    seq_length: int | None = None
    micro_batch_size: int | None = None
    variable_seq_lengths: bool = False
    num_moe_experts: int | None = None
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_router_padding_for_fp8: bool = False
    moe_layer_freq: Any = 1
    moe_permute_fusion: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_input_jitter_eps: float | None = None
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] | None = None
    recompute_num_layers: int | None = None
    recompute_method: str | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    cpu_offloading: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    gradient_accumulation_fusion: bool = False
    add_qkv_bias: bool = False
    add_bias_linear: bool = False
    report_json: str | None = None
    fallback_on_slowdown: bool = False
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def enabled(self) -> bool:
        """CUDA graphs are requested (``impl`` other than ``none``)."""
        return self.impl != "none"

    @property
    def full_iteration(self) -> bool:
        return "full_iteration" in self.scope

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts) and self.num_moe_experts > 1

    @property
    def dropless_moe(self) -> bool:
        """MoE without drop-and-pad (MCore: no capacity factor or no padding to capacity)."""
        return self.is_moe and (
            self.moe_expert_capacity_factor is None or not self.moe_pad_expert_input_to_capacity
        )

    @property
    def effective_recompute_modules(self) -> tuple[str, ...]:
        """megatron-core's default for selective recompute is ``("core_attn",)``."""
        if self.recompute_modules is None:
            return ("core_attn",)
        return tuple(self.recompute_modules)

    def field(self, setting: str) -> str:
        """The name to show for ``setting``: where it was found, else its usual name."""
        if setting in self.sources:
            return self.sources[setting]
        return _DEFAULT_NAMES.get(setting, setting)


_DEFAULT_NAMES = {
    "impl": "cuda_graph_impl",
    "scope": "cuda_graph_scope",
    "warmup_steps": "cuda_graph_warmup_steps",
    "model_te_rng_tracker": "use_te_rng_tracker",
    "rng_te_rng_tracker": "rng.te_rng_tracker",
}


def read_settings(config: Any) -> Settings:
    """Read :class:`Settings` from a host config of any supported shape (duck-typed)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in FIELD_PATHS:
        value, path = lookup(config, setting)
        if path is None:
            continue
        sources[setting] = display_name(config, path)
        values[setting] = value
    impl, scope = compat.canonical_impl_and_scope(
        values.get("impl", "none"), parse_scope(values.get("scope"))
    )
    values["impl"] = impl
    values["scope"] = scope
    if values.get("recompute_modules") is not None:
        values["recompute_modules"] = tuple(values["recompute_modules"])
    if values.get("warmup_steps") is None:
        values["warmup_steps"] = DEFAULT_WARMUP_STEPS
    for flag in (
        "enable_cuda_graph",
        "external_cuda_graph",
        "variable_seq_lengths",
        "moe_pad_expert_input_to_capacity",
        "moe_router_padding_for_fp8",
        "moe_permute_fusion",
        "cpu_offloading",
        "overlap_moe_expert_parallel_comm",
        "delay_wgrad_compute",
        "gradient_accumulation_fusion",
        "add_qkv_bias",
        "add_bias_linear",
        "fallback_on_slowdown",
    ):
        if flag in values:
            values[flag] = bool(values[flag])
    for number in ("attention_dropout", "hidden_dropout"):
        if values.get(number) is None:
            values.pop(number, None)
    if values.get("moe_token_dispatcher_type") is None:
        values.pop("moe_token_dispatcher_type", None)
    if values.get("moe_layer_freq") is None:
        values.pop("moe_layer_freq", None)
    return Settings(**values, sources=sources)
