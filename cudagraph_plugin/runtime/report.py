"""What CUDA graphs bought this run: the eager-vs-replay verdict and the run report.

Owns the verdict (a speed-up counts only beyond the noise), the :class:`RunReport` that is
printed as a table at shutdown, written as JSON on request and passed to the
``mcgraph_report`` hook, and :class:`Reporter`, which builds it from the run's measurement
and captures and sends it out. Step times come from :mod:`~cudagraph_plugin.runtime.measurement`
(eager: warm-up steps without the first; replay: steps after the capture step); both are
medians.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.runtime.bucket_keys import no_capture_reason
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.measurement import Measurement
from cudagraph_plugin.runtime.payoff import (
    break_even_steps,
    bucket_rows,
    bucket_samples,
    capture_cost_seconds,
    fewest_eager_samples,
    key_samples,
    pays_off,
    thin_sample_note,
)
from cudagraph_plugin.runtime.state import RunState
from cudagraph_plugin.runtime.timing import MemorySnapshot, median_or_none
from hookspecs import call_hook
from hookspecs.report_schema import REPORT_SCHEMA_VERSION

logger = logging.getLogger("cudagraph_plugin")
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
                        + f" (the capture cost {_cost(self)})",
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


def _cost(report: RunReport) -> str:
    """What the captures cost the run, and their wall-clock time where that differs."""
    cost, wall = report.capture_cost_seconds, report.capture_seconds
    if cost is None:
        return "an unknown time" if wall is None else f"{wall:.3f} s"
    if wall is None or round(wall, 3) == round(cost, 3):
        return f"{cost:.3f} s"
    return f"{cost:.3f} s beyond a replayed step ({wall:.3f} s wall)"


def _bucket_key(row: dict[str, Any]) -> str:
    return f"seq {row['seq_length']} x mbs {row['micro_batch_size']} x {row['num_microbatches']}"


def _bucket_line(row: dict[str, Any]) -> str:
    """One bucket key of the bucketed graphs, for the table."""
    key = _bucket_key(row)
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


@dataclasses.dataclass
class Reporter:
    """Builds the run's report at shutdown and sends it out: one table per job (rank 0), a
    JSON file per rank on request, and the ``mcgraph_report`` hook on every rank."""

    state: RunState
    measurement: Measurement
    captures: Captures
    invalidations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    report: RunReport | None = None
    # training steps that ran on the graphs (Measurement.steps_replayed), for the warning
    replayed: int | None = None

    def emit(self, reason: str, *, sync: bool) -> None:
        peak_at_end = MemorySnapshot.take().peak_allocated_mib if self.captures.records else None
        self.report = self.build(reason, peak_at_end, sync=sync)
        rank, world_size = self.report.rank, self.report.world_size
        # One table per job, not one per rank; every rank still gets the hook and its JSON.
        logger.log(
            logging.INFO if rank == 0 else logging.DEBUG,
            "CUDA graph report%s:\n%s",
            f" (rank {rank} of {world_size})" if world_size > 1 else "",
            self.report.format_table(),
            extra=JOB_WIDE,
        )
        # Each rank's own measurement (pipeline stages differ): said by each rank that
        # measured no gain, its rank named in a multi-rank job (ranklog), not as rank 0's
        # figures standing for the job.
        if self.report.verdict in ("slower", "no_gain"):
            logger.warning("CUDA graphs did not pay off: %s", self.report.verdict_text)
        elif self.report.pays_off is False:
            even = self.report.break_even_steps
            logger.warning(
                "CUDA graphs did not pay off within this run: the capture cost %s and %s; "
                "this run replayed %s step(s)",
                _cost(self.report),
                "replay saves no time per step"
                if even is None
                else f"is earned back after {even} replayed step(s)",
                self.replayed,
            )
        unpaid = [row for row in self.report.buckets if row["paid_off"] is False]
        if unpaid:
            logger.warning(
                "CUDA graphs did not pay off within this run for %d of %d captured "
                "bucket(s): %s (each row of the report's buckets says why)",
                len(unpaid),
                sum(1 for row in self.report.buckets if row["capture_steps"]),
                "; ".join(_bucket_key(row) for row in unpaid),
            )
        settings = self.state.settings
        if settings.report_json:
            path = self.report.write_json(rank_path(settings.report_json, rank))
            logger.info("CUDA graph report written to %s", path)
        try:
            call_hook(self.state.pm, "mcgraph_report", report=self.report)
        except BaseException as exc:
            exc.add_note(
                "(in a mcgraph_report implementation: the report was built, logged and "
                "written; the implementations after this one did not receive it)"
            )
            raise

    def build(self, reason: str, peak_at_end: float | None, *, sync: bool) -> RunReport:
        state, captures = self.state, self.captures
        rank, world_size = state.rank_and_world()
        # A capture that produced no graph (a scope matching no layer) buys nothing: the
        # report reads as if nothing was captured (no capture step, replays or memory; the
        # steps after it ran eagerly), and no speed-up is claimed for it.
        captured = captures.produced_graphs
        # a step whose time includes a capture is no sample on either side
        holding = captures.steps_holding_a_capture()
        eager, replay, durations = self.measurement.samples(sync=sync)
        eager_samples = [durations[s] for s in eager]
        replay_samples = [durations[s] for s in replay]
        bucket_summary = [] if state.buckets is None else state.buckets.summary(durations, holding)
        bucketed = captured and state.buckets is not None
        # Every step after the first capture is not a replay with buckets (other buckets
        # warm up and capture later, lengths outside every bucket run eagerly, an
        # invalidation starts over): each bucket's replays against its own eager steps, as
        # fractions of that bucket's eager median; where no bucket replayed, each shape's
        # steps whose optimizer graph replayed against its steps whose optimizer ran eagerly.
        samples = bucket_samples(bucket_summary, durations, holding) if bucketed else None
        per_bucket = samples is not None and bool(samples[1])
        optimizer_only = bucketed and not per_bucket and captures.made_graphs("optimizer")
        fewest_eager = None  # (with buckets: the fewest eager samples of a bucket that replayed)
        if per_bucket:
            eager, replay, eager_samples, replay_samples = samples
            fewest_eager = fewest_eager_samples(bucket_summary, durations, holding)
        elif optimizer_only:
            eager, replay, eager_samples, replay_samples = key_samples(
                bucket_summary, durations, holding, captures.optimizer_replay_steps
            )
        elif bucketed:
            eager, replay, eager_samples, replay_samples = [], [], [], []  # (nothing replayed)
        thin = None
        if captured:
            result, speedup, noise, text = verdict(eager_samples, replay_samples, relative=bucketed)
            if per_bucket and result != "unknown":
                text += " (each bucket's replayed steps against its own eager steps)"
            elif bucketed and not per_bucket and result == "unknown":
                text = (
                    (
                        "no bucket graph replayed (a bucket replays on its steps after the "
                        "one that captured it)"
                        if any(r["capture_steps"] for r in bucket_summary)
                        else "no bucket was captured"
                    )
                    + (
                        ", and no shape ran both with the optimizer graph replayed and without it"
                        if optimizer_only
                        else ""
                    )
                    + ": nothing to compare like for like"
                )
            elif result == "unknown" and captures.training_capture_step() is None:
                # (the hints of verdict() are about the training capture step)
                text = "no training step ran on a graph (only evaluations did): nothing to compare"
            elif optimizer_only:
                text += (
                    " (no bucket graph replayed: each shape's steps whose optimizer graph "
                    "replayed against its own steps whose optimizer step ran eagerly)"
                )
            no_graph_reason = None
            thin = thin_sample_note(
                len(eager_samples) if fewest_eager is None else fewest_eager,
                len(replay_samples),
                per_bucket=fewest_eager is not None,
            )
            if thin is not None and result != "unknown":
                text += f" ({thin})"
        else:
            result, speedup, noise = "unknown", None, 0.0
            no_graph_reason = self.no_graph_reason()
            text = f"no graph captured: {no_graph_reason}"
        eager_ms = median_or_none([durations[s] for s in eager])
        replay_ms = median_or_none([durations[s] for s in replay])
        # with buckets, break-even is each bucket's own (its capture against its saving)
        even = paid = cost = None
        self.replayed = self.measurement.steps_replayed() if captured else None
        if captured and state.buckets is None:
            cost = capture_cost_seconds(captures.records, durations, replay_ms)
            even = break_even_steps(cost, eager_ms, replay_ms)
            if result in ("slower", "no_gain"):
                even = None  # a saving within the noise earns nothing back
            # the steps that did replay (up to a fallback or an invalidation, or where the
            # run ended early), not the ones train_iters planned
            paid = pays_off(eager_ms, replay_ms, even, self.replayed)
        memory_before, memory_after = captures.capture_step_memory() if captured else (None, None)
        return RunReport(
            impl=state.settings.impl,
            scope=list(state.settings.scope),
            graphs_captured=captured,
            no_graph_reason=no_graph_reason,
            warmup_steps=state.settings.warmup_steps,
            start_step=state.start_step,
            capture_step=captures.training_capture_step() if captured else None,
            capture_seconds=captures.seconds() if captured else None,
            capture_cost_seconds=cost,
            graph_count=captures.graphs_held_max,
            steps_timed=len(durations),
            eager_steps=eager,
            eager_step_ms=eager_ms,
            replay_steps=replay,
            replay_step_ms=replay_ms,
            speedup=speedup,
            verdict=result,
            verdict_text=text,
            noise=noise,
            memory_before_capture=memory_before,
            memory_after_capture=memory_after,
            peak_allocated_at_end_mib=peak_at_end if captured else None,
            fallback_step=self.measurement.fallback_step,
            graphs_held=captures.graph_count,
            replays=dict(captures.replays) if captured else {},
            notes=self.notes(),
            thin_sample=thin is not None,
            break_even_steps=even,
            pays_off=paid,
            buckets=bucket_rows(
                bucket_summary,
                captures.records,
                durations,
                holding,
                judge=lambda eager, replay: verdict(eager, replay, relative=True)[0],
            ),
            invalidations=list(self.invalidations),
            captures=[dict(record) for record in captures.records],
            shutdown_reason=reason,
            device=_device_name(state.cuda),
            versions=compat.versions(),
            rank=rank,
            world_size=world_size,
        )

    def no_graph_reason(self) -> str:
        """Why the run holds no graph: a capture that raised, one that produced none, graphs
        off or no device, or a run that ended before its capture step."""
        state, captures = self.state, self.captures
        if captures.failed is not None:
            stage, step, error = captures.failed
            return f"the {stage} capture at step {step} failed ({error})"
        if captures.records:
            return (
                f"the capture at step {captures.records[0]['step']} produced no graph "
                "(nothing in the model matched the scope)"
            )
        if state.te_mode and not state.te_layers_anywhere:
            return (
                f"no graph: no layer of the model is graphable for scope "
                f"{','.join(state.settings.scope)} on any rank, so nothing was captured (eager, "
                "as cuda_graph_accept_eager allows)"
            )
        reason = state.no_graph_reason()
        if reason is None and state.buckets is not None:
            reason = no_capture_reason(
                state.buckets, state.settings.warmup_steps, len(self.invalidations)
            )
        if reason is not None:
            return reason
        if state.step is None:
            return "the run ended before its first training step"
        return (
            f"the run ended (after step {state.step}) before the capture step "
            f"(start_step + {state.settings.warmup_steps})"
        )

    def notes(self) -> list[str]:
        """What the plugin supplied or changed in megatron-core for this run."""
        optim, kernels = self.state.optim, self.state.kernels
        notes = []
        if kernels is not None and kernels.replaced:
            notes.append(kernels.description)
        if optim is not None and optim.sync_description() is not None:
            notes.append(optim.sync_description())
        return notes


def rank_path(path: str, rank: int) -> str:
    """Rank 0 writes ``path``; rank N writes ``<stem>.rankN<suffix>`` beside it."""
    if rank == 0:
        return path
    target = Path(path)
    return str(target.with_name(f"{target.stem}.rank{rank}{target.suffix}"))


def _device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name()
