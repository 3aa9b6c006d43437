"""What a Megatron-LM command line means once Megatron-LM's ``validate_args`` (0.19.2) has read
it, for the check command: the settings it derives from other flags before any plugin sees
them (:func:`as_validate_args`), the checks it asserts on those flags, and the notes for
what its launcher refuses before the plugin's configure could fix it
(:func:`megatron_lm_refuses`). Pure Python: the layout's stages are counted here as
megatron-core counts them (:func:`layout_stages`; a test compares the two).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from cudagraph_plugin.config.errors import Violation


def as_validate_args(args: argparse.Namespace) -> tuple[list[Violation], list[str]]:
    """What Megatron-LM's ``validate_args`` (0.19.2) derives from the flags before any plugin
    sees them, done to ``args`` in its order: the problems of the flags it derives from, and
    a line for each setting derived (the problems name the derived setting).

    * ``--recompute-activations``: selective recompute;
    * the virtual pipeline stages (:func:`_virtual_stages`); one per rank is none (so the p2p
      exchanges are batched: no overlap without the interleaved schedule);
    * ``--cpu-offloading-num-layers`` above 0: CPU offloading;
    * ``--use-rotary-position-embeddings`` (the legacy flag): ``--position-embedding-type
      rope``.
    """
    problems: list[Violation] = []
    derived: list[str] = []
    if args.recompute_activations:
        args.recompute_granularity = "selective"
        derived.append("--recompute-activations: --recompute-granularity selective")
    vpp, given = _virtual_stages(args, problems)
    if given is not None and vpp is not None:
        derived.append(
            f"{given}: {vpp} virtual stage(s) per pipeline rank"
            + (" (one is none: the p2p exchanges are batched)" if vpp == 1 else "")
        )
    if given is not None or vpp is not None:  # (not a value the settings report as bad)
        if vpp is None or vpp == 1:
            vars(args).pop("virtual_pipeline_model_parallel_size", None)
        else:
            args.virtual_pipeline_model_parallel_size = vpp
    offloaded = _whole(args, "cpu_offloading_num_layers", problems)
    if offloaded is not None and offloaded > 0:
        args.cpu_offloading = True
        derived.append(f"--cpu-offloading-num-layers {offloaded}: --cpu-offloading")
    if getattr(args, "use_rotary_position_embeddings", False):
        args.position_embedding_type = "rope"
        derived.append("--use-rotary-position-embeddings: --position-embedding-type rope")
    return problems, derived


def _whole(
    args: argparse.Namespace, dest: str, problems: list[Violation] | None, minimum: int = 0
) -> int | None:
    """A flag's whole number (None: not given); a bad one is a problem in ``problems``
    (``None``: the settings report it, as a field they read)."""
    text = getattr(args, dest, None)
    if text is None:
        return None
    flag = "--" + dest.replace("_", "-")
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if value is not None and value >= minimum:
        return value
    if problems is not None:
        problems.append(
            Violation((flag,), repr(text), f"not a whole number >= {minimum}", f"give {flag} N")
        )
    return None


def _virtual_stages(
    args: argparse.Namespace, problems: list[Violation]
) -> tuple[int | None, str | None]:
    """(virtual stages per pipeline rank, the flag they came from) as Megatron-LM derives
    them: from ``--pipeline-model-parallel-layout`` (its stages per pipeline rank),
    ``--num-layers-per-virtual-pipeline-stage`` (the layers per pipeline rank, with
    ``--account-for-embedding/loss-in-pipeline-split`` adding one each, divided by it) or
    ``--num-virtual-stages-per-pipeline-rank``; with the checks it asserts on them."""
    pp = _whole(args, "pipeline_model_parallel_size", None, minimum=1) or 1
    vpp = _whole(args, "virtual_pipeline_model_parallel_size", None, minimum=1)
    per_stage = _whole(args, "num_layers_per_virtual_pipeline_stage", problems, minimum=1)
    layout = args.pipeline_model_parallel_layout
    given = [
        flag
        for flag, value in (
            ("--num-virtual-stages-per-pipeline-rank", vpp),
            ("--num-layers-per-virtual-pipeline-stage", per_stage),
            ("--pipeline-model-parallel-layout", layout),
        )
        if value is not None
    ]
    if not given:
        return None, None
    if len(given) > 1:
        problems.append(
            Violation(
                tuple(given),
                "given together",
                "each gives the virtual pipeline stages (Megatron-LM: one of them at most)",
                "keep one of them",
            )
        )
        return None, None
    if layout is not None:
        stages = layout_stages(layout)
        if stages % pp:
            problems.append(
                Violation(
                    ("--pipeline-model-parallel-layout", "--pipeline-model-parallel-size"),
                    repr((layout, pp)),
                    f"the layout's {stages} stages do not divide among {pp} pipeline ranks",
                    "give a layout with a multiple of --pipeline-model-parallel-size stages",
                )
            )
            return None, None
        vpp = stages // pp
    elif per_stage is not None:
        vpp = _per_stage_vpp(args, pp, per_stage, problems)
        if vpp is None:
            return None, None
    assert vpp is not None
    if vpp > 1 and pp < (2 if args.overlap_p2p_comm else 3):
        overlap = args.overlap_p2p_comm
        problems.append(
            Violation(
                ("--pipeline-model-parallel-size", given[0]),
                repr((pp, vpp)),
                f"the interleaved schedule needs at least {2 if overlap else 3} pipeline "
                "ranks"
                + (
                    ""
                    if overlap
                    else " without p2p overlap (--no-overlap-p2p-"
                    "communication: two sends and receives between the same two ranks)"
                ),
                "raise --pipeline-model-parallel-size, or drop the virtual stages"
                + ("" if overlap else " or --no-overlap-p2p-communication"),
            )
        )
    return vpp, given[0]


def _per_stage_vpp(
    args: argparse.Namespace, pp: int, per_stage: int, problems: list[Violation]
) -> int | None:
    if args.decoder_first_pipeline_num_layers is not None or (
        args.decoder_last_pipeline_num_layers is not None
    ):
        problems.append(
            Violation(
                (
                    "--num-layers-per-virtual-pipeline-stage",
                    "--decoder-first/last-pipeline-num-layers",
                ),
                "given together",
                "an uneven pipeline needs its virtual stages given as a count (Megatron-LM: "
                '"please use --num-virtual-stages-per-pipeline-rank")',
                "give --num-virtual-stages-per-pipeline-rank instead",
            )
        )
        return None
    layers = _whole(args, "num_layers", problems, minimum=1)
    if layers is not None:
        layers += int(args.account_for_embedding_in_pipeline_split)
        layers += int(args.account_for_loss_in_pipeline_split)
    if layers is None or layers % pp or (layers // pp) % per_stage:
        problems.append(
            Violation(
                (
                    "--num-layers",
                    "--pipeline-model-parallel-size",
                    "--num-layers-per-virtual-pipeline-stage",
                ),
                repr((layers, pp, per_stage)),
                "the virtual stages are the layers (--num-layers, one more for each "
                "--account-for-embedding/loss-in-pipeline-split) / --pipeline-model-parallel-size "
                "/ --num-layers-per-virtual-pipeline-stage, which needs the layers and whole "
                "divisions",
                "give --num-layers so that both divide, or --num-virtual-stages-per-pipeline-rank",
            )
        )
        return None
    return layers // pp // per_stage


def layout_stages(layout: str) -> int:
    """The stages of a ``--pipeline-model-parallel-layout`` string, as megatron-core's
    ``PipelineParallelLayerLayout.get_num_stages_from_str`` counts them (the check imports no
    megatron-core; a test compares the two): cosmetic commas dropped, ``(...)*n`` and
    ``x*n`` unrolled, stages split at ``|``."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return len(text.split("|"))


def megatron_lm_refuses(fixes: Sequence[Any], impl: str) -> list[str]:
    """Notes for the auto-fixes a Megatron-LM launcher never reaches: its ``validate_args``
    asserts on these settings before any plugin's configure runs."""
    notes = []
    if any(fix.setting == "check_for_nan_in_loss" for fix in fixes):
        notes.append(
            "Megatron-LM's validate_args refuses full-iteration graphs with the NaN check on "
            "before any plugin runs: a Megatron-LM launcher needs "
            "--no-check-for-nan-in-loss-and-grad on its command line (the plugin's own "
            "configure turns it off for other hosts)"
        )
    if impl == "transformer_engine" and any(fix.setting == "NCCL_GRAPH_REGISTER" for fix in fixes):
        notes.append(
            "Megatron-LM's validate_args (0.19) refuses transformer_engine graphs with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before any plugin runs: a "
            "Megatron-LM launcher needs NCCL_GRAPH_REGISTER=0 in its environment"
        )
    return notes
