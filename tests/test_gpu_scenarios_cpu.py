"""The GPU suite's table and checks, on the CPU (the GPU jobs themselves need the device).

Every scenario of ``tests/test_gpu.py`` parses with the example's parser and passes the CUDA
graph plugin's own validation (as ``mcgraph_configure`` runs it at the start of a job), its
expectations agree with its flags (capture step = start step + warm-up, DP x TP = GPUs,
faults the probe accepts), and the checks a GPU job's records go through accept a record
shaped like a good run's and reject each defect they exist to catch. A GPU call costs
device time; a check that cannot fail, or fails on a good run, is found here first.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import rl_loop
import test_gpu
import test_gpu_rl
from test_gpu import SCENARIOS, Scenario

import train_gpt
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from hookspecs import TrainingRun, get_plugin_manager
from hookspecs.reasons import refused_by
from jobs import JobResult, first_failure
from train_jobs import PROBE_PATH, REPO, TrainJob, pinned_device, probe_refusal_said

GOOD = [s for s in SCENARIOS if not s.failure]
FAILURES = [s for s in SCENARIOS if s.failure]


def parse(argv: list[str]) -> Any:
    return train_gpt.build_parser(get_plugin_manager()).parse_args(argv)


def _probe() -> Any:
    spec = importlib.util.spec_from_file_location("mcgraph_probe", PROBE_PATH / "mcgraph_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_the_scenario_agrees_with_its_flags(scenario: Scenario) -> None:
    args = parse(scenario.argv())
    eager = parse(scenario.eager_argv())
    assert eager.cuda_graph_impl == "none"
    assert args.cuda_graph_impl != "none"
    assert args.start_step == scenario.start_step
    warmup = 3 if args.cuda_graph_warmup_steps is None else args.cuda_graph_warmup_steps
    assert scenario.capture_step == scenario.start_step + warmup
    if args.exit_interval:
        first_exit = -(-(scenario.start_step + 1) // args.exit_interval) * args.exit_interval
        assert scenario.last_step == first_exit - 1
        assert scenario.end == "early_exit"
    else:
        assert scenario.last_step == args.train_iters - 1
    assert scenario.nproc % args.tensor_model_parallel_size == 0
    assert scenario.te == (args.transformer_impl == "transformer_engine")
    assert ("validation" in scenario.stages) == (args.eval_interval is not None)
    if args.use_distributed_optimizer and args.overlap_param_gather:
        assert scenario.toggles is not None
    if scenario.failure:
        assert scenario.failing_ranks and max(scenario.failing_ranks) < scenario.nproc
        assert not scenario.parity
        assert scenario.end in ("exception", "signal")  # peers: peer_failed (issue 22)
        probe = _probe()
        env = dict(scenario.fault)
        for rank in range(scenario.nproc):
            # the probe accepts the fault (it would fail the job's configure otherwise)
            run = probe.Probe(
                get_plugin_manager(load_entrypoints=False), {**env, "RANK": str(rank)}
            )
            hit = run.fail_capture or any(
                spec is not None and probe._applies(spec[1], rank)
                for spec in (run.raise_at, run.sigterm_at, run.refuse_at)
            )
            assert hit == (rank in scenario.failing_ranks)
        if scenario.fault_step is not None:
            assert scenario.capture_step < scenario.fault_step < scenario.last_step
    else:
        assert scenario.end in ("completed", "early_exit")


def configure(argv: list[str]) -> None:
    """What a job does first: the plugins validate the configuration in configure."""
    pm = get_plugin_manager()
    args = train_gpt.build_parser(pm).parse_args(argv)
    run = TrainingRun(
        pm, config=args, train_iters=args.train_iters, start_step=args.start_step, handle_signals=()
    )
    with run:
        pass


def test_every_scenario_passes_the_plugins_validation(monkeypatch) -> None:
    from cudagraph_plugin.config import environment

    for scenario in SCENARIOS:
        with monkeypatch.context() as patch:
            if scenario.needs_optimizer_graph:  # its GPU run needs megatron-core 0.17+
                patch.setattr(environment, "has_optimizer_graph", lambda: True)
            configure(scenario.argv())
    # ... which is a real check: the MoE scenario without TE's fused permutation fails it
    moe = test_gpu.BY_NAME["te_moe"].argv()
    moe.remove("--moe-permute-fusion")
    with pytest.raises(CudaGraphConfigError, match="moe_preprocess"):
        configure(moe)
    # and the pipeline full-iteration scenario with megatron-core's default batched p2p
    pipeline = test_gpu.BY_NAME["pp2_full_iteration_unbatched_p2p"].argv()
    pipeline.remove("--no-batch-p2p-comm")
    with pytest.raises(CudaGraphConfigError, match="batch_isend_irecv"):
        configure(pipeline)


def _host_accepts(module: Any, argv: Sequence[str], nproc: int, monkeypatch) -> None:
    """``module``'s own checks (the example host's, on a GPU machine with TE) accept ``argv``
    in a job of ``nproc`` processes: they exit 2 otherwise."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        te = name == "transformer_engine"
        return object() if te else real_find_spec(name, *args)

    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", str(nproc))
        patch.setattr(train_gpt.importlib.util, "find_spec", find_spec)
        parser = module.build_parser(get_plugin_manager())
        args = parser.parse_args(list(argv))
        more = rl_loop._problems if module is rl_loop else None
        train_gpt._check_args(parser, args, use_cuda=True, more=more)


def test_the_example_hosts_accept_every_gpu_job_s_command_line(monkeypatch) -> None:
    """The hosts' own checks run before anything is built: one that refused a GPU test's
    command line would only be found on the GPU (a review, 2026-12-05)."""
    for scenario in SCENARIOS:
        for argv in (scenario.argv(), scenario.eager_argv()):
            _host_accepts(train_gpt, argv, scenario.nproc, monkeypatch)
    loop, bf16, graphs = test_gpu_rl.LOOP, test_gpu_rl.BF16, test_gpu_rl.GRAPHS
    bucketed = (*graphs, "--cuda-graph-buckets", test_gpu_rl.BUCKETS)
    offload = (*bf16, *test_gpu_rl.OFFLOAD)
    for argv, nproc in [  # the command lines of tests/test_gpu_rl.py's jobs
        ((*loop, *bf16), 1),
        ((*loop, *bf16, *bucketed), 1),
        ((*loop, *bf16, *graphs, "--cuda-graph-buckets", "512"), 1),
        ((*loop, *bf16, *test_gpu_rl.ROPE, *bucketed), 1),
        ((*loop, *offload, "--invalidate-after-reload", *bucketed), 1),
        ((*loop, *offload, *bucketed, "--optimizer-cuda-graph", "--transformer-impl",
          "transformer_engine"), 1),
        ((*loop, *offload, "--invalidate-after-reload", *bucketed), 2),
        ((*loop, *bf16, "--use-distributed-optimizer", "--overlap-param-gather",
          "--overlap-grad-reduce", *bucketed), 2),
    ]:  # fmt: skip
        _host_accepts(rl_loop, argv, nproc, monkeypatch)


@pytest.mark.parametrize("name", ["tp2_sp_te_attn", "pp2_te_attn_mlp"])
def test_the_hosts_check_refuses_a_two_process_layout_in_one_process(
    name, monkeypatch, capsys
) -> None:
    """(what makes the test above one that can fail)"""
    with pytest.raises(SystemExit) as refused:
        _host_accepts(train_gpt, test_gpu.BY_NAME[name].argv(), 1, monkeypatch)
    assert refused.value.code == 2
    assert "ranks per model replica must divide the job's 1 process(es)" in capsys.readouterr().err


def test_scenario_names_are_the_test_ids_and_the_eager_twins_are_shared() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(set(names)) == len(names)
    twins = {s.name: s.twin_key for s in GOOD}
    assert twins["te_attn"] == twins["te_attn_mlp"]
    assert twins["te_overlap_w0"] == twins["te_overlap_w2"] != twins["te_overlap_w2_resumed"]
    assert twins["full_iteration"] != twins["dp2_full_iteration"]


# -------------------------------------------------------------------------------------------
# The checks, on records shaped like the probe's.
# -------------------------------------------------------------------------------------------


def _result(rc: int = 0, wall_s: float = 20.0, **changes: Any) -> JobResult:
    fields = dict(
        name="x",
        command=["python"],
        rc=rc,
        wall_s=wall_s,
        timed_out=False,
        stdout=Path("/nonexistent/stdout.log"),
        stderr=Path("/nonexistent/stderr.log"),
        tag="t",
        leftovers=[],
        survivors=[],
    )
    fields.update(changes)
    return JobResult(**fields)


def fails(check: Any) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False


def check_all_ranks(s: Scenario, job: TrainJob) -> None:
    for rank in range(s.nproc):
        test_gpu.check_graphed_rank(s, job, rank)


def good_record(s: Scenario) -> dict[str, Any]:
    """What the probe writes for a run of ``s`` that does what the table expects."""
    impl = "local" if "local" in s.graphs else "transformer_engine"
    events: list[list[Any]] = [list(t) for t in s.toggles or ()]
    events.append(["train_start", s.start_step, test_gpu.STEPS])
    captures = [{"stage": "training", "step": s.capture_step, "seconds": 0.5}]
    for step in range(s.start_step, s.last_step + 1):
        events.append(["step", step])
        if step == s.capture_step:
            events += [["before_capture", step, impl, []], ["after_capture", step, 2]]
        events.append(["step_end", step])
        if "validation" in s.stages and (step + 1) % 4 == 0:
            events.append(["evaluation_start", step])
            if step == 7:
                events += [["before_capture", step, impl, []], ["after_capture", step, 2]]
                captures.append({"stage": "validation", "step": 7, "seconds": 0.5})
            events.append(["evaluation_end", step])
    events += [["report"], ["shutdown", s.end]]
    steps = list(range(s.start_step, s.last_step + 1))
    return {
        "shutdown_reason": s.end,
        "plugins": ["probe", "cudagraph", RUN_PLUGIN_NAME, "mcgraph-probe-run"],
        "events": events,
        "report": {
            "graphs_captured": True,
            "capture_step": s.capture_step,
            "replay_steps": list(range(s.capture_step + 1, s.last_step + 1)),
            "capture_seconds": 0.5,
            "memory_before_capture": {"allocated_mib": 128.0},
            "memory_after_capture": {"allocated_mib": 130.0},
            "graph_count": 2,
        },
        "graph_plugin": {
            "graphs_freed": 2,
            "allocated_after_free_mib": 64.0,
            "memory_before": {"allocated_mib": 128.0},
            "captures": captures,
        },
        "memory": {"before_capture_mib": 128.0, "at_record_mib": 64.0},
        "loss_steps": steps,
        "losses": [7.0 - 0.1 * i for i in range(len(steps))],
        "eval_losses": [6.5] * sum(1 for e in events if e[0] == "evaluation_end"),
        "at_exit": {"process_group_initialized": False},
    }


def job_of(s: Scenario, records: dict[int, dict[str, Any]], **result: Any) -> TrainJob:
    return TrainJob(s.name, s.argv(), s.nproc, _result(**result), records)


def _set(record: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    record = copy.deepcopy(record)
    *parents, last = path.split(".")
    target = record
    for key in parents:
        target = target[key]
    target[last] = value
    return record


GOOD_RUN_DEFECTS = {
    "capture a step late": lambda r, s: _set(r, "report.capture_step", s.capture_step + 1),
    "a replay step missing": lambda r, s: _set(
        r, "report.replay_steps", r["report"]["replay_steps"][1:]
    ),
    "a graph not freed": lambda r, s: _set(r, "graph_plugin.graphs_freed", 1),
    "no graph at all": lambda r, s: _set(
        _set(r, "graph_plugin.graphs_freed", 0), "report.graph_count", 0
    ),
    "memory not back": lambda r, s: _set(r, "graph_plugin.allocated_after_free_mib", 200.0),
    "wrong shutdown reason": lambda r, s: _set(r, "shutdown_reason", "exception"),
    "a NaN loss": lambda r, s: _set(r, "losses", [*r["losses"][:-1], float("nan")]),
    "a process group left": lambda r, s: _set(r, "at_exit.process_group_initialized", True),
    "no exit record": lambda r, s: {k: v for k, v in r.items() if k != "at_exit"},
    "the graph plugin missing": lambda r, s: _set(r, "plugins", ["probe", "mcgraph-probe-run"]),
    "a step missing": lambda r, s: _set(
        r, "events", [e for e in r["events"] if e != ["step", s.last_step]]
    ),
}

SAMPLES = [
    "full_iteration_eval",
    "te_overlap_w2_resumed",
    "te_attn_mlp_early_exit",
    "tp2_sp_te_attn",
]


@pytest.mark.parametrize("name", SAMPLES)
def test_the_good_run_checks_pass_a_good_record_and_catch_every_defect(name: str) -> None:
    s = test_gpu.BY_NAME[name]
    good = good_record(s)
    check_all_ranks(s, job_of(s, {r: good for r in range(s.nproc)}))
    defects = dict(GOOD_RUN_DEFECTS)
    if s.toggles:
        defects["no toggles"] = lambda r, s: _set(
            r, "events", [e for e in r["events"] if "pre_hook" not in e[0]]
        )
    if "validation" in s.stages:
        defects["no validation graph"] = lambda r, s: _set(
            r, "events", [e for e in r["events"] if e[0] != "after_capture" or e[1] != 7]
        )
    for defect, make in defects.items():
        records = {r: good for r in range(s.nproc)}
        records[s.nproc - 1] = make(good, s)  # the last rank's record has the defect
        job = job_of(s, records)
        assert fails(lambda job=job: check_all_ranks(s, job)), f"not caught: {defect}"
    # and a job that hung, or left a process behind, fails before any record is read
    for result in ({"timed_out": True, "rc": -9}, {"leftovers": [4242]}):
        with pytest.raises(AssertionError):
            test_gpu.check_job_ended_cleanly(job_of(s, {0: good}, **result))


FAULT_AT = 1_700_000_000.0  # the probe's wall-clock fault time in these records


def failure_record(s: Scenario) -> dict[str, Any]:
    captured = s.fault_step is not None
    return {
        "shutdown_reason": s.end,
        "fault_at": FAULT_AT,
        "losses": None,
        "events": [["step", 6], ["fault", "raise", 6], ["report"], ["shutdown", s.end]],
        "report": {
            "graphs_captured": captured,
            "capture_step": s.capture_step if captured else None,
            "graph_count": 2 if captured else 0,
            "memory_before_capture": {"allocated_mib": 128.0} if captured else None,
        },
        "graph_plugin": {"graphs_freed": 2 if captured else 0, "allocated_after_free_mib": 64.0},
        "memory": {"before_capture_mib": 128.0, "at_record_mib": 64.0},
    }


def peer_record(s: Scenario) -> dict[str, Any]:
    """What a rank the fault did not hit writes: its watch ended it (issue 22)."""
    failing = ", ".join(str(r) for r in s.failing_ranks)
    told = f"PeerFailed('rank {failing} (h, pid 7) failed: exception: ...')"
    if s.refusal:  # told of a refusal: the refusal itself, the probe's own words naming the rank
        told = f"PeerRefused('{refused_by(failing, f'mcgraph probe: rank {failing} refuses')}')"
    return {
        "shutdown_reason": "peer_failed",
        "fault_at": None,
        "exception": told,
        "losses": None,
        "events": [["step", 6], ["report"], ["shutdown", "peer_failed"]],
        "report": {"graphs_captured": True, "graph_count": 2},
        "graph_plugin": {"graphs_freed": 2, "allocated_after_free_mib": 64.0},
        "memory": {"before_capture_mib": 128.0, "at_record_mib": 64.0},
    }


def refusal_output(
    tmp_path: Path, lines: list[str], first_exit: tuple[int, int] | None = None
) -> Path:
    """A job's standard error with a refusal scenario's ``error:`` lines, or the told
    ranks' lines of a failure scenario (the rest of what such a job prints: log lines,
    torchrun's one traceback) and, under torchrun,
    ``first_exit``: its line for the first worker that exited (exit status, local rank)."""
    path = tmp_path / f"stderr-{len(list(tmp_path.iterdir()))}.log"
    text = "[cudagraph_plugin] [rank 1] shutdown (exception): 1 CUDA graph(s) freed\n"
    text += "".join(f"{line}\n" for line in lines)
    if first_exit is not None:
        status, rank = first_exit
        text += f"E1204 api.py:1002] {first_failure(status, rank)} (pid: 7)\n"
    path.write_text(text + "Traceback (most recent call last):\nChildFailedError\n")
    return path


@pytest.mark.parametrize("s", FAILURES, ids=lambda s: s.name)
def test_the_failure_checks_pass_an_ended_job_and_catch_a_hang_or_a_leak(
    s: Scenario, tmp_path: Path
) -> None:
    rc = -15 if s.nproc == 1 and s.end == "signal" else 1
    if s.nproc == 1 and s.refusal:
        rc = 2  # print_refusal's exit status
    records = {rank: failure_record(s) for rank in s.failing_ranks}
    peers = sorted(set(range(s.nproc)) - set(s.failing_ranks))
    records.update({rank: peer_record(s) for rank in peers})
    ended = FAULT_AT + 3.0  # the job ended 3 s after the fault
    said: dict[str, Any] = {}  # a refusal scenario's output: said once, by the refusing rank
    bad_output: list[Path] = []
    if s.refusal:
        [who] = s.failing_ranks
        assert s.fault_step is not None
        line = probe_refusal_said(who, s.fault_step)
        # under torchrun the speaker exits first, with the refusal's status
        first = (2, who) if s.nproc > 1 else None
        entry = [f"  traceback : CudaGraphConfigError: {test_gpu.REFUSAL_ENTRY}, ..."]
        said = {"stderr": refusal_output(tmp_path, [line] + entry * (s.nproc > 1), first)}
        # the same refusal, its rank named where it should not be, or not where it should
        if who:
            misnamed = line.replace(f"rank {who} refused the run: ", "")
        else:
            misnamed = line.replace("error: ", "error: rank 1 refused the run: ", 1)
        assert misnamed != line
        bad_output = [
            refusal_output(tmp_path, lines, first) for lines in ([], [line, line], [misnamed])
        ]
        if s.nproc > 1:  # said, but another rank exited first, or the speaker with status 1
            other = 1 - who
            bad_output += [
                refusal_output(tmp_path, [line, *entry], exit_line)
                for exit_line in (None, (2, other), (1, who))
            ]
            bad_output.append(refusal_output(tmp_path, [line], first))  # (no summary entry)

    elif peers:  # each told rank says its end in one line (print_peer_failure)
        failing = ", ".join(str(r) for r in s.failing_ranks)
        told = [f"[rank {p}] run ended: rank {failing} (h, pid 7) failed: ..." for p in peers]
        entries = [
            f"  traceback : {test_gpu.TOLD_ENTRY}rank {failing} (h, pid 7) ..." for _ in peers
        ]
        said = {"stderr": refusal_output(tmp_path, told + entries)}
        bad_output = [
            refusal_output(tmp_path, []),  # (its traceback instead)
            refusal_output(tmp_path, told),  # (torchrun's summary: "To enable traceback ...")
        ]

    def job_of_s(records: dict[int, dict[str, Any]], **result: Any) -> TrainJob:
        return job_of(s, records, **{**said, **result})

    test_gpu.check_failure(s, job_of_s(records, rc=rc, wall_s=12.0, ended_at=ended))
    bad_jobs = [
        *(job_of_s(records, rc=rc, ended_at=ended, stderr=path) for path in bad_output),
        job_of_s(records, rc=0, ended_at=ended),
        job_of_s(records, rc=rc, wall_s=61.0, ended_at=ended),
        job_of_s(records, rc=-9, timed_out=True, wall_s=90.0, ended_at=ended),
        job_of_s({}, rc=rc, ended_at=ended),
        job_of_s(records, rc=rc, wall_s=40.0, ended_at=FAULT_AT + 20.0),  # not within 15 s
    ]
    for peer in peers:
        for path, value in (
            ("shutdown_reason", "signal"),  # ended by torchrun, not by its watch
            ("exception", "PeerFailed('rank 9 failed')"),
            *(  # told of a failure, not of the refusal (the probe's words name the rank)
                [("exception", "PeerFailed('rank 1 failed: mcgraph probe: rank 1 refuses')")]
                if s.refusal
                else []
            ),
            ("graph_plugin.graphs_freed", 0),
            ("graph_plugin.allocated_after_free_mib", 300.0),
        ):
            changed = {**records, peer: _set(records[peer], path, value)}
            bad_jobs.append(job_of_s(changed, rc=rc, ended_at=ended))
        bad_jobs.append(
            job_of_s({r: v for r, v in records.items() if r != peer}, rc=rc, ended_at=ended)
        )
    rank = s.failing_ranks[-1]
    for path, value in (
        ("shutdown_reason", "completed"),
        ("graph_plugin.allocated_after_free_mib", 300.0),
        ("graph_plugin.graphs_freed", 1 if s.fault_step is not None else -1),
        ("losses", [1.0]),
    ):
        bad_jobs.append(
            job_of_s({**records, rank: _set(records[rank], path, value)}, rc=rc, ended_at=ended)
        )
    if rc in (-15, 2):
        bad_jobs.append(job_of_s(records, rc=1, ended_at=ended))
    for job in bad_jobs:
        assert fails(lambda job=job: test_gpu.check_failure(s, job)), job


def test_the_killed_rank_checks_pass_a_survivor_that_shut_down_and_catch_the_old_end(
    tmp_path: Path,
) -> None:
    """``check_killed_without_a_word`` (rank 1 SIGKILLed, no mark): rank 0's shutdown ran by
    torchrun's SIGTERM after the peer watch's release, graphs freed. The end before the
    release (the stuck-signal exit 5 s after the SIGTERM: no record from rank 0, the exit
    line) and every other defect fail it."""
    s = test_gpu.KILLED
    killed = {
        "shutdown_reason": None,
        "fault_at": FAULT_AT,
        "losses": None,
        "events": [["step", 6], ["step_end", 6], ["fault", "sigkill", 6]],
        "report": None,
        "graph_plugin": None,
    }
    survivor = {**peer_record(s), "shutdown_reason": "signal", "exception": "SignalReceived()"}
    records = {0: survivor, 1: killed}
    released = f"[cudagraph_plugin] {test_gpu.RELEASED_LINE} (a collective ...)"
    good = {"stderr": refusal_output(tmp_path, [released])}
    ended = FAULT_AT + 8.0
    test_gpu.check_killed_without_a_word(
        job_of(s, records, rc=1, wall_s=20.0, ended_at=ended, **good)
    )
    stuck_exit = (
        "hookspecs.run: [rank 0] SIGTERM received, but the main thread has not come back to "
        "Python for 5 s (blocked in C at x.py:1 (f)): ending the process now with status 143, "
        "without the shutdown hooks"
    )
    bad_jobs = [
        job_of(s, {1: killed}, rc=1, ended_at=ended, stderr=refusal_output(tmp_path, [stuck_exit])),
        job_of(s, records, rc=1, ended_at=ended, stderr=refusal_output(tmp_path, [])),
        # every record good, but a process ended by the stuck-signal watch all the same
        job_of(
            s,
            records,
            rc=1,
            ended_at=ended,
            stderr=refusal_output(tmp_path, [released, stuck_exit]),
        ),
        job_of(s, records, rc=0, ended_at=ended, **good),
        job_of(s, records, rc=1, wall_s=61.0, ended_at=ended, **good),
        job_of(s, records, rc=1, ended_at=FAULT_AT + 31.0, **good),  # torchrun's SIGKILL
        job_of(s, records, rc=-9, timed_out=True, wall_s=90.0, ended_at=ended, **good),
    ]
    for rank, path, value in (
        (0, "shutdown_reason", "completed"),
        (0, "shutdown_reason", None),
        (0, "graph_plugin.graphs_freed", 0),
        (0, "graph_plugin.allocated_after_free_mib", 300.0),
        (1, "shutdown_reason", "signal"),  # (not a death without a word)
        (1, "events", [["step", 6]]),
    ):
        changed = {**records, rank: _set(records[rank], path, value)}
        bad_jobs.append(job_of(s, changed, rc=1, ended_at=ended, **good))
    for job in bad_jobs:
        assert fails(lambda job=job: test_gpu.check_killed_without_a_word(job)), job


def test_the_early_end_checks_pass_a_told_rank_and_catch_the_hang(tmp_path: Path) -> None:
    """``check_left_early`` (rank 1's loop ends early after step 6, rank 0 goes on): rank 1
    ``early_exit`` with its graphs freed, rank 0 told by its watch (``peer_failed`` naming
    the early end and both steps), every graph freed, the job ended within seconds. The old
    end (rank 0 in step 7's all-reduce until the collective's timeout, or a failure that
    does not name the early end) and every other defect fail it."""
    s = test_gpu.LEFT_EARLY
    left = {
        **failure_record(s),
        "losses": [2.0] * 7,
        "events": [["step", 6], ["step_end", 6], ["fault", "exit", 6], ["report"]],
    }
    told = {
        **peer_record(s),
        "exception": "PeerFailed('rank 1 (h, pid 7) ended its run early: early_exit after step "
        "6, while rank 0 went on to step 7: ...')",
    }
    records = {0: told, 1: left}
    line = "[cudagraph_plugin] [rank 0] run ended: rank 1 (h, pid 7) ended its run early: ..."
    entry = f"  traceback : {test_gpu.TOLD_ENTRY}rank 1 (h, pid 7) ended its run early: ..."
    good = {"stderr": refusal_output(tmp_path, [line, entry])}
    ended = FAULT_AT + 3.0
    test_gpu.check_left_early(job_of(s, records, rc=1, wall_s=20.0, ended_at=ended, **good))
    bad_jobs = [
        job_of(s, records, rc=0, wall_s=20.0, ended_at=ended, **good),
        job_of(s, records, rc=1, wall_s=20.0, ended_at=ended, stderr=refusal_output(tmp_path, [])),
        # said, but not in torchrun's summary ("To enable traceback see ...")
        job_of(
            s, records, rc=1, wall_s=20.0, ended_at=ended, stderr=refusal_output(tmp_path, [line])
        ),
        # the collective's timeout ended rank 0 (NCCL's watchdog, minutes later)
        job_of(s, records, rc=1, wall_s=61.0, ended_at=ended, **good),
        job_of(s, records, rc=1, wall_s=20.0, ended_at=FAULT_AT + 16.0, **good),
        job_of(s, records, rc=-9, timed_out=True, wall_s=90.0, ended_at=ended, **good),
    ]
    for rank, path, value in (
        (0, "shutdown_reason", "exception"),
        (0, "exception", "DistBackendError('... rank 1 (h, pid 7) had ended its run early')"),
        (
            0,
            "exception",
            "PeerFailed('... early_exit after step 6, while rank 0 went on to step 6')",
        ),
        (0, "graph_plugin.graphs_freed", 0),
        (0, "graph_plugin.allocated_after_free_mib", 300.0),
        (1, "shutdown_reason", "completed"),
        (1, "events", [["step", 6], ["step_end", 6]]),
        (1, "graph_plugin.graphs_freed", 1),
    ):
        changed = {**records, rank: _set(records[rank], path, value)}
        bad_jobs.append(job_of(s, changed, rc=1, wall_s=20.0, ended_at=ended, **good))
    for job in bad_jobs:
        assert fails(lambda job=job: test_gpu.check_left_early(job)), job


GOOD_TWO_RANK_OUTPUT = """\
[cudagraph_plugin] RNG tracker is CUDA-graph safe: TECudaRNGStatesTracker
[cudagraph_plugin] [rank 0] captured 4 graph(s)
[cudagraph_plugin] [rank 1] captured 4 graph(s)
[cudagraph_plugin] CUDA graph report (rank 0 of 2):
[cudagraph_plugin] [rank 1] shutdown (completed): 4 CUDA graph(s) freed
[cudagraph_plugin] [rank 0] shutdown (completed): 4 CUDA graph(s) freed
"""


def test_a_two_rank_job_must_say_each_job_wide_line_once(tmp_path) -> None:
    s = test_gpu.BY_NAME["dp2_full_iteration"]

    def job_saying(text: str) -> TrainJob:
        stdout = tmp_path / f"{len(list(tmp_path.iterdir()))}.log"
        stdout.write_text(text)
        return job_of(s, {}, stdout=stdout)

    test_gpu.check_said_once(job_saying(GOOD_TWO_RANK_OUTPUT))
    lines = GOOD_TWO_RANK_OUTPUT.splitlines(keepends=True)
    bad = {
        "both ranks say the RNG line": [lines[0], *lines],
        "both ranks print the report": [*lines, lines[3]],
        "no report": [line for line in lines if "report" not in line],
        "rank 1 never shut down": [line for line in lines if "[rank 1] shutdown" not in line],
        "untagged shutdown lines": [line.replace("[rank 0] ", "") for line in lines],
    }
    for defect, text in bad.items():
        job = job_saying("".join(text))
        assert fails(lambda job=job: test_gpu.check_said_once(job)), f"not caught: {defect}"


def test_parity_is_per_rank_within_the_bf16_tolerance() -> None:
    s = test_gpu.BY_NAME["dp2_full_iteration"]
    eager = job_of(s, {0: {"losses": [7.0, 6.0]}, 1: {"losses": [7.5, 6.5]}})
    close = job_of(s, {0: {"losses": [7.05, 6.04]}, 1: {"losses": [7.5, 6.55]}})
    test_gpu.check_parity(s, close, eager)
    off = job_of(s, {0: {"losses": [7.0, 6.0]}, 1: {"losses": [7.5, 6.7]}})
    with pytest.raises(AssertionError, match="rank 1"):
        test_gpu.check_parity(s, off, eager)


def test_parity_of_a_scenario_with_evaluation_covers_its_evaluation_losses() -> None:
    s = test_gpu.BY_NAME["dp2_full_iteration_overlap_eval"]
    ranks = (0, 1)
    eager = job_of(s, {r: {"losses": [7.0, 6.0], "eval_losses": [6.5, 5.5]} for r in ranks})
    same = job_of(s, {r: {"losses": [7.0, 6.0], "eval_losses": [6.5, 5.51]} for r in ranks})
    test_gpu.check_parity(s, same, eager)
    stale = {**{0: {"losses": [7.0, 6.0], "eval_losses": [6.5, 5.5]}},
             1: {"losses": [7.0, 6.0], "eval_losses": [6.5, 5.7]}}  # fmt: skip
    with pytest.raises(AssertionError, match="rank 1: graphed vs eager eval losses"):
        test_gpu.check_parity(s, job_of(s, stale), eager)


def test_capture_stages_come_from_the_events_around_them() -> None:
    events = [
        ["step", 3],
        ["after_capture", 3, 1],
        ["evaluation_start", 7],
        ["after_capture", 7, 2],
        ["evaluation_end", 7],
    ]
    assert test_gpu.capture_stages(events) == [("training", 3), ("validation", 7)]


def test_each_xdist_worker_pins_its_jobs_to_its_own_gpu() -> None:
    assert pinned_device(None, None, 2) is None
    assert pinned_device("master", None, 2) is None
    assert [pinned_device(w, None, 2) for w in ("gw0", "gw1", "gw2")] == ["0", "1", "0"]
    assert [pinned_device(w, "3,5", 8) for w in ("gw0", "gw1")] == ["3", "5"]
    assert pinned_device("gw0", None, 0) is None


@pytest.mark.slow
def test_the_suite_driver_runs_and_packs_its_outputs_where_no_gpu_is_visible(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
        "TMPDIR": str(tmp_path),
    }
    command = [
        "bash",
        str(REPO / "tests" / "gpu_suite.sh"),
        str(out),
        "single",
        "-k",
        "full_iteration_eval",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # at most 8 files come back from the device
    assert sorted(path.name for path in out.iterdir()) == ["logs.tar.gz", "summary.txt", "table.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        junit = ET.fromstring(tar.extractfile("./junit_single.xml").read())
        assert "./gpu_processes_after.txt" in tar.getnames()
    cases = {case.get("name"): case for case in junit.iter("testcase")}
    assert sorted(cases) == ["test_scenario[full_iteration_eval]"]
    for case in cases.values():
        assert case.find("skipped").get("message") == "needs a CUDA device"
    assert "## single: pytest exit code 0" in (out / "summary.txt").read_text()
    assert list(tmp_path.glob("mcgraph-gpu-suite.*")) == []  # its work folder is gone
