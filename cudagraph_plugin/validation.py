"""Every constraint on a CUDA-graph configuration, checked before anything is built.

Owns the rules (DESIGN.md's constraints plus megatron-core's own cuda-graph assertions that
apply to the model config), the error type that lists all violations at once, the advice
(warnings that are logged, never raised), the documented auto-fixes (planned here without
touching the config; applied by the run) and the warm-up warning given at train start.

Each rule quotes the reference phrase megatron-core (0.16.1 and 0.19.2), Megatron-LM or
Megatron-Bridge use for the same constraint (``Violation.references``), so a pasted error
finds its explanation; the rest of each message is ours: the field, the value, the fix.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from packaging.version import InvalidVersion, Version

from cudagraph_plugin import compat
from cudagraph_plugin.settings import (
    DEPRECATED_SCOPES,
    IMPLS,
    SCOPES,
    Settings,
    assign,
    display_name,
    existing_paths,
    resolve,
    to_bool,
)

logger = logging.getLogger("cudagraph_plugin")

TE_SCOPES = tuple(s for s in SCOPES if s != "full_iteration")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")

# Where the reference phrases come from.
MCORE = "megatron-core"  # the same text in 0.16.1 and 0.19.2
MCORE_16 = "megatron-core 0.16"
MCORE_19 = "megatron-core 0.19"
MLM = "Megatron-LM"
BRIDGE = "Megatron-Bridge"


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken constraint: the field(s) involved, their value, what is wrong, the fix,
    and the phrases megatron-core / Megatron-LM / Megatron-Bridge use for it."""

    fields: tuple[str, ...]
    value: str
    problem: str
    fix: str
    references: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        """The problem with its reference phrases quoted: ``... (megatron-core: "...")``."""
        if not self.references:
            return self.problem
        quoted = "; ".join(f'{source}: "{phrase}"' for source, phrase in self.references)
        return f"{self.problem} ({quoted})"

    def format(self) -> str:
        return f"{', '.join(self.fields)} = {self.value}: {self.text}\n     fix: {self.fix}"


class CudaGraphConfigError(ValueError):
    """The CUDA-graph configuration cannot work; ``violations`` lists every problem."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = list(violations)
        lines = [f"{len(self.violations)} problem(s) with the CUDA graph configuration:"]
        lines += [f"  {i}. {v.format()}" for i, v in enumerate(self.violations, 1)]
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class Note:
    """Something a rule could not check here (said, never raised)."""

    text: str


INSTALLED = "installed"


@dataclasses.dataclass(frozen=True)
class Environment:
    """The facts about the machine of the run that rules need: the Transformer Engine
    version to check against (None: not known here, so not checked) and where it came from
    (``"installed"`` or ``"given"``)."""

    te_version: Version | None = None
    te_origin: str = INSTALLED

    @classmethod
    def of(cls, te_version: Any = INSTALLED, origin: str = "given") -> Environment:
        """``te_version``: ``"installed"`` (read this machine's metadata), ``None`` (unknown)
        or a version to check against, such as ``"2.12"`` (given by ``origin``)."""
        if te_version == INSTALLED:
            return cls(compat.te_version(), INSTALLED)
        if te_version is None:
            return cls(None, origin)
        return cls(parse_te_version(te_version), origin)

    def te_label(self) -> str:
        return f"{self.te_origin}: {self.te_version}"


def parse_te_version(value: Any) -> Version:
    """A Transformer Engine version such as ``"2.12"``; ``ValueError`` with the fix if not."""
    if isinstance(value, Version):
        return value
    try:
        return Version(str(value).strip())
    except InvalidVersion:
        raise ValueError(f"{value!r} is not a version number: give one such as 2.12.0") from None


Rule = Callable[[Settings, Environment], Iterator["Violation | Note"]]
_RULES: list[Rule] = []


def _rule(func: Rule) -> Rule:
    _RULES.append(func)
    return func


def _v(
    s: Settings,
    settings: tuple[str, ...],
    value: Any,
    problem: str,
    fix: str,
    *references: tuple[str, str],
) -> Violation:
    return Violation(
        tuple(s.field(name) for name in settings), repr(value), problem, fix, references
    )


def _scope_value(s: Settings) -> str:
    return ",".join(s.scope) if s.scope else "(empty)"


def _did_you_mean(name: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# -- values that could not be read ------------------------------------------------------------


@_rule
def _field_values(s: Settings, env: Environment) -> Iterator[Violation]:
    for p in s.input_problems:
        yield Violation((s.field(p.setting),), repr(p.value), p.problem, p.fix)


# -- impl and scope names ---------------------------------------------------------------------


@_rule
def _impl_known(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.impl not in IMPLS:
        yield _v(
            s,
            ("impl",),
            s.impl,
            f"unknown CUDA graph implementation {s.impl!r}",
            f"use one of {', '.join(IMPLS)} (megatron-core 0.18+ also spells local + "
            f"full_iteration as full_iteration){_did_you_mean(s.impl, IMPLS)}",
            (MCORE, "Invalid cuda graph implementation"),
            (BRIDGE, "Invalid value for cuda_graph_impl"),
        )


@_rule
def _scope_names_known(s: Settings, env: Environment) -> Iterator[Violation]:
    unknown = [name for name in s.scope if name not in (*SCOPES, *DEPRECATED_SCOPES, "")]
    if unknown:
        hints = "".join(_did_you_mean(name, SCOPES) for name in unknown[:1])
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            f"unknown CUDA graph scope(s) {', '.join(map(repr, unknown))}",
            f"use names from {', '.join(SCOPES)} (comma-separated){hints}",
            (BRIDGE, "Invalid cuda graph scope"),
        )
    if "" in s.scope:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "an empty scope name (a doubled, leading or trailing comma)",
            "remove the extra comma, e.g. attn,mlp",
        )


@_rule
def _scope_names_deprecated(s: Settings, env: Environment) -> Iterator[Violation]:
    if "full" in s.scope:  # alone it means whole-layer capture (see _scope_not_empty)
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "'full' is megatron-core's deprecated name for whole-layer capture (now an empty "
            "scope) and cannot be combined with other scopes",
            "drop 'full' and list only the parts to capture, e.g. attn,mlp",
            (MCORE, "full scope is deprecated"),
            (MCORE, "full scope cannot be used with other scopes"),
        )
    if "full_iteration_inference" in s.scope:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "'full_iteration_inference' is megatron-core 0.19's deprecated scope for "
            "inference CUDA graphs (now inference_cuda_graph_scope=block), which this plugin "
            "does not manage",
            "drop it from the scope; set inference_cuda_graph_scope for inference graphs",
            (MCORE_19, "cuda_graph_modules 'full_iteration_inference' is deprecated"),
        )


@_rule
def _scope_fields_not_both(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.scope_conflict:
        yield Violation(
            tuple(name for name, _ in s.scope_conflict),
            repr(tuple(value for _, value in s.scope_conflict)),
            "the scope is given twice, in megatron-core 0.16's cuda_graph_scope and in 0.18+'s "
            "cuda_graph_modules",
            "keep one of them (cuda_graph_modules on megatron-core 0.18+, cuda_graph_scope before)",
            (
                (MCORE_19, "cuda_graph_scope and cuda_graph_modules cannot be set together"),
                (MLM, "--cuda-graph-scope and --cuda-graph-modules cannot be used together"),
            ),
        )


@_rule
def _scope_not_duplicated(s: Settings, env: Environment) -> Iterator[Violation]:
    duplicated = sorted({name for name in s.scope if name and s.scope.count(name) > 1})
    if duplicated:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            f"scope(s) listed more than once: {', '.join(duplicated)}",
            "list each scope once",
        )


@_rule
def _scope_not_empty(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.impl in IMPLS and not s.scope and not s.impl_from_legacy_flag:
        example = "full_iteration" if s.impl == "local" else "attn or attn,mlp"
        references = ()
        problem = (
            "CUDA graphs are on but no scope is given (whole-layer capture is not managed "
            "by this plugin)"
        )
        if s.deprecated_full_scope:
            problem += "; 'full' is megatron-core's deprecated name for that whole-layer capture"
            references = ((MCORE, "full scope is deprecated"),)
        yield _v(
            s,
            ("impl", "scope"),
            (s.impl, _scope_value(s)),
            problem,
            f"name the scope explicitly, e.g. {example}",
            *references,
        )


@_rule
def _full_iteration_only_local(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.full_iteration and s.impl == "transformer_engine":
        yield _v(
            s,
            ("impl", "scope"),
            (s.impl, _scope_value(s)),
            "scope full_iteration is megatron-core's FullCudaGraphWrapper, which only the local "
            "implementation provides",
            "use cuda_graph_impl=local with scope full_iteration (megatron-core 0.18+: "
            "cuda_graph_impl=full_iteration), or TE scopes such as attn,mlp",
            (
                MCORE,
                "full_iteration cuda graph is not supported for cuda_graph_impl=transformer_engine",
            ),
            (
                MCORE_16,
                "To use full iteration cuda graph, please use cuda_graph_impl=local "
                "instead of cuda_graph_impl=transformer_engine",
            ),
            (
                BRIDGE,
                "full_iteration CUDA graph scope cannot use cuda_graph_impl=transformer_engine",
            ),
        )


@_rule
def _full_iteration_alone(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.full_iteration and len(set(s.scope)) > 1:
        others = sorted(set(s.scope) - {"full_iteration"})
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            f"full_iteration cannot be mixed with other scopes ({', '.join(others)}): it "
            "already captures the whole forward and backward",
            "use scope full_iteration alone, or drop it and use TE scopes",
            (BRIDGE, "full_iteration CUDA graph scope cannot be combined with other scopes"),
            (MCORE_19, 'cuda_graph_modules must be empty when cuda_graph_impl="full_iteration"'),
        )


@_rule
def _local_is_full_iteration(s: Settings, env: Environment) -> Iterator[Violation]:
    per_layer = [name for name in s.scope if name in TE_SCOPES]
    if s.impl == "local" and per_layer:
        yield _v(
            s,
            ("impl", "scope"),
            (s.impl, _scope_value(s)),
            f"impl local with per-layer scopes ({', '.join(per_layer)}) uses megatron-core's "
            "per-layer CudaGraphManager, which this plugin does not manage",
            "use cuda_graph_impl=transformer_engine for per-layer scopes, or "
            "cuda_graph_impl=local with scope full_iteration",
            (BRIDGE, 'cuda_graph_impl="local" only for full-iteration CUDA graphs'),
        )


# -- legacy flags and RNG ---------------------------------------------------------------------


@_rule
def _legacy_flags(s: Settings, env: Environment) -> Iterator[Violation]:
    flag = s.legacy_flag
    if flag is None:
        return
    new = "local" if flag == "enable_cuda_graph" else "transformer_engine"
    if s.enable_cuda_graph and s.external_cuda_graph:
        yield _v(
            s,
            ("enable_cuda_graph", "external_cuda_graph"),
            (True, True),
            "both deprecated CUDA graph flags are on",
            "drop both deprecated flags and set cuda_graph_impl",
            (MCORE, "enable_cuda_graph and external_cuda_graph cannot be enabled at the same time"),
        )
    elif s.enabled and not s.impl_from_legacy_flag:
        yield _v(
            s,
            (flag, "impl"),
            (True, s.impl),
            f"the deprecated {flag} is set together with cuda_graph_impl",
            "drop the deprecated flag; cuda_graph_impl says it all",
            (MCORE, "Do not use enable_cuda_graph or external_cuda_graph with cuda_graph_impl"),
        )
    else:
        # Alone, or with the impl megatron-core derived from it (a built TransformerConfig).
        example = "full_iteration" if new == "local" else "attn,mlp"
        yield _v(
            s,
            (flag,),
            True,
            f"{flag} is deprecated: megatron-core turns it into cuda_graph_impl={new} with "
            "whole-layer graphs, which this plugin does not manage",
            f"drop {flag} and set cuda_graph_impl={new} with an explicit cuda_graph_scope "
            f"(e.g. {example})",
            (MCORE, f"{flag} is deprecated, use cuda_graph_impl={new} instead"),
        )


@_rule
def _te_rng_tracker(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled:
        return
    for setting in ("model_te_rng_tracker", "rng_te_rng_tracker"):
        if getattr(s, setting) is False:
            yield _v(
                s,
                (setting,),
                False,
                "CUDA graphs require the TE RNG tracker (graph-safe RNG states)",
                f"set {s.field(setting)}=True (the plugin's configure does this for you)",
                (MCORE, "RNG tracker does not support cudagraphs"),
            )


# -- static shapes, NaN checks, offloading ----------------------------------------------------


@_rule
def _static_shapes(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.variable_seq_lengths:
        yield _v(
            s,
            ("variable_seq_lengths",),
            True,
            "CUDA graphs need static tensor shapes; variable-length sequences do not work",
            "fix seq_length and micro_batch_size; pad packed sequences to a fixed width and "
            "set variable_seq_lengths=False",
            (BRIDGE, "Offline packing with CUDA graphs requires dataset pad_to_max_length=True"),
        )


@_rule
def _nan_loss_check(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.impl == "local" and s.full_iteration and s.check_for_nan_in_loss:
        yield _v(
            s,
            ("check_for_nan_in_loss",),
            True,
            "full_iteration CUDA graph requires check_for_nan_in_loss=False: the whole "
            "forward and backward is captured, so the loss cannot be inspected in between",
            f"turn {s.field('check_for_nan_in_loss')} off",
            (BRIDGE, "check_for_nan_in_loss must be disabled when using full_iteration CUDA graph"),
            (
                MLM,
                "--no-check-for-nan-in-loss-and-grad should be set with "
                "--cuda-graph-impl=full_iteration for training",
            ),
        )


@_rule
def _cpu_offloading(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.cpu_offloading:
        yield _v(
            s,
            ("cpu_offloading",),
            True,
            "activations offloaded to the CPU cannot live in a captured graph",
            "set cpu_offloading=False, or turn CUDA graphs off",
            (MCORE, "CUDA graphs not supported with CPU offloading"),
        )


@_rule
def _nan_grad_check(s: Settings, env: Environment) -> Iterator[Violation]:
    same_field = s.paths.get("check_for_nan_in_grad") == s.paths.get("check_for_nan_in_loss")
    if s.impl == "local" and s.full_iteration and s.check_for_nan_in_grad and not same_field:
        yield _v(
            s,
            ("check_for_nan_in_grad",),
            True,
            "full_iteration CUDA graph with the gradient NaN check on: DDP inspects the "
            "reduced gradients on the host (a device synchronisation) inside the captured "
            "iteration",
            f"turn {s.field('check_for_nan_in_grad')} off",
            (
                MLM,
                "--no-check-for-nan-in-loss-and-grad should be set with "
                "--cuda-graph-impl=full_iteration for training",
            ),
        )


@_rule
def _full_iteration_warmup(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.full_iteration and s.warmup_steps == 0:
        yield _v(
            s,
            ("warmup_steps",),
            0,
            "full_iteration with no warm-up captures the very first step, while cuBLAS handles "
            "and NCCL communicators are still created lazily on first use, which a capture "
            "forbids (seen on an H200 with DP=2)",
            f"set {s.field('warmup_steps')} to 1 or more (megatron-core's default: 3)",
            ("CUDA", "CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
        )


@_rule
def _fp16_full_iteration(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.full_iteration and s.fp16:
        yield _v(
            s,
            ("fp16",),
            True,
            "fp16 training scales the loss dynamically: the scaler checks the gradients for "
            "inf/NaN on the host and replaces its scale tensor when it changes the scale, so a "
            "captured iteration would go on using the scale it was captured with",
            "train in bf16 (bf16=True, fp16=False), or use TE scopes such as attn,mlp",
        )


# -- pipeline parallelism ---------------------------------------------------------------------


@_rule
def _pipeline_full_iteration(s: Settings, env: Environment) -> Iterator[Violation]:
    if not (s.enabled and s.full_iteration):
        return
    if s.pipeline_parallel and s.batch_p2p_comm and s.batch_p2p_sync:
        yield _v(
            s,
            ("pipeline_model_parallel_size", "batch_p2p_comm", "batch_p2p_sync"),
            (s.pipeline_model_parallel_size, True, True),
            "full_iteration with pipeline parallelism: megatron-core synchronises the device "
            "after every batched p2p exchange between stages, which a capture forbids (seen on "
            'an H200: "operation not permitted when stream is capturing")',
            f"set {s.field('batch_p2p_comm')}=False (Megatron-LM: --overlap-p2p-communication "
            f"with virtual stages) or {s.field('batch_p2p_sync')}=False, or use TE scopes such "
            "as attn,mlp",
            (MCORE, "To protect against race condition when using batch_isend_irecv()"),
        )
    if s.overlap_param_gather_with_optimizer_step:
        yield _v(
            s,
            ("overlap_param_gather_with_optimizer_step",),
            True,
            "full_iteration with the parameter all-gather overlapped with the optimizer step: "
            "the gather is dispatched from the preceding optimizer step, outside the captured "
            "iteration, so the graph would wait for work it never launched",
            f"set {s.field('overlap_param_gather_with_optimizer_step')}=False, or use TE scopes",
            (
                BRIDGE,
                "incompatible with full-iteration capture because the parameter gather is "
                "dispatched from the preceding optimizer step",
            ),
        )


# -- optimizer graph (megatron-core 0.17+) ------------------------------------------------------


@_rule
def _optimizer_graph(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    if not s.optimizer_cuda_graph:
        return
    available = compat.has_optimizer_graph()
    if available is False:
        yield _v(
            s,
            ("optimizer_cuda_graph",),
            True,
            "the optimizer CUDA graph needs megatron-core's OptimizerCudaGraphWrapper, first "
            f"released in megatron-core {compat.OPTIMIZER_GRAPH_FIRST_RELEASE} (installed: "
            f"{_installed_mcore()})",
            f"install megatron-core >= {compat.OPTIMIZER_GRAPH_FIRST_RELEASE} (Python 3.12), "
            f"or turn {s.field('optimizer_cuda_graph')} off",
        )
    elif available is None:
        yield Note(
            "megatron-core is not installed here: the optimizer graph's release is not checked"
        )
    if s.optimizer != "adam":
        yield _v(
            s,
            ("optimizer",),
            s.optimizer,
            "megatron-core makes only Adam capturable (OptimizerConfig.optimizer_cuda_graph "
            "builds Adam with capturable=True)",
            f"use optimizer=adam, or turn {s.field('optimizer_cuda_graph')} off",
        )
    if s.fp16:
        yield _v(
            s,
            ("fp16", "optimizer_cuda_graph"),
            (True, True),
            "fp16's dynamic loss scaler checks the gradients for inf/NaN on the host inside "
            "the optimizer step, which a capture forbids",
            "train in bf16, or turn the optimizer graph off",
        )
    if s.optimizer_cpu_offload:
        yield _v(
            s,
            ("optimizer_cpu_offload", "optimizer_cuda_graph"),
            (True, True),
            "an optimizer step offloaded to the CPU cannot be captured in a CUDA graph",
            "turn optimizer_cpu_offload or the optimizer graph off",
        )
    if s.warmup_steps == 0:
        yield _v(
            s,
            ("warmup_steps", "optimizer_cuda_graph"),
            (0, True),
            "with no warm-up the optimizer graph captures the first optimizer step, which "
            "creates Adam's state",
            f"set {s.field('warmup_steps')} to 1 or more",
        )


def _installed_mcore() -> str:
    try:
        return str(compat.mcore_version())
    except RuntimeError:
        return "none"


# -- MoE --------------------------------------------------------------------------------------


@_rule
def _moe_scopes(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled:
        return
    scope = set(s.scope)
    if {"moe", "moe_router"} <= scope:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "moe (the whole MoE layer) and moe_router (its dense part) are mutually exclusive",
            "use moe for drop-and-pad MoE, or moe_router[,moe_preprocess] for dropless MoE",
            (MCORE_16, "cuda_graph_scope must not contain both moe and moe_router"),
            (MCORE_19, "cuda_graph_modules must not contain both moe and moe_router"),
        )
    if "moe_preprocess" in scope and "moe_router" not in scope:
        yield _v(
            s,
            ("scope",),
            _scope_value(s),
            "moe_preprocess is captured together with the router graph only",
            "add moe_router to the scope",
            (MCORE, "moe_preprocess cuda graph is only supported with moe_router cuda graph"),
        )
    moe_scopes = sorted(scope & {"moe", "moe_router"})
    if moe_scopes and not s.is_moe:
        yield _v(
            s,
            ("scope", "num_moe_experts"),
            (_scope_value(s), s.num_moe_experts),
            f"{', '.join(moe_scopes)} needs an MoE model (num_moe_experts > 1)",
            "drop the MoE scopes for a dense model (use attn,mlp)",
            (MCORE, "moe cuda graph is only supported for MoE"),
        )
    if not s.is_moe:
        return
    freq = s.moe_layer_freq
    all_moe = freq == 1 or (isinstance(freq, (list, tuple)) and 0 not in freq)
    if "mlp" in scope and all_moe:
        yield _v(
            s,
            ("scope", "moe_layer_freq"),
            (_scope_value(s), freq),
            "scope mlp captures dense MLP layers, and every layer of this model is MoE",
            "drop mlp from the scope (every layer is MoE); use moe_router,moe_preprocess",
            (
                MCORE,
                "mlp cuda graph is only supported for dense layers, but not found in the model",
            ),
        )
    if "moe" in scope and s.dropless_moe:
        yield _v(
            s,
            ("scope", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"),
            (_scope_value(s), s.moe_expert_capacity_factor, s.moe_pad_expert_input_to_capacity),
            "scope moe needs drop-and-pad MoE; dropless MoE has dynamic expert shapes, only its "
            "dense parts are graphable",
            "use moe_router,moe_preprocess for dropless MoE, or set "
            "moe_expert_capacity_factor and moe_pad_expert_input_to_capacity=True",
            (MCORE, "moe cuda graph is only supported with drop-padding MoE"),
        )
    if (
        "moe_preprocess" in scope
        and s.dropless_moe
        and s.moe_token_dispatcher_type == "alltoall"
        and (s.moe_expert_capacity_factor is not None or s.moe_router_padding_for_fp8)
    ):
        yield _v(
            s,
            ("scope", "moe_token_dispatcher_type"),
            (_scope_value(s), "alltoall"),
            "the alltoall dispatcher's preprocess step copies to the host and synchronises "
            "with a capacity factor or FP8 router padding",
            "drop moe_preprocess from the scope, or pad to capacity "
            "(moe_pad_expert_input_to_capacity=True)",
            (
                MCORE,
                "moe_preprocess cuda graph is not supported when there are DtoH copies "
                "and synchronizations in the preprocess step",
            ),
        )


@_rule
def _moe_preprocess_needs_fused_permute(s: Settings, env: Environment) -> Iterator[Violation]:
    # Seen on an H200 (megatron-core 0.16.1, TE 2.11): the alltoall dispatcher's unfused
    # permutation uses masked_select, whose device-to-host sync invalidates the capture.
    # megatron-core has no check for it; the reference is the CUDA error users get.
    if (
        s.impl == "transformer_engine"
        and "moe_preprocess" in s.scope
        and s.dropless_moe
        and s.moe_token_dispatcher_type == "alltoall"
        and not s.moe_permute_fusion
    ):
        yield _v(
            s,
            ("scope", "moe_permute_fusion"),
            (_scope_value(s), False),
            "moe_preprocess cuda graph with the dropless alltoall dispatcher needs the fused "
            "permutation: the unfused one synchronizes with the host (masked_select) inside "
            "the captured region",
            "set moe_permute_fusion=True (needs Transformer Engine), or drop moe_preprocess "
            "from the scope",
            ("CUDA, at capture", "operation not permitted when stream is capturing"),
        )


@_rule
def _ep_overlap(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.overlap_moe_expert_parallel_comm:
        bad = sorted(set(s.scope) & {"moe", "mlp", "full_iteration"})
        if s.impl != "transformer_engine" or bad:
            yield _v(
                s,
                ("overlap_moe_expert_parallel_comm", "impl", "scope"),
                (True, s.impl, _scope_value(s)),
                "with expert-parallel communication overlap only TE graphs of attn, moe_router "
                "and moe_preprocess are supported",
                "use cuda_graph_impl=transformer_engine with attn/moe_router/moe_preprocess, "
                "or turn overlap_moe_expert_parallel_comm off",
                (
                    MCORE,
                    "CUDA graph scope on moe and mlp is not supported with "
                    "overlap_moe_expert_parallel_comm",
                ),
            )


# -- recompute --------------------------------------------------------------------------------


@_rule
def _full_recompute(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled or s.full_iteration:
        return
    # recompute_num_layers only counts with granularity "full"; megatron-core ignores it
    # otherwise (hosts often carry a default for it).
    if s.recompute_granularity == "full":
        yield _v(
            s,
            ("recompute_granularity", "recompute_num_layers", "scope"),
            (s.recompute_granularity, s.recompute_num_layers, _scope_value(s)),
            "layer-level (full) recompute works only with the full-iteration graph, not with "
            "per-layer graphs",
            "use selective recompute (recompute_granularity=selective), turn CUDA graphs "
            "off, or use cuda_graph_impl=local with scope full_iteration",
            (MCORE, "full recompute is only supported with full iteration CUDA graph"),
        )


@_rule
def _selective_recompute(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled or s.recompute_granularity != "selective":
        return
    modules = s.effective_recompute_modules
    scope = set(s.scope)
    if s.impl == "transformer_engine" and "moe" in modules and "moe_router" in scope:
        yield _v(
            s,
            ("recompute_modules", "scope"),
            (list(modules), _scope_value(s)),
            "recomputing the MoE layer would re-run the graphed router with "
            "--cuda-graph-impl transformer_engine",
            "drop 'moe' from recompute_modules, or moe_router from the scope",
            (MCORE, "moe recompute is not supported with moe_router CUDA graph"),
        )
    whole = s.full_iteration
    if s.attention_dropout != 0.0 and "core_attn" in modules and (whole or "attn" in scope):
        yield _v(
            s,
            ("attention_dropout", "recompute_modules", "scope"),
            (s.attention_dropout, list(modules), _scope_value(s)),
            "recomputed attention inside a graph would replay its dropout mask",
            "set attention_dropout=0.0, or drop core_attn from recompute_modules",
            (MCORE, "attention dropout is not supported with graphed attention recomputation"),
        )
    if s.hidden_dropout != 0.0 and (
        ("mlp" in modules and (whole or "mlp" in scope))
        or ("moe" in modules and (whole or "moe" in scope))
    ):
        yield _v(
            s,
            ("hidden_dropout", "recompute_modules", "scope"),
            (s.hidden_dropout, list(modules), _scope_value(s)),
            "recomputed MLP/MoE inside a graph would replay its dropout mask",
            "set hidden_dropout=0.0, or drop mlp/moe from recompute_modules",
            (MCORE, "hidden dropout is not supported with graphed MLP/MoE recomputation"),
        )
    if s.moe_input_jitter_eps is not None and "moe" in modules and (whole or "moe" in scope):
        yield _v(
            s,
            ("moe_input_jitter_eps", "recompute_modules", "scope"),
            (s.moe_input_jitter_eps, list(modules), _scope_value(s)),
            "recomputed MoE inside a graph would replay its input jitter",
            "unset moe_input_jitter_eps, or drop moe from recompute_modules",
            (MCORE, "moe_input_jitter_eps is not supported with graphed moe recomputation"),
        )


# -- delayed weight gradients -----------------------------------------------------------------

_TE_FLAG_HINT = (
    "pass te_version= to check_config (--te-version to the check command) to check it "
    "against a version"
)


@_rule
def _delay_wgrad(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    if not (s.delay_wgrad_compute and s.impl == "transformer_engine"):
        return
    te = env.te_version
    scope = set(s.scope)
    # As Megatron-LM: shared experts are inside the router graph unless they overlap.
    needs_new_te = "attn" in scope or (
        "moe_router" in scope
        and s.moe_shared_expert_intermediate_size is not None
        and not s.moe_shared_expert_overlap
    )
    if needs_new_te:
        problems: list[str] = []
        references: list[tuple[str, str]] = []
        need = compat.TE_DELAY_WGRAD_WITH_ATTN
        if te is None:
            yield Note(
                f"delay_wgrad_compute with {_scope_value(s)} in the CUDA graph scope needs "
                f"Transformer Engine >= {need}: not checked here (no Transformer Engine "
                f"installed); {_TE_FLAG_HINT}"
            )
        elif te < need:
            problems.append(f"Transformer Engine >= {need} ({env.te_label()})")
            references.append(
                (MLM, f"CUDA graph with delay_wgrad_compute requires TE version >= {need}")
            )
        if not s.gradient_accumulation_fusion:
            problems.append("gradient_accumulation_fusion=True")
            references.append(
                (
                    MLM,
                    "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion "
                    "to be enabled",
                )
            )
        # Megatron-LM checks the bias only for graphed attention.
        if "attn" in scope and (s.add_qkv_bias or s.add_bias_linear):
            problems.append("no attention bias (add_qkv_bias=False, add_bias_linear=False)")
            references.append(
                (MLM, "CUDA graph with delay_wgrad_compute doesn't support attn bias for now")
            )
        if problems:
            yield _v(
                s,
                ("delay_wgrad_compute", "scope"),
                (True, _scope_value(s)),
                "delay_wgrad_compute with attn (or moe_router with shared experts) in the CUDA "
                "graph scope requires " + "; ".join(problems),
                "meet those requirements, or drop attn/moe_router from the scope, or set "
                "delay_wgrad_compute=False",
                *references,
            )
        return
    need = compat.TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS
    if te is None:
        yield Note(
            f"delay_wgrad_compute with per-layer (partial) CUDA graphs needs Transformer "
            f"Engine >= {need}: not checked here (no Transformer Engine installed); "
            f"{_TE_FLAG_HINT}"
        )
    elif te < need:
        yield _v(
            s,
            ("delay_wgrad_compute",),
            True,
            f"delay_wgrad_compute with per-layer (partial) CUDA graphs needs Transformer "
            f"Engine >= {need} ({env.te_label()})",
            "upgrade Transformer Engine or set delay_wgrad_compute=False",
            (
                MCORE,
                f"TE version >= {need} is required for delay_wgrad_compute with partial cuda graph",
            ),
        )


# -- entry points -----------------------------------------------------------------------------


def evaluate(
    settings: Settings, environment: Environment | None = None
) -> tuple[list[Violation], list[str]]:
    """Every broken constraint of ``settings``, and what could not be checked here.

    A rule's violation that names a field whose value could not be read is left out: the
    unreadable value is the problem to report, not what a default put in its place implies.
    """
    env = Environment.of() if environment is None else environment
    unreadable = {settings.field(p.setting) for p in settings.input_problems}
    violations: list[Violation] = []
    notes: list[str] = []
    for rule in _RULES:
        for finding in rule(settings, env):
            if isinstance(finding, Note):
                notes.append(finding.text)
            elif rule is _field_values or not unreadable & set(finding.fields):
                violations.append(finding)
    return violations, notes


def find_violations(settings: Settings, environment: Environment | None = None) -> list[Violation]:
    """Every broken constraint of ``settings`` (empty when the configuration can work)."""
    return evaluate(settings, environment)[0]


def validate(settings: Settings, environment: Environment | None = None) -> None:
    """Raise :class:`CudaGraphConfigError` listing every violation, if any."""
    violations = find_violations(settings, environment)
    if violations:
        raise CudaGraphConfigError(violations)


def _model_kind(s: Settings) -> str:
    if not s.is_moe:
        return "dense"
    return "dropless MoE" if s.dropless_moe else "drop-and-pad MoE"


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads both
EXPANDABLE = "expandable_segments:True"


def expandable_segments_source(environ: Any) -> str | None:
    """The allocator variable that turns expandable segments on, if any."""
    for name in ALLOC_CONF_VARS:
        if EXPANDABLE in environ.get(name, ""):
            return name
    return None


RECOMMENDED_SCOPES = {
    "dense": ("attn", "mlp"),
    "dropless MoE": ("attn", "moe_router", "moe_preprocess"),
    "drop-and-pad MoE": ("attn", "moe"),
}


def advice(settings: Settings, environ: Any = None) -> list[str]:
    """Warnings worth logging for a configuration that is valid (never raised)."""
    s = settings
    env = os.environ if environ is None else environ
    notes: list[str] = []
    if not s.enabled:
        return notes
    kind = _model_kind(s)
    recommended = RECOMMENDED_SCOPES[kind]
    scope = set(s.scope)
    if not scope <= set(SCOPES):
        pass  # unknown or deprecated names: validation says what is wrong with the scope
    elif s.full_iteration:
        notes.append(
            f"scope full_iteration is wider than recommended for a first {kind} run "
            f"(start with TE {','.join(recommended)}): it can raise peak memory 1.5-2x; "
            "check replay works and memory fits, and compare eager vs replay"
        )
    elif scope and scope < set(recommended):
        missing = [name for name in recommended if name not in scope]
        notes.append(
            f"scope {_scope_value(s)} is narrower than recommended for a {kind} model "
            f"({','.join(recommended)}); once replay works, memory fits and replay beats "
            f"eager, consider adding {','.join(missing)}"
        )
    elif scope - set(recommended) - {"mamba"}:
        extra = sorted(scope - set(recommended) - {"mamba"})
        notes.append(
            f"scope {_scope_value(s)} is wider than recommended for a {kind} model "
            f"({','.join(recommended)}): {','.join(extra)} adds memory; widen only after "
            "measuring eager vs replay"
        )
    source = expandable_segments_source(env)
    if source:
        notes.append(
            f"{source} has expandable_segments:True: CUDA graphs then need "
            "NCCL_GRAPH_REGISTER=0 (the preflight sets it when it can)"
        )
    if s.warmup_steps < 2:
        notes.append(
            f"{s.field('warmup_steps')}={s.warmup_steps}: the run report needs at least 2 "
            "warm-up steps to measure eager step time (the first step is excluded)"
        )
    return notes


def warmup_warning(settings: Settings, start_step: int, train_iters: int) -> str | None:
    """What to say at train start when the warm-up leaves nothing to capture or replay."""
    if not settings.enabled:
        return None
    steps = train_iters - start_step
    warmup = settings.warmup_steps
    capture = start_step + warmup
    where = (
        f"{settings.field('warmup_steps')}={warmup} and this run trains {steps} step(s) "
        f"(steps {start_step}..{train_iters - 1}: start_step={start_step}, "
        f"train_iters={train_iters})"
    )
    if warmup >= steps:
        return (
            f"{where}: the capture step {capture} (start_step + warm-up) is never reached, so "
            f"no CUDA graph will be captured; use fewer than {steps} warm-up step(s) or train "
            "longer"
        )
    if warmup == steps - 1:
        return (
            f"{where}: the graphs are captured at the last step ({capture}) and never "
            f"replayed, so the run cannot show a speed-up; use at most {max(steps - 2, 0)} "
            "warm-up step(s) or train longer"
        )
    return None


# -- auto-fixes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AutoFix:
    """One documented auto-fix: the setting, the config path (or, for ``environment``
    fixes, the variable) it writes, the value and the line that says so."""

    setting: str
    path: str
    value: Any
    message: str
    environment: bool = False


def _readable_bool(value: Any) -> bool | None:
    try:
        return None if value is None else to_bool(value)
    except ValueError:
        return None


def plan_autofixes(config: Any, settings: Settings, *, harness: bool = False) -> list[AutoFix]:
    """The documented auto-fixes ``config`` needs, without touching it.

    * CUDA graphs on: every TE RNG tracker flag the config has is set to True.
    * ``impl="none"``: the scope is cleared.
    * ``harness`` (a command line, as Megatron-Bridge's performance harness): local
      ``full_iteration`` also turns the loss and gradient NaN checks off (Megatron-LM
      asserts both off; its one flag holds both).

    A field whose value cannot be read is left alone (validation reports it).
    """
    fixes: list[AutoFix] = []
    if settings.enabled:
        for setting in ("model_te_rng_tracker", "rng_te_rng_tracker"):
            for path in existing_paths(config, setting):
                value = resolve(config, path)
                if value is None or _readable_bool(value) is False:
                    fixes.append(
                        AutoFix(
                            setting,
                            path,
                            True,
                            f"CUDA graphs are on: set {display_name(config, path)}=True "
                            "(TE RNG tracker)",
                        )
                    )
        if harness and settings.impl == "local" and settings.full_iteration:
            written: set[str] = set()
            for setting, what in (
                ("check_for_nan_in_loss", "the loss"),
                ("check_for_nan_in_grad", "the gradients"),
            ):
                for path in existing_paths(config, setting):
                    if path in written or _readable_bool(resolve(config, path)) is not True:
                        continue
                    written.add(path)
                    fixes.append(
                        AutoFix(
                            setting,
                            path,
                            False,
                            f"full_iteration CUDA graph: set {display_name(config, path)}=False "
                            f"({what} cannot be inspected inside the captured iteration)",
                        )
                    )
    elif settings.scope:
        for path in existing_paths(config, "scope"):
            if resolve(config, path):
                fixes.append(
                    AutoFix(
                        "scope",
                        path,
                        [],
                        f"cuda_graph_impl is none: cleared {display_name(config, path)} "
                        f"(was {_scope_value(settings)})",
                    )
                )
    return fixes


def settings_after(settings: Settings, fixes: list[AutoFix]) -> Settings:
    """``settings`` as they read once ``fixes`` are applied to the config: every setting
    read from a path a fix writes (Megatron-LM's ``check_for_nan_in_loss_and_grad`` holds
    both NaN checks) takes the written value."""
    written = {fix.path: fix.value for fix in fixes if not fix.environment}
    changed = {
        setting: (() if setting == "scope" else written[path])
        for setting, path in settings.paths.items()
        if path in written
    }
    return dataclasses.replace(settings, **changed) if changed else settings


def write_autofixes(config: Any, fixes: list[AutoFix], environ: Any = None) -> list[str]:
    """Write ``fixes`` into ``config`` (and ``environ``), logging each once."""
    env = os.environ if environ is None else environ
    for fix in fixes:
        if fix.environment:
            env[fix.path] = fix.value
            logger.warning("preflight: %s", fix.message)
        else:
            assign(config, fix.path, fix.value)
            logger.warning("auto-fix: %s", fix.message)
    return [fix.message for fix in fixes]


def apply_autofixes(config: Any, settings: Settings) -> list[str]:
    """Apply the documented auto-fixes to the host config in place; return what changed.

    Unconditional, for callers that mean it (:func:`cudagraph_plugin.cli.apply_overrides`,
    the harness's overrides); a run applies its auto-fixes through
    :meth:`cudagraph_plugin.config_check.ConfigCheck.apply`, only to a valid configuration.
    """
    return write_autofixes(config, plan_autofixes(config, settings))
