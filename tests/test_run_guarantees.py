"""Issue 22's guarantees, each through the example loop on the CPU with fake graphs:

* the release of every graph runs exactly once whatever ``BaseException`` arrives while the
  report is produced (a plugin's ``mcgraph_report``, the report's device sync, the JSON
  write);
* a full-iteration capture never runs with the DDP forward pre-hooks off (it would capture
  an iteration without the parameter all-gather);
* training never starts without ``run.model_built()``;
* a run that asked for graphs never ends up eager without a word: no graphable layer for
  the scope, a forward/backward not taken from the run, an optimizer step that bypassed the
  optimizer graph stop the run, unless eager is accepted explicitly (then one warning and a
  report without a speed-up verdict);
* the report counts the replays of each captured graph.

The signal and Ctrl-C holes of ``TrainingRun`` are in ``tests/test_hookspecs_shutdown.py``.
"""

from __future__ import annotations

import argparse
import logging

import pytest
from cpu_only import needs_mcore_on_cpu

import fake_optimizer_graph
import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin.runtime.report import RunReport
from cudagraph_plugin.runtime.timing import StepTimer
from cudagraph_plugin.runtime.wiring import CudaGraphWiringError
from hookspecs import TrainingRun, get_plugin_manager, hookimpl
from recording import FULL, OVERLAP, TE, Recorder, run_recorded

pytestmark = needs_mcore_on_cpu

EAGER_OK = ["--cuda-graph-accept-eager"]


def run(*argv: str, plugins=(), steps: int = 6):
    return run_recorded(*argv, plugins=plugins, steps=steps)


def graph_plugin(recorder: Recorder):
    from cudagraph_plugin.entry import RUN_PLUGIN_NAME

    return recorder.pm.get_plugin(RUN_PLUGIN_NAME)


class ShutdownSeen:
    """A plain shutdown implementation: inside the CUDA graph plugin's wrapper."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.reasons.append(str(reason))


# -- the release runs whatever interrupts the report ---------------------------------------------


class RaisingReportSink:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    @hookimpl
    def mcgraph_report(self, report):
        raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)], ids=["ctrl-c", "exit"])
def test_a_plugins_report_hook_raising_base_exception_does_not_skip_the_release(fake_graphs, exc):
    seen = ShutdownSeen()
    with pytest.raises(type(exc)):
        run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[RaisingReportSink(exc), seen])
    [graph] = fake_graphs.graphs
    assert graph.resets == 1  # freed, exactly once
    assert seen.reasons == ["completed"]  # the inner shutdown implementations ran too


def test_a_ctrl_c_during_the_reports_device_sync_does_not_skip_the_release(
    fake_graphs, monkeypatch
):
    def interrupted(self, sync=True):
        raise KeyboardInterrupt

    monkeypatch.setattr(StepTimer, "durations_ms", interrupted)
    seen = ShutdownSeen()
    with pytest.raises(KeyboardInterrupt):
        run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[seen])
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert seen.reasons == ["completed"]


def test_a_system_exit_from_the_json_write_does_not_skip_the_release(
    fake_graphs, monkeypatch, tmp_path
):
    def exits(self, path):
        raise SystemExit(4)

    monkeypatch.setattr(RunReport, "write_json", exits)
    with pytest.raises(SystemExit):
        run(
            *FULL, "--cuda-graph-warmup-steps", "1",
            "--cuda-graph-report-json", str(tmp_path / "r.json"),
        )  # fmt: skip
    [graph] = fake_graphs.graphs
    assert graph.resets == 1


def test_a_ctrl_c_while_the_reports_failure_is_logged_does_not_skip_the_release(
    fake_graphs, monkeypatch, tmp_path
):
    """(a second Ctrl-C inside the log call that says the report failed: it used to leave
    before the release, which the guard then skipped, since the wrapper had been entered)"""
    from cudagraph_plugin.runtime import shutdown

    def fails(self, path):
        raise OSError("disk full")

    real_error = shutdown.logger.error

    def ctrl_c_while_logging(message, *args, **kwargs):
        if message.startswith("the run report failed"):
            raise KeyboardInterrupt
        real_error(message, *args, **kwargs)

    monkeypatch.setattr(RunReport, "write_json", fails)
    monkeypatch.setattr(shutdown.logger, "error", ctrl_c_while_logging)
    with pytest.raises(KeyboardInterrupt):
        run(
            *FULL, "--cuda-graph-warmup-steps", "1",
            "--cuda-graph-report-json", str(tmp_path / "r.json"),
        )  # fmt: skip
    [graph] = fake_graphs.graphs
    assert graph.resets == 1


class ShutdownRaises:
    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        raise RuntimeError("an inner shutdown implementation failed")


def _tracebacks_of(caplog, exc_type):
    return [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], exc_type)]


@pytest.mark.parametrize(
    "then", ["raised", "inner-raises", "release-raises", "release-raises-in-context"]
)
def test_a_report_write_that_fails_prints_its_traceback_once(
    fake_graphs, monkeypatch, tmp_path, caplog, then
):
    """(2026-12-05, a review: a report file that could not be written at shutdown printed
    its traceback twice, once logged by the shutdown and once by the host that received it)
    Raised: the host prints it, nothing logs it. An inner shutdown implementation raising
    too: that error goes on and the report's is logged, once. The release failing too: its
    error goes on with the report's as its context (printed together)."""
    from cudagraph_plugin.runtime.release_plan import ReleasePlan

    def fails(self, path):
        raise OSError("disk full")

    monkeypatch.setattr(RunReport, "write_json", fails)
    plugins = [ShutdownRaises()] if then == "inner-raises" else []
    if then.startswith("release-raises"):
        real = ReleasePlan.release_all

        def release_then_raise(self, *args, **kwargs):
            real(self, *args, **kwargs)
            if then == "release-raises":
                raise RuntimeError("the release failed")
            try:
                raise KeyError("a step's own error")
            except KeyError:  # (its context is taken: the report's is logged instead)
                raise RuntimeError("the release failed") from None

        monkeypatch.setattr(ReleasePlan, "release_all", release_then_raise)
    argv = [
        *FULL,
        "--cuda-graph-warmup-steps",
        "1",
        "--cuda-graph-report-json",
        str(tmp_path / "r.json"),
    ]
    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        with pytest.raises((OSError, RuntimeError)) as raised:
            run(*argv, plugins=plugins)
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert "the run report failed: OSError('disk full') (the CUDA graphs are freed first)" in (
        caplog.text
    )
    logged = _tracebacks_of(caplog, OSError)
    if then == "raised":
        assert isinstance(raised.value, OSError) and logged == []
    elif then == "inner-raises":
        assert "inner shutdown implementation failed" in str(raised.value)
        assert len(logged) == 1 and logged[0].getMessage() == "the run report also failed"
    elif then == "release-raises":
        assert str(raised.value) == "the release failed" and logged == []
        assert isinstance(raised.value.__context__, OSError)
    else:
        assert str(raised.value) == "the release failed"
        assert isinstance(raised.value.__context__, KeyError)
        assert len(logged) == 1 and logged[0].getMessage() == "the run report failed"


@pytest.mark.parametrize("interrupted", [1, 2], ids=["first-try", "both-tries"])
def test_a_ctrl_c_while_the_failure_is_marked_for_the_peers_does_not_skip_the_release(
    fake_graphs, monkeypatch, interrupted
):
    """The mark in the job's store is the first thing of shutdown (a slow store: a second
    Ctrl-C lands there). It is tried once more, and whatever happens the shutdown runs,
    the graphs are freed once, and the Ctrl-C goes on to the host afterwards."""
    from cudagraph_plugin.runtime.job_watch import JobWatch

    calls = []

    def end(self, reason, exception):
        calls.append(str(reason))
        if len(calls) <= interrupted:
            raise KeyboardInterrupt

    monkeypatch.setattr(JobWatch, "end", end)
    seen = ShutdownSeen()
    with pytest.raises(KeyboardInterrupt):
        run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[seen])
    assert calls == ["completed", "completed"]
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert seen.reasons == ["completed"]


def test_a_clean_end_past_a_peers_early_end_frees_the_graphs_then_raises_peer_failed(
    fake_graphs, monkeypatch, caplog
):
    """The example loop finishes its 6 steps (queued ahead of the device, its watch never
    looked) after a peer's loop ended early after step 2: at its clean end the watch is
    told, the plugin's shutdown runs without waiting on the device and frees the graph
    once, and the run then ends with PeerFailed (the host says it in one line, exit 1)."""
    import torch.distributed as dist

    from cudagraph_plugin.runtime import shutdown
    from cudagraph_plugin.runtime.job_watch import JobWatch
    from cudagraph_plugin.runtime.peer_mark import PeerFailed
    from cudagraph_plugin.runtime.peers import PeerWatch

    store = dist.HashStore()
    aborts: list[int] = []
    PeerWatch(store, 1, 2, current_step=lambda: 2).end("early_exit")  # (its record)

    def watch(self):  # a 2-rank job's watch, over this store; its thread never polls
        if self.peers is None:
            state = self.state
            self.peers = PeerWatch(store, 0, 2, abort=lambda: aborts.append(1),
                                   settle=lambda seconds: True,
                                   current_step=lambda: state.step)  # fmt: skip

    monkeypatch.setattr(JobWatch, "watch", watch)
    decided = []
    decide = shutdown.device_may_block
    monkeypatch.setattr(
        shutdown, "device_may_block", lambda *a: decided.append(decide(*a)) or decided[-1]
    )
    seen = ShutdownSeen()
    with caplog.at_level(logging.ERROR, logger="cudagraph_plugin"):
        with pytest.raises(PeerFailed) as raised:
            run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[seen])
    assert raised.value.rank == 1
    assert "early_exit after step 2, while rank 0 went on to step 5" in raised.value.reason
    assert seen.reasons == ["completed"] and aborts == [1] and decided == [True]
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert "ended its run early" in caplog.text


def test_a_ctrl_c_before_the_report_does_not_skip_the_release(fake_graphs, monkeypatch):
    """The first thing the plugin's shutdown does is decide whether the device may block;
    a Ctrl-C landing there (before the report's own guard) is left to the safety net."""
    from cudagraph_plugin.runtime import shutdown

    decide = shutdown.device_may_block
    calls = []

    def interrupted(reason, state):
        calls.append(str(reason))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return decide(reason, state)

    monkeypatch.setattr(shutdown, "device_may_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(*FULL, "--cuda-graph-warmup-steps", "1")
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert len(calls) == 2  # the safety net decided again, and released


# -- a full-iteration capture needs the pre-hooks on ----------------------------------------------


class KeepsPreHooksOff:
    """A host that 'enables' the pre-hooks without doing it (as one re-enabling them only
    after the capture step would)."""

    @hookimpl(tryfirst=True)
    def mcgraph_enable_forward_pre_hook(self, model):
        return True


def test_full_iteration_capture_with_the_pre_hooks_off_is_refused(fake_graphs):
    with pytest.raises(CudaGraphWiringError, match="forward pre-hooks disabled") as info:
        run(*FULL, *OVERLAP, "--cuda-graph-warmup-steps", "1", plugins=[KeepsPreHooksOff()])
    assert "stale shards" in str(info.value)
    assert fake_graphs.graphs == []  # refused before megatron-core captured anything


def test_full_iteration_capture_with_the_pre_hooks_on_goes_ahead(fake_graphs):
    _, rec = run(*FULL, *OVERLAP, "--cuda-graph-warmup-steps", "1")
    assert rec.report.graphs_captured


# -- training needs run.model_built() -------------------------------------------------------------


# (TE without --bf16: the plugin's own parser knows no precision flag)
@pytest.mark.parametrize("argv", [FULL, TE[:4]], ids=["full", "te"])
def test_training_without_model_built_is_refused_with_the_fix(fake_graphs, argv):
    pm = get_plugin_manager()
    parser = argparse.ArgumentParser()
    pm.hook.mcgraph_add_arguments(parser=parser)
    args = parser.parse_args([*argv, "--cuda-graph-warmup-steps", "1"])
    with pytest.raises(CudaGraphWiringError, match=r"before run\.model_built\(\)") as info:
        with TrainingRun(pm, config=args, train_iters=3) as run_:
            with run_.train_step(0):
                pass
    assert "call run.model_built(model=" in str(info.value)


# -- asked for graphs, got none -----------------------------------------------------------------


MAMBA = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "mamba", "--bf16"]


def test_a_scope_that_matches_no_layer_stops_the_run_before_training(fake_graphs):
    seen = ShutdownSeen()
    with pytest.raises(CudaGraphWiringError, match="No graphable layers found") as info:
        run(*MAMBA, plugins=[seen])
    assert "scope mamba" in str(info.value) and "--cuda-graph-accept-eager" in str(info.value)
    assert seen.reasons == ["exception"]


def test_accepting_eager_runs_warns_once_and_claims_no_speedup(fake_graphs, caplog):
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        summary, rec = run(*MAMBA, *EAGER_OK, "--cuda-graph-warmup-steps", "1")
    assert summary["shutdown_reason"] == "completed"
    warnings = [r for r in caplog.records if "running eagerly as" in r.getMessage()]
    assert len(warnings) == 1
    report = rec.report.to_dict()
    assert report["graphs_captured"] is False
    assert report["verdict"] == "unknown" and report["speedup"] is None
    assert "faster" not in report["verdict_text"]
    assert "no graph" in report["no_graph_reason"]


def test_with_no_layer_on_any_rank_and_eager_accepted_no_rank_calls_the_capture(
    fake_graphs, monkeypatch
):
    # megatron-core 0.16's helper would hand Transformer Engine nothing to capture
    from fakes import FakeTECudaGraphHelper

    created = []
    monkeypatch.setattr(FakeTECudaGraphHelper, "create_cudagraphs", lambda h: created.append(h))
    summary, rec = run(*MAMBA, *EAGER_OK, "--cuda-graph-warmup-steps", "1")
    assert summary["shutdown_reason"] == "completed" and created == []
    assert rec.report.capture_step is None


def test_a_te_capture_that_makes_no_graph_of_the_layers_it_has_stops_the_run(
    fake_graphs, monkeypatch
):
    from fakes import FakeTECudaGraphHelper

    monkeypatch.setattr(FakeTECudaGraphHelper, "_make_graphs", lambda helper: None)
    with pytest.raises(CudaGraphWiringError, match="the TE capture at step 1 produced no graph"):
        run(*TE, "--cuda-graph-warmup-steps", "1")


def _another_stage(monkeypatch, *, empty: bool, layers: bool) -> None:
    """The all-reduce of ``te_layers_across_ranks`` as a 2-stage job answers it (this rank's
    part, and the other stage's); the real one is tested over gloo ranks."""
    monkeypatch.setattr(
        compat,
        "max_across_ranks",
        lambda values: [max(values[0], int(empty)), max(values[1], int(layers))],
    )


def test_a_pipeline_stage_without_a_layer_of_the_scope_is_refused_where_megatron_core_cannot(
    fake_graphs, monkeypatch
):
    # megatron-core 0.16's helper (the fake mirrors it): no capture on an empty stage
    _another_stage(monkeypatch, empty=True, layers=True)
    with pytest.raises(CudaGraphWiringError, match=r"a pipeline stage has no layer.*0\.19"):
        run(*TE)


def test_with_0_19_a_stage_without_a_layer_of_the_scope_captures_none_and_says_so(
    fake_graphs, monkeypatch, caplog
):
    from megatron.core.transformer import cuda_graphs

    from fakes import FakeTECudaGraphHelper019

    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", FakeTECudaGraphHelper019)
    monkeypatch.setattr(cuda_graphs, "_layer_is_graphable", lambda layer, config: False)
    _another_stage(monkeypatch, empty=False, layers=True)  # the other stage has layers
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        summary, _ = run(*TE, "--cuda-graph-warmup-steps", "1")
    assert summary["shutdown_reason"] == "completed"
    assert "this rank's model chunks have no layer graphable for scope attn,mlp" in caplog.text
    assert "running eagerly" not in caplog.text  # the job has graphs: nothing to accept


class PlainForwardBackward:
    """A host that hands its loop the plain forward/backward, not the run's."""

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_forward_backward_func(self, forward_backward_func):
        yield
        return forward_backward_func


def test_a_forward_backward_not_taken_from_the_run_stops_at_the_capture_step(fake_graphs):
    rec = Recorder()
    with pytest.raises(CudaGraphWiringError, match="ended without a full-iteration capture"):
        train_gpt.run(
            ["--train-iters", "6", "--log-interval", "0", *FULL, "--cuda-graph-warmup-steps", "2"],
            plugins=[rec, PlainForwardBackward()],
        )
    assert [e for e in rec.events if e[0] == "step"][-1] == ("step", 2)  # the capture step


def test_with_buckets_a_forward_backward_not_taken_from_the_run_stops_at_the_capture_step(
    bucket_fakes,
):
    rec = Recorder()
    buckets = ["--cuda-graph-buckets", "32", "--cuda-graph-warmup-steps", "2"]
    with pytest.raises(CudaGraphWiringError, match="without a training call through the CUDA"):
        train_gpt.run(
            ["--train-iters", "6", "--log-interval", "0", *FULL, *buckets],
            plugins=[rec, PlainForwardBackward()],
        )
    assert [e for e in rec.events if e[0] == "step"][-1] == ("step", 2)
    summary, _ = run(*FULL, *buckets)  # through the run: captured, no complaint
    assert summary["shutdown_reason"] == "completed"


def test_accepting_eager_lets_a_plain_forward_backward_run_to_the_end(fake_graphs):
    summary, rec = run(*FULL, *EAGER_OK, plugins=[PlainForwardBackward()])
    assert summary["shutdown_reason"] == "completed"
    assert rec.report.graphs_captured is False and rec.report.verdict == "unknown"


@pytest.fixture
def optimizer_graphs(fake_graphs, monkeypatch):
    fake_graphs.wrapper = fake_optimizer_graph.install(monkeypatch)
    from megatron.core.optimizer import clip_grads

    # megatron-core 0.17+'s layout (see tests/test_optimizer_graph.py)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", None, raising=False)
    capturable = fake_optimizer_graph.capturable_build(train_gpt._build_optimizer)
    monkeypatch.setattr(train_gpt, "_build_optimizer", capturable)
    yield fake_graphs
    assert not compat.optimizer_graph_state_dirty()


class BypassesTheOptimizerGraph:
    """A host whose optimizer.step() is not the one the plugin installed."""

    @hookimpl(trylast=True)
    def mcgraph_model_built(self, model, optimizer):
        vars(optimizer).pop("step", None)


def test_an_optimizer_step_that_bypasses_the_graph_stops_at_the_capture_step(optimizer_graphs):
    with pytest.raises(CudaGraphWiringError, match="without capturing the optimizer step"):
        run(*FULL, "--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "1",
            "--lr-decay-style", "constant", plugins=[BypassesTheOptimizerGraph()])  # fmt: skip


class ReportSink:
    """A third-party consumer of the report (a metrics service)."""

    def __init__(self) -> None:
        self.reports: list[RunReport] = []

    @hookimpl
    def mcgraph_report(self, report):
        self.reports.append(report)


class FolderTurnedFile:
    """The report's folder becomes a file during the run (gone, replaced: what a full disk
    or a cleaned-up scratch space does after the configure check passed)."""

    def __init__(self, folder) -> None:
        self.folder = folder

    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        if self.folder.is_dir():
            self.folder.rmdir()
            self.folder.write_text("not a folder any more")


def test_a_report_json_that_cannot_be_written_names_the_field_after_every_sink_had_it(
    fake_graphs, tmp_path
) -> None:
    """(Before: the write's OSError came first, so no mcgraph_report implementation received
    the report, and the error said a path but not the setting or its fix.)"""
    folder = tmp_path / "reports"
    folder.mkdir()
    sink = ReportSink()
    asked = str(folder / "report.json")
    with pytest.raises(OSError) as raised:
        run(*FULL, "--cuda-graph-warmup-steps", "1", "--cuda-graph-report-json", asked,
            plugins=[sink, FolderTurnedFile(folder)])  # fmt: skip
    [report] = sink.reports  # (the sink had it, graphs captured and all)
    assert report.graphs_captured and report.shutdown_reason == "completed"
    notes = "\n".join(raised.value.__notes__)
    assert f"cuda_graph_report_json={asked!r}: the report was logged and handed to every " in notes
    assert "fix: point cuda_graph_report_json (--cuda-graph-report-json) at a file" in notes
    [graph] = fake_graphs.graphs
    assert graph.resets == 1  # (freed all the same)


def test_an_unwritten_report_json_is_said_where_a_sink_raised_too(fake_graphs, tmp_path, caplog):
    """A consumer that raises ends the run with its own error; the JSON's error, with its
    note naming the setting and the fix, is then logged rather than lost."""
    folder = tmp_path / "reports"
    folder.mkdir()
    asked = str(folder / "report.json")
    sinks = [RaisingReportSink(RuntimeError("sink down")), FolderTurnedFile(folder)]
    with pytest.raises(RuntimeError, match="sink down") as raised:
        run(*FULL, "--cuda-graph-warmup-steps", "1", "--cuda-graph-report-json", asked,
            plugins=sinks)  # fmt: skip
    assert "the report was built, logged and not written (logged above)" in "\n".join(
        raised.value.__notes__
    )
    [logged] = [r for r in caplog.records if r.getMessage().startswith("the run report's JSON")]
    said = "\n".join(logged.exc_info[1].__notes__)
    assert f"cuda_graph_report_json={asked!r}: the report was logged and handed to the " in said
    assert "before the one that raised" in said


# -- replays per graph ---------------------------------------------------------------------------


def test_the_report_counts_replays_per_captured_graph(fake_graphs):
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "2", "--eval-interval", "3", steps=8)
    report = rec.report.to_dict()
    # training: captured by step 2's call, replayed by steps 3..7
    assert report["replays"]["training"] == 5
    # evaluation after steps 2 and 5, two forward-only calls each: captured by the third
    # call (the wrapper's warm-up counts per stage), replayed by the fourth
    assert report["replays"]["validation"] == 1
    assert set(report["replays"]) == {"training", "validation"}
    assert "training 5" in rec.report.format_table()


def test_te_replays_count_each_training_call_after_the_capture(fake_graphs):
    _, rec = run(*TE, "--cuda-graph-warmup-steps", "1", steps=4)
    # captured at the start of step 1; steps 1, 2 and 3 run through the graphs
    assert rec.report.replays == {"training": 3}


def test_a_graph_captured_at_the_last_step_shows_zero_replays(fake_graphs):
    _, rec = run(*FULL, "--cuda-graph-warmup-steps", "3", steps=4)
    assert rec.report.graphs_captured
    assert rec.report.replays == {"training": 0}


def test_a_raising_mcgraph_report_says_the_report_was_out_and_who_missed_it(fake_graphs):
    """(review of 2026-12-04: the run ended by a consumer's failure read as "the run report
    failed", though the report had been built, logged and written.)"""

    class FailingSink:
        @hookimpl
        def mcgraph_report(self, report):
            raise RuntimeError("sink down")

    with pytest.raises(RuntimeError, match="sink down") as raised:
        run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[FailingSink()])
    notes = "\n".join(raised.value.__notes__)
    assert "in a mcgraph_report implementation: the report was built, logged and written" in notes
    assert "raised by plugin" in notes
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
