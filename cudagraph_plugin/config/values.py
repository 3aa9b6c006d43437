"""The accepted forms of every setting's value, and their normalisation.

Launchers (YAML recipes, environment overrides, Megatron-LM command lines) pass numbers and
booleans as strings, lists as comma-separated strings and MoE layer patterns as
Megatron-LM pattern strings. Each value is normalised here (docs/configuration.md, "Accepted
forms"), or, when it cannot be read, recorded as a :class:`FieldProblem` naming the field,
the value and the fix, which the rules list with the other problems; a value is never
misread and nothing raises a bare ``TypeError``.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cudagraph_plugin.config.buckets import parse_buckets
from cudagraph_plugin.config.fields import MISSING


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
    # where a section on the way raised instead (``model``): said once for every setting
    # read through it (a property raising for its whole section gave ~50 problems; user trial)
    section: str | None = None


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


def whole_number(value: Any) -> int | None:
    """``value`` as an int where this module would read it as one (an int, or a string of
    digits with an optional sign and spaces), else None."""
    try:
        return _integer(value)
    except _Unreadable:
        return None


def _to_int(minimum: int, example: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        number = whole_number(value)
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
    if number is None:
        raise _Unreadable("not a number", "give a number such as 0.1")
    if not math.isfinite(number):
        raise _Unreadable("not a finite number", "give a finite number such as 0.1")
    return number


def _to_limit(value: Any) -> float:
    """A number where infinity means "no limit" (``inf``, ``"inf"``)."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(value, float) and value == math.inf:
        return value
    try:
        return _to_float(value)
    except _Unreadable:
        raise _Unreadable(
            "not a number", "give a number such as 1e5, or inf for no limit"
        ) from None


def _to_deadline(value: Any) -> float:
    """Seconds, 0 for "off"; a shorter deadline than a normal shutdown takes is refused."""
    fix = "give 0 (off) or a number of seconds from 1 to 3600, such as 12 (the default)"
    try:
        number = _to_float(value)
    except _Unreadable as exc:
        raise _Unreadable(exc.problem, fix) from None
    if number != 0 and not 1 <= number <= 3600:
        raise _Unreadable(
            "must be 0 (off) or from 1 s (a rank's shutdown, the graphs freed, takes about a "
            "second) to 3600 s",
            fix,
        )
    return number


_DTYPE_NAMES = {
    "fp32": ("float32", "fp32", "float"),
    "bf16": ("bfloat16", "bf16"),
    "fp16": ("float16", "fp16", "half"),
    "fp8": ("float8", "fp8", "uint8"),
}


def _to_dtype_name(value: Any) -> str:
    """A dtype as ``fp32``/``bf16``/``fp16``/``fp8``: from a torch dtype (``torch.float32``)
    or its name in any of the spellings Megatron-LM and megatron-core use."""
    text = str(value).strip().lower().removeprefix("torch.")
    for name, spellings in _DTYPE_NAMES.items():
        if any(text.startswith(spelling) for spelling in spellings):
            return name
    raise _Unreadable("not a known dtype", "use fp32, bf16, fp16 or fp8 (or a torch dtype)")


def _to_buckets(value: Any) -> tuple[int, ...]:
    """Sequence-length buckets: a list of ints or a string ``"256,512,1024"`` (commas or
    spaces), or one int in a config (a YAML recipe's ``cuda_graph_buckets: 512``, read as
    ``"512"`` is; ``pad_step``'s own argument stays a list); sorted, each once."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = [value]
    try:
        # ("it": the problem follows the field as the config or command line names it,
        # "--cuda-graph-buckets = '512,256,512': it has a length twice"; user trial)
        return parse_buckets(value, "it")
    except ValueError as exc:
        raise _Unreadable(str(exc), _BUCKETS_FIX) from None


_BUCKETS_FIX = "give distinct positive sequence lengths, e.g. 256,512,1024"


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
    """Megatron-LM's ``--optimizer`` / Bridge's ``optimizer.optimizer``: a name, kept as
    written: megatron-core compares it so (``config.optimizer == 'adam'``), and the optimizer
    graph's rule with it (``"Adam"`` is no Adam to megatron-core)."""
    if not isinstance(value, str) or not value.strip():
        raise _Unreadable("not an optimizer name", "give the optimizer's name, e.g. adam")
    return value


def _to_recipe(value: Any) -> str:
    """A mixed-precision recipe: its name as given, or the class of a recipe object."""
    return value.strip() if isinstance(value, str) else type(value).__name__


def _to_path(value: Any) -> Any:
    """The report's path: a string or a path object, kept as given (``""`` or ``False``:
    no report, as a YAML recipe's "off")."""
    if value is False:
        return ""
    if not isinstance(value, (str, os.PathLike)):
        raise _Unreadable(
            f"not a file path ({type(value).__name__})",
            "give the report's path as a string, e.g. report.json, or leave it out",
        )
    if "\0" in os.fsdecode(value):  # (no file system takes one: the write would fail at the end)
        raise _Unreadable(
            "a file path with a NUL character in it",
            "give the report's path without it, e.g. report.json",
        )
    return value


# setting -> (parser, optional). ``optional``: None and the words none/null/"" mean "not set"
# (the setting stays None); otherwise None means "use the default". Settings not listed are
# taken as given (impl and scope have their own handling).
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
    "tensor_model_parallel_size": (_to_int(1, 2), True),
    "context_parallel_size": (_to_int(1, 2), True),
    "optimizer": (_to_optimizer_name, False),
    "transformer_impl": (_to_choice("local", "transformer_engine", "inference_optimized"), True),
    "loss_scale": (_to_float, True),
    "buckets": (_to_buckets, True),
    "baseline_steps": (_to_int(0, 10), True),
    "peer_exit_deadline": (_to_deadline, False),
    "report_json": (_to_path, False),
    "grad_norm_skip_threshold": (_to_limit, True),
    "main_params_dtype": (_to_dtype_name, True),
    "params_dtype": (_to_dtype_name, True),
    "mixed_precision": (_to_recipe, True),
    "exp_avg_dtype": (_to_dtype_name, True),
    "exp_avg_sq_dtype": (_to_dtype_name, True),
    "timing_log_level": (_to_int(0, 0), True),
    "weight_decay_incr_style": (_to_choice("constant", "linear", "cosine"), True),
}
BOOL_SETTINGS = (
    "moe_layer_recompute",
    "check_for_large_grads",
    "check_for_spiky_loss",
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
    "accept_eager",
    "device_grad_norm",
    "log_all_ranks",
    "log_num_zeros_in_grad",
    "use_precision_aware_optimizer",
    "store_param_remainders",
    "fp8_param",
    "use_distributed_optimizer",
    "fp16",
    "bf16",
    "batch_p2p_comm",
    "batch_p2p_sync",
    "overlap_p2p_comm",
    "overlap_param_gather_with_optimizer_step",
    "optimizer_cuda_graph",
    "optimizer_cpu_offload",
    "sequence_parallel",
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
    except (ValueError, OverflowError, TypeError) as exc:
        # (what Python itself cannot convert: an integer of thousands of digits, a number
        # beyond a float's range; a problem like any unreadable value, not a traceback)
        raise ValueError(
            FieldProblem(
                setting,
                value,
                f"cannot be read ({type(exc).__name__}: {str(exc)[:120]})",
                _FIX_TEXT.get(setting, "give a plain value of its kind, e.g. a small number"),
            )
        ) from None
