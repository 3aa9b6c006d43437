"""Rules on the names: unreadable values, the implementation and scope names, both
generations' scope fields, the deprecated flags and the RNG tracker."""

from __future__ import annotations

from collections.abc import Iterator

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import (
    BRIDGE,
    MCORE,
    MCORE_16,
    MCORE_19,
    MLM,
    Note,
    Violation,
)
from cudagraph_plugin.config.fields import FIELD_PATHS
from cudagraph_plugin.config.rules.base import did_you_mean, rule, scope_value, violation
from cudagraph_plugin.config.settings import Settings
from cudagraph_plugin.config.vocabulary import DEPRECATED_SCOPES, IMPLS, SCOPES, TE_SCOPES

# -- values that could not be read ------------------------------------------------------------

MCORE_READS = ("impl", "scope", "warmup_steps")  # (TransformerConfig's; the rest: the plugin's)


@rule
def field_values(s: Settings, env: Environment) -> Iterator[Violation | Note]:
    said = set()
    for p in s.input_problems:
        where = p.section or s.field(p.setting)
        if where not in said:  # (a section that raised: once for all read through it)
            said.add(where)
            yield Violation((where,), repr(p.value), p.problem, p.fix)
    for d in s.disagreements:
        read, other = d.said()
        if all("cuda_graph" in path for path in FIELD_PATHS[d.setting]):
            # a CUDA graph setting is read in one place: the other is not used (a top-level
            # cuda_graph_impl=local beside a nested config's model.cuda_graph_impl='none'
            # ran eagerly, only noted; user trial, 2026-12-05)
            mcore = " (by megatron-core too, where it builds the model)"
            yield Violation(
                (d.read, d.other),
                repr((d.read_value, d.other_value)),
                f"the CUDA graph setting is given twice with two values: {d.read} is the one "
                f"read{mcore if d.setting in MCORE_READS else ''}, {d.other} is not used",
                f"give it once: set {d.read}={d.other_value!r} if that is the value you "
                f"meant, and drop {d.other} (or give both the same value)",
            )
            continue
        yield Note(  # (said, not refused: each part may be right)
            f"{read} and {other} disagree: the check reads the first, while megatron-core "
            "reads each where the part it builds is given it (OptimizerConfig's fp16 picks "
            "the loss scaler, say). Make them agree"
        )
    for stray in s.stray_fields:  # (notes, a name close to ours may be someone else's
        # field; a problem only where graphs are asked for and none where they are read)
        if not stray.asks_for_graphs:
            yield Note(stray.text)
            continue
        # graphs asked for where nothing reads it, no implementation where one is read: the
        # run would be eager without a word (a Hydra tree passed whole; user trial, 2026-12-05)
        yield Violation(
            (stray.path,),
            repr(stray.value),
            "it asks for CUDA graphs where nothing reads it, and no implementation is given "
            f"where one is read: the run would be eager ({stray.said})",
            f"{stray.move}; if that section belongs to something else (training without "
            "graphs), give cuda_graph_impl='none' at the top of the config",
        )


# -- impl and scope names ---------------------------------------------------------------------


@rule
def _impl_known(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.impl not in IMPLS:
        yield violation(
            s,
            ("impl",),
            s.impl,
            f"unknown CUDA graph implementation {s.impl!r}",
            f"use one of {', '.join(IMPLS)} (megatron-core 0.18+ also spells local + "
            f"full_iteration as full_iteration){did_you_mean(s.impl, IMPLS)}",
            (MCORE, "Invalid cuda graph implementation"),
            (BRIDGE, "Invalid value for cuda_graph_impl"),
        )


@rule
def _scope_names_known(s: Settings, env: Environment) -> Iterator[Violation]:
    unknown = [name for name in s.scope if name not in (*SCOPES, *DEPRECATED_SCOPES, "")]
    if unknown:
        hints = "".join(did_you_mean(name, SCOPES) for name in unknown[:1])
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            f"unknown CUDA graph scope(s) {', '.join(map(repr, unknown))}",
            f"use names from {', '.join(SCOPES)} (comma-separated){hints}",
            (BRIDGE, "Invalid cuda graph scope"),
        )
    if "" in s.scope:
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            "an empty scope name (a doubled, leading or trailing comma)",
            "remove the extra comma, e.g. attn,mlp",
        )


@rule
def _scope_names_deprecated(s: Settings, env: Environment) -> Iterator[Violation]:
    if "full" in s.scope:  # alone it means whole-layer capture (see _scope_not_empty)
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            "'full' is megatron-core's deprecated name for whole-layer capture (now an empty "
            "scope) and cannot be combined with other scopes",
            "drop 'full' and list only the parts to capture, e.g. attn,mlp",
            (MCORE, "full scope is deprecated"),
            (MCORE, "full scope cannot be used with other scopes"),
        )
    if "full_iteration_inference" in s.scope:
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            "'full_iteration_inference' is megatron-core 0.19's deprecated scope for "
            "inference CUDA graphs (now inference_cuda_graph_scope=block), which this plugin "
            "does not manage",
            "drop it from the scope; set inference_cuda_graph_scope for inference graphs",
            (MCORE_19, "cuda_graph_modules 'full_iteration_inference' is deprecated"),
        )


@rule
def _full_iteration_scope_without_impl(s: Settings, env: Environment) -> Iterator[Violation]:
    # (not cleared as another scope of a run with graphs off: megatron-core 0.18+ migrates
    # this deprecated spelling to graphs on, so clearing it would run eagerly a job that its
    # megatron-core runs with graphs; megatron-core 0.16's own spelling on 0.16 is cleared)
    if environment.full_iteration_scope_turns_graphs_on(s):
        yield violation(
            s,
            ("impl", "scope"),
            ("none", scope_value(s)),
            "the scope asks for full-iteration graphs but cuda_graph_impl is none: "
            "megatron-core 0.18+ reads this deprecated spelling as "
            "cuda_graph_impl=full_iteration (graphs on), megatron-core 0.16 as graphs off",
            f"to capture, set {s.field('impl')}=full_iteration (megatron-core 0.18+) or "
            f"{s.field('impl')}=local (0.16); to run eagerly, drop full_iteration from "
            f"{s.field('scope')}",
            (MCORE_19, "cuda_graph_modules 'full_iteration' is deprecated"),
        )


@rule
def _scope_fields_not_both(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.scope_conflict:
        yield Violation(
            tuple(name for name, _ in s.scope_conflict),
            "(" + ", ".join(value for _, value in s.scope_conflict) + ")",  # (each a repr)
            "the scope is given twice, in megatron-core 0.16's cuda_graph_scope and in 0.18+'s "
            "cuda_graph_modules",
            "keep one of them (cuda_graph_modules on megatron-core 0.18+, cuda_graph_scope before)",
            (
                (MCORE_19, "cuda_graph_scope and cuda_graph_modules cannot be set together"),
                (MLM, "--cuda-graph-scope and --cuda-graph-modules cannot be used together"),
            ),
        )


@rule
def _scope_not_empty(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.enabled and s.impl in IMPLS and not s.scope and not s.impl_from_legacy_flag:
        example = (
            "full_iteration"
            if s.impl == "local"
            else "attn, or attn,mlp for the most of a layer (its layer norms and residual "
            "adds then run eagerly between the graphs)"
        )
        references = ()
        problem = (
            "CUDA graphs are on but no scope is given: megatron-core would then capture each "
            "whole layer (its default), which this plugin does not manage"
        )
        if s.deprecated_full_scope:
            problem += "; 'full' is megatron-core's deprecated name for that whole-layer capture"
            references = ((MCORE, "full scope is deprecated"),)
        yield violation(
            s,
            ("impl", "scope"),
            (s.impl, scope_value(s)),
            problem,
            f"name the scope explicitly, e.g. {example}",
            *references,
        )


@rule
def _full_iteration_only_local(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.full_iteration and s.impl == "transformer_engine":
        yield violation(
            s,
            ("impl", "scope"),
            (s.impl, scope_value(s)),
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


@rule
def _full_iteration_alone(s: Settings, env: Environment) -> Iterator[Violation]:
    if s.full_iteration and len(set(s.scope)) > 1 and s.full_iteration_impl:
        # (0.18+'s spelling: said in the user's words, not in the local + scope read of it)
        given = ",".join(s.scope[1:])
        yield violation(
            s,
            ("impl", "scope"),
            ("full_iteration", given),
            f"{s.field('impl')}=full_iteration captures the whole forward and backward and "
            f"takes no modules ({given})",
            f"drop {s.field('scope')}, or use {s.field('impl')}=transformer_engine with these "
            "modules",
            (MCORE_19, 'cuda_graph_modules must be empty when cuda_graph_impl="full_iteration"'),
        )
    elif s.full_iteration and len(set(s.scope)) > 1:
        others = sorted(set(s.scope) - {"full_iteration"})
        yield violation(
            s,
            ("scope",),
            scope_value(s),
            f"full_iteration cannot be mixed with other scopes ({', '.join(others)}): it "
            "already captures the whole forward and backward",
            "use scope full_iteration alone, or drop it and use TE scopes",
            (BRIDGE, "full_iteration CUDA graph scope cannot be combined with other scopes"),
            (MCORE_19, 'cuda_graph_modules must be empty when cuda_graph_impl="full_iteration"'),
        )


@rule
def _local_is_full_iteration(s: Settings, env: Environment) -> Iterator[Violation]:
    per_layer = [name for name in s.scope if name in TE_SCOPES]
    # (0.18+'s impl full_iteration with modules: _full_iteration_alone says it)
    if s.impl == "local" and per_layer and not s.full_iteration_impl:
        yield violation(
            s,
            ("impl", "scope"),
            (s.impl, scope_value(s)),
            f"impl local with per-layer scopes ({', '.join(per_layer)}) uses megatron-core's "
            "per-layer CudaGraphManager, which this plugin does not manage",
            "use cuda_graph_impl=transformer_engine for per-layer scopes, or "
            "cuda_graph_impl=local with scope full_iteration",
            (BRIDGE, 'cuda_graph_impl="local" only for full-iteration CUDA graphs'),
        )


# -- legacy flags and RNG ---------------------------------------------------------------------


@rule
def _legacy_flags(s: Settings, env: Environment) -> Iterator[Violation]:
    flag = s.legacy_flag
    if flag is None:
        return
    new = "local" if flag == "enable_cuda_graph" else "transformer_engine"
    if s.enable_cuda_graph and s.external_cuda_graph:
        yield violation(
            s,
            ("enable_cuda_graph", "external_cuda_graph"),
            (True, True),
            "both deprecated CUDA graph flags are on",
            "drop both deprecated flags and set cuda_graph_impl",
            (MCORE, "enable_cuda_graph and external_cuda_graph cannot be enabled at the same time"),
        )
    elif s.enabled and not s.impl_from_legacy_flag:
        yield violation(
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
        yield violation(
            s,
            (flag,),
            True,
            f"{flag} is deprecated: megatron-core turns it into cuda_graph_impl={new} with "
            "whole-layer graphs, which this plugin does not manage",
            f"drop {flag} and set cuda_graph_impl={new} with an explicit cuda_graph_scope "
            f"(e.g. {example})",
            (MCORE, f"{flag} is deprecated, use cuda_graph_impl={new} instead"),
        )


@rule
def _te_rng_tracker(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.enabled:
        return
    for setting in ("model_te_rng_tracker", "rng_te_rng_tracker"):
        if getattr(s, setting) is False:
            yield violation(
                s,
                (setting,),
                False,
                "CUDA graphs require the TE RNG tracker (graph-safe RNG states)",
                f"{s.set_text(setting, True)} (the plugin's configure does this for you)",
                (MCORE, "RNG tracker does not support cudagraphs"),
            )
