"""Read the CUDA-graph settings from whatever configuration the host has.

Owns the field table: for every setting, the attribute paths under which hosts keep it
(a Megatron-Bridge-style nested config, a megatron-core ``TransformerConfig``, a
Megatron-LM-style argparse namespace), the lookup, the in-place assignment used by the
documented auto-fixes, and the display name used in error messages (``--cuda-graph-scope``
for a command line, ``model.cuda_graph_scope`` for a nested config).

It also owns the accepted forms of every value: launchers (YAML recipes, environment
overrides, Megatron-LM command lines) pass numbers and booleans as strings, lists as
comma-separated strings and MoE layer patterns as Megatron-LM pattern strings. Each value is
normalised here (README's "Accepted forms" table), or, when it cannot be read, recorded as a
:class:`FieldProblem` naming the field, the value and the fix, which validation lists with
the other problems; a value is never misread and nothing raises a bare ``TypeError``.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
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
    "moe_shared_expert_overlap": (
        "model.moe_shared_expert_overlap",
        "moe_shared_expert_overlap",
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
    "fp16": ("model.fp16", "optimizer.fp16", "fp16"),
    "pipeline_model_parallel_size": (
        "model.pipeline_model_parallel_size",
        "pipeline_model_parallel_size",
    ),
    "virtual_pipeline_model_parallel_size": (
        "model.virtual_pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
    ),
    "batch_p2p_comm": ("model.batch_p2p_comm", "batch_p2p_comm"),
    "batch_p2p_sync": ("model.batch_p2p_sync", "batch_p2p_sync"),
    "overlap_param_gather_with_optimizer_step": (
        "optimizer.overlap_param_gather_with_optimizer_step",
        "overlap_param_gather_with_optimizer_step",
    ),
    "optimizer_cuda_graph": ("optimizer.optimizer_cuda_graph", "optimizer_cuda_graph"),
    "optimizer": ("optimizer.optimizer", "optimizer"),
    "optimizer_cpu_offload": ("optimizer.optimizer_cpu_offload", "optimizer_cpu_offload"),
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


# megatron-core's deprecated scope names: "full" (both generations) is whole-layer capture,
# "full_iteration_inference" (0.19) moved to inference_cuda_graph_scope=block.
DEPRECATED_SCOPES = ("full", "full_iteration_inference")


def _split_names(text: str) -> list[str]:
    """``"attn, mlp"`` -> ``["attn", "mlp"]``; a doubled or trailing comma leaves an empty
    name (``""``) for validation to report; a blank string holds no names."""
    if not text.strip():
        return []
    return [name.strip() for name in text.split(",")]


def parse_scope(value: Any) -> tuple[str, ...]:
    """Scope names from a list, a comma-separated string or enum members (either MCore
    generation's ``CudaGraphScope``/``CudaGraphModule``). Unknown, deprecated, duplicated
    and empty names (``"attn,,mlp"``) are kept as given for validation to report; spaces
    around names are dropped."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(_split_names(value))
    items: Iterable[Any] = (
        value if isinstance(value, Iterable) and not isinstance(value, Mapping) else [value]
    )
    names: list[str] = []
    for item in items:
        if isinstance(item, str):
            names += _split_names(item) or [""]
        else:
            names.append(str(getattr(item, "name", item)).strip())
    return tuple(names)


# -- value normalisation -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FieldProblem:
    """A value that cannot be read: the setting, the value as given, what is wrong, the fix."""

    setting: str
    value: Any
    problem: str
    fix: str


class _Unreadable(ValueError):
    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


_NONE_WORDS = ("", "none", "null")
_TRUE_WORDS = ("true", "t", "yes", "y", "on", "1")
_FALSE_WORDS = ("false", "f", "no", "n", "off", "0")
_BOOL_FIX = "use true or false (1/0, yes/no and on/off are read too)"


def _is_none_word(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in _NONE_WORDS


def to_bool(value: Any) -> bool:
    """A boolean from ``True``/``False``, ``1``/``0`` or a word such as ``"false"``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise _Unreadable("not a boolean", _BOOL_FIX)


def _integer(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise _Unreadable("not an integer", "")


def _to_int(minimum: int, example: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            number = _integer(value)
        except _Unreadable:
            number = None
        if number is None or number < minimum:
            what = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
            raise _Unreadable(f"must be {what}", f"give a whole number such as {example}")
        return number

    return parse


def _to_float(value: Any) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise _Unreadable("not a number", "give a number such as 0.1")
    return number


def _to_choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and value.strip() in choices:
            return value.strip()
        raise _Unreadable("not a known value", f"use one of {', '.join(choices)}")

    return parse


def _to_name(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


def _to_names(value: Any) -> tuple[str, ...]:
    """Module names from a list or a comma- (or space-) separated string."""
    if isinstance(value, str):
        return tuple(name for name in re.split(r"[,\s]+", value) if name)
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        names: list[str] = []
        for item in value:
            if not isinstance(item, str):
                raise _Unreadable("holds a value that is not a name", _NAMES_FIX)
            names += [name for name in re.split(r"[,\s]+", item) if name]
        return tuple(names)
    raise _Unreadable("not a list of names", _NAMES_FIX)


_NAMES_FIX = "give a list of names, e.g. [core_attn, mlp], or a comma-separated string"
_PATTERN_LIMIT = 100_000  # layers: bounds what a pattern such as [0]*10**9 could allocate
_LAYER_FREQ_FIX = (
    "give an integer N >= 1 (one MoE layer every N layers), a list of 0/1 per layer "
    "(1 = MoE), or a Megatron-LM pattern string such as ([0]*1+[1]*3)*4"
)


def parse_layer_pattern(text: str) -> list[int]:
    """Megatron-LM's layer pattern string, e.g. ``"([0]*1+[1]*3)*2"`` -> ``[0,1,1,1,0,1,1,1]``.

    The same grammar Megatron-LM evaluates (list literals of integers, ``+``, ``*`` and
    parentheses; spaces tolerated), read without ``eval``.
    """
    if re.search(r"[^\d\s,\[\]()+*]", text):
        raise ValueError(f"invalid pattern {text!r}")

    def evaluate(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [evaluate(item) for item in node.elts]
            if not all(type(item) is int for item in items):
                raise ValueError("a pattern list holds integers only")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult):
                if isinstance(left, int) and isinstance(right, int):
                    return left * right
                lst, times = (left, right) if isinstance(left, list) else (right, left)
                if isinstance(lst, list) and isinstance(times, int):
                    if len(lst) * max(times, 0) > _PATTERN_LIMIT:
                        raise ValueError("pattern too long")
                    return lst * times
        raise ValueError("not a list expression")

    try:
        result = evaluate(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"invalid pattern {text!r}") from exc
    if not isinstance(result, list):
        raise ValueError("a pattern must evaluate to a list")
    return result


def _to_layer_freq(value: Any) -> int | list[int] | tuple[int, ...]:
    """megatron-core's ``moe_layer_freq``: an int N, a 0/1 list, or (Megatron-LM's
    ``--moe-layer-freq``) a string holding either."""
    if isinstance(value, str):
        try:
            value = int(value) if re.fullmatch(r"\s*\d+\s*", value) else parse_layer_pattern(value)
        except ValueError as exc:
            raise _Unreadable(
                f"not an integer or a layer pattern ({exc})", _LAYER_FREQ_FIX
            ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise _Unreadable("must be an integer >= 1", _LAYER_FREQ_FIX)
        return value
    if isinstance(value, (list, tuple)):
        if value and all(type(item) is int and item in (0, 1) for item in value):
            return value
        raise _Unreadable("a layer pattern must be a non-empty list of 0 and 1", _LAYER_FREQ_FIX)
    raise _Unreadable("not an integer or a layer pattern", _LAYER_FREQ_FIX)


_WARMUP = _to_int(0, 3)


def _to_optimizer_name(value: Any) -> str:
    """Megatron-LM's ``--optimizer`` / Bridge's ``optimizer.optimizer``: a name."""
    if not isinstance(value, str) or not value.strip():
        raise _Unreadable("not an optimizer name", "give the optimizer's name, e.g. adam")
    return value.strip().lower()


# setting -> (parser, optional). ``optional``: None and the words none/null/"" mean "not set"
# (the setting stays None); otherwise None means "use the default". Settings not listed are
# taken as given (impl and scope have their own handling, report_json is a path).
_PARSERS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "impl": (_to_name, False),
    "warmup_steps": (_WARMUP, False),
    "model_te_rng_tracker": (to_bool, True),
    "rng_te_rng_tracker": (to_bool, True),
    "check_for_nan_in_loss": (to_bool, True),
    "check_for_nan_in_grad": (to_bool, True),
    "seq_length": (_to_int(1, 4096), True),
    "micro_batch_size": (_to_int(1, 1), True),
    "num_moe_experts": (_to_int(0, 8), True),
    "moe_expert_capacity_factor": (_to_float, True),
    "moe_token_dispatcher_type": (_to_choice("allgather", "alltoall", "flex"), False),
    "moe_layer_freq": (_to_layer_freq, False),
    "moe_shared_expert_intermediate_size": (_to_int(1, 2048), True),
    "moe_input_jitter_eps": (_to_float, True),
    "recompute_granularity": (_to_choice("full", "selective"), True),
    "recompute_modules": (_to_names, True),
    "recompute_num_layers": (_to_int(0, 1), True),
    "recompute_method": (_to_choice("uniform", "block"), True),
    "attention_dropout": (_to_float, False),
    "hidden_dropout": (_to_float, False),
    "pipeline_model_parallel_size": (_to_int(1, 2), True),
    "virtual_pipeline_model_parallel_size": (_to_int(1, 2), True),
    "optimizer": (_to_optimizer_name, False),
}
BOOL_SETTINGS = (
    "enable_cuda_graph",
    "external_cuda_graph",
    "variable_seq_lengths",
    "moe_pad_expert_input_to_capacity",
    "moe_router_padding_for_fp8",
    "moe_permute_fusion",
    "moe_shared_expert_overlap",
    "cpu_offloading",
    "overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute",
    "gradient_accumulation_fusion",
    "add_qkv_bias",
    "add_bias_linear",
    "fallback_on_slowdown",
    "fp16",
    "batch_p2p_comm",
    "batch_p2p_sync",
    "overlap_param_gather_with_optimizer_step",
    "optimizer_cuda_graph",
    "optimizer_cpu_offload",
)
_PARSERS.update({name: (to_bool, False) for name in BOOL_SETTINGS})
_PROBLEM_TEXT = {
    "warmup_steps": "cuda_graph_warmup_steps must be a non-negative integer",
}
_FIX_TEXT = {
    "warmup_steps": "set it to the number of eager steps before capture (megatron-core's "
    "default: 3)",
}


def normalise(setting: str, value: Any) -> Any:
    """The value of ``setting`` in the plugin's types, or :data:`MISSING` for "use the
    default". Raises ``ValueError`` carrying a :class:`FieldProblem` when it cannot be read."""
    parser, optional = _PARSERS.get(setting, (None, False))
    if value is None or (optional and _is_none_word(value)):
        return None if optional else MISSING
    if parser is None:
        return value
    try:
        return parser(value)
    except _Unreadable as exc:
        raise ValueError(
            FieldProblem(
                setting,
                value,
                _PROBLEM_TEXT.get(setting, exc.problem),
                _FIX_TEXT.get(setting, exc.fix),
            )
        ) from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The CUDA-graph settings and the model facts the constraints depend on.

    ``impl`` and ``scope`` are normalised to the plugin's vocabulary (megatron-core 0.16's:
    ``impl="local"`` + ``scope=("full_iteration",)`` for full-iteration graphs) whatever
    spelling the host used; every other value to its type (see :func:`normalise`).
    ``sources`` maps each setting found in the host config to the name the user knows it
    by (``paths``: to its path); ``input_problems`` lists the values that could not be read
    (their settings keep their defaults).
    """

    impl: Any = "none"
    scope: tuple[str, ...] = ()
    warmup_steps: int = DEFAULT_WARMUP_STEPS
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
    moe_layer_freq: int | list[int] | tuple[int, ...] = 1
    moe_permute_fusion: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
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
    fp16: bool = False
    pipeline_model_parallel_size: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    batch_p2p_comm: bool = True  # megatron-core's defaults
    batch_p2p_sync: bool = True
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cuda_graph: bool = False
    optimizer: str = "adam"
    optimizer_cpu_offload: bool = False
    report_json: str | None = None
    fallback_on_slowdown: bool = False
    # Where the values came from, and what could not be read.
    from_command_line: bool = False
    deprecated_full_scope: bool = False
    scope_conflict: tuple[tuple[str, str], ...] = ()
    input_problems: tuple[FieldProblem, ...] = ()
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    paths: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def enabled(self) -> bool:
        """CUDA graphs are requested (``impl`` other than ``none``)."""
        return self.impl != "none"

    @property
    def full_iteration(self) -> bool:
        return "full_iteration" in self.scope

    @property
    def pipeline_parallel(self) -> bool:
        return (self.pipeline_model_parallel_size or 1) > 1

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

    @property
    def legacy_flag(self) -> str | None:
        """The deprecated flag that is on (``enable_cuda_graph`` / ``external_cuda_graph``)."""
        if self.enable_cuda_graph:
            return "enable_cuda_graph"
        return "external_cuda_graph" if self.external_cuda_graph else None

    @property
    def impl_from_legacy_flag(self) -> bool:
        """``impl`` is what megatron-core's ``__post_init__`` derives from the one deprecated
        flag that is on (``enable_cuda_graph`` -> local, ``external_cuda_graph`` ->
        transformer_engine), so the user need not have set it. On a command line the impl
        flag is the user's own (Megatron-LM converts the deprecated flags itself)."""
        derived = {"enable_cuda_graph": "local", "external_cuda_graph": "transformer_engine"}
        return (
            not self.from_command_line
            and not (self.enable_cuda_graph and self.external_cuda_graph)
            and self.legacy_flag is not None
            and self.impl == derived[self.legacy_flag]
        )

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


def _scope_conflict(config: Any) -> tuple[tuple[str, str], ...]:
    """Both generations' scope fields set at one level (0.19 refuses that)."""
    for prefix in ("model.", ""):
        present = []
        for name in compat.SCOPE_FIELD_NAMES:
            path = prefix + name
            value = resolve(config, path)
            if value is not MISSING and parse_scope(value) not in ((), ("full",)):
                present.append((display_name(config, path), repr(value)))
        if len(present) > 1:
            return tuple(present)
    return ()


def read_settings(config: Any) -> Settings:
    """Read :class:`Settings` from a host config of any supported shape (duck-typed).

    Never raises for a bad value: it is recorded in ``input_problems`` (validation lists
    it) and its setting keeps its default.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    paths: dict[str, str] = {}
    problems: list[FieldProblem] = []
    for setting in FIELD_PATHS:
        value, path = lookup(config, setting)
        if path is None:
            continue
        paths[setting] = path
        sources[setting] = display_name(config, path)
        if setting == "scope":
            values[setting] = value
            continue
        try:
            value = normalise(setting, value)
        except ValueError as exc:
            problems.append(exc.args[0])
            continue
        if value is not MISSING:
            values[setting] = value
    names = parse_scope(values.pop("scope", None))
    impl, scope = compat.canonical_impl_and_scope(values.pop("impl", "none"), names)
    return Settings(
        impl=impl,
        scope=scope,
        **values,
        from_command_line=isinstance(config, argparse.Namespace),
        deprecated_full_scope=names == ("full",),
        scope_conflict=_scope_conflict(config),
        input_problems=tuple(problems),
        sources=sources,
        paths=paths,
    )
