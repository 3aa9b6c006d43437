"""What to say about a configuration that can work: advice (logged, never raised) and the
warm-up warning given at train start.

Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import os
from typing import Any

from cudagraph_plugin.config import environment
from cudagraph_plugin.config.environment import expandable_segments_source
from cudagraph_plugin.config.rules.base import scope_value
from cudagraph_plugin.config.settings import Settings
from cudagraph_plugin.config.vocabulary import SCOPES

THIN_SAMPLE = 5
"""Steps on either side below which a speed-up is reported as not to be trusted (and the
fallback policy is advised to measure more eager steps)."""


def _model_kind(s: Settings) -> str:
    if not s.is_moe:
        return "dense"
    return "dropless MoE" if s.dropless_moe else "drop-and-pad MoE"


def _te_layer_graphs_refused(s: Settings) -> bool:
    """Whether the configuration rules refuse TE layer graphs for the layers' precision (the
    config says fp32 or fp16, and the installed megatron-core captures them with bfloat16
    sample inputs): then advising TE scopes would send the user to a refusal. Layers built
    with the local spec are no reason: TE graphs capture them too (bf16, measured on an H100
    on 2026-12-05)."""
    return s.layer_dtype in ("fp32", "fp16") and environment.te_layers_need_bf16()


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
    if s.duplicated_scopes:
        notes.append(
            f"{s.field('scope')} lists {', '.join(s.duplicated_scopes)} more than once "
            f"(megatron-core accepts that); using each once: {scope_value(s)}"
        )
    kind = _model_kind(s)
    recommended = RECOMMENDED_SCOPES[kind]
    scope = set(s.scope)
    if not scope <= set(SCOPES):
        pass  # unknown or deprecated names: validation says what is wrong with the scope
    elif s.full_iteration and _te_layer_graphs_refused(s):
        pass  # fp32 or fp16 layers: full_iteration is the option (TE scopes would be refused)
    elif s.full_iteration and s.buckets:
        pass  # graphs per length bucket are full-iteration graphs: no narrower option
    elif s.full_iteration:
        # (a precision the config does not say: the layers' dtype is checked at the build)
        unsaid = s.layer_dtype is None and environment.te_layers_need_bf16()
        notes.append(
            f"scope full_iteration is wider than recommended for a first {kind} run "
            f"(start with TE {','.join(recommended)}{' on bf16 layers' if unsaid else ''}): "
            "it can raise peak memory 1.5-2x; "
            "check replay works and memory fits, and compare eager vs replay"
        )
    elif scope and scope < set(recommended):
        missing = [name for name in recommended if name not in scope]
        notes.append(
            f"scope {scope_value(s)} is narrower than recommended for a {kind} model "
            f"({','.join(recommended)}); once replay works, memory fits and replay beats "
            f"eager, consider adding {','.join(missing)}"
        )
    elif scope - set(recommended) - {"mamba"}:
        extra = sorted(scope - set(recommended) - {"mamba"})
        notes.append(
            f"scope {scope_value(s)} is wider than recommended for a {kind} model "
            f"({','.join(recommended)}): {','.join(extra)} adds memory; widen only after "
            "measuring eager vs replay"
        )
    source = expandable_segments_source(env)
    if source:
        notes.append(
            f"{source} has expandable_segments:True: CUDA graphs then need "
            "NCCL_GRAPH_REGISTER=0 (the preflight sets it when it can)"
        )
    # (where the config says learned position embeddings, the rules refuse such buckets)
    if (
        s.buckets
        and s.position_embedding_type is None
        and s.seq_length is not None
        and max(s.buckets) > s.seq_length
    ):
        notes.append(
            f"cuda_graph_buckets go up to {max(s.buckets)} but {s.field('seq_length')} is "
            f"{s.seq_length}: a model with learned position embeddings has none beyond it"
        )
    if s.warmup_from_baseline is not None:
        notes.append(
            f"cuda_graph_baseline_steps={s.baseline_steps}: capturing after "
            f"{s.warmup_steps} eager step(s) instead of {s.warmup_from_baseline}, so the report's "
            f"eager figure rests on {s.baseline_steps} of them"
        )
    eager_samples = s.warmup_steps - 1  # (the first step is no sample)
    if s.fallback_on_slowdown and s.full_iteration and 0 < eager_samples < THIN_SAMPLE:
        notes.append(
            f"cuda_graph_fallback_on_slowdown decides from {eager_samples} eager step(s) (the "
            "warm-up's, without the first): one noisy step can free the graph for the rest of "
            f"the run; measure at least {THIN_SAMPLE} with --cuda-graph-baseline-steps "
            f"{THIN_SAMPLE} (cuda_graph_baseline_steps)"
        )
    if s.warmup_steps < 2:
        notes.append(
            f"{s.field('warmup_steps')}={s.warmup_steps}: the run report needs at least 2 "
            "warm-up steps to measure eager step time (the first step is excluded)"
        )
    return notes


def _buckets_warning(settings: Settings, steps: int) -> str | None:
    """Bucket graphs each count their own warm-up: a bucket replays once it had warm-up + 1
    steps of its own plus one more, so ``steps`` too few for every bucket cannot replay them
    all, whatever the lengths (user trial, 2026-12-05: no word was said of it)."""
    buckets, warmup = settings.buckets or (), settings.warmup_steps
    each = warmup + 2
    if len(buckets) < 2 or steps >= len(buckets) * each:
        return None
    fewer = "warm-up steps"
    if settings.warmup_from_baseline is not None:  # (the baseline raised the warm-up)
        fewer = (
            f"{settings.field('baseline_steps')} below {settings.baseline_steps} (it raised "
            f"the warm-up to {warmup})"
        )
    return (
        f"{settings.field('buckets')} has {len(buckets)} buckets, each captured after "
        f"{warmup} warm-up step(s) of its own and replayed from the step after: this run's "
        f"{steps} step(s) can replay at most {steps // each} of them ({len(buckets)} x {each} "
        f"= {len(buckets) * each} steps would replay each once, if the lengths fall so); "
        f"train longer, or use fewer buckets or {fewer}"
    )


def warmup_warning(settings: Settings, start_step: int, train_iters: int) -> str | None:
    """What to say at train start when the warm-up leaves nothing to capture or replay."""
    if not settings.enabled:
        return None
    steps = train_iters - start_step
    warmup = settings.warmup_steps
    capture = start_step + warmup
    if warmup >= steps:
        said = (
            f"the capture step {capture} (start_step + warm-up) is never reached, so no CUDA "
            "graph will be captured"
        )
    elif warmup == steps - 1:
        said = (
            f"the graphs are captured at the last step ({capture}) and never replayed, so the "
            "run cannot show a speed-up"
        )
    else:
        return _buckets_warning(settings, steps)
    most = steps - 2  # the longest warm-up whose graphs are replayed in this run
    warmup_field = settings.field("warmup_steps")
    given = settings.warmup_from_baseline
    fixes = []
    if given is None:
        knob = f"{warmup_field}={warmup}"
        fixes.append((most, "warm-up"))
    else:
        # the baseline raised the warm-up to one more than itself: it is what to lower, and
        # the warm-up given too where it is itself too long
        knob = (
            f"{settings.field('baseline_steps')}={settings.baseline_steps} (the warm-up "
            f"raised to {warmup} from {warmup_field}={given})"
        )
        fixes.append((most - 1, "baseline"))
        if given > most:
            fixes.append((most, "warm-up"))
    where = (
        f"{knob} and this run trains {steps} step(s) (steps {start_step}..{train_iters - 1}: "
        f"start_step={start_step}, train_iters={train_iters})"
    )
    if any(count < 0 for count, _ in fixes):
        return f"{where}: {said}; train longer"
    fewer = " and ".join(f"at most {count} {what} step(s)" for count, what in fixes)
    return f"{where}: {said}; use {fewer} (so that a step replays) or train longer"
