"""Hook dispatch overhead per training step, on the CPU, in microseconds.

A host fires these hooks on every training step, through ``TrainingRun.train_step``:
``mcgraph_train_step_start``, the post-warm-up check (``mcgraph_post_warmup_step`` fires
once, at the capture step) and ``mcgraph_train_step_end``. This script times an empty
training step (no model, no device: a fake step that fills the metrics dict) in a tight
loop, for these plugin sets:

* ``bare``: the same loop without ``TrainingRun`` or any hook (the reference);
* ``host-defaults``: a ``TrainingRun`` whose plugin manager has only the host's default
  implementations (no plugin installed);
* ``cudagraph-none``: plus the CUDA graph plugin, configured with ``--cuda-graph-impl none``;
* ``cudagraph-graphs-cpu``: the CUDA graph plugin configured for graphs
  (``local``/``full_iteration``) but on the CPU, where it validates and runs eagerly;
* ``cudagraph+third-party``: as ``cudagraph-graphs-cpu`` plus a no-op third-party plugin
  implementing the three per-step hooks.

The configuration is the example host's own command line (``examples/train_gpt.py``'s
parser, with the plugin's flags added through ``mcgraph_add_arguments``), and every
repeat uses a fresh plugin manager and ``TrainingRun``, as a host does for each run.
Garbage collection stays enabled (what a training loop sees). Run::

    python benchmarks/hook_overhead.py                 # make bench-cpu
    python benchmarks/hook_overhead.py --steps 200000 --repeats 9 --json hook.json
    python benchmarks/hook_overhead.py --steps 2000 --cache-sweep-mib 64   # cold caches

The hot loop is the least the hooks can cost. In a training loop each step's GPU work (or,
on a CPU, its forward/backward) evicts the hooks' code and data from the CPU caches first;
``--cache-sweep-mib`` writes over that much memory between steps (untimed) to show it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (ROOT, ROOT / "examples", HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import tables  # noqa: E402  (after the sys.path set-up above)

from hookspecs import hookimpl  # noqa: E402

VARIANTS = (
    "bare",
    "host-defaults",
    "cudagraph-none",
    "cudagraph-graphs-cpu",
    "cudagraph+third-party",
)
GRAPH_FLAGS = {
    "cudagraph-none": ["--cuda-graph-impl", "none"],
    "cudagraph-graphs-cpu": [
        "--cuda-graph-impl",
        "local",
        "--cuda-graph-scope",
        "full_iteration",
        "--cuda-graph-warmup-steps",
        "3",
    ],
}
GRAPH_FLAGS["cudagraph+third-party"] = GRAPH_FLAGS["cudagraph-graphs-cpu"]


class NoOpThirdPartyPlugin:
    """A third-party plugin that implements the per-step hooks and does nothing."""

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        pass

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        pass

    @hookimpl
    def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        pass


def fake_step(metrics: dict[str, Any], step: int) -> None:
    """What is left of a training step without a model: the host fills in its metrics."""
    metrics["loss"] = 0.0
    metrics["step_time_ms"] = float(step)


class CacheSweep:
    """Between timed steps, what a real training step does to the CPU caches: a write over
    ``mib`` MiB (untimed). The hot loop keeps the hooks' code and data in cache, so it shows
    the least they can cost; with the sweep each step starts cold, as after a model's
    forward/backward."""

    def __init__(self, mib: int) -> None:
        import torch

        self.buffer = torch.zeros(mib * 2**20 // 4) if mib else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.add_(1.0)


def _time_bare(steps: int, sweep: CacheSweep) -> float:
    if sweep.buffer is not None:
        spent = 0
        for step in range(steps):
            sweep()
            start = time.perf_counter_ns()
            metrics: dict[str, Any] = {}
            fake_step(metrics, step)
            spent += time.perf_counter_ns() - start
        return spent / steps / 1000.0
    start = time.perf_counter_ns()
    for step in range(steps):
        metrics = {}
        fake_step(metrics, step)
    return (time.perf_counter_ns() - start) / steps / 1000.0


def _make_run(variant: str, steps: int) -> Any:
    """A fresh plugin manager and ``TrainingRun`` for ``variant`` (not yet entered)."""
    import cudagraph_plugin.entry
    import train_gpt
    from hookspecs import TrainingRun, get_plugin_manager

    # Explicit registration instead of entry points: the measured set is exactly the
    # variant's, whatever else is installed here.
    pm = get_plugin_manager(load_entrypoints=False)
    if variant != "host-defaults":
        pm.register(cudagraph_plugin.entry, name="cudagraph")
    if variant == "cudagraph+third-party":
        pm.register(NoOpThirdPartyPlugin(), name="noop-third-party")
    argv = ["--cpu", "--train-iters", str(steps), *GRAPH_FLAGS.get(variant, [])]
    config = train_gpt.build_parser(pm).parse_args(argv)
    return TrainingRun(pm, config=config, train_iters=steps)


def _time_hooks(variant: str, steps: int, sweep: CacheSweep) -> float:
    run = _make_run(variant, steps)
    with run:
        # (a run with graphs asked for trains only after it: on the CPU too)
        run.model_built(
            model=[], optimizer=None, model_config=None, seq_length=1, micro_batch_size=1
        )
        gc.collect()
        if sweep.buffer is not None:
            elapsed = 0
            for step in range(steps):
                sweep()
                start = time.perf_counter_ns()
                with run.train_step(step) as metrics:
                    fake_step(metrics, step)
                elapsed += time.perf_counter_ns() - start
        else:
            start = time.perf_counter_ns()
            for step in range(steps):
                with run.train_step(step) as metrics:
                    fake_step(metrics, step)
            elapsed = time.perf_counter_ns() - start
    return elapsed / steps / 1000.0


def _timer(variant: str, sweep: CacheSweep) -> Callable[[int], float]:
    if variant == "bare":
        return lambda n: _time_bare(n, sweep)
    return lambda n: _time_hooks(variant, n, sweep)


def measure(steps: int, repeats: int, sweep_mib: int = 0) -> dict[str, list[float]]:
    """Microseconds per step, one value per repeat and variant.

    The variants take turns within each repeat (round-robin), so a slow phase of a shared
    machine hits all of them alike; one short untimed loop per variant warms up first.
    """
    sweep = CacheSweep(sweep_mib)
    for variant in VARIANTS:
        _timer(variant, sweep)(min(steps, 1000))
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            samples[variant].append(_timer(variant, sweep)(steps))
    return samples


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("pluggy", "torch", "megatron-core", "megatron-cudagraph-plugin"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_benchmark(steps: int, repeats: int, sweep_mib: int = 0) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    for variant, samples in measure(steps, repeats, sweep_mib).items():
        results[variant] = {
            "us_per_step_median": statistics.median(samples),
            "us_per_step_min": min(samples),
            "us_per_step_max": max(samples),
            "samples_us": samples,
        }
    bare = results["bare"]["us_per_step_median"]
    host = results["host-defaults"]["us_per_step_median"]
    for data in results.values():
        data["delta_vs_bare_us"] = data["us_per_step_median"] - bare
        data["delta_vs_host_defaults_us"] = data["us_per_step_median"] - host
    worst = max(results[v]["delta_vs_bare_us"] for v in VARIANTS if v != "bare")
    return {
        "benchmark": "hook_overhead",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor() or None,
            "cpu_count": os.cpu_count(),
            "system": f"{platform.system()} {platform.release()}",
        },
        "versions": _versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "steps": steps,
        "repeats": repeats,
        "cache_sweep_mib": sweep_mib,
        "hooks_per_step": [
            "mcgraph_train_step_start",
            "post-warm-up check",
            "mcgraph_train_step_end",
        ],
        "results": results,
        "max_delta_vs_bare_us": worst,
        "under_10us": worst < 10.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=9, help="timed loops per variant")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--cache-sweep-mib",
        type=int,
        default=0,
        metavar="MIB",
        help="write over MIB MiB between steps (untimed) so each step starts with cold "
        "caches, as after a real forward/backward (0: the hot loop)",
    )
    args = parser.parse_args(argv)
    # The CUDA graph plugin says on every run that the CPU means no graphs, and megatron
    # warns at import; neither is what is measured here.
    logging.basicConfig(level=logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")

    data = run_benchmark(args.steps, args.repeats, args.cache_sweep_mib)
    sweep = f", {args.cache_sweep_mib} MiB cache sweep" if args.cache_sweep_mib else ""
    print(
        f"hook dispatch per training step{sweep}, {args.steps} steps x {args.repeats} repeats, "
        f"Python {data['versions']['python']}, pluggy {data['versions']['pluggy']}"
    )
    print(tables.hook_table(data))
    verdict = "under" if data["under_10us"] else "NOT under"
    print(
        f"largest overhead vs the bare loop: {data['max_delta_vs_bare_us']:.2f} µs/step "
        f"({verdict} the 10 µs target)"
    )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
