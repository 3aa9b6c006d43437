"""The CUDA-graph settings of one configuration, read from whatever config the host has.

:func:`read_settings` walks the field table (:mod:`~cudagraph_plugin.config.fields`),
normalises each value (:mod:`~cudagraph_plugin.config.values`) and returns a frozen
:class:`Settings`: the values in the plugin's vocabulary, where each came from, and the
values that could not be read. It never raises and never writes.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from cudagraph_plugin.config.fields import (
    FIELD_PATHS,
    MISSING,
    Unreadable,
    assignment,
    display_name,
    lookup,
    resolve,
)
from cudagraph_plugin.config.strays import Stray, stray_fields
from cudagraph_plugin.config.values import FieldProblem, normalise, parse_scope, whole_number
from cudagraph_plugin.config.vocabulary import (
    DEFAULT_WARMUP_STEPS,
    PEER_EXIT_DEADLINE_S,
    SCOPE_FIELD_NAMES,
    canonical_impl_and_scope,
)


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
    check_for_large_grads: bool = False
    check_for_spiky_loss: bool = False
    enable_cuda_graph: bool = False
    external_cuda_graph: bool = False
    seq_length: int | None = None
    position_embedding_type: Any = None  # (taken as given: only learned_absolute matters)
    max_position_embeddings: Any = None  # (as given: a bad one only makes the limit unknown)
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
    moe_layer_recompute: bool = False  # deprecated; read into the two above
    recompute_num_layers: int | None = None
    recompute_method: str | None = None
    attention_dropout: float = 0.1  # megatron-core's defaults: a host config without the
    hidden_dropout: float = 0.1  # field builds its TransformerConfig with them
    cpu_offloading: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    gradient_accumulation_fusion: bool = False
    add_qkv_bias: bool = False
    add_bias_linear: bool = True  # megatron-core's default
    fp16: bool = False
    bf16: bool | None = None  # None: the config does not say
    params_dtype: str | None = None
    # Megatron-Bridge's recipe (ConfigContainer.mixed_precision), which sets the model's
    # bf16/fp16/params_dtype when the config is finalised: as given, or its class's name
    mixed_precision: str | None = None
    pipeline_model_parallel_size: int | None = None
    tensor_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    sequence_parallel: bool = False
    virtual_pipeline_model_parallel_size: int | None = None
    batch_p2p_comm: bool = True  # megatron-core's defaults
    batch_p2p_sync: bool = True
    overlap_p2p_comm: bool | None = None  # Megatron-LM's args only
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cuda_graph: bool = False
    optimizer: str = "adam"
    optimizer_cpu_offload: bool = False
    log_num_zeros_in_grad: bool = False
    loss_scale: float | None = None
    grad_norm_skip_threshold: float | None = None
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True  # megatron-core's default
    main_params_dtype: str | None = None
    exp_avg_dtype: str | None = None
    exp_avg_sq_dtype: str | None = None
    fp8_param: bool = False
    timing_log_level: int | None = None
    weight_decay_incr_style: str | None = None
    use_distributed_optimizer: bool = False
    report_json: str | None = None
    fallback_on_slowdown: bool = False
    buckets: tuple[int, ...] | None = None
    baseline_steps: int | None = None
    warmup_from_baseline: int | None = None  # the warm-up given, when baseline_steps raised it
    accept_eager: bool = False
    device_grad_norm: bool = False
    log_all_ranks: bool = False
    peer_exit_deadline: float = PEER_EXIT_DEADLINE_S  # 0: off
    transformer_impl: str | None = None
    # Where the values came from, and what could not be read.
    from_command_line: bool = False
    deprecated_full_scope: bool = False
    scope_conflict: tuple[tuple[str, str], ...] = ()
    duplicated_scopes: tuple[str, ...] = ()
    # the fields as written in megatron-core 0.18+'s spelling ("--cuda-graph-impl
    # full_iteration", "cuda_graph_modules"): a note where the installed one does not know it
    newer_spelling: tuple[str, ...] = ()
    # megatron-core 0.18+'s impl full_iteration (read as local with scope full_iteration)
    full_iteration_impl: bool = False
    input_problems: tuple[FieldProblem, ...] = ()
    # a setting found in two places with two values ("model.fp16=False", "optimizer.fp16=True"):
    # the first is read; megatron-core may read the other where it builds that part
    disagreements: tuple[Disagreement, ...] = ()
    # CUDA graph fields where nothing reads them (misplaced, misspelt): what to say of each
    stray_fields: tuple[Stray, ...] = ()
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
    def learned_positions_end(self) -> tuple[str, int] | None:
        """Where a model with learned position embeddings (``learned_absolute``) has none
        further, and the setting that says so: ``max_position_embeddings`` (Megatron-LM's
        GPTModel gets it as ``max_sequence_length``), else ``seq_length`` (Megatron-LM's
        default for it; Megatron-Bridge's provider builds the model with it). None where the
        config does not say the position embeddings or their length."""
        if self.position_embedding_type != "learned_absolute":
            return None
        if self.max_position_embeddings is not None:
            # (read only here, so a value that is no whole number refuses nothing: it leaves
            # the limit unknown; review of 2026-12-05)
            given = whole_number(self.max_position_embeddings)
            if given is None or given < 1:
                return None
            return "max_position_embeddings", given
        if self.seq_length is not None:
            return "seq_length", self.seq_length
        return None

    @property
    def sequence_multiple(self) -> int:
        """What every sequence length must be a multiple of: megatron-core splits it over
        ``2 x context_parallel_size`` chunks (load-balanced causal CP) and, with sequence
        parallelism, each context-parallel rank's part over the tensor-parallel ranks."""
        tp = self.tensor_model_parallel_size or 1
        cp = self.context_parallel_size or 1
        multiple = 2 * cp if cp > 1 else 1
        if self.sequence_parallel and tp > 1:
            multiple = math.lcm(multiple, tp * cp)
        return multiple

    @property
    def p2p_from_overlap(self) -> bool:
        """``batch_p2p_comm`` was derived from Megatron-LM's ``overlap_p2p_comm`` (its args
        hold no ``batch_p2p_comm``)."""
        return "batch_p2p_comm" not in self.paths and self.overlap_p2p_comm is not None

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
    def layer_dtype(self) -> str | None:
        """The dtype the model's layers hold their parameters in (``fp32``, ``bf16``,
        ``fp16``), where the config says: ``fp16`` and ``bf16`` (megatron-core's Float16Module
        casts to them) before ``params_dtype``; None where it does not say (no ``bf16``
        field) or a Megatron-Bridge recipe will decide when the config is finalised."""
        if self.mixed_precision is not None:
            return None
        if self.fp16:
            return "fp16"
        if self.bf16 or self.params_dtype == "bf16":
            return "bf16"
        if self.bf16 is None:
            return None
        return self.params_dtype or "fp32"

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

    def set_text(self, setting: str, value: Any) -> str:
        """How a fix says to give ``setting`` the ``value`` (:func:`~cudagraph_plugin.config.
        fields.assignment`): ``set model.fp16=False``, or ``drop --fp16`` on a command line."""
        return assignment(
            self.from_command_line, self.paths.get(setting), self.field(setting), value
        )


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """One setting given in two places of the config with two values: ``read`` (the path
    the settings took it from) and ``other``, each as the config names it."""

    setting: str
    read: str
    read_value: Any
    other: str
    other_value: Any

    def said(self) -> tuple[str, str]:
        return f"{self.read}={self.read_value!r}", f"{self.other}={self.other_value!r}"


# what to do about a value whose reading raised, by the error's type where it says more
_UNREADABLE_FIXES = {
    "MissingMandatoryValue": "fill in the value that the config marks mandatory (OmegaConf's "
    "???), e.g. with a Hydra override, or drop the field",
}

_DEFAULT_NAMES = {
    "impl": "cuda_graph_impl",
    "scope": "cuda_graph_scope",
    "warmup_steps": "cuda_graph_warmup_steps",
    "buckets": "cuda_graph_buckets",
    "model_te_rng_tracker": "use_te_rng_tracker",
    "rng_te_rng_tracker": "rng.te_rng_tracker",
}


def _scope_conflict(config: Any) -> tuple[tuple[str, str], ...]:
    """Both generations' scope fields set at one level (0.19 refuses that)."""
    for prefix in ("model.", ""):
        present = []
        for name in SCOPE_FIELD_NAMES:
            path = prefix + name
            value = resolve(config, path)
            if isinstance(value, Unreadable):
                continue  # (listed as unreadable)
            if value is not MISSING and parse_scope(value) not in ((), ("full",)):
                present.append((display_name(config, path), repr(value)))
        if len(present) > 1:
            return tuple(present)
    return ()


def _disagreeing(config: Any, setting: str, read: str, value: Any) -> list[Disagreement]:
    """The other places ``setting`` is given with another value than ``value`` (read from
    ``read``); unreadable ones are left out. The scope: only another level's (both
    generations' names at one level are :func:`_scope_conflict`), and not megatron-core's
    defaults there (nothing, or 0.16's ``"full"``)."""
    found = []
    level = read.rpartition(".")[0]
    for path in FIELD_PATHS[setting]:
        if path == read or path.startswith(read + "."):
            continue
        if setting == "scope" and path.rpartition(".")[0] == level:
            continue
        other = resolve(config, path)
        if other is MISSING or other is None or isinstance(other, Unreadable):
            continue
        with contextlib.suppress(ValueError, TypeError):
            if setting == "scope":
                names = parse_scope(other)
                alike = names in ((), ("full",)) or names == parse_scope(value)
            else:
                alike = _same(normalise(setting, other), value)
            if not alike:
                shown = display_name(config, read), display_name(config, path)
                found.append(Disagreement(setting, shown[0], value, shown[1], other))
    return found


def _same(read: Any, value: Any) -> bool:
    """Two read values alike: a list and a tuple of the same items, a path and its string."""
    if read is MISSING:
        return True
    if isinstance(read, list | tuple) and isinstance(value, list | tuple):
        return tuple(read) == tuple(value)
    if isinstance(read, os.PathLike | str) and isinstance(value, os.PathLike | str):
        return os.fspath(read) == os.fspath(value)
    return bool(read == value)


def read_settings(config: Any) -> Settings:
    """Read :class:`Settings` from a host config of any supported shape (duck-typed).

    Never raises for a bad value: it is recorded in ``input_problems`` (validation lists
    it) and its setting keeps its default.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    paths: dict[str, str] = {}
    problems: list[FieldProblem] = []
    disagreements: list[Disagreement] = []
    for setting in FIELD_PATHS:
        value, path = lookup(config, setting)
        if path is None:
            continue
        paths[setting] = path
        sources[setting] = display_name(config, path)
        if isinstance(value, Unreadable):
            problems.append(
                FieldProblem(
                    setting,
                    value,
                    f"reading it raised {type(value.error).__name__}: "
                    f"{(str(value.error).splitlines() or [''])[0][:120]}",
                    _UNREADABLE_FIXES.get(
                        type(value.error).__name__,
                        "give the field a plain value before the run starts (a property must "
                        "not raise when it is read)",
                    ),
                    section=(
                        display_name(config, value.where)
                        if value.where and value.where != path
                        else None
                    ),
                )
            )
            continue
        if setting == "scope":
            values[setting] = value
            disagreements += _disagreeing(config, setting, path, value)
            continue
        try:
            value = normalise(setting, value)
        except ValueError as exc:
            problems.append(exc.args[0])
            continue
        if value is not MISSING:
            values[setting] = value
            disagreements += _disagreeing(config, setting, path, value)
    if "batch_p2p_comm" not in paths and values.get("overlap_p2p_comm") is not None:
        # Megatron-LM builds batch_p2p_comm=not overlap_p2p_comm, and its validate_args turns
        # the overlap off without virtual stages; it also derives the virtual stages there
        # (from --num-layers-per-virtual-pipeline-stage ...): args read before that call
        # have none, and are judged as without them (the fix says so)
        values["batch_p2p_comm"] = not (
            values["overlap_p2p_comm"]
            and values.get("virtual_pipeline_model_parallel_size") is not None
        )
    if values.get("moe_layer_recompute") and values.get("recompute_granularity") != "full":
        # megatron-core's __post_init__ turns the deprecated flag into selective recompute of
        # moe before its CUDA graph checks (with full recompute it raises on its own)
        values["recompute_granularity"] = "selective"
        modules = values.get("recompute_modules")
        if modules is None:  # megatron-core's default (an empty list stays empty)
            modules = ("core_attn",)
        values["recompute_modules"] = tuple(dict.fromkeys((*modules, "moe")))
        given = sources.get("recompute_modules", "recompute_modules")
        sources["recompute_modules"] = f"{given} (+moe from {sources['moe_layer_recompute']})"
    baseline = values.get("baseline_steps")
    if baseline is not None and values.get("impl", "none") != "none":  # (graphs off: no capture)
        given = values.get("warmup_steps", DEFAULT_WARMUP_STEPS)
        if given < baseline + 1:
            # eager steps measured before the capture, the run's first one left out
            values["warmup_steps"] = baseline + 1
            values["warmup_from_baseline"] = given
    names = parse_scope(values.pop("scope", None))
    newer = []
    if values.get("impl") == "full_iteration":
        newer.append(f"{sources['impl']}=full_iteration")
    if names and paths.get("scope", "").endswith(SCOPE_FIELD_NAMES[1]):
        newer.append(sources["scope"])
    given_impl = values.pop("impl", "none")
    impl, scope = canonical_impl_and_scope(given_impl, names)
    # megatron-core accepts a scope listed twice; the plugin uses each once and says so.
    # counted in the names the user wrote: the 0.18+ impl full_iteration adds its own
    duplicated = tuple(dict.fromkeys(n for n in names if n and names.count(n) > 1))
    scope = tuple(dict.fromkeys(scope))
    return Settings(
        impl=impl,
        scope=scope,
        **values,
        from_command_line=isinstance(config, argparse.Namespace),
        deprecated_full_scope=names == ("full",),
        duplicated_scopes=duplicated,
        newer_spelling=tuple(newer),
        full_iteration_impl=given_impl == "full_iteration",
        scope_conflict=_scope_conflict(config),
        input_problems=tuple(problems),
        disagreements=tuple(disagreements),
        stray_fields=stray_fields(config),
        sources=sources,
        paths=paths,
    )
