"""Rules that depend on the Transformer Engine version (delayed weight gradients)."""

from __future__ import annotations

from collections.abc import Iterator

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import MCORE, MLM, Note, Violation
from cudagraph_plugin.config.rules.base import rule, scope_value, violation
from cudagraph_plugin.config.settings import Settings

# -- delayed weight gradients -----------------------------------------------------------------

_TE_FLAG_HINT = (
    "pass te_version= to check_config (--te-version to the check command) to check it "
    "against a version"
)


@rule
def _delay_wgrad_needs_ep_overlap(s: Settings, env: Environment) -> Iterator[Violation]:
    # (megatron-core asserts it whatever the graphs; said here so that a run with graphs on
    # hears it with the other problems, and so that no fix below leads to a config it refuses)
    if s.enabled and s.delay_wgrad_compute and not s.overlap_moe_expert_parallel_comm:
        yield violation(
            s,
            ("delay_wgrad_compute", "overlap_moe_expert_parallel_comm"),
            (True, False),
            "delay_wgrad_compute delays the expert weight gradients of expert-parallel "
            "communication overlap, and megatron-core accepts it only with that overlap on",
            f"{s.set_text('overlap_moe_expert_parallel_comm', True)} (an MoE model with expert "
            f"parallelism; TE graphs of attn, moe_router and moe_preprocess only), or "
            f"{s.set_text('delay_wgrad_compute', False)}",
            (
                MCORE,
                "overlap_moe_expert_parallel_comm must be enabled when enabling "
                "delay_wgrad_compute",
            ),
        )


@rule
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
        need = environment.TE_DELAY_WGRAD_WITH_ATTN
        if te is None:
            yield Note(
                f"delay_wgrad_compute with {scope_value(s)} in the CUDA graph scope needs "
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
            yield violation(
                s,
                ("delay_wgrad_compute", "scope"),
                (True, scope_value(s)),
                "delay_wgrad_compute with attn (or moe_router with shared experts) in the CUDA "
                "graph scope requires " + "; ".join(problems),
                "meet those requirements, or drop attn/moe_router from the scope, or "
                + s.set_text("delay_wgrad_compute", False),
                *references,
            )
        return
    need = environment.TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS
    if te is None:
        yield Note(
            f"delay_wgrad_compute with per-layer (partial) CUDA graphs needs Transformer "
            f"Engine >= {need}: not checked here (no Transformer Engine installed); "
            f"{_TE_FLAG_HINT}"
        )
    elif te < need:
        yield violation(
            s,
            ("delay_wgrad_compute",),
            True,
            f"delay_wgrad_compute with per-layer (partial) CUDA graphs needs Transformer "
            f"Engine >= {need} ({env.te_label()})",
            f"upgrade Transformer Engine or {s.set_text('delay_wgrad_compute', False)}",
            (
                MCORE,
                f"TE version >= {need} is required for delay_wgrad_compute with partial cuda graph",
            ),
        )
