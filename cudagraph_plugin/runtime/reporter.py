"""Builds the run report at shutdown and sends it out.

Owns :class:`Reporter`: from the run's measurement (:mod:`~cudagraph_plugin.runtime.measurement`;
eager: warm-up steps without the first; replay: steps after the capture step; both medians),
its captures and its buckets it builds the :class:`~cudagraph_plugin.runtime.report.RunReport`
(verdict, break-even, why no graph was captured), logs one table per job, writes each rank's
JSON on request and fires the ``mcgraph_report`` hook on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.config.logs import JOB_WIDE
from cudagraph_plugin.config.rules.report import rank_path
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
from cudagraph_plugin.runtime.report import RunReport, bucket_key, capture_cost_words, verdict
from cudagraph_plugin.runtime.state import RunState
from cudagraph_plugin.runtime.timing import MemorySnapshot, median_or_none
from hookspecs import call_hook

logger = logging.getLogger("cudagraph_plugin")


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
                capture_cost_words(self.report),
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
                "; ".join(bucket_key(row) for row in unpaid),
            )
        # A JSON that cannot be written (its folder gone, a full disk since the configure
        # check) keeps no mcgraph_report implementation from the report: raised after them.
        unwritten = self._write_json(self.report, rank)
        try:
            call_hook(self.state.pm, "mcgraph_report", report=self.report)
        except BaseException as exc:
            if unwritten is not None:  # (said here: only this exception goes on)
                self._note_unwritten(unwritten, "and handed to the mcgraph_report "
                                     "implementations before the one that raised")  # fmt: skip
                logger.error("the run report's JSON was not written", exc_info=unwritten)
            exc.add_note(
                "(in a mcgraph_report implementation: the report was built, logged and "
                + ("written" if unwritten is None else "not written (logged above)")
                + "; the implementations after this one did not receive it)"
            )
            raise
        if unwritten is not None:
            self._note_unwritten(unwritten, "and handed to every mcgraph_report implementation")
            raise unwritten

    def _write_json(self, report: RunReport, rank: int) -> OSError | ValueError | None:
        """Write this rank's JSON where ``cuda_graph_report_json`` asks; what the write
        raised (:meth:`_note_unwritten` says it once the hook ran)."""
        asked = self.state.settings.report_json
        if not asked:
            return None
        try:
            path = report.write_json(rank_path(asked, rank))
        except (OSError, ValueError) as unwritten:  # (ValueError: a NUL in the path)
            return unwritten
        logger.info("CUDA graph report written to %s", path)
        return None

    def _note_unwritten(self, unwritten: BaseException, handed: str) -> None:
        """The note naming the setting, its value and the fix, and where the report went."""
        unwritten.add_note(
            "(writing the run report's JSON, cuda_graph_report_json="
            f"{self.state.settings.report_json!r}: the report was logged {handed}, and the "
            "CUDA graphs are freed; fix: point cuda_graph_report_json "
            "(--cuda-graph-report-json) at a file this rank can write, or leave it unset)"
        )

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


def _device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name()
