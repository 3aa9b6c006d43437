"""Rules on sequence-length buckets (``cuda_graph_buckets``): one full-iteration graph per
bucket, so buckets need the full-iteration scope; the fallback policy and pipeline
parallelism are not served with them yet; each bucket must be a sequence length the model's
parallel layout can split, and none may be longer than the model's learned position
embeddings where the config says them."""

from __future__ import annotations

from collections.abc import Iterator

from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import Note, Violation
from cudagraph_plugin.config.rules.base import rule, scope_value, violation
from cudagraph_plugin.config.settings import Settings
from cudagraph_plugin.config.vocabulary import IMPLS, SCOPES


def _buckets_value(s: Settings) -> str:
    return ",".join(map(str, s.buckets or ()))


@rule
def _buckets(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.buckets:
        return
    if not s.enabled:  # (an eager baseline of a bucketed recipe pads to them: said, not refused)
        yield Note(
            f"{s.field('buckets')} has nothing to do with CUDA graphs off "
            f"({s.field('impl')}={s.impl})"
        )
        return
    # (an unknown impl or scope name is refused by its own rule, with a did-you-mean: a
    # misspelt full_iteration is not told to become what it meant to be)
    named = s.impl in IMPLS and set(s.scope) <= set(SCOPES)
    if named and not (s.impl == "local" and s.full_iteration):
        yield violation(
            s,
            ("buckets", "impl", "scope"),
            (_buckets_value(s), s.impl, scope_value(s)),
            "sequence-length buckets are full-iteration graphs (one per bucket)",
            "use cuda_graph_impl=local with scope full_iteration, or drop cuda_graph_buckets",
        )
    if s.fallback_on_slowdown:
        yield violation(
            s,
            ("buckets", "fallback_on_slowdown"),
            (_buckets_value(s), True),
            "the fallback policy decides for one graph; with buckets the report shows each "
            "bucket's speed-up instead",
            "drop cuda_graph_fallback_on_slowdown (read the per-bucket report)",
        )
    if s.pipeline_parallel:
        yield violation(
            s,
            ("buckets", "pipeline_model_parallel_size"),
            (_buckets_value(s), s.pipeline_model_parallel_size),
            "bucketed graphs are not served with pipeline parallelism yet",
            "use one sequence length (no buckets) with pipeline parallelism",
        )
    end = s.learned_positions_end
    over = [bucket for bucket in s.buckets if end is not None and bucket > end[1]]
    if end is not None and over:
        setting, length = end
        model = f"{s.field(setting)} >= {max(over)}"
        if s.from_command_line and setting == "seq_length":  # (Megatron-LM requires the flag)
            model += f" (Megatron-LM: --max-position-embeddings >= {max(over)})"
        fitting = sorted({min(bucket, length) for bucket in s.buckets})
        yield violation(
            s,
            ("buckets", setting, "position_embedding_type"),
            (_buckets_value(s), length, s.position_embedding_type),
            f"the model's learned position embeddings end at {length}: a step padded to "
            f"bucket(s) {', '.join(map(str, over))} fails in the model (no position beyond "
            "the embedding table)",
            f"give buckets up to {length} (e.g. {','.join(map(str, fitting))}), or a model "
            f"with {model}, or rotary position embeddings "
            f"({s.field('position_embedding_type')}=rope)",
        )
    multiple = s.sequence_multiple
    uneven = [bucket for bucket in s.buckets if bucket % multiple]
    if multiple > 1 and uneven:
        fields: list[tuple[str, object]] = [("buckets", _buckets_value(s))]
        splits = []
        if (s.context_parallel_size or 1) > 1:
            fields.append(("context_parallel_size", s.context_parallel_size))
            splits.append(f"2 x {s.context_parallel_size} context-parallel chunks")
        if s.sequence_parallel and (s.tensor_model_parallel_size or 1) > 1:
            fields += [
                ("tensor_model_parallel_size", s.tensor_model_parallel_size),
                ("sequence_parallel", True),
            ]
            splits.append(f"its {s.tensor_model_parallel_size} tensor-parallel ranks")
        # (rounded up, each once: 250 and 256 both round to 256)
        rounded = ",".join(map(str, sorted({-(-b // multiple) * multiple for b in s.buckets})))
        yield violation(
            s,
            tuple(name for name, _ in fields),
            tuple(value for _, value in fields),
            f"bucket(s) {', '.join(map(str, uneven))} are not multiples of {multiple}: "
            f"megatron-core splits each sequence over {' and over '.join(splits)}, and a "
            "step padded to such a bucket fails in the model",
            f"give buckets that are multiples of {multiple}, e.g. {rounded}",
        )
