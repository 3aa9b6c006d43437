"""``python -m cudagraph_plugin check``: validate a CUDA-graph configuration without a GPU.

Takes the plugin's CUDA-graph flags plus the model-shape flags the constraints depend on
(spelled as Megatron-LM spells them, with its defaults), applies the performance harness's
overrides, and prints either OK or every violation with its fix, the auto-fixes it applied
and the advice. Exit code 0 when the configuration can work, 1 when it cannot.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cudagraph_plugin import compat
from cudagraph_plugin.cli import add_cuda_graph_arguments, apply_overrides
from cudagraph_plugin.preflight import preflight
from cudagraph_plugin.settings import read_settings
from cudagraph_plugin.validation import CudaGraphConfigError, advice, find_violations


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cudagraph_plugin check",
        description="Check a CUDA-graph configuration against every known constraint.",
    )
    add_cuda_graph_arguments(parser)
    model = parser.add_argument_group("model (Megatron-LM flag names and defaults)")
    add = model.add_argument
    add("--seq-length", type=int, default=None)
    add("--micro-batch-size", type=int, default=None)
    add("--num-experts", type=int, default=None, help="MoE experts (num_moe_experts)")
    add("--moe-expert-capacity-factor", type=_optional_float, default=None)
    add("--moe-pad-expert-input-to-capacity", action="store_true")
    add(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"),
        default="allgather",
    )
    add("--moe-router-padding-for-fp8", action="store_true")
    add("--moe-permute-fusion", action="store_true")
    add("--moe-layer-freq", type=int, default=1)
    add("--moe-shared-expert-intermediate-size", type=int, default=None)
    add("--moe-input-jitter-eps", type=float, default=None)
    add("--overlap-moe-expert-parallel-comm", action="store_true")
    add("--recompute-granularity", choices=("full", "selective"), default=None)
    add("--recompute-method", choices=("uniform", "block"), default=None)
    add("--recompute-num-layers", type=int, default=None)
    add("--recompute-modules", nargs="+", default=None)
    add("--attention-dropout", type=float, default=0.1)
    add("--hidden-dropout", type=float, default=0.1)
    add("--cpu-offloading", action="store_true")
    add("--delay-wgrad-compute", action="store_true")
    add(
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
    )
    add("--add-qkv-bias", action="store_true")
    add("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    add("--variable-seq-lengths", action="store_true")
    add("--te-rng-tracker", action="store_true")
    add("--no-check-for-nan-in-loss", dest="check_for_nan_in_loss", action="store_false")
    add("--check-for-nan-in-grad", action="store_true")
    add(
        "--fp8-format",
        choices=("e4m3", "hybrid"),
        default=None,
        help="informational: FP8 recipes often default to TE mlp graphs",
    )
    add("--enable-cuda-graph", action="store_true", help="deprecated Megatron-LM flag")
    add("--external-cuda-graph", action="store_true", help="deprecated Megatron-LM flag")
    return parser


def run_check(argv: Sequence[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    notes: list[str] = []
    handler = _CollectingHandler(notes)
    log = logging.getLogger("cudagraph_plugin")
    log.addHandler(handler)
    try:
        apply_overrides(args)
        settings = read_settings(args)
        violations = find_violations(settings)
        if not violations:
            try:
                preflight(
                    settings,
                    nccl_initialized=lambda: False,
                    te_available=lambda: True,
                    dry_run=True,
                )
            except CudaGraphConfigError as exc:
                violations = exc.violations
        for note in advice(settings):
            notes.append(f"advice: {note}")
    finally:
        log.removeHandler(handler)
    te = compat.te_version()
    print(
        f"cuda graphs: impl={settings.impl} scope={','.join(settings.scope) or '-'} "
        f"warmup={settings.warmup_steps} (megatron-core {compat.mcore_version()}, "
        f"Transformer Engine {te or 'not installed here'})",
        file=out,
    )
    for note in notes:
        print(f"  {note}", file=out)
    if settings.impl == "transformer_engine" and te is None:
        print(
            "  note: a run needs Transformer Engine (pip install "
            "'megatron-cudagraph-plugin[te]'); not checked here",
            file=out,
        )
    if violations:
        print(str(CudaGraphConfigError(violations)), file=out)
        print("FAILED", file=out)
        return 1
    print("OK", file=out)
    return 0


class _CollectingHandler(logging.Handler):
    """Collects the auto-fix/override log lines to show them in the check output."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


def main(argv: Sequence[str] | None = None) -> int:
    return run_check(argv)
