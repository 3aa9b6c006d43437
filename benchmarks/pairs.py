"""Plugin vs hand-written loop, one fresh process per run, in alternating pairs, with the
kernels of one graphed step of each: the decidable comparison of issue 21, item 4.

For each pair index and each mode (round-robin: every mode gets pair 1 before any gets
pair 2) this runs the plugin (``examples/train_gpt.py``'s ``run()`` with the CUDA graph plugin
found through its entry point) and the hand-written loop (``benchmarks/handwritten.py``, the
same loop wired by hand, no plugin), each as its own Python process, the side that goes
first alternating from pair to pair. Each run times its steps with the same clock (a pair of
CUDA events around each step, read once at the end, no device synchronisation per step; the
wall clock on the CPU), with Python's garbage collector collected before the run and off
during it, and writes one JSON: the step times, the steady ones (after the capture step and
one more: ``warmup + 2`` onwards), losses, capture steps, the run report (plugin),
versions, device and its process id. After the pairs, one profiled run per side and mode:
``torch.profiler`` (GPU activity) over ``--profile-steps`` steady steps, counting the kernels
and summing their durations per step (on the CPU: CPU operators, labelled so).

Per mode, the summary (``summary.json``, ``summary.md``) gives both sides' median step time
(median of the runs' medians), the per-pair ratios plugin/hand-written and their median,
the **spread**: ``max/min - 1`` of the per-pair ratios (each side's own run-to-run
``max/min - 1`` is given too, for reading), the kernel counts and kernel time per step of
both sides, the losses of both sides compared step by step, and a verdict (:func:`decide`):

* kernel counts per step differ: **FAIL** (the loops do not launch the same work);
* spread <= 3%: **PASS** when the median ratio is <= 1.03 and the kernel counts are
  identical, else FAIL;
* spread > 3%: the result says "spread above 3%: kernel-time equality decides", and it is
  **PASS** when the kernel counts are identical and the plugin's kernel time per step is
  at most 1.03 times the hand-written loop's, else FAIL;
* fewer complete pairs than asked, or no profile where one decides: **INCOMPLETE** (with
  what the numbers so far say).

The done-when of item 4 is the verdict of ``full_iteration`` and ``full_iteration_optimizer``
together. On the CPU every verdict is "n/a": CPU timings and operator counts say nothing
about a GPU.

GPU, one command per device call (``benchmarks/pairs_gpu.sh`` explains the split)::

    bash benchmarks/pairs_gpu.sh $OUT TAG

by hand::

    python3 benchmarks/pairs.py --modes eager,full_iteration,full_iteration_optimizer,\\
        te_attn_mlp --pairs 5 --out /tmp/pairs --resume --time-budget 460

CPU check of every code path::

    python benchmarks/pairs.py --cpu --smoke --out /tmp/pairs_smoke

The runs live in ``--out DIR`` (``settings.json``, ``runs/``, ``logs/``, ``summary.*``);
``--resume`` continues a DIR (same settings; ``--pairs`` may grow), making only the runs
that are missing; ``--time-budget`` starts no run that would, by the longest run so far, end
after it. A child that outlives ``--timeout`` is ended with its whole process group.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (ROOT, ROOT / "examples", HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import gpu_modes  # noqa: E402  (after the sys.path set-up above)
import tables  # noqa: E402

SCHEMA = "mcgraph-bench-pairs/1"
RUN_SCHEMA = "mcgraph-bench-pairs-run/1"
SIDES = ("plugin", "handwritten")
DEFAULT_MODES = ("eager", "full_iteration", "full_iteration_optimizer", "te_attn_mlp")
# The modes item 4's done-when is about.
CRITERION_MODES = ("full_iteration", "full_iteration_optimizer")
RATIO_LIMIT = 1.03
SPREAD_LIMIT = 0.03
PROFILE = "profile"  # the pair label of the profiled runs

PASS, FAIL, INCOMPLETE, NOT_APPLICABLE = "PASS", "FAIL", "INCOMPLETE", "n/a"


# -------------------------------------------------------------------------------------------
# Settings.
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PairSettings:
    """What every run of one DIR shares (``settings.json``)."""

    size: str
    steps: int
    warmup: int
    seq_length: int
    micro_batch_size: int
    vocab_size: int
    bf16: bool
    cpu: bool
    smoke: bool
    profile_skip: int
    profile_steps: int

    @property
    def steady_from(self) -> int:
        return gpu_modes.steady_from(self.warmup)

    @property
    def profile_first(self) -> int:
        """The first profiled step: ``profile_skip`` steady steps after the capture."""
        return self.steady_from + self.profile_skip

    def bench(self, profiled: bool) -> gpu_modes.Settings:
        """``gpu_modes``' settings, whose argv and config builders both sides use."""
        steps = self.profile_first + self.profile_steps if profiled else self.steps
        return gpu_modes.Settings(
            steps=steps,
            warmup=self.warmup,
            repeats=1,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            vocab_size=self.vocab_size,
            bf16=self.bf16,
            cpu=self.cpu,
            smoke=self.smoke,
        )

    def model_size(self) -> gpu_modes.Size:
        return {**gpu_modes.SIZES, **gpu_modes.SMOKE_SIZES}[self.size]


def _mcore_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def known_skip(mode: gpu_modes.Mode, cpu: bool, mcore_version: str | None) -> str | None:
    """Why ``mode`` cannot run, where that is known without starting a run (the parent
    imports neither torch nor megatron-core); a run finds the other reasons itself."""
    if mode.optimizer_graph and mcore_version is not None:
        parts = tuple(int(p) for p in mcore_version.split(".")[:2] if p.isdigit())
        if parts < (0, 17):
            return (
                f"megatron-core {mcore_version} has no optimizer graph "
                "(OptimizerCudaGraphWrapper, megatron-core 0.17+)"
            )
    if cpu and mode.needs_te:
        return "no CUDA device (--cpu): the TE layer spec and TE graphs need one"
    if cpu and mode.optimizer_graph:
        return "no CUDA device (--cpu): the optimizer graph captures a capturable Adam on one"
    return None


# -------------------------------------------------------------------------------------------
# One run (the child process).
# -------------------------------------------------------------------------------------------


def profile_counts(trace_path: Path, steps: int, use_cuda: bool) -> dict[str, Any]:
    """Per-step counts and time from a ``torch.profiler`` Chrome trace: GPU kernels on a GPU
    (with ``gpu_limit.parse_trace``'s memcpy/memset/busy figures), CPU operators on the CPU."""
    raw = json.loads(trace_path.read_text())
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    category = "kernel" if use_cuda else "cpu_op"
    items = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == category and e.get("dur") is not None
    ]
    if use_cuda and not items:
        # Both sides empty would read as "identical kernel counts (0 per step)": a PASS.
        raise RuntimeError(
            f"the profile of {steps} step(s) holds no GPU kernel ({len(events)} trace events): "
            "torch.profiler recorded no CUDA activity (CUPTI unavailable or not permitted?)"
        )
    counts = collections.Counter(str(e.get("name")) for e in items)
    out: dict[str, Any] = {
        "unit": "GPU kernels" if use_cuda else "CPU operators (no GPU: not kernels)",
        "profiled_steps": steps,
        "count_total": len(items),
        "count_per_step": len(items) / steps,
        "time_ms_per_step": sum(float(e["dur"]) for e in items) / 1000.0 / steps,
        "names": dict(sorted(counts.items())),
    }
    if use_cuda:
        import gpu_limit

        limit = gpu_limit.parse_trace(trace_path, steps)
        out.update({k: limit[k] for k in ("memcpy_ms_per_step", "memset_ms_per_step")})
        out["busy_ms_per_step"] = limit["busy_ms_per_step"]
    return out


def _plugin_run(
    mode: gpu_modes.Mode, ps: PairSettings, use_cuda: bool, trace: Path | None
) -> dict[str, Any]:
    import train_gpt

    s = ps.bench(profiled=trace is not None)
    collector = gpu_modes.Collector()
    plugins: list[Any] = [collector]
    profiler = None
    if trace is not None:
        import gpu_limit

        profiler = gpu_limit.KernelProfiler(ps.profile_first, ps.profile_steps, use_cuda, trace)
        plugins.append(profiler)
    argv = gpu_modes.plugin_argv(ps.model_size(), mode, s, use_cuda)
    try:
        summary = train_gpt.run(argv, plugins=plugins)
    finally:
        if profiler is not None:
            profiler.stop()
    report = collector.report or {}
    record: dict[str, Any] = {
        "argv": argv,
        "step_ms": summary["step_ms"],
        "losses": summary["losses"],
        "shutdown_reason": summary["shutdown_reason"],
        "plugins": collector.plugin_names(),
        "capture_step": report.get("capture_step"),
        "graphs_captured": report.get("graphs_captured"),
        "report": {
            key: report.get(key)
            for key in (
                "graphs_captured",
                "capture_step",
                "graph_count",
                "capture_seconds",
                "eager_step_ms",
                "replay_step_ms",
                "speedup",
                "verdict",
                "no_graph_reason",
            )
        },
        "profiled": profiler is not None and profiler.result is not None,
    }
    if "cudagraph" not in record["plugins"]:
        raise RuntimeError(
            "the CUDA graph plugin was not loaded (its entry point is not installed where this "
            "runs: install the project, e.g. pip install --no-deps --target /tmp/proj "
            "./hookspecs . and put /tmp/proj on PYTHONPATH, as pairs_gpu.sh does)"
        )
    return record


def _handwritten_run(
    mode: gpu_modes.Mode, ps: PairSettings, use_cuda: bool, trace: Path | None
) -> dict[str, Any]:
    import handwritten

    s = ps.bench(profiled=trace is not None)
    cfg = gpu_modes.baseline_config(ps.model_size(), mode, s, use_cuda)
    if trace is not None:
        cfg = dataclasses.replace(
            cfg,
            profile_first=ps.profile_first,
            profile_steps=ps.profile_steps,
            trace_path=str(trace),
        )
    out = handwritten.run(cfg)
    captured = None
    if mode.graphed and use_cuda:
        captured = out.get("capture_step") is not None and (
            not mode.optimizer_graph or out.get("optimizer_capture_step") is not None
        )
    return {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "trace_path"},
        "step_ms": out["step_ms"],
        "losses": out["losses"],
        "capture_step": out.get("capture_step"),
        "optimizer_capture_step": out.get("optimizer_capture_step"),
        "graphs_captured": captured,
        "graph_path": out.get("graph_path"),
        "optimizer_graph_path": out.get("optimizer_graph_path"),
        "graphs_freed": out.get("graphs_freed"),
        "profiled": bool(out.get("profiled")),
    }


def run_side(
    side: str, mode: gpu_modes.Mode, ps: PairSettings, trace: Path | None = None
) -> dict[str, Any]:
    """One run of ``side`` in this process; profiled into ``trace`` when given. Never
    raises: a failure is recorded (``ok`` false, ``error``, ``traceback``)."""
    import torch

    use_cuda = torch.cuda.is_available() and not ps.cpu
    env = gpu_modes.environment(use_cuda)
    record: dict[str, Any] = {
        "schema": RUN_SCHEMA,
        "side": side,
        "mode": mode.name,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "ok": False,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **{key: env[key] for key in ("device", "gpu", "versions", "host_cpu")},
        "steady_from": ps.steady_from,
    }
    reason = gpu_modes.mode_unavailable(
        mode, use_cuda, None if env["te_available"] else env["te_note"]
    )
    if reason is not None:
        record["skipped"] = reason
        return record
    collector_was_on = gc.isenabled()
    gc.collect()
    gc.disable()  # as Megatron-LM's --manual-gc: no collection inside a timed step, either side
    start = time.perf_counter()
    try:
        runner = _plugin_run if side == "plugin" else _handwritten_run
        record.update(runner(mode, ps, use_cuda, trace))
        steady = record["step_ms"][ps.steady_from :]
        if trace is not None:
            steady = record["step_ms"][ps.steady_from : ps.profile_first]
        record["steady_step_ms"] = steady
        record["median_step_ms"] = statistics.median(steady) if steady else None
        problems = []
        if not steady:
            problems.append(f"no step after step {ps.steady_from - 1} was timed")
        if use_cuda and mode.graphed and not record.get("graphs_captured"):
            problems.append("graphs were asked for but nothing was captured")
        if trace is not None:
            if not record.get("profiled"):
                problems.append("the profiled steps did not all run")
            else:
                record["profile"] = profile_counts(trace, ps.profile_steps, use_cuda)
        if problems:
            record["error"] = "; ".join(problems)
        record["ok"] = not problems
    except (Exception, SystemExit) as exc:  # argparse's parser.error() raises SystemExit
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc(limit=-8)
    finally:
        if collector_was_on:
            gc.enable()
    record["wall_s"] = time.perf_counter() - start
    if use_cuda:
        record["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return record


def child_main(args: argparse.Namespace) -> int:
    """``--one SIDE``: one run in this (fresh) process, its JSON written to ``--out``."""
    import logging
    import warnings

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("megatron", "cudagraph_plugin", "train_gpt", "handwritten"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", module="torch")

    ps = PairSettings(**json.loads((Path(args.dir) / "settings.json").read_text())["settings"])
    mode = gpu_modes.MODES[args.mode]
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        trace = None
        if args.pair == PROFILE:
            keep = Path(args.dir) / "traces"
            trace_dir = keep if args.keep_traces else Path(tmp)
            trace_dir.mkdir(parents=True, exist_ok=True)
            trace = trace_dir / f"{args.mode}-{args.one}.json"
        record = run_side(args.one, mode, ps, trace)
    record["pair"] = args.pair if args.pair == PROFILE else int(args.pair)
    gpu_modes.write_json(out, record)
    print(
        f"{args.one} {args.mode} pair {args.pair}: "
        + (
            f"skipped: {record['skipped']}"
            if record.get("skipped")
            else f"{record.get('median_step_ms')} ms/step"
            if record["ok"]
            else f"FAILED: {record.get('error')}"
        )
    )
    if record.get("traceback"):
        print(record["traceback"])
    return 0 if record["ok"] or record.get("skipped") else 1


# -------------------------------------------------------------------------------------------
# Fresh processes with a timeout.
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChildResult:
    pid: int
    rc: int | None
    timed_out: bool
    wall_s: float


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def run_child(
    cmd: Sequence[str], log_path: Path, timeout: float, env: dict[str, str] | None = None
) -> ChildResult:
    """Run ``cmd`` in its own session (its own process group), output to ``log_path``. Past
    ``timeout`` seconds the whole group gets SIGTERM, then SIGKILL 5 s later; after a normal
    end, whatever the child left in its group is killed too, and so is the whole group when
    this process is interrupted while waiting (SIGTERM: see :func:`main`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        finally:
            # Grandchildren of a child that ended; everything, if this process is ending.
            _kill_group(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                proc.wait()
    return ChildResult(proc.pid, rc, timed_out, time.perf_counter() - start)


def child_env() -> dict[str, str]:
    """This environment, with the project, ``examples/`` and ``benchmarks/`` on PYTHONPATH
    (after what is there: an installed copy with the plugin's entry point comes first)."""
    env = dict(os.environ)
    have = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    wanted = [str(ROOT), str(ROOT / "examples"), str(HERE)]
    env["PYTHONPATH"] = os.pathsep.join(have + [p for p in wanted if p not in have])
    return env


# -------------------------------------------------------------------------------------------
# The verdict.
# -------------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> float | None:
    """``max/min - 1``: 0.05 when the largest is 5% above the smallest."""
    values = [v for v in values if v]
    return max(values) / min(values) - 1.0 if values else None


def decide(
    ratios: Sequence[float],
    kernels: tuple[float | None, float | None],
    kernel_ms: tuple[float | None, float | None],
    pairs_wanted: int,
) -> dict[str, Any]:
    """The verdict of one mode from its per-pair ratios (plugin/hand-written step time), the
    kernels per step and the kernel time per step of (plugin, hand-written).

    Returns ``verdict`` (PASS, FAIL or INCOMPLETE), ``decided_by`` ("kernel counts", "step
    time" or "kernel time"), ``reason`` (one sentence with the numbers) and, when
    INCOMPLETE for want of pairs, ``so_far`` (what the pairs so far say).
    """
    if not ratios:
        return {"verdict": INCOMPLETE, "decided_by": None, "reason": "no complete pair"}
    median = statistics.median(ratios)
    pair_spread = spread(ratios) or 0.0
    counts_known = kernels[0] is not None and kernels[1] is not None
    result: dict[str, Any]
    if counts_known and kernels[0] != kernels[1]:
        result = {
            "verdict": FAIL,
            "decided_by": "kernel counts",
            "reason": f"kernel counts per step differ: plugin {kernels[0]:g}, hand-written "
            f"{kernels[1]:g}",
        }
    elif pair_spread <= SPREAD_LIMIT:
        within = median <= RATIO_LIMIT
        text = (
            f"median ratio {median:.3f} {'<=' if within else '>'} {RATIO_LIMIT}, "
            f"pair spread {pair_spread:.1%}"
        )
        if not within:
            result = {"verdict": FAIL, "decided_by": "step time", "reason": text}
        elif not counts_known:
            result = {
                "verdict": INCOMPLETE,
                "decided_by": None,
                "reason": text + "; the kernel counts were not profiled",
            }
        else:
            result = {
                "verdict": PASS,
                "decided_by": "step time",
                "reason": text + f", identical kernel counts ({kernels[0]:g} per step)",
            }
    else:
        head = (
            f"spread above 3%: kernel-time equality decides (pair spread {pair_spread:.1%}, "
            f"median ratio {median:.3f})"
        )
        if not counts_known or kernel_ms[0] is None or not kernel_ms[1]:
            result = {
                "verdict": INCOMPLETE,
                "decided_by": None,
                "reason": head + "; no kernel profile of both sides",
            }
        else:
            kernel_ratio = kernel_ms[0] / kernel_ms[1]
            ok = kernel_ratio <= RATIO_LIMIT
            result = {
                "verdict": PASS if ok else FAIL,
                "decided_by": "kernel time",
                "reason": head + f"; identical kernel counts ({kernels[0]:g} per step), kernel "
                f"time ratio {kernel_ratio:.3f} {'<=' if ok else '>'} {RATIO_LIMIT}",
            }
    if len(ratios) < pairs_wanted and result["verdict"] != INCOMPLETE:
        result = {
            "verdict": INCOMPLETE,
            "decided_by": None,
            "reason": f"{len(ratios)} of {pairs_wanted} pairs",
            "so_far": result,
        }
    return result


# -------------------------------------------------------------------------------------------
# The summary.
# -------------------------------------------------------------------------------------------


def run_name(pair: int | str, mode: str, side: str) -> str:
    label = PROFILE if pair == PROFILE else f"pair{int(pair) + 1:02d}"
    return f"{label}-{mode}-{side}"


def load_runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted((out / "runs").glob("*.json"))]


def _losses(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    diffs, equal, steps = [], 0, 0
    for plugin, hand in pairs:
        a, b = plugin.get("losses") or [], hand.get("losses") or []
        n = min(len(a), len(b))
        if not n:
            continue
        diff = max(abs(x - y) for x, y in zip(a[:n], b[:n], strict=True))
        diffs.append(diff)
        equal += diff == 0.0 and len(a) == len(b)
        steps = max(steps, n)
    return {
        "pairs_compared": len(diffs),
        "steps_compared": steps,
        "pairs_identical": equal,
        "max_abs_diff": max(diffs) if diffs else None,
        "identical": bool(diffs) and equal == len(diffs),
    }


def _get(profile: dict[str, Any] | None, key: str) -> Any:
    return None if profile is None else profile.get(key)


def _kernel_diff(plugin: dict[str, Any], hand: dict[str, Any], limit: int = 20) -> dict[str, Any]:
    a, b = plugin.get("names") or {}, hand.get("names") or {}
    diff = {n: [a.get(n, 0), b.get(n, 0)] for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)}
    biggest = sorted(diff, key=lambda n: -abs(diff[n][0] - diff[n][1]))[:limit]
    return {n: diff[n] for n in biggest}


def summarise(
    runs: list[dict[str, Any]], modes: list[str], skipped: dict[str, str], pairs_wanted: int
) -> dict[str, Any]:
    """Per mode: medians, ratios, spreads, kernels, losses and the verdict; the done-when."""
    rows = []
    on_gpu = any(r.get("device") == "cuda" for r in runs)
    for name in modes:
        mode = gpu_modes.MODES[name]
        row: dict[str, Any] = {
            "mode": name,
            "label": mode.label,
            "criterion": name in CRITERION_MODES,
        }
        mine = [r for r in runs if r["mode"] == name]
        reason = skipped.get(name) or next((r["skipped"] for r in mine if r.get("skipped")), None)
        if reason is not None:
            row["skipped"] = reason
            rows.append(row)
            continue
        timed = {(r["pair"], r["side"]): r for r in mine if r["pair"] != PROFILE and r.get("ok")}
        indices = sorted({p for p, _ in timed})
        complete = [p for p in indices if (p, "plugin") in timed and (p, "handwritten") in timed]
        row["errors"] = [
            f"{run_name(r['pair'], name, r['side'])}: {r.get('error')}"
            for r in mine
            if not r.get("ok")
        ]
        for side in SIDES:
            medians = [timed[(p, side)]["median_step_ms"] for p in indices if (p, side) in timed]
            row[f"{side}_ms_per_run"] = medians
            row[f"{side}_ms"] = statistics.median(medians) if medians else None
            row[f"{side}_spread"] = spread(medians)
        ratios = [
            timed[(p, "plugin")]["median_step_ms"] / timed[(p, "handwritten")]["median_step_ms"]
            for p in complete
        ]
        row["pairs_complete"] = len(complete)
        row["ratios"] = ratios
        row["median_ratio"] = statistics.median(ratios) if ratios else None
        row["spread"] = spread(ratios)
        row["losses"] = _losses(
            [(timed[(p, "plugin")], timed[(p, "handwritten")]) for p in complete]
        )

        profiles = {r["side"]: r for r in mine if r["pair"] == PROFILE and r.get("ok")}
        prof = {side: (profiles.get(side) or {}).get("profile") for side in SIDES}
        row["profile"] = {
            side: None
            if p is None
            else {k: v for k, v in p.items() if k != "names"}
            | {"step_ms": profiles[side]["median_step_ms"]}
            for side, p in prof.items()
        }
        p_prof, h_prof = prof["plugin"], prof["handwritten"]
        kernels = (_get(p_prof, "count_per_step"), _get(h_prof, "count_per_step"))
        kernel_ms = (_get(p_prof, "time_ms_per_step"), _get(h_prof, "time_ms_per_step"))
        row["kernel_unit"] = _get(p_prof, "unit") or _get(h_prof, "unit")
        row["kernel_counts_equal"] = None
        if p_prof and h_prof:
            row["kernel_counts_equal"] = kernels[0] == kernels[1]
            row["kernel_time_ratio"] = kernel_ms[0] / kernel_ms[1] if kernel_ms[1] else None
            row["kernel_count_diff"] = _kernel_diff(p_prof, h_prof)
        decision = decide(ratios, kernels, kernel_ms, pairs_wanted)
        row["rule"] = decision
        row["verdict"] = decision["verdict"] if on_gpu else NOT_APPLICABLE
        rows.append(row)

    judged = [r for r in rows if r["criterion"]]
    verdicts = [r.get("verdict") for r in judged if not r.get("skipped")]
    if not on_gpu:
        done = NOT_APPLICABLE
    elif any(r.get("skipped") for r in judged) or not verdicts or INCOMPLETE in verdicts:
        done = FAIL if FAIL in verdicts else INCOMPLETE
    else:
        done = FAIL if FAIL in verdicts else PASS
    return {
        "results": rows,
        "done_when": {
            "criterion": f"plugin/hand-written median step-time ratio <= {RATIO_LIMIT} for "
            f"{' and '.join(CRITERION_MODES)} with identical kernel counts; where the pairs' "
            f"spread exceeds {SPREAD_LIMIT:.0%}, kernel-time equality decides",
            "verdict": done,
            "modes": {r["mode"]: r.get("verdict", r.get("skipped")) for r in judged},
        },
    }


def _environment(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seen = [r for r in runs if r.get("versions")]
    if not seen:
        return {}
    first = seen[0]
    mixed = sorted(
        {
            run_name(r["pair"], r["mode"], r["side"])
            for r in seen
            if (r.get("versions"), r.get("gpu")) != (first.get("versions"), first.get("gpu"))
        }
    )
    env = {key: first.get(key) for key in ("device", "gpu", "versions", "host_cpu")}
    if mixed:
        env["mixed_environment_runs"] = mixed
    return env


def write_summary(out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    runs = load_runs(out)
    ps = meta["settings"]
    data = {
        "schema": SCHEMA,
        **_environment(runs),
        "command": meta["commands"][-1] if meta["commands"] else None,
        "commands": meta["commands"],
        "date": meta["created"],
        "settings": ps,
        "pairs_wanted": meta["pairs"],
        "processes": sorted({r["pid"] for r in runs if "pid" in r}),
        **summarise(runs, meta["modes"], meta["skipped"], meta["pairs"]),
        "notes": meta["notes"],
    }
    gpu_modes.write_json(out / "summary.json", data)
    (out / "summary.md").write_text(summary_markdown(data) + "\n")
    return data


def summary_markdown(data: dict[str, Any]) -> str:
    lines = ["# Plugin vs hand-written loop: fresh-process pairs", ""]
    lines += tables.environment_lines(data)
    lines += ["", tables.pairs_table(data), ""]
    lines += tables.pairs_verdict_lines(data)
    lines += [f"- note: {note}" for note in data.get("notes", [])]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------
# The parent: plan, runs, summary.
# -------------------------------------------------------------------------------------------


def plan(modes: list[str], pairs: int, profile: bool) -> list[tuple[int | str, str, str]]:
    """``(pair, mode, side)`` in the order they run: pair-major over the modes (every mode
    gets pair 1 before any gets pair 2), the side that goes first alternating from pair to
    pair (and from mode to mode); then the profiled runs, one per side and mode."""
    order: list[tuple[int | str, str, str]] = []
    for pair in range(pairs):
        for index, mode in enumerate(modes):
            sides = SIDES if (pair + index) % 2 == 0 else SIDES[::-1]
            order += [(pair, mode, side) for side in sides]
    if profile:
        for index, mode in enumerate(modes):
            sides = SIDES if index % 2 == 0 else SIDES[::-1]
            order += [(PROFILE, mode, side) for side in sides]
    return order


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Plugin vs hand-written loop: alternating pairs of fresh processes, "
        "kernel counts, a verdict.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="the DIR of the runs and the summary")
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help=f"from {', '.join(gpu_modes.MODES)}"
    )
    parser.add_argument("--pairs", type=int, default=5, help="plugin/hand-written pairs per mode")
    parser.add_argument("--size", default="4L-512H", help=f"from {', '.join(gpu_modes.SIZES)}")
    parser.add_argument("--steps", type=int, default=60, help="training steps per timed run")
    gpu_modes.add_shape_arguments(parser)
    parser.add_argument(
        "--profile-steps", type=int, default=10, help="profiled steps per profiled run (0: none)"
    )
    parser.add_argument(
        "--profile-skip", type=int, default=5, help="steady steps before the profiled ones"
    )
    parser.add_argument("--keep-traces", action="store_true", help="keep the traces in DIR/traces")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds: start no run that would end after this, by the longest run so far (0: "
        "no limit); --resume continues",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue DIR (same settings): only missing runs"
    )
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="with --resume: make the failed runs again (their records move to DIR/failed)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (no graphs)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model, 8 steps, 1 pair, 2 profiled steps"
    )
    child = parser.add_argument_group("one run (what the parent starts)")
    child.add_argument("--one", choices=SIDES, help="make one run of this side and exit")
    child.add_argument("--mode", help="its mode")
    child.add_argument("--pair", help=f"its pair index, or {PROFILE}")
    child.add_argument("--dir", help="the DIR whose settings.json it uses")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.seq_length = min(args.steps, 8), 32
        args.profile_steps, args.profile_skip = (
            min(args.profile_steps, 2),
            min(args.profile_skip, 1),
        )
        if args.pairs == parser.get_default("pairs"):
            args.pairs = 1
        if args.size == parser.get_default("size"):
            args.size = next(iter(gpu_modes.SMOKE_SIZES))
    return args


def _settings(args: argparse.Namespace) -> PairSettings:
    return PairSettings(
        size=args.size,
        steps=args.steps,
        warmup=args.warmup,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        vocab_size=args.vocab_size,
        bf16=args.bf16,
        cpu=args.cpu,
        smoke=args.smoke,
        profile_skip=args.profile_skip,
        profile_steps=args.profile_steps,
    )


def _load_or_start(out: Path, args: argparse.Namespace, command: str) -> dict[str, Any]:
    ps = _settings(args)
    meta_path = out / "settings.json"
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if meta_path.exists():
        if not args.resume:
            raise SystemExit(
                f"{out} holds runs already: --resume continues them, or use another --out"
            )
        meta = json.loads(meta_path.read_text())
        if meta["settings"] != dataclasses.asdict(ps):
            raise SystemExit(
                f"--resume {out}: its settings ({meta['settings']}) differ from this run's "
                f"({dataclasses.asdict(ps)}); resume only with the same settings"
            )
        meta["commands"].append(command)
        meta["pairs"] = max(meta["pairs"], args.pairs)
        meta["modes"] += [m for m in args.modes.split(",") if m not in meta["modes"]]
        meta["notes"].append(f"resumed at {now} by `{command}`")
    else:
        meta = {
            "schema": SCHEMA,
            "created": now,
            "settings": dataclasses.asdict(ps),
            "commands": [command],
            "pairs": args.pairs,
            "modes": args.modes.split(","),
            "skipped": {},
            "notes": [],
        }
        if args.cpu:
            meta["notes"].append(
                "CPU run: nothing is captured (graph modes run eagerly after the plugin "
                "validated them; the hand-written loop runs FullCudaGraphWrapper's eager "
                "warm-up path); the counts are CPU operators, not kernels; no verdict"
            )
    version = _mcore_version()
    for name in meta["modes"]:
        reason = known_skip(gpu_modes.MODES[name], ps.cpu, version)
        if reason is not None:
            meta["skipped"][name] = reason
    out.mkdir(parents=True, exist_ok=True)
    gpu_modes.write_json(meta_path, meta)
    return meta


def _set_failed_aside(out: Path) -> None:
    """Move the records of failed runs to DIR/failed, so that they are made again."""
    for path in sorted((out / "runs").glob("*.json")):
        record = json.loads(path.read_text())
        if not record.get("ok") and not record.get("skipped"):
            aside = out / "failed" / f"{path.stem}.{int(time.time())}.json"
            aside.parent.mkdir(parents=True, exist_ok=True)
            path.replace(aside)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        return child_main(args)
    for name in args.modes.split(","):
        if name not in gpu_modes.MODES:
            raise SystemExit(f"unknown mode {name!r}: from {', '.join(gpu_modes.MODES)}")
    # A SIGTERM (timeout(1) around this script) unwinds through run_child, which then ends the
    # running child's process group: children live in their own sessions, out of its reach.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _parent(args, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _parent(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """The runs still missing in ``--out``, each in a fresh process, then the summary."""
    out = Path(args.out)
    command = gpu_modes.command_line("benchmarks/pairs.py", None if argv is None else list(argv))
    meta = _load_or_start(out, args, command)
    if args.retry_failed:
        _set_failed_aside(out)
    env = child_env()
    started = time.perf_counter()
    # What the next run may take: the longest so far (a run that timed out predicts nothing).
    longest = max(
        (
            r.get("process_wall_s") or 0.0
            for r in load_runs(out)
            if not r.get("skipped") and not r.get("timed_out")
        ),
        default=0.0,
    )
    todo = plan(meta["modes"], meta["pairs"], meta["settings"]["profile_steps"] > 0)
    left = []
    for pair, mode, side in todo:
        if (
            mode in meta["skipped"]
            or (out / "runs" / f"{run_name(pair, mode, side)}.json").exists()
        ):
            continue
        left.append((pair, mode, side))
    for number, (pair, mode, side) in enumerate(left, 1):
        if mode in meta["skipped"]:  # found by a run of this call
            continue
        elapsed = time.perf_counter() - started
        if args.time_budget and elapsed + longest > args.time_budget:
            note = (
                f"time budget of {args.time_budget:.0f} s: stopped after {elapsed:.0f} s with "
                f"{len(left) - number + 1} run(s) left (the longest took {longest:.0f} s); "
                "--resume continues"
            )
            meta["notes"].append(note)
            print(note, flush=True)
            break
        name = run_name(pair, mode, side)
        path = out / "runs" / f"{name}.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--out", str(path),
            "--one", side,
            "--mode", mode,
            "--pair", str(pair),
            "--dir", str(out),
        ] + (["--keep-traces"] if args.keep_traces else [])  # fmt: skip
        result = run_child(cmd, out / "logs" / f"{name}.log", args.timeout, env)
        record = json.loads(path.read_text()) if path.exists() else None
        if record is None:  # ended before writing its record: killed, or crashed
            record = {
                "schema": RUN_SCHEMA,
                "side": side,
                "mode": mode,
                "pair": pair,
                "pid": result.pid,
                "ok": False,
                "error": f"timed out after {args.timeout:.0f} s (process group killed)"
                if result.timed_out
                else f"the process ended with rc {result.rc} before writing its record",
                "log_tail": (out / "logs" / f"{name}.log").read_text(errors="replace")[-2000:],
            }
        record.update(rc=result.rc, timed_out=result.timed_out, process_wall_s=result.wall_s)
        gpu_modes.write_json(path, record)
        if record.get("skipped"):
            meta["skipped"][mode] = record["skipped"]
        elif not result.timed_out:
            longest = max(longest, result.wall_s)
        status = (
            f"skipped: {record['skipped']}"
            if record.get("skipped")
            else f"{record['median_step_ms']:.3f} ms/step"
            if record.get("ok")
            else f"FAILED: {record.get('error')}"
        )
        print(
            f"[{number}/{len(left)} {time.perf_counter() - started:4.0f} s] {name} "
            f"(pid {result.pid}, {result.wall_s:.1f} s): {status}",
            flush=True,
        )
        gpu_modes.write_json(out / "settings.json", meta)
        write_summary(out, meta)

    gpu_modes.write_json(out / "settings.json", meta)
    data = write_summary(out, meta)
    print()
    print(summary_markdown(data))
    missing = [
        item
        for item in plan(meta["modes"], meta["pairs"], meta["settings"]["profile_steps"] > 0)
        if item[1] not in meta["skipped"]
        and not (out / "runs" / f"{run_name(*item)}.json").exists()
    ]
    print(
        f"{len(missing)} run(s) still missing: run the same command with --resume"
        if missing
        else "all runs made",
        f"({time.perf_counter() - started:.0f} s; {out})",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
