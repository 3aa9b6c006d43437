"""Step time per CUDA-graph mode and model size: through the plugin vs a hand-written loop.

For each model size and mode this runs, in one process and interleaved (A/B, then B/A):

* **plugin**: ``examples/train_gpt.py``'s :func:`run` with the CUDA graph plugin, plus a
  small collecting plugin (the end time of each step from ``mcgraph_train_step_end``, the
  run report from ``mcgraph_report``);
* **baseline**: ``benchmarks/handwritten.py``, the same loop written by hand with CUDA
  graphs applied inline the way Megatron-LM does, without any plugin or hook.

Modes: ``eager`` (local layer spec), ``full_iteration`` (local spec, FullCudaGraphWrapper),
``eager_te`` (TE layer spec), ``te_attn`` and ``te_attn_mlp`` (TE spec, per-layer TE graphs
of those scopes); on request ``full_iteration_optimizer`` (the optimizer step captured too,
megatron-core 0.17+). TE modes are skipped, with a note, when Transformer Engine cannot be
imported, the optimizer graph where megatron-core has none. Both loops time a step with the
same clock (a pair of CUDA events around it, read at the end of the run, no device
synchronisation per step; the wall clock on the CPU). The step time of a run is the median
of its steps after the capture step and one more (``warmup + 2`` onwards, the same steps
for eager runs); a mode's time is the median
of all its runs' steps; ``ratio_per_repeat`` adds plugin/baseline of each back-to-back
pair. By default (``--gc manual``) Python's garbage collector is collected before each run
and kept off during it, as Megatron-LM's ``--manual-gc`` does for its performance runs.
Every run ends with its process groups destroyed, ``gc.collect()`` and
``torch.cuda.empty_cache()``; a failing run is recorded and the next one starts.

GPU (see benchmarks/README.md)::

    PYTHONPATH=$PWD:$PWD/examples:$PYTHONPATH python3 benchmarks/gpu_modes.py --out $OUT/bench.json

CPU check of every code path (graphs cannot be captured there: graph modes run eagerly,
the plugin having validated them, and the baseline's graph branches run their CPU paths)::

    python benchmarks/gpu_modes.py --cpu --smoke --out /tmp/bench_smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (ROOT, ROOT / "examples", HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import tables  # noqa: E402  (after the sys.path set-up above)

from hookspecs import hookimpl  # noqa: E402

logger = logging.getLogger("gpu_modes")

SCHEMA = "mcgraph-bench-modes/1"


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str
    impl: str
    scope: str | None
    transformer_impl: str
    eager_reference: str | None  # the mode whose step time the speed-up is relative to
    # The optimizer step captured too (megatron-core 0.17+): the plugin's
    # --optimizer-cuda-graph and --cuda-graph-device-grad-norm, the hand-written loop's
    # OptimizerCudaGraphWrapper with the same device-side gradient norm.
    optimizer_graph: bool = False
    # The plugin's device-side gradient norm without any graph (--cuda-graph-device-grad-norm):
    # the eager baseline the optimizer graph is compared with (issue 21). Plugin side only.
    device_grad_norm: bool = False

    @property
    def needs_te(self) -> bool:
        return self.transformer_impl == "transformer_engine"

    @property
    def graphed(self) -> bool:
        return self.impl != "none"


# shared/gpu/README.md: tiny GPT, seq 512, micro-batch 2, bf16, Adam, one GPU.
SIZES = {
    "4L-512H": Size("4L-512H", 4, 512, 8),
    "8L-1024H": Size("8L-1024H", 8, 1024, 16),
}
SMOKE_SIZES = {"smoke-2L-64H": Size("smoke-2L-64H", 2, 64, 4)}
MODES = {
    m.name: m
    for m in (
        Mode("eager", "eager (local spec)", "none", None, "local", None),
        Mode(
            "full_iteration",
            "full_iteration (local spec)",
            impl="local",
            scope="full_iteration",
            transformer_impl="local",
            eager_reference="eager",
        ),
        Mode("eager_te", "eager (TE spec)", "none", None, "transformer_engine", None),
        Mode(
            "te_attn",
            "TE attn",
            impl="transformer_engine",
            scope="attn",
            transformer_impl="transformer_engine",
            eager_reference="eager_te",
        ),
        Mode(
            "te_attn_mlp",
            "TE attn,mlp",
            impl="transformer_engine",
            scope="attn,mlp",
            transformer_impl="transformer_engine",
            eager_reference="eager_te",
        ),
        Mode(
            "full_iteration_optimizer",
            "full_iteration + optimizer graph (local spec)",
            impl="local",
            scope="full_iteration",
            transformer_impl="local",
            eager_reference="eager_device_norm",
            optimizer_graph=True,
        ),
        Mode(
            "eager_device_norm",
            "eager, device-side gradient norm (local spec)",
            "none",
            None,
            "local",
            None,
            device_grad_norm=True,
        ),
    )
}
# What gpu_modes.py runs unless told (the optimizer graph needs megatron-core 0.17+).
DEFAULT_MODES = ("eager", "full_iteration", "eager_te", "te_attn", "te_attn_mlp")


# -------------------------------------------------------------------------------------------
# Environment.
# -------------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(use_cuda: bool) -> dict[str, Any]:
    import megatron.core
    import torch

    te_ok, te_note = te_status(use_cuda)
    te_version = None
    if te_ok:
        import transformer_engine

        te_version = getattr(transformer_engine, "__version__", None)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if use_cuda else None,
        "device": "cuda" if use_cuda else "cpu",
        "host_cpu": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "megatron-core": megatron.core.__version__,
            "transformer-engine": te_version,
            "pluggy": _dist_version("pluggy"),
            "megatron-cudagraph-plugin": _plugin_version(),
        },
        "te_available": te_ok,
        "te_note": te_note,
    }


def _plugin_version() -> str | None:
    import cudagraph_plugin

    return getattr(cudagraph_plugin, "__version__", None)


def mode_unavailable(mode: Mode, use_cuda: bool, te_note: str | None) -> str | None:
    """Why ``mode`` cannot run here (``None``: it can). ``te_note``: :func:`te_status`'s
    reason, where TE is not available."""
    if mode.needs_te and te_note is not None:
        return te_note
    if mode.optimizer_graph:
        import handwritten

        return handwritten.optimizer_graph_unavailable(use_cuda)
    return None


def te_status(use_cuda: bool) -> tuple[bool, str | None]:
    """Whether the TE modes can run here, and why not."""
    if not use_cuda:
        return False, "no CUDA device: TE layer spec and TE graphs need one"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # a missing or broken install
        return False, f"Transformer Engine is not importable: {type(exc).__name__}: {exc}"
    from megatron.core.transformer import cuda_graphs

    if not getattr(cuda_graphs, "HAVE_TE_GRAPHS", False):
        return False, "megatron-core finds no TE graph support (HAVE_TE_GRAPHS is False)"
    return True, None


# -------------------------------------------------------------------------------------------
# Plugins passed to train_gpt.run().
# -------------------------------------------------------------------------------------------


class Collector:
    """Collects the end time of each step, the run report and the plugin list of one run
    (the step times are the example's own clock, in ``train_gpt.run()``'s summary)."""

    def __init__(self) -> None:
        self.step_end_time: dict[int, float] = {}
        self.report: dict[str, Any] | None = None
        self.pluginmanager: Any = None

    @hookimpl
    def mcgraph_configure(self, config: Any, pluginmanager: Any) -> None:
        self.pluginmanager = pluginmanager

    def plugin_names(self) -> list[str]:
        """Every plugin the run had (unnamed ones by their class), for the record."""
        if self.pluginmanager is None:
            return []
        return sorted(
            type(plugin).__name__ if name.isdigit() else name
            for name, plugin in self.pluginmanager.list_name_plugin()
        )

    @hookimpl
    def mcgraph_train_step_end(self, step: int) -> None:
        self.step_end_time[step] = time.perf_counter()

    @hookimpl
    def mcgraph_report(self, report: Any) -> None:
        self.report = report.to_dict()


# -------------------------------------------------------------------------------------------
# One run of each kind.
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    warmup: int
    repeats: int
    seq_length: int
    micro_batch_size: int
    vocab_size: int
    bf16: bool
    cpu: bool
    smoke: bool
    manual_gc: bool = True

    @property
    def steady_from(self) -> int:
        return steady_from(self.warmup)


def steady_from(warmup: int) -> int:
    """First step counted: after the capture step (``warmup``) and the one after it (every
    benchmark counts from here)."""
    return warmup + 2


def _spec_for(mode: Mode, use_cuda: bool) -> str:
    # train_gpt refuses the TE layer spec without CUDA; on the CPU the TE modes keep their
    # graph settings (validated by the plugin) on the local spec.
    return mode.transformer_impl if use_cuda else "local"


def plugin_argv(size: Size, mode: Mode, s: Settings, use_cuda: bool) -> list[str]:
    argv = [
        "--num-layers", str(size.num_layers),
        "--hidden-size", str(size.hidden_size),
        "--num-attention-heads", str(size.num_attention_heads),
        "--seq-length", str(s.seq_length),
        "--micro-batch-size", str(s.micro_batch_size),
        "--vocab-size", str(s.vocab_size),
        "--train-iters", str(s.steps),
        "--log-interval", "0",
        "--transformer-impl", _spec_for(mode, use_cuda),
        "--cuda-graph-impl", mode.impl,
    ]  # fmt: skip
    if mode.scope:
        argv += ["--cuda-graph-scope", mode.scope]
    if mode.graphed:
        argv += ["--cuda-graph-warmup-steps", str(s.warmup)]
    if mode.optimizer_graph:
        argv += ["--optimizer-cuda-graph", "--cuda-graph-device-grad-norm"]
    elif mode.device_grad_norm:
        argv.append("--cuda-graph-device-grad-norm")
    if s.bf16:
        argv.append("--bf16")
    if s.cpu:
        argv.append("--cpu")
    return argv


def baseline_config(size: Size, mode: Mode, s: Settings, use_cuda: bool) -> Any:
    import handwritten

    return handwritten.BaselineConfig(
        num_layers=size.num_layers,
        hidden_size=size.hidden_size,
        num_attention_heads=size.num_attention_heads,
        vocab_size=s.vocab_size,
        transformer_impl=_spec_for(mode, use_cuda),
        bf16=s.bf16,
        seq_length=s.seq_length,
        micro_batch_size=s.micro_batch_size,
        train_iters=s.steps,
        cuda_graph_impl=mode.impl,
        cuda_graph_scope=tuple(mode.scope.split(",")) if mode.scope else (),
        cuda_graph_warmup_steps=s.warmup,
        optimizer_cuda_graph=mode.optimizer_graph,
        log_interval=0,  # as plugin_argv's --log-interval 0: the clock is read at the end
        cpu=s.cpu,
    )


def _steady(step_ms: dict[int, float], s: Settings) -> list[float]:
    return [ms for step, ms in sorted(step_ms.items()) if step >= s.steady_from]


def iteration_ms(end_times: dict[int, float]) -> dict[int, float]:
    """Whole loop iterations: from the end of step ``n - 1`` to the end of step ``n``
    (everything the loop does, hooks included, not only the timed region)."""
    return {
        step: (end - end_times[step - 1]) * 1000.0
        for step, end in end_times.items()
        if step - 1 in end_times
    }


def _run_plugin(size: Size, mode: Mode, s: Settings, use_cuda: bool) -> dict[str, Any]:
    import train_gpt

    collector = Collector()
    plugins = [collector]
    summary = train_gpt.run(plugin_argv(size, mode, s, use_cuda), plugins=plugins)
    step_ms = dict(enumerate(summary["step_ms"]))  # the example's step clock, from step 0
    return {
        "step_ms": summary["step_ms"],
        "steady_step_ms": _steady(step_ms, s),
        "steady_iteration_ms": _steady(iteration_ms(collector.step_end_time), s),
        "losses": summary["losses"],
        "shutdown_reason": summary["shutdown_reason"],
        "report": collector.report,
        "plugins": collector.plugin_names(),
    }


def _run_baseline(size: Size, mode: Mode, s: Settings, use_cuda: bool) -> dict[str, Any]:
    import handwritten

    out = handwritten.run(baseline_config(size, mode, s, use_cuda))
    step_ms = dict(enumerate(out["step_ms"]))
    return {
        "step_ms": out["step_ms"],
        "steady_step_ms": _steady(step_ms, s),
        "steady_iteration_ms": _steady(iteration_ms(dict(enumerate(out["step_end_time"]))), s),
        "losses": out["losses"],
        "capture_seconds": out.get("capture_seconds"),
        "capture_step": out.get("capture_step"),
        "graph_path": out.get("graph_path"),
        "graphs_freed": out.get("graphs_freed"),
        "te_helper_calls": out.get("te_helper_calls"),
        "peak_allocated_mib_loop": out.get("peak_allocated_mib"),
    }


def free_device_memory(use_cuda: bool) -> dict[str, Any]:
    """Free what the run left to the allocator's cache; say what is still allocated."""
    gc.collect()
    if not use_cuda:
        return {"allocated_after_mib": None, "reserved_after_mib": None}
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return {
            "allocated_after_mib": torch.cuda.memory_allocated() / 2**20,
            "reserved_after_mib": torch.cuda.memory_reserved() / 2**20,
        }
    except Exception as exc:  # a sticky CUDA error from the run: the next runs will say so
        return {"cleanup_error": f"{type(exc).__name__}: {exc}"}


def one_run(
    kind: str, size: Size, mode: Mode, repeat: int, s: Settings, use_cuda: bool
) -> dict[str, Any]:
    """One plugin or baseline run; never raises (the error is recorded instead)."""
    record: dict[str, Any] = {
        "kind": kind,
        "size": size.name,
        "mode": mode.name,
        "repeat": repeat,
        "ok": False,
    }
    if use_cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    if s.manual_gc:
        gc.collect()
        gc.disable()
    start = time.perf_counter()
    try:
        runner = _run_plugin if kind == "plugin" else _run_baseline
        record.update(runner(size, mode, s, use_cuda))
        steady = record["steady_step_ms"]
        record["median_step_ms"] = statistics.median(steady) if steady else None
        iterations = record["steady_iteration_ms"]
        record["median_iteration_ms"] = statistics.median(iterations) if iterations else None
        record["ok"] = record["median_step_ms"] is not None
        if not record["ok"]:
            record["error"] = f"no step after step {s.steady_from - 1} was timed"
    except (Exception, SystemExit) as exc:  # argparse's parser.error() raises SystemExit
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc(limit=-8)
        logger.error("%s run %s/%s failed: %s", kind, size.name, mode.name, record["error"])
    if use_cuda:
        import torch

        record["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    record["wall_s"] = time.perf_counter() - start
    if s.manual_gc:
        gc.enable()  # before free_device_memory's collect, so the run's cycles go too
    record.update(free_device_memory(use_cuda))
    return record


# -------------------------------------------------------------------------------------------
# Aggregation.
# -------------------------------------------------------------------------------------------


def _pooled_median(runs: list[dict[str, Any]], key: str = "steady_step_ms") -> float | None:
    samples = [ms for run in runs for ms in run[key]]
    return statistics.median(samples) if samples else None


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def paired_ratios(plugin: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> list[float]:
    """plugin / baseline median step time of each repeat both finished (the two runs of a
    pair ran back to back, so slow phases of the machine hit both)."""
    base = {r["repeat"]: r["median_step_ms"] for r in baseline}
    return [
        r["median_step_ms"] / base[r["repeat"]]
        for r in sorted(plugin, key=lambda r: r["repeat"])
        if base.get(r["repeat"])
    ]


def _loss_difference(plugin: list[dict], baseline: list[dict]) -> float | None:
    """Largest |plugin - baseline| loss over the steps of the first repeat both finished."""
    for p in plugin:
        for b in baseline:
            if p["repeat"] == b["repeat"] and p["losses"] and b["losses"]:
                return max(abs(x - y) for x, y in zip(p["losses"], b["losses"], strict=False))
    return None


def aggregate(
    runs: list[dict[str, Any]],
    sizes: list[Size],
    modes: list[Mode],
    skipped: dict[str, str],
    intervals: bool = True,
) -> list[dict[str, Any]]:
    """Per size and mode: pooled medians, ratios and speed-ups; with ``intervals``, also the
    bootstrap intervals of the ratios (seconds of CPU: only for the final results)."""
    results = []
    # 95% intervals for the reader; for the check, Bonferroni over the rows of this file
    # (with 10 modes x sizes, one 95% interval in ten misses by chance alone).
    family = 1.0 - 0.05 / max(1, len(sizes) * len([m for m in modes if m.name not in skipped]))
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    for size in sizes:
        for mode in modes:
            row: dict[str, Any] = {"size": size.name, "mode": mode.name, "label": mode.label}
            if mode.name in skipped:
                row["skipped"] = skipped[mode.name]
                results.append(row)
                continue
            mine = [r for r in runs if r["size"] == size.name and r["mode"] == mode.name]
            plugin = [r for r in mine if r["kind"] == "plugin" and r["ok"]]
            baseline = [r for r in mine if r["kind"] == "baseline" and r["ok"]]
            row["errors"] = sorted({f"{r['kind']}: {r['error']}" for r in mine if r.get("error")})
            row["plugin_ms"] = _pooled_median(plugin)
            row["baseline_ms"] = _pooled_median(baseline)
            row["plugin_ms_per_repeat"] = [r["median_step_ms"] for r in plugin]
            row["baseline_ms_per_repeat"] = [r["median_step_ms"] for r in baseline]
            row["runs_ok"] = {"plugin": len(plugin), "baseline": len(baseline)}
            if row["plugin_ms"] and row["baseline_ms"]:
                row["ratio"] = row["plugin_ms"] / row["baseline_ms"]
            row["ratio_per_repeat"] = paired_ratios(plugin, baseline)
            for kind, kind_runs in (("plugin", plugin), ("baseline", baseline)):
                row[f"{kind}_iteration_ms"] = _pooled_median(kind_runs, "steady_iteration_ms")
            if row["plugin_iteration_ms"] and row["baseline_iteration_ms"]:
                row["iteration_ratio"] = row["plugin_iteration_ms"] / row["baseline_iteration_ms"]
            if intervals:
                for key, samples in (
                    ("ratio", "steady_step_ms"),
                    ("iteration_ratio", "steady_iteration_ms"),
                ):
                    found = ratio_intervals(plugin, baseline, samples, (0.95, family))
                    row[f"{key}_ci95"], row[f"{key}_ci_check"] = found or (None, None)
                row["check_confidence"] = family
            reports = [r["report"] for r in plugin if r.get("report")]
            if reports:
                row["report"] = {
                    key: _median([rep.get(key) for rep in reports])
                    for key in (
                        "eager_step_ms",
                        "replay_step_ms",
                        "speedup",
                        "capture_seconds",
                        "memory_overhead_mib",
                        "peak_overhead_mib",
                        "graph_count",
                    )
                }
                row["report"]["verdicts"] = [rep.get("verdict") for rep in reports]
                row["report"]["graphs_captured"] = [rep.get("graphs_captured") for rep in reports]
            row["baseline_capture_seconds"] = _median([r.get("capture_seconds") for r in baseline])
            row["peak_allocated_mib"] = {
                "plugin": _median([r.get("peak_allocated_mib") for r in plugin]),
                "baseline": _median([r.get("peak_allocated_mib") for r in baseline]),
            }
            row["loss_max_abs_diff"] = _loss_difference(plugin, baseline)
            results.append(row)
            by_key[(size.name, mode.name)] = row
    for row in results:
        mode = MODES[row["mode"]]
        reference = by_key.get((row["size"], mode.eager_reference or ""))
        if reference is None or row.get("skipped"):
            continue
        for kind in ("plugin", "baseline"):
            ref_ms, ms = reference.get(f"{kind}_ms"), row.get(f"{kind}_ms")
            if ref_ms and ms:
                row[f"speedup_{kind}"] = ref_ms / ms
    return results


def ratio_intervals(
    plugin: list[dict[str, Any]],
    baseline: list[dict[str, Any]],
    key: str,
    levels: tuple[float, ...],
    resamples: int = 2000,
) -> list[list[float]] | None:
    """Bootstrap intervals (one per confidence level) of the pooled-median ratio
    plugin/baseline.

    Runs, not steps, are resampled (with replacement, each kind on its own): on a machine
    whose speed changes from run to run, the steps of one run are not independent, and the
    run-to-run spread is what decides whether a difference is real. ``None`` with fewer than
    3 runs of either kind. Seeded, so the same runs give the same intervals.
    """
    if len(plugin) < 3 or len(baseline) < 3:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(resamples):
        p = [ms for run in rng.choices(plugin, k=len(plugin)) for ms in run[key]]
        b = [ms for run in rng.choices(baseline, k=len(baseline)) for ms in run[key]]
        ratios.append(statistics.median(p) / statistics.median(b))
    ratios.sort()
    out = []
    for level in levels:
        tail = (1.0 - level) / 2
        out.append([ratios[int(tail * resamples)], ratios[int((1.0 - tail) * resamples) - 1]])
    return out


UNRESOLVED = "unresolved"


def checks(
    results: list[dict[str, Any]], first_size: str, timed_on_gpu: bool = True
) -> dict[str, bool | str | None]:
    """The issue's criteria; all ``None`` (n/a) for CPU timings, which prove nothing.

    "Within 2%" is judged on each mode's interval of the ratio, not its point value, at a
    confidence corrected for the number of modes (``check_confidence``): ``True`` when
    every interval lies inside 0.98-1.02, ``False`` when some interval lies wholly outside
    it (a real difference), ``"unresolved"`` otherwise (the run-to-run noise is wider than
    the band: more pairs are needed to say either).
    """

    def within_2pct(key: str) -> bool | str | None:
        rows = [r for r in results if not r.get("skipped")]
        if not timed_on_gpu or not any(r.get(key) is not None for r in rows):
            return None
        intervals = [r.get(f"{key}_ci_check") for r in rows]
        if any(ci is not None and (ci[0] > 1.02 or ci[1] < 0.98) for ci in intervals):
            return False
        if all(ci is not None and 0.98 <= ci[0] and ci[1] <= 1.02 for ci in intervals):
            return True
        return UNRESOLVED

    fi = next(
        (r for r in results if r["size"] == first_size and r["mode"] == "full_iteration"), None
    )
    fi_speedup = fi.get("speedup_plugin") if fi is not None else None
    return {
        "plugin vs hand-written loop within 2% for every mode (timed step)": within_2pct("ratio"),
        "plugin vs hand-written loop within 2% for every mode (whole iteration, hooks included)": (
            within_2pct("iteration_ratio")
        ),
        f"full_iteration speed-up over eager >= 4x on {first_size} (plugin)": (
            fi_speedup >= 4.0 if timed_on_gpu and fi_speedup is not None else None
        ),
    }


# -------------------------------------------------------------------------------------------
# Main.
# -------------------------------------------------------------------------------------------


def command_line(script: str, argv: list[str] | None) -> str:
    """The command a results file records: what was asked for (``main()``'s ``argv`` when
    called from Python, not the calling program's arguments)."""
    return " ".join(["python3", script, *(sys.argv[1:] if argv is None else argv)])


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _default_out() -> str:
    out_dir = os.environ.get("OUT")
    return str(Path(out_dir) / "bench.json") if out_dir else "bench.json"


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The warm-up, sequence, batch, vocabulary and precision arguments of every GPU
    benchmark (gpu_modes, gpu_limit, pairs), with one set of defaults, so that their runs
    of one size line up."""
    parser.add_argument("--warmup", type=int, default=3, help="cuda_graph_warmup_steps")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128, help="train_gpt's default")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 instead")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="CUDA-graph modes: plugin vs hand-written loop, per model size.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default=_default_out(), help="JSON results ($OUT/bench.json)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"from {', '.join(SIZES)}")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"from {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="plugin/baseline pairs per mode")
    add_shape_arguments(parser)
    parser.add_argument(
        "--resume",
        metavar="JSON",
        help="continue the benchmark of this results file (same settings; --repeats may "
        "grow): keep its runs, make only the missing ones (e.g. over two device calls)",
    )
    parser.add_argument(
        "--reaggregate",
        metavar="JSON",
        help="only recompute results and checks of this file from its runs, write --out",
    )
    parser.add_argument("--no-warmup-run", action="store_true", help="skip the discarded run")
    parser.add_argument(
        "--gc",
        choices=("manual", "auto"),
        default="manual",
        help="manual: collect before each run and keep Python's garbage collector off during "
        "it (as Megatron-LM's --manual-gc), so collections do not land in timed steps of one "
        "run and not the other; auto: Python's default",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (no graphs)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and few steps (2 layers, hidden 64, seq 32, 8 steps, 2 repeats)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=330.0,
        help="seconds; no new run starts after this (0: no limit)",
    )
    parser.add_argument("--verbose", action="store_true", help="INFO logs from the runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats, args.seq_length = min(args.steps, 8), min(args.repeats, 2), 32
        if args.sizes == ",".join(SIZES):
            args.sizes = ",".join(SMOKE_SIZES)
    return args


def setup(args: argparse.Namespace, log: logging.Logger) -> tuple[bool, list[Size]]:
    """Logging and warnings as both GPU scripts want them; the device and the sizes asked for."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log.setLevel(logging.INFO)
    for noisy in ("megatron", "cudagraph_plugin", "train_gpt"):
        logging.getLogger(noisy).setLevel(logging.INFO if args.verbose else logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", module="torch")
    import torch

    use_cuda = torch.cuda.is_available() and not args.cpu
    known = {**SIZES, **SMOKE_SIZES}
    return use_cuda, [known[name] for name in args.sizes.split(",")]


# What must match for runs of an earlier process to be pooled with this one's.
RESUME_KEYS = ("gpu", "device", "versions", "settings", "te_available")


def resume_from(path: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """Continue the benchmark in ``path`` (same machine, versions and settings): its runs
    are kept and only the missing plugin/baseline runs of the plan are made."""
    earlier = json.loads(path.read_text())
    for key in RESUME_KEYS:
        mine, theirs = fresh.get(key), earlier.get(key)
        if key == "settings":  # the number of repeats may grow
            mine, theirs = (
                {k: v for k, v in (d or {}).items() if k != "repeats"} for d in (mine, theirs)
            )
        if mine != theirs:
            raise SystemExit(
                f"--resume {path}: its {key} ({theirs!r}) differ from this run's ({mine!r}); "
                "resume only with the same machine, versions and settings, or start afresh"
            )
    continued = {
        **fresh,
        "runs": earlier["runs"],
        "date": earlier["date"],
        "command": f"{earlier['command']} ; then {fresh['command']}",
    }
    continued["notes"] = [
        *earlier.get("notes", []),
        f"resumed at {fresh['date']} by `{fresh['command']}` "
        f"({len(earlier['runs'])} runs kept from {earlier['date']})",
    ]
    continued["processes"] = earlier.get("processes", 1) + 1
    continued["warmup_runs"] = [*earlier.get("warmup_runs", []), earlier.get("warmup_run")]
    return continued


def reaggregate(path: Path, out: Path) -> int:
    """Recompute the results and checks of a results file from its runs (no device needed)."""
    data = json.loads(path.read_text())
    settings = data["settings"]
    sizes = [Size(**size) for size in settings["sizes"]]
    modes = [MODES[name] for name in settings["modes"]]
    skipped = {r["mode"]: r["skipped"] for r in data.get("results", []) if r.get("skipped")}
    data["results"] = aggregate(data["runs"], sizes, modes, skipped)
    data["checks"] = checks(data["results"], sizes[0].name, data.get("device") == "cuda")
    write_json(out, data)
    print(tables.modes_table(data))
    print("\n".join(tables.checks_lines(data)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reaggregate:
        return reaggregate(Path(args.reaggregate), Path(args.out))
    use_cuda, sizes = setup(args, logger)
    modes = [MODES[name] for name in args.modes.split(",")]
    s = Settings(
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        vocab_size=args.vocab_size,
        bf16=args.bf16,
        cpu=args.cpu,
        smoke=args.smoke,
        manual_gc=args.gc == "manual",
    )
    if s.steps <= s.steady_from:
        raise SystemExit(f"--steps must exceed warmup + 2 = {s.steady_from}")

    env = environment(use_cuda)
    notes: list[str] = []
    skipped: dict[str, str] = {}
    for mode in modes:
        reason = mode_unavailable(mode, use_cuda, None if env["te_available"] else env["te_note"])
        if reason is not None and (use_cuda or not mode.needs_te):
            skipped[mode.name] = reason
    if use_cuda and not env["te_available"]:
        notes.append(f"TE modes skipped: {env['te_note']}")
    if not use_cuda:
        notes.append(
            "CPU run: no CUDA graph can be captured; graph modes run eagerly after the plugin "
            "validated them, TE modes use the local layer spec, and the baseline drives "
            "FullCudaGraphWrapper's eager warm-up path and a TECudaGraphHelper stand-in"
        )
    data: dict[str, Any] = {
        "schema": SCHEMA,
        **env,
        "command": command_line("benchmarks/gpu_modes.py", argv),
        "settings": {
            "sizes": [dataclasses.asdict(size) for size in sizes],
            "modes": [m.name for m in modes],
            **{k: v for k, v in dataclasses.asdict(s).items()},
            "steady_from_step": s.steady_from,
            "optimizer": "adam (megatron-core), clip_grad 1.0, 1 GPU, no distributed optimizer",
        },
        "notes": notes,
        "runs": [],
        "results": [],
        "checks": {},
    }
    out = Path(args.out)
    if args.resume:
        data = resume_from(Path(args.resume), data)
    done = {
        (r["repeat"], r["size"], r["mode"], r["kind"]) for r in data["runs"] if r["repeat"] >= 0
    }
    started = time.perf_counter()

    if not args.no_warmup_run:
        # The first run in a process pays CUDA context, cuBLAS and NCCL start-up.
        warm = one_run("baseline", sizes[0], MODES["eager"], -1, s, use_cuda)
        data["warmup_run"] = {k: warm.get(k) for k in ("ok", "error", "wall_s", "median_step_ms")}
        logger.info("discarded warm-up run: %.1f s", warm["wall_s"])

    # Repeat-major: every size and mode gets a first pair before any gets a second, so a
    # time budget that runs out leaves fewer repeats, not missing modes.
    plan = [
        (repeat, size, index, mode)
        for repeat in range(s.repeats)
        for size in sizes
        for index, mode in enumerate(modes)
        if mode.name not in skipped
        and not all((repeat, size.name, mode.name, kind) in done for kind in ("plugin", "baseline"))
    ]
    for repeat, size, index, mode in plan:
        elapsed = time.perf_counter() - started
        if args.time_budget and elapsed > args.time_budget:
            data["notes"].append(
                f"time budget of {args.time_budget:.0f} s reached after {elapsed:.0f} s: "
                f"stopped before repeat {repeat} of {size.name}/{mode.name}"
            )
            logger.warning("%s", data["notes"][-1])
            break
        kinds = ["plugin", "baseline"]
        if (repeat + index) % 2:
            kinds.reverse()  # A/B, then B/A: drift cancels
        for kind in kinds:
            if (repeat, size.name, mode.name, kind) in done:
                continue
            record = one_run(kind, size, mode, repeat, s, use_cuda)
            data["runs"].append(record)
            logger.info(
                "%-8s %-9s %-15s repeat %d: %s ms/step (%.1f s, %.0f s so far)",
                size.name,
                kind,
                mode.name,
                repeat,
                f"{record['median_step_ms']:.3f}" if record["ok"] else "FAILED",
                record["wall_s"],
                time.perf_counter() - started,
            )
            data["results"] = aggregate(data["runs"], sizes, modes, skipped, intervals=False)
            data["checks"] = checks(data["results"], sizes[0].name, use_cuda)
            data["total_wall_s"] = time.perf_counter() - started
            write_json(out, data)

    data["results"] = aggregate(data["runs"], sizes, modes, skipped)
    data["checks"] = checks(data["results"], sizes[0].name, use_cuda)
    after = [r["allocated_after_mib"] for r in data["runs"] if r.get("allocated_after_mib")]
    data["max_allocated_after_run_mib"] = max(after) if after else None
    data["total_wall_s"] = time.perf_counter() - started
    write_json(out, data)

    print("\n".join(tables.environment_lines(data)))
    print()
    print(tables.modes_table(data))
    print()
    print("\n".join(tables.checks_lines(data)))
    for note in notes:
        print(f"note: {note}")
    print(f"total {data['total_wall_s']:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
