"""What CUDA graphs bought this run: the eager-vs-replay verdict and the run report.

Owns the verdict (a speed-up counts only beyond the noise) and the :class:`RunReport` that is
printed as a table at shutdown, written as JSON on request and passed to the
``mcgraph_report`` hook: its fields, its public dictionary and its table.
:class:`~cudagraph_plugin.runtime.reporter.Reporter` builds it from the run's measurement and
captures and sends it out.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from cudagraph_plugin.runtime.timing import MemorySnapshot
from hookspecs.report_schema import REPORT_SCHEMA_VERSION

NOISE_FLOOR = 0.02  # below a 2% difference nobody should call a winner


def _median_and_spread(samples: list[float]) -> tuple[float | None, float]:
    """Median and relative median absolute deviation (0 for fewer than 2 samples)."""
    if not samples:
        return None, 0.0
    median = statistics.median(samples)
    if len(samples) < 2 or median <= 0:
        return median, 0.0
    mad = statistics.median(abs(x - median) for x in samples)
    return median, mad / median


def verdict(
    eager: list[float], replay: list[float], *, relative: bool = False
) -> tuple[str, float | None, float, str]:
    """(verdict, speed-up, noise, one-line explanation) for eager vs replay step times.

    The verdict is ``faster`` only when the speed-up exceeds the noise (the larger of 2% and
    the two samples' relative spreads added), ``slower`` when replay loses by more than the
    noise, else ``no_gain``; ``unknown`` without samples on both sides. ``relative``: the
    samples are fractions of an eager median (bucketed graphs), not milliseconds.
    """
    eager_ms, eager_spread = _median_and_spread(eager)
    replay_ms, replay_spread = _median_and_spread(replay)
    if eager_ms is None or replay_ms is None or replay_ms <= 0:
        missing = "eager" if eager_ms is None else "replay"
        hint = (
            " (needs cuda_graph_warmup_steps >= 2: the first step is excluded)"
            if missing == "eager"
            else " (no step ran after the capture step)"
        )
        return "unknown", None, 0.0, f"no {missing} step time measured{hint}"
    speedup = eager_ms / replay_ms
    noise = max(NOISE_FLOOR, eager_spread + replay_spread)
    if speedup > 1.0 + noise:
        return "faster", speedup, noise, f"replay is {speedup:.2f}x faster than eager"
    times = (
        f"{replay_ms / eager_ms:.0%} of the eager step time"
        if relative
        else f"{replay_ms:.2f} ms vs {eager_ms:.2f} ms per step"
    )
    if speedup < 1.0 - noise:
        return (
            "slower",
            speedup,
            noise,
            (
                f"replay is SLOWER than eager: {times} (speed-up {speedup:.2f}x, "
                f"noise ±{noise:.0%}); CUDA graphs cost you time here"
            ),
        )
    return (
        "no_gain",
        speedup,
        noise,
        (
            f"replay is NOT faster than eager beyond noise: {times} (speed-up "
            f"{speedup:.2f}x, noise ±{noise:.0%})"
        ),
    )


@dataclasses.dataclass
class RunReport:
    """The run report; ``to_dict()`` is JSON-ready, ``format_table()`` is for humans.

    Plugins see it through the ``mcgraph_report`` hook and may rely only on ``to_dict()``
    (the public schema of :mod:`hookspecs.report_schema`, documented in docs/hooks.md) and
    ``format_table()``; the attributes here are internals.
    """

    impl: str
    scope: list[str]
    graphs_captured: bool
    no_graph_reason: str | None
    warmup_steps: int
    start_step: int | None
    capture_step: int | None
    capture_seconds: float | None
    capture_cost_seconds: float | None
    graph_count: int
    steps_timed: int
    eager_steps: list[int]
    eager_step_ms: float | None
    replay_steps: list[int]
    replay_step_ms: float | None
    speedup: float | None
    verdict: str
    verdict_text: str
    noise: float
    memory_before_capture: MemorySnapshot | None
    memory_after_capture: MemorySnapshot | None
    peak_allocated_at_end_mib: float | None
    fallback_step: int | None
    graphs_held: int
    replays: dict[str, int]
    notes: list[str]
    thin_sample: bool
    break_even_steps: int | None
    pays_off: bool | None
    buckets: list[dict[str, Any]]
    invalidations: list[dict[str, Any]]
    captures: list[dict[str, Any]]
    shutdown_reason: str
    device: str
    versions: dict[str, str | None]
    rank: int = 0
    world_size: int = 1

    @property
    def memory_overhead_mib(self) -> float | None:
        before, after = self.memory_before_capture, self.memory_after_capture
        if before is None or after is None:
            return None
        return after.allocated_mib - before.allocated_mib

    @property
    def peak_overhead_mib(self) -> float | None:
        before = self.memory_before_capture
        if before is None or self.peak_allocated_at_end_mib is None:
            return None
        return self.peak_allocated_at_end_mib - before.peak_allocated_mib

    def to_dict(self) -> dict[str, Any]:
        """The public form: the keys of :data:`hookspecs.report_schema.REPORT_FIELDS`."""
        data = {"schema_version": REPORT_SCHEMA_VERSION, **dataclasses.asdict(self)}
        data["memory_overhead_mib"] = self.memory_overhead_mib
        data["peak_overhead_mib"] = self.peak_overhead_mib
        data["memory_overhead_pct"] = _pct(
            self.memory_overhead_mib, self.memory_before_capture, "allocated_mib"
        )
        data["peak_overhead_pct"] = _pct(
            self.peak_overhead_mib, self.memory_before_capture, "peak_allocated_mib"
        )
        return data

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def _captured_row(self, at: str) -> str:
        """``N graph(s) at step S in T s`` where every capture ran in the capture step; else
        the steps of each stage's captures (a validation graph, buckets, recaptures), which
        the total time covers."""
        total = f"in {self.capture_seconds:.3f} s"
        steps: dict[str, list[Any]] = {}
        for capture in self.captures:
            steps.setdefault(capture["stage"], []).append(capture["step"])
        if self.capture_step is not None and all(
            capture["step"] == self.capture_step for capture in self.captures
        ):
            return f"{self.graph_count} graph(s) {at} {total}"
        stages = "; ".join(
            f"{stage} " + ("before the first step" if at_steps == [None] else
            f"at step{'s' if len(at_steps) > 1 else ''} "
            + ", ".join("-" if n is None else str(n) for n in at_steps))
            for stage, at_steps in steps.items()
        )  # fmt: skip
        if self.capture_step is None:
            return f"{self.graph_count} graph(s) {at} {total}: {stages}"
        return (
            f"{self.graph_count} graph(s) at most at once; {len(self.captures)} capture(s) "
            f"{total}: {stages}"
        )

    def format_table(self) -> str:
        d = self.to_dict()
        scope = ",".join(self.scope) or "-"
        where = self.device if self.world_size == 1 else f"{self.device}, rank {self.rank}"
        rows = [("CUDA graphs", f"impl={self.impl} scope={scope} on {where}")]
        if not self.graphs_captured:
            rows.append(("captured", f"NO GRAPH CAPTURED: {self.no_graph_reason}"))
        else:
            ended = (
                "invalidated before the training capture: eager since"
                if self.invalidations
                else "the run ended before the training capture"
            )
            at = (
                f"at step {self.capture_step}"
                if self.capture_step is not None
                else f"for evaluation only ({ended})"
            )
            rows.append(("captured", self._captured_row(at)))
        rows.append(("eager step", _ms(self.eager_step_ms, self.eager_steps)))
        if self.graphs_captured:
            rows.append(("replay step", _ms(self.replay_step_ms, self.replay_steps)))
            rows.append(("verdict", self.verdict_text))
            if self.break_even_steps is not None:
                paid = {True: "paid off", False: "NOT paid off in this run", None: ""}
                rows.append(
                    (
                        "break-even",
                        f"after {self.break_even_steps} replayed step(s) "
                        f"{paid[self.pays_off]}".rstrip()
                        + f" (the capture cost {capture_cost_words(self)})",
                    )
                )
        if self.fallback_step is not None:
            rows.append(("fallback", f"graph freed at step {self.fallback_step}; eager since"))
        if self.memory_before_capture is not None:
            rows.append(
                (
                    "memory",
                    (
                        f"allocated {self.memory_before_capture.allocated_mib:.0f} -> "
                        f"{self.memory_after_capture.allocated_mib:.0f} MiB "
                        f"({d['memory_overhead_mib']:+.0f} MiB, "
                        f"{_fmt_pct(d['memory_overhead_pct'])}); "
                        f"peak {self.memory_before_capture.peak_allocated_mib:.0f} -> "
                        f"{self.peak_allocated_at_end_mib:.0f} MiB "
                        f"({d['peak_overhead_mib']:+.0f} MiB, "
                        f"{_fmt_pct(d['peak_overhead_pct'])})"
                    ),
                )
            )
        if self.graphs_captured:
            rows.append(("replays", ", ".join(f"{k} {v}" for k, v in sorted(self.replays.items()))))
            rows.append(("held now", f"{self.graphs_held} graph(s), freed right after this"))
        rows += [("bucket", _bucket_line(row)) for row in self.buckets]
        rows += [
            (
                "invalidated",
                f"{'before the first step' if e['step'] is None else 'step ' + str(e['step'])}"
                f": {e['reason']} ({e['graphs_freed']} freed; {e['then']})",
            )
            for e in self.invalidations
        ]
        rows += [("note", note) for note in self.notes]
        rows.append(("run", f"{self.steps_timed} step(s) timed, ended: {self.shutdown_reason}"))
        rows.append(("versions", ", ".join(f"{k} {v or '-'}" for k, v in self.versions.items())))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def capture_cost_words(report: RunReport) -> str:
    """What the captures cost the run, and their wall-clock time where that differs."""
    cost, wall = report.capture_cost_seconds, report.capture_seconds
    if cost is None:
        return "an unknown time" if wall is None else f"{wall:.3f} s"
    if wall is None or round(wall, 3) == round(cost, 3):
        return f"{cost:.3f} s"
    return f"{cost:.3f} s beyond a replayed step ({wall:.3f} s wall)"


def bucket_key(row: dict[str, Any]) -> str:
    return f"seq {row['seq_length']} x mbs {row['micro_batch_size']} x {row['num_microbatches']}"


def _bucket_line(row: dict[str, Any]) -> str:
    """One bucket key of the bucketed graphs, for the table."""
    key = bucket_key(row)
    if not row["in_bucket"]:
        return f"{key}: outside every bucket, {len(row['eager_steps'])} eager step(s)"
    parts = [f"{row['replays']} replays"]
    if row.get("speedup"):
        parts.append(f"{row['speedup']:.2f}x")
    if row.get("capture_seconds"):
        parts.append(f"capture {row['capture_seconds']:.3f} s")
    if row.get("pool_mib") is not None:
        parts.append(f"+{row['pool_mib']:.0f} MiB")
    if row.get("padding_waste_percent") is not None:
        parts.append(f"padding {row['padding_waste_percent']:.1f}%")
    if row.get("break_even_steps") is not None:
        parts.append(f"break-even {row['break_even_steps']} step(s)")
    if row.get("paid_off") is not None:
        parts.append(
            "paid off"
            if row["paid_off"]
            else "NOT paid off in this run"
            + (
                " (never replayed)"
                if not row.get("replay_steps")
                else " (no saving beyond noise)"
                if row.get("break_even_steps") is None
                else ""
            )
        )
    return f"{key}: " + ", ".join(parts)


def _ms(value: float | None, steps: list[int]) -> str:
    if value is None:
        return "n/a"
    if len(steps) == 1:
        span = f"step {steps[0]}"
    elif steps[-1] - steps[0] + 1 == len(steps):
        span = f"steps {steps[0]}-{steps[-1]}"
    else:  # some steps between the first and last were not timed
        span = f"sampled from steps {steps[0]}-{steps[-1]}"
    return f"{value:.3f} ms (median of {len(steps)}, {span})"


def _pct(delta: float | None, base: MemorySnapshot | None, field: str) -> float | None:
    if delta is None or base is None or getattr(base, field) <= 0:
        return None
    return 100.0 * delta / getattr(base, field)


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"
