"""The GPU limit: GPU kernel time per training step (torch.profiler) vs the step time.

CUDA graphs remove host launch overhead; what is left is the GPU's own work. For the small
model (4 layers, hidden 512) this runs ``examples/train_gpt.py`` through the CUDA graph
plugin in two modes, ``full_iteration`` first (captured before the profiler ever starts)
and then ``eager``. Each run times ``--timed-steps`` steps after the capture step without
the profiler, then profiles ``--profiled-steps`` more steps with CUDA activity and sums
the durations of the GPU kernels in the trace (also memcpy/memset, the number of kernels
and the GPU busy time: the union of all GPU activity intervals). Reported: kernel time per
step, and step time / kernel time for the graphed and the eager step (the eager run's
kernel time is the reference: the same kernels, profiled without graph replay).

GPU (see benchmarks/README.md)::

    PYTHONPATH=$PWD:$PWD/examples:$PYTHONPATH python3 benchmarks/gpu_limit.py --out $OUT/limit.json

CPU check of the code path (no kernels there: the numbers are empty)::

    python benchmarks/gpu_limit.py --cpu --smoke --out /tmp/limit_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpu_modes  # noqa: E402  (sets up sys.path for the project and the example)
import tables  # noqa: E402

from hookspecs import hookimpl  # noqa: E402

logger = logging.getLogger("gpu_limit")

SCHEMA = "mcgraph-bench-limit/1"

MODES = gpu_modes.MODES
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def parse_trace(path: Path, steps: int) -> dict[str, Any]:
    """Per-step GPU time from a Chrome trace written by ``torch.profiler``."""
    raw = json.loads(path.read_text())
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    gpu = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and e.get("dur") is not None
    ]
    kernels = [e for e in gpu if e["cat"] == "kernel"]

    def per_step_ms(items: list[dict[str, Any]]) -> float:
        return sum(float(e["dur"]) for e in items) / 1000.0 / steps

    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    busy_us, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop <= end:
            continue
        busy_us += stop - max(start, end)
        end = stop
    return {
        "profiled_steps": steps,
        "kernel_ms_per_step": per_step_ms(kernels),
        "kernels_per_step": len(kernels) / steps,
        "memcpy_ms_per_step": per_step_ms([e for e in gpu if e["cat"] == "gpu_memcpy"]),
        "memset_ms_per_step": per_step_ms([e for e in gpu if e["cat"] == "gpu_memset"]),
        "busy_ms_per_step": busy_us / 1000.0 / steps,
        "trace_events": len(events),
    }


class KernelProfiler:
    """Profiles steps ``first .. first + count - 1`` of a run (hooks outside the timed part)."""

    def __init__(self, first: int, count: int, use_cuda: bool, trace_path: Path) -> None:
        self.first = first
        self.count = count
        self.use_cuda = use_cuda
        self.trace_path = trace_path
        self.profiler: Any = None
        self.result: dict[str, Any] | None = None

    def _sync(self) -> None:
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        if step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if self.use_cuda else ProfilerActivity.CPU
        self._sync()
        self.profiler = profile(activities=[activity])
        self.profiler.start()

    @hookimpl
    def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        if self.profiler is None or step != self.first + self.count - 1:
            return
        self._sync()
        self.stop()
        self.result = parse_trace(self.trace_path, self.count)

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.export_chrome_trace(str(self.trace_path))
            self.profiler = None


@dataclasses.dataclass(frozen=True)
class LimitSettings:
    warmup: int
    timed_steps: int
    profiled_steps: int

    @property
    def steady_from(self) -> int:
        return gpu_modes.steady_from(self.warmup)

    @property
    def first_profiled(self) -> int:
        return self.steady_from + self.timed_steps

    @property
    def steps(self) -> int:
        return self.first_profiled + self.profiled_steps


def profile_run(
    size: gpu_modes.Size,
    mode: gpu_modes.Mode,
    base: gpu_modes.Settings,
    ls: LimitSettings,
    use_cuda: bool,
    trace_dir: Path,
) -> dict[str, Any]:
    import train_gpt

    record: dict[str, Any] = {"size": size.name, "mode": mode.name}
    collector = gpu_modes.Collector()
    profiler = KernelProfiler(
        ls.first_profiled, ls.profiled_steps, use_cuda, trace_dir / f"{size.name}-{mode.name}.json"
    )
    plugins = [
        collector,
        profiler,
    ]
    start = time.perf_counter()
    try:
        argv = gpu_modes.plugin_argv(size, mode, base, use_cuda)
        summary = train_gpt.run(argv, plugins=plugins)
        # The example's step clock (CUDA events, no synchronisation per step), from step 0.
        clock = list(enumerate(summary["step_ms"]))
        timed = [ms for step, ms in clock if ls.steady_from <= step < ls.first_profiled]
        record["step_ms"] = statistics.median(timed) if timed else None
        record["timed_steps"] = len(timed)
        record["profiled_step_ms"] = [ms for step, ms in clock if step >= ls.first_profiled]
        record["shutdown_reason"] = summary["shutdown_reason"]
        record["report"] = collector.report
        if profiler.result is None:
            raise RuntimeError("the profiled steps did not all run")
        record.update(profiler.result)
        kernel = record["kernel_ms_per_step"]
        if record["step_ms"] and kernel:
            record["step_over_own_kernel_time"] = record["step_ms"] / kernel
    except (Exception, SystemExit) as exc:
        with contextlib.suppress(Exception):
            profiler.stop()
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc(limit=-8)
        logger.error("%s/%s failed: %s", size.name, mode.name, record["error"])
    record["wall_s"] = time.perf_counter() - start
    record.update(gpu_modes.free_device_memory(use_cuda))
    return record


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = {r["mode"]: r for r in runs if not r.get("error")}
    eager = ok.get("eager")
    graphed = ok.get("full_iteration_optimizer") or ok.get("full_iteration")
    reference = eager if eager and eager.get("kernel_ms_per_step") else graphed
    kernel = reference.get("kernel_ms_per_step") if reference else None
    summary: dict[str, Any] = {
        "kernel_ms_per_step": kernel or None,
        "kernel_time_from": reference["mode"] if reference and kernel else None,
        "graphed_kernel_ms_per_step": graphed.get("kernel_ms_per_step") if graphed else None,
        "eager_step_ms": eager.get("step_ms") if eager else None,
        "graphed_step_ms": graphed.get("step_ms") if graphed else None,
    }
    for key, step in (
        ("eager_over_kernel", "eager_step_ms"),
        ("graphed_over_kernel", "graphed_step_ms"),
    ):
        summary[key] = summary[step] / kernel if summary[step] and kernel else None
    # Issue 21's two criteria for the graphed step: within 1.4x of its own run's kernel time,
    # and at least 5x faster than the eager step with the same device-side gradient norm.
    own_kernel = summary["graphed_kernel_ms_per_step"]
    graphed_ms = summary["graphed_step_ms"]
    summary["graphed_over_own_kernel"] = (
        graphed_ms / own_kernel if graphed_ms and own_kernel else None
    )
    device_norm = ok.get("eager_device_norm")
    summary["eager_device_norm_step_ms"] = device_norm.get("step_ms") if device_norm else None
    summary["speedup_vs_eager_device_norm"] = (
        summary["eager_device_norm_step_ms"] / graphed_ms
        if summary["eager_device_norm_step_ms"] and graphed_ms
        else None
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="GPU kernel time per step vs step time (eager and full_iteration).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    out_dir = os.environ.get("OUT")
    parser.add_argument(
        "--out", default=str(Path(out_dir) / "limit.json") if out_dir else "limit.json"
    )
    parser.add_argument("--sizes", default="4L-512H", help="from " + ", ".join(gpu_modes.SIZES))
    parser.add_argument("--modes", default="full_iteration,eager", help="run in this order")
    parser.add_argument("--timed-steps", type=int, default=30, help="unprofiled, after capture")
    parser.add_argument("--profiled-steps", type=int, default=20)
    gpu_modes.add_shape_arguments(parser)
    parser.add_argument("--keep-traces", metavar="DIR", help="keep the Chrome traces here")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 3 timed + 2 profiled")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.timed_steps, args.profiled_steps, args.seq_length = 3, 2, 32
        if args.sizes == "4L-512H":
            args.sizes = ",".join(gpu_modes.SMOKE_SIZES)

    use_cuda, sizes = gpu_modes.setup(args, logger)
    modes = [MODES[name] for name in args.modes.split(",")]
    ls = LimitSettings(args.warmup, args.timed_steps, args.profiled_steps)
    base = gpu_modes.Settings(
        steps=ls.steps,
        warmup=ls.warmup,
        repeats=1,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        vocab_size=args.vocab_size,
        bf16=args.bf16,
        cpu=args.cpu,
        smoke=args.smoke,
    )
    data: dict[str, Any] = {
        "schema": SCHEMA,
        **gpu_modes.environment(use_cuda),
        "command": gpu_modes.command_line("benchmarks/gpu_limit.py", argv),
        "settings": {
            "sizes": [dataclasses.asdict(size) for size in sizes],
            "modes": [m.name for m in modes],
            **dataclasses.asdict(ls),
            "steps": ls.steps,
            "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size,
            "vocab_size": args.vocab_size,
            "bf16": args.bf16,
        },
        "notes": [] if use_cuda else ["CPU run: no GPU kernels, the kernel times are empty"],
        "runs": [],
    }
    out = Path(args.out)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(args.keep_traces) if args.keep_traces else Path(tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        for size in sizes:
            for mode in modes:
                record = profile_run(size, mode, base, ls, use_cuda, trace_dir)
                data["runs"].append(record)
                logger.info(
                    "%s %s: step %s ms, kernels %s ms/step (%.1f s)",
                    size.name,
                    mode.name,
                    record.get("step_ms"),
                    record.get("kernel_ms_per_step"),
                    record["wall_s"],
                )
                gpu_modes.write_json(out, data)
    data["summary"] = summarise([r for r in data["runs"] if r["size"] == sizes[0].name])
    data["total_wall_s"] = time.perf_counter() - started
    gpu_modes.write_json(out, data)

    print("\n".join(tables.environment_lines(data)))
    print()
    print(tables.limit_table(data))
    summary = data["summary"]
    if summary["graphed_over_own_kernel"]:
        print(
            f"graphed step / its own kernel time: {summary['graphed_over_own_kernel']:.2f}x "
            "(issue 21: at most 1.4x)"
        )
    if summary["speedup_vs_eager_device_norm"]:
        print(
            f"graphed step vs eager with the device-side norm: "
            f"{summary['speedup_vs_eager_device_norm']:.1f}x faster (issue 21: at least 5x)"
        )
    for note in data["notes"]:
        print(f"note: {note}")
    print(f"total {data['total_wall_s']:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
