"""The lifecycle's failure paths and correctness fixes, on real megatron-core on the CPU.

Each test here failed on the plugin before the fix it names (issue 12): cleanup per
resource, no device waits after an abnormal multi-rank end, collective decisions, the
input copy ordered after the previous replay, eager after shutdown, an idempotent
``forward_backward_func``, manual hooks when the host re-enables pre-hooks itself, DDP
built outside ``model_build_context``, and one report per rank. Graph capture and TE are
the fakes of ``tests/fakes.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal

import pytest
from cpu_only import needs_mcore_on_cpu

import cpu_redirect as redirect
import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.runtime import fallback, release_plan
from cudagraph_plugin.runtime.timing import StepTimer
from cudagraph_plugin.runtime.wiring import CudaGraphWiringError
from hookspecs import (
    ConfigurationError,
    PeerFailed,
    ShutdownReason,
    SignalReceived,
    TrainingRun,
    hookimpl,
)
from recording import FULL, OVERLAP, TE, RaiseAt, Recorder, run_recorded

pytestmark = needs_mcore_on_cpu


def run(*argv: str, plugins=(), steps: int = 6):
    return run_recorded(*argv, plugins=plugins, steps=steps)


# -- cleanup per resource -----------------------------------------------------------------------


def _failing(exc: BaseException):
    def release(*args, **kwargs):
        raise exc

    return release


@pytest.mark.parametrize("ended_by_exception", [False, True])
def test_a_raising_release_does_not_skip_the_others(fake_graphs, monkeypatch, ended_by_exception):
    monkeypatch.setattr(compat, "clear_static_buffers", _failing(RuntimeError("buffers stuck")))
    plugins = [RaiseAt(4, RuntimeError("the run failed"))] if ended_by_exception else []
    with pytest.raises(RuntimeError) as info:
        run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=plugins)
    # every other resource was released: the graph, the counters, the cuBLAS workspaces
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert compat.full_iteration_calls("training") == 0
    assert ("clear_cublas_workspaces", None) in fake_graphs.events
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if ended_by_exception:  # the run's own exception stays the one raised, with a note
        assert str(info.value) == "the run failed"
        assert "releasing full-iteration static input buffers failed" in notes
    else:
        assert str(info.value) == "buffers stuck"
        assert "releasing full-iteration static input buffers" in notes
    monkeypatch.undo()  # the real release again, for the fixture's final check
    compat.clear_static_buffers()


def test_a_second_ctrl_c_during_cleanup_does_not_skip_the_rest(fake_graphs, monkeypatch):
    monkeypatch.setattr(compat, "reset_full_iteration_counters", _failing(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        run(*FULL, "--cuda-graph-warmup-steps", "1")
    [graph] = fake_graphs.graphs
    assert graph.resets == 1  # released before the interrupted step
    from megatron.core.full_cuda_graph import StaticBufferLoader

    assert StaticBufferLoader.static_buffers["training"] == []  # and after it
    monkeypatch.undo()
    compat.reset_full_iteration_counters()


@pytest.fixture
def device_waits(monkeypatch):
    """What shutdown asks of the device: the report's timing reads (``sync`` each) and
    cache flushes."""
    waits: dict[str, list] = {"syncs": [], "flushes": []}
    original = StepTimer.durations_ms

    def durations(self, sync=True):
        waits["syncs"].append(sync)
        return original(self, sync=sync)

    monkeypatch.setattr(StepTimer, "durations_ms", durations)
    monkeypatch.setattr(release_plan, "empty_cache", lambda: waits["flushes"].append(1))
    monkeypatch.setattr(release_plan, "allocated_mib", lambda: 0.0)
    return waits


@pytest.mark.parametrize("mode", ["full", "te"])
def test_after_an_abnormal_multi_rank_end_shutdown_never_waits_on_the_device(
    fake_graphs, device_waits, monkeypatch, mode
):
    """A peer may be dead: neither the report's timings nor a cache flush may synchronise."""
    monkeypatch.setattr(compat, "distributed_world", lambda: (1, 2))
    with pytest.raises(RuntimeError, match="peer"):
        run(*(FULL if mode == "full" else TE), plugins=[RaiseAt(4, RuntimeError("peer"))])
    assert device_waits == {"syncs": [False], "flushes": []}
    assert fake_graphs.graphs[0].resets == 1 if mode == "full" else True
    if mode == "te":
        [helper] = fake_graphs.helpers
        assert not helper.graphs_created()


def test_an_abnormal_single_rank_end_still_waits_and_flushes(fake_graphs, device_waits):
    """No peer can be gone in a one-rank run: the report reads its timings and the cache is
    flushed as after a normal end."""
    with pytest.raises(RuntimeError, match="alone"):
        run(*FULL, plugins=[RaiseAt(4, RuntimeError("alone"))])
    assert device_waits == {"syncs": [True], "flushes": [1]}


def test_a_clean_multi_rank_end_still_flushes_the_cache(fake_graphs, device_waits, monkeypatch):
    monkeypatch.setattr(compat, "distributed_world", lambda: (0, 2))
    monkeypatch.setattr(compat, "any_rank", lambda flag: flag)
    run(*FULL)
    assert device_waits["flushes"] == [1]


# -- decisions every rank takes together --------------------------------------------------------


def test_a_second_ctrl_c_while_the_release_plan_is_drawn_up_does_not_skip_it(fake_graphs):
    """Interrupted at each line of the plan's drawing up in turn (each mechanism lists its
    steps), the graph is still freed (third review: drawn up before the guarded loop, an
    interruption there skipped every step, and the run was marked shut down)."""
    import sys

    code = release_plan.ReleasePlan.steps.__code__
    lines = sorted({line for _, _, line in code.co_lines() if line and line > code.co_firstlineno})
    leaked, interrupted = {}, []
    for target in lines:
        fired: list[int] = []

        def tracer(frame, event, arg, target=target, fired=fired):
            if frame.f_code is not code:
                return None

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == target and not fired:
                    fired.append(target)
                    raise KeyboardInterrupt("second Ctrl-C")
                return local

            return local

        fake_graphs.graphs.clear()
        sys.settrace(tracer)
        try:
            with contextlib.suppress(KeyboardInterrupt):
                run(*FULL, "--cuda-graph-warmup-steps", "1", steps=3)
        finally:
            sys.settrace(None)
        if fired:
            interrupted.append(target)
            resets = [graph.resets for graph in fake_graphs.graphs]
            if resets != [1] or compat.full_iteration_state_dirty():
                leaked[target] = resets
        compat.free_full_iteration_graphs()
    assert len(interrupted) >= 4
    assert not leaked, leaked


@pytest.mark.parametrize("outer_wrapper_raises", [False, True])
def test_a_shutdown_reason_of_the_host_s_own_still_frees_the_graphs(
    fake_graphs, monkeypatch, caplog, outer_wrapper_raises
):
    """A host firing mcgraph_shutdown itself with a reason that is no ShutdownReason: the
    graphs are freed, with a warning naming the valid reasons (third review: a ValueError
    skipped the release, in the plugin's wrapper and again in its guard)."""
    from hookspecs import run as run_module

    call = run_module.TrainingRun._call

    def own_reason(self, hook_name, **kwargs):
        if hook_name == "mcgraph_shutdown":
            kwargs["reason"] = "done"
        return call(self, hook_name, **kwargs)

    monkeypatch.setattr(run_module.TrainingRun, "_call", own_reason)
    # what marks the end for the other ranks (peers.PeerWatch.end in a multi-rank job)
    # takes a ShutdownReason too: it refused 'done' (fourth review)
    from cudagraph_plugin.runtime import job_watch

    marked = []
    monkeypatch.setattr(
        job_watch.JobWatch,
        "end",
        lambda self, reason, exception: marked.append(ShutdownReason(reason)),
    )

    class RaisesBeforeItsYield:  # (skips the plugin's wrapper: its guard frees the graphs)
        @hookimpl(wrapper=True)
        def mcgraph_shutdown(self, reason, exception):
            raise RuntimeError("a wrapper in between failed")
            yield  # (a generator, as pluggy wants of a wrapper)

    plugins = [RaisesBeforeItsYield()] if outer_wrapper_raises else []
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"), contextlib.ExitStack() as s:
        if outer_wrapper_raises:
            s.enter_context(pytest.raises(RuntimeError, match="in between"))
        run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=plugins, steps=4)
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert not compat.full_iteration_state_dirty()
    assert "'done' is not one of hookspecs.ShutdownReason's values (completed, " in caplog.text
    assert marked == [ShutdownReason.EXCEPTION]
    assert len([r for r in caplog.records if "is not one of" in r.getMessage()]) == 1


@pytest.mark.parametrize("local,anywhere", [("faster", True), ("slower", True), ("faster", False)])
def test_fallback_is_decided_by_all_ranks(fake_graphs, monkeypatch, local, anywhere):
    asked = []
    monkeypatch.setattr(
        fallback, "verdict", lambda eager, replay: (local, 1.0, 0.02, f"replay {local}")
    )

    def any_rank(flag):
        asked.append(flag)
        return anywhere

    monkeypatch.setattr(compat, "any_rank", any_rank)
    _, rec = run(
        *FULL, "--cuda-graph-warmup-steps", "2", "--cuda-graph-fallback-on-slowdown", steps=12
    )
    assert asked == [local == "slower"]
    fell_back = rec.report.fallback_step is not None
    assert fell_back is anywhere


def _interrupting_the_release(fake_graphs, monkeypatch, interruption: BaseException) -> list[int]:
    """The first graph reset frees the graph, then ``interruption`` arrives (a Ctrl-C, a
    signal, a peer's failure: what the run's handlers raise wherever the interpreter is)."""
    from fakes import FakeCUDAGraph

    reset, fired = FakeCUDAGraph.reset, []

    def interrupted_reset(self):
        reset(self)
        if not fired:
            fired.append(1)
            raise interruption

    monkeypatch.setattr(FakeCUDAGraph, "reset", interrupted_reset)
    return fired


@pytest.mark.parametrize(
    "make",
    [KeyboardInterrupt, lambda: SignalReceived(signal.SIGTERM), lambda: PeerFailed(1, "died")],
    ids=["ctrl-c", "sigterm", "peer-failed"],
)
@pytest.mark.parametrize("cause", ["invalidation", "fallback"])
def test_an_interruption_while_graphs_are_freed_during_training_ends_the_run(
    fake_graphs, monkeypatch, make, cause
):
    """The host's invalidation and the fallback free graphs during training: an
    interruption that arrives then ends the run, shut down with the graphs freed (third
    review: it was logged as a failed release and the run trained on to 'completed')."""
    from recording import InvalidateAt

    interruption = make()
    fired = _interrupting_the_release(fake_graphs, monkeypatch, interruption)
    if cause == "fallback":
        monkeypatch.setattr(
            fallback, "verdict", lambda eager, replay: ("slower", 1.0, 0.02, "replay slower")
        )
        argv, plugins = (*FULL, "--cuda-graph-fallback-on-slowdown"), []
    else:
        argv, plugins = FULL, [InvalidateAt(4)]
    with pytest.raises(type(interruption)) as info:
        run(*argv, "--cuda-graph-warmup-steps", "2", plugins=plugins, steps=14)
    assert info.value is interruption
    assert (
        "raised while releasing full-iteration training graph while freeing graphs during training"
        in info.value.__notes__
    )
    assert fired
    [graph] = fake_graphs.graphs
    assert graph.resets == 1
    assert not compat.full_iteration_state_dirty()


# -- full-iteration correctness ----------------------------------------------------------------


def test_each_input_copy_waits_for_the_previous_replay(fake_graphs, monkeypatch):
    """megatron-core 0.16 copies the next micro-batch into the static buffers on a side
    stream without waiting for the replay still reading them."""
    waits = []
    monkeypatch.setattr(redirect.Stream, "wait_stream", lambda self, other: waits.append(self))
    loaders = []
    original = compat.make_full_iteration_wrapper

    def remember(*args, **kwargs):
        wrapper = original(*args, **kwargs)
        loaders.append(wrapper.static_loader.stream)
        return wrapper

    monkeypatch.setattr(compat, "make_full_iteration_wrapper", remember)
    run(*FULL, "--cuda-graph-warmup-steps", "1", steps=5)
    [loader] = loaders
    # one wait of the copy stream per training call (warm-up, capture and 3 replays)
    assert sum(1 for stream in waits if stream is loader) == 5


def _args(argv):
    from hookspecs import get_plugin_manager

    pm = get_plugin_manager()
    parser = argparse.ArgumentParser()
    pm.hook.mcgraph_add_arguments(parser=parser)
    return pm, parser.parse_args(argv)


def test_forward_backward_after_shutdown_runs_eagerly(fake_graphs, caplog):
    """Megatron-LM-style evaluation after training: the graphs are gone by then (said
    once, not on every call)."""
    calls = []

    def eager(**kwargs):
        calls.append(kwargs)
        return ["eager"]

    pm, args = _args(FULL)
    with redirect.cpu_redirect(), caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        with TrainingRun(pm, config=args, train_iters=1) as training:
            fwd_bwd = training.forward_backward_func(eager)
        results = [
            fwd_bwd(forward_only=True, data_iterator=None, num_microbatches=1) for _ in range(3)
        ]
    assert results == [["eager"]] * 3 and len(calls) == 3
    assert caplog.text.count("called after shutdown: running eagerly") == 1


def test_asking_for_the_forward_backward_again_keeps_the_live_graph(fake_graphs):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    answers, bare = [], []

    class AskAgain:
        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            self.pm = pluginmanager

        @hookimpl
        def mcgraph_train_step_end(self, step, metrics):
            if step in (3, 4):  # after the capture at step 1
                hook = self.pm.hook.mcgraph_forward_backward_func
                bare.append(get_forward_backward_func())
                answers.append(hook(forward_backward_func=bare[-1]))

    run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[AskAgain()], steps=6)
    [graph] = fake_graphs.graphs  # no second capture
    assert graph.replays == 6 - 1 and graph.resets == 1  # freed once, at shutdown
    assert answers[0] is answers[1]
    assert answers[0] is not bare[0]  # the plugin's callable, not megatron-core's bare one


# -- TE manual hooks, DDP build stream ------------------------------------------------------------


def test_manual_hooks_are_set_when_the_host_enables_pre_hooks_itself(fake_graphs, monkeypatch):
    """Warm-up 0: the capture happens while the host has the pre-hooks off; a host that
    turns them back on directly (not through run.enable_forward_pre_hook) must still get the
    manual hooks, or the all-gather never runs for graphed layers."""

    def direct(self, model):
        for chunk in model:
            chunk.enable_forward_pre_hook()
        return True

    monkeypatch.setattr(TrainingRun, "enable_forward_pre_hook", direct)
    run(*TE, *OVERLAP, "--cuda-graph-warmup-steps", "0", steps=3)
    names = [event for event, _ in fake_graphs.events]
    assert names.count("set_manual_hooks") == 1
    assert ("set_manual_hooks", True) in fake_graphs.events


@pytest.mark.parametrize("mode", ["full", "te"])
def test_ddp_built_outside_the_build_context_is_refused_with_the_fix(
    fake_graphs, monkeypatch, mode
):
    monkeypatch.setattr(TrainingRun, "model_build_context", lambda self: contextlib.nullcontext())
    if mode == "full":  # 0.16 full-iteration graphs need no build stream: nothing to check
        summary, _ = run(*FULL, steps=4)
        assert summary["steps"] == 4
        return
    with pytest.raises(CudaGraphConfigError) as info:
        run(*TE, steps=4)
    message = str(info.value)
    assert "built outside run.model_build_context()" in message
    assert "with run.model_build_context():" in message
    assert "legacy stream" in message


# -- one report per job, one JSON per rank ---------------------------------------------------------


def test_rank_0_logs_the_table_and_other_ranks_write_their_own_json(
    fake_graphs, monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(compat, "any_rank", lambda flag: flag)
    path = tmp_path / "report.json"
    for rank in (0, 1):
        monkeypatch.setattr(compat, "distributed_world", lambda rank=rank: (rank, 2))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
            run(*FULL, "--cuda-graph-report-json", str(path), steps=5)
        tables = caplog.text.count("  verdict  ")
        assert tables == (1 if rank == 0 else 0)
    assert json.loads(path.read_text())["rank"] == 0
    other = tmp_path / "report.rank1.json"
    assert json.loads(other.read_text())["rank"] == 1
    assert json.loads(other.read_text())["world_size"] == 2


# -- megatron-core 0.18+ arguments read from the model config --------------------------------------


@pytest.mark.parametrize("single", [True, False])
def test_single_mempool_comes_from_the_model_config(fake_graphs, monkeypatch, single):
    """Megatron-LM passes ``config.cuda_graph_use_single_mempool``; it was hard-coded."""
    from megatron.core import full_cuda_graph

    from fakes import _fake_full_cuda_graph_019

    monkeypatch.setattr(full_cuda_graph, "FullCudaGraphWrapper", _fake_full_cuda_graph_019())
    made = []
    original = compat.make_full_iteration_wrapper

    def remember(func, warmup_steps, use_single_mempool):
        wrapper = original(func, warmup_steps, use_single_mempool)
        made.append(wrapper.use_single_mempool)
        return wrapper

    monkeypatch.setattr(compat, "make_full_iteration_wrapper", remember)

    class Config:
        @hookimpl
        def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
            model_config.cuda_graph_use_single_mempool = single  # 0.18+'s field

    run(*FULL, "--cuda-graph-warmup-steps", "1", plugins=[Config()], steps=3)
    assert made == [single]


def test_te_graphs_held_when_megatron_core_s_finish_capturing_fails_are_freed(
    fake_graphs, monkeypatch
):
    """megatron-core 0.16's ``_finish_capturing`` runs a barrier, zeroes the gradients and
    collects garbage after the layers hold their graphs and before ``_graphs_created`` is
    set: a barrier that fails there (a peer gone, the communicators aborted) must not leave
    the graphs held by the layers after shutdown."""
    import torch

    import train_gpt

    barriers = []
    real_barrier = torch.distributed.barrier

    def barrier(*args, **kwargs):
        barriers.append(1)
        if len(barriers) == 2:  # _start_capturing's, then _finish_capturing's
            raise RuntimeError("NCCL communicator was aborted")
        return real_barrier(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "barrier", barrier)
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="aborted"):
        train_gpt.run(
            ["--train-iters", "4", "--log-interval", "0", *TE, "--cuda-graph-warmup-steps", "1"],
            plugins=[recorder],
        )
    # counted where they were freed: at once, when the capture raised (seventh review: the
    # shutdown's count said 0)
    assert recorder.graph_plugin.graphs_freed == 2
    [helper] = fake_graphs.helpers
    assert [name for name, _ in fake_graphs.events].count("create_cudagraphs") == 1
    layers = [layer for chunk in helper.callables_per_chunk for layer in chunk]
    assert layers and all(layer.cuda_graphs == [] for layer in layers)
    assert not helper.graphs_created()


# -- a host that carries on after a failed TE capture -------------------------------------------


def _retrying_train(training, args, use_cuda, record):
    """A host loop that retries a step whose forward/backward raised (a transient error)."""
    setup = train_gpt.set_up(training, args, use_cuda)
    batches = train_gpt.synthetic_batches(
        seed=1,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        device=setup.device,
    )
    step_args = dict(
        forward_step_func=train_gpt.forward_step,
        model=setup.model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
    )
    record.errors = []
    step = args.start_step
    while step < args.train_iters:
        try:
            with training.train_step(step):
                train_gpt.optimizer_step(setup, data_iterator=batches, **step_args)
        except RuntimeError as exc:
            if isinstance(exc, ConfigurationError) or record.errors:
                raise  # (the plugin's refusal, or a second failure: no retry)
            record.errors.append(str(exc))
            continue
        record.steps += 1
        step += 1


@pytest.mark.parametrize("where", ["capture", "finish"])
@pytest.mark.parametrize("accept_eager", [True, False])
def test_a_failed_te_capture_is_undone_at_once_for_a_host_that_retries(
    fake_graphs, monkeypatch, caplog, where, accept_eager
):
    """The TE capture raises once, inside the layers' capture (megatron-core's capture flag
    set) or in megatron-core's _finish_capturing (the layers already hold their graphs); the
    host retries the step. The flag is cleared and the graphs freed at once, so the retried
    steps run eagerly, and the run says why no graph exists (fifth review: the flag stayed
    set until shutdown, every TE layer took the capture path and DDP's hooks were skipped;
    or the layers replayed graphs without the manual hooks while the report said nothing
    was captured)."""
    from megatron.core.transformer import cuda_graphs

    from fakes import FakeTECudaGraphHelper

    name = "_make_graphs" if where == "capture" else "_finish_capturing"
    original, calls = getattr(FakeTECudaGraphHelper, name), []

    def fails_once(self, *args):
        calls.append(1)
        if len(calls) == 1:
            if where == "finish":
                cuda_graphs._set_capture_end()
            raise RuntimeError(f"the capture failed ({where})")
        return original(self, *args)

    monkeypatch.setattr(FakeTECudaGraphHelper, name, fails_once)
    seen: dict[int, tuple[bool, int, int]] = {}

    class Look:
        @hookimpl
        def mcgraph_train_step_end(self, step, metrics):
            [helper] = fake_graphs.helpers
            layer = helper.flattened_callables[0]
            replays = sum(graph.calls for graph in layer.cuda_graphs)
            seen[step] = (cuda_graphs.is_graph_capturing(), len(layer.cuda_graphs), replays)

    record, recorder = train_gpt._Record(), Recorder()
    argv = ["--train-iters", "4", "--log-interval", "0", *TE, *OVERLAP]
    argv += ["--cuda-graph-warmup-steps", "1"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(caplog.at_level(logging.WARNING, logger="cudagraph_plugin"))
        if not accept_eager:
            info = stack.enter_context(pytest.raises(CudaGraphWiringError))
        train_gpt.host_run(
            [*argv, "--cuda-graph-accept-eager"] if accept_eager else argv,
            [recorder, Look()],
            parser=train_gpt.build_parser,
            train=_retrying_train,
            record=record,
        )
    assert record.errors == [f"the capture failed ({where})"]
    assert not cuda_graphs.is_graph_capturing()
    assert all(state == (False, 0, 0) for state in seen.values()), seen
    problem = f"the TE capture at step 1 raised (RuntimeError: the capture failed ({where}))"
    if accept_eager:
        assert sorted(seen) == [0, 1, 2, 3]
        assert recorder.report.graphs_captured is False
        assert problem in caplog.text
    else:
        assert problem in str(info.value)
