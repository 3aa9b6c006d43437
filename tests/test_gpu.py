"""CUDA graphs for real, run the way users run them: one fresh process per scenario.

Every scenario is its own job, launched by its test through ``tests/jobs.py``:
``python examples/train_gpt.py ...`` on one GPU, ``torchrun --standalone --nproc-per-node 2
examples/train_gpt.py ...`` on two. Running scenarios in one process hid a real bug (per-layer
TE graphs failed in every fresh process but passed in file order, on state earlier tests
left behind), so no test here uses anything another test did: each passes alone and in any
order. A job that runs past its timeout is killed whole, torchrun's workers included (they
live in their own sessions), and fails its test with its logs' tails; after every job the
launcher checks that none of its processes is left. What a run did comes back through the
probe plugin (``tests/probe/``, installed for the jobs through its ``.dist-info``): each
rank's hook events, run report, losses and the CUDA graph plugin's cleanup facts.

The scenarios are the table :data:`SCENARIOS` below (name, flags, GPUs, expected capture
step, expectations). Assertions, on every rank:

* good runs: exit code 0, the expected shutdown reason (``completed``/``early_exit``),
  captured at the expected step (and for evaluation a validation graph too), replayed on
  every later step, ``graphs freed == graph count > 0``, allocated memory after the free
  back near its level before the capture (8 MiB slack; 64 MiB with warm-up 0, whose
  capture precedes Adam's state), the expected forward pre-hook toggles, finite losses, no
  process group left at exit, and loss parity with the scenario's eager twin (the same
  flags without the CUDA-graph ones, so the same model and seed) within ``rtol=atol=1e-2``
  (bf16), per rank;
* failure runs (a raise, SIGTERM or failed capture injected by the probe): the job ends
  non-zero in under 60 s (not a speed limit: the bound that tells an ended job from a hung
  one), and each failing rank's record says ``exception``/``signal`` with its graphs freed
  and allocated memory back near the pre-capture level.

The eager twins run inside the tests that need them, once per pytest process (cached by
command line); ``xdist_group`` marks keep the scenarios sharing a twin on one worker under
``--dist loadgroup``. Speed is never asserted (``benchmarks/`` measures it); each job's
report goes to ``MCGRAPH_GPU_RESULTS`` when set (one JSON line per job, see
``tests/gpu_table.py``). Two runs in one process, the one thing that needs in-process
state, is ``tests/test_gpu_in_process.py``.

Markers: ``gpu`` (one GPU; skipped without CUDA) and ``multigpu`` (two GPUs; skipped with
fewer); TE scenarios are skipped without Transformer Engine. On a 2-GPU host the single-GPU
scenarios run two at a time (pytest-xdist, each worker's jobs pinned to its own GPU through
``CUDA_VISIBLE_DEVICES``: ``gw0`` -> the first, ``gw1`` -> the second); the two-GPU ones run
in a second invocation without xdist. On the device (after ``../shared/gpu/README.md``'s
install steps), one call each, under 600 s::

    source /tmp/gpu/env.sh && bash tests/gpu_suite.sh $OUT single
    source /tmp/gpu/env.sh && bash tests/gpu_suite.sh $OUT multi
    source /tmp/gpu/env.sh && bash tests/gpu_suite.sh $OUT single -k "te_attn or exception"

or by hand::

    MCGRAPH_GPU_RESULTS=$OUT/results.jsonl python3 -m pytest tests/test_gpu.py \\
        tests/test_gpu_in_process.py -m gpu -n 2 --dist loadgroup -W ignore -q
    MCGRAPH_GPU_RESULTS=$OUT/results.jsonl python3 -m pytest tests/test_gpu.py -m multigpu \\
        -W ignore -q
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from cudagraph_plugin import compat
from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from hookspecs.reasons import refused_by
from jobs import first_failure
from train_jobs import (
    HAS_TE,
    TE_SPEC,
    TrainJob,
    append_result,
    check_job_ended_cleanly,
    end_after_fault_s,
    launch,
    probe_refusal_said,
    result_line,
    single_gpu_env,
)

# A small bf16 GPT: big enough to launch real kernels, quick to build (--bf16 first:
# Scenario.precision replaces it).
MODEL = (
    "--bf16",
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "2",
    "--vocab-size",
    "1024",
    "--log-interval",
    "0",
)
STEPS = 12
FULL = ("--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration")
OVERLAP = ("--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce")
MOE = (
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-permute-fusion",
)
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
EVAL = ("--eval-interval", "4", "--eval-iters", "2")
PP2 = ("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-microbatches", "4")
FP8 = ("--fp8-format", "hybrid")

# bf16 loss parity, eager vs graphed (as the in-process suite had it).
PARITY_TOLERANCE = {"rtol": 1e-2, "atol": 1e-2}
# FP8 (delayed scaling): the amax history makes the scales depend on earlier steps' values,
# so small bf16 differences can move later losses more.
FP8_PARITY_TOLERANCE = {"rtol": 5e-2, "atol": 5e-2}
# A failure job must have ended by then: the correctness bound of "no hang" (issue 12).
NO_HANG_S = 60.0
# ... and every rank within this of the first fault (issue 22: the other ranks' watch of the
# job ends them, instead of torchrun's grace period).
PEER_END_S = 15.0
GOOD_TIMEOUT_S = float(os.environ.get("MCGRAPH_GPU_JOB_TIMEOUT", "180"))
# Longer than NO_HANG_S, so that a slow exit is reported with its time rather than as a hang.
FAILURE_TIMEOUT_S = 90.0
# A test launches two jobs at most (a scenario and its eager twin), each ended by its own
# timeout: pytest's (300 s, thread method: it ends the whole session) only as a backstop.
pytestmark = pytest.mark.timeout(2 * GOOD_TIMEOUT_S + 60)


def te(scope: str) -> tuple[str, ...]:
    return ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", scope)


def warmup(steps: int) -> tuple[str, ...]:
    return ("--cuda-graph-warmup-steps", str(steps))


HOST_TOGGLES = (("disable_pre_hook", False), ("enable_pre_hook",))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One row of the scenario table.

    :ivar base: Flags shared with the eager twin (model spec, parallelism, evaluation, ...).
    :ivar graphs: The CUDA-graph flags; the eager twin runs ``base`` without them.
    :ivar capture_step: The training step the capture must happen at (every rank).
    :ivar last_step: The last training step that runs (``STEPS - 1`` unless it exits early).
    :ivar end: The expected shutdown reason (of the failing ranks, for a failure).
    :ivar fault: The probe's fault-injection variables for the job.
    :ivar failing_ranks: Ranks the fault hits (failure scenarios).
    :ivar stages: The graphs captured, in order: ``training``, then ``validation``.
    :ivar toggles: The expected forward pre-hook toggles, in order (``None``: not checked).
    :ivar slack_mib: How far above the pre-capture level allocated memory may be after free.
    :ivar loss_ranks: The ranks that compute the loss (``None``: all; with pipeline
        parallelism only the last stage's).
    :ivar tolerance: The loss parity tolerance (bf16 by default, wider for FP8).
    :ivar needs_optimizer_graph: Skipped where megatron-core has no optimizer graph (< 0.17).
    :ivar precision: Flags that replace the model's ``--bf16`` (``None``: bf16).
    """

    name: str
    base: tuple[str, ...]
    graphs: tuple[str, ...]
    nproc: int = 1
    capture_step: int | None = 3
    last_step: int = STEPS - 1
    start_step: int = 0
    te: bool = False
    parity: bool = True
    end: str = "completed"
    fault: tuple[tuple[str, str], ...] = ()
    failing_ranks: tuple[int, ...] = ()
    stages: tuple[str, ...] = ("training",)
    toggles: tuple[tuple[Any, ...], ...] | None = None
    slack_mib: float = 8.0
    loss_ranks: tuple[int, ...] | None = None
    tolerance: tuple[tuple[str, float], ...] = tuple(PARITY_TOLERANCE.items())
    needs_optimizer_graph: bool = False
    precision: tuple[str, ...] | None = None

    def computes_loss(self, rank: int) -> bool:
        """Only the last pipeline stage computes the loss."""
        return self.loss_ranks is None or rank in self.loss_ranks

    @property
    def failure(self) -> bool:
        return bool(self.fault)

    @property
    def fault_step(self) -> int | None:
        """The step a raise, SIGTERM, SIGKILL, refusal or early exit is injected at (``None``
        for a capture failure)."""
        for var, value in self.fault:
            if var.endswith(("_RAISE", "_SIGTERM", "_SIGKILL", "_REFUSE", "_EXIT")):
                return int(value.split(":")[0])
        return None

    @property
    def refusal(self) -> bool:
        """The fault is a refused run (``MCGRAPH_PROBE_REFUSE``): said once, by that rank."""
        return any(var.endswith("_REFUSE") for var, _ in self.fault)

    def argv(self) -> list[str]:
        return [*self.eager_argv(), *self.graphs]

    def eager_argv(self) -> list[str]:
        model = MODEL if self.precision is None else (*MODEL[1:], *self.precision)
        return ["--train-iters", str(STEPS), *model, *self.base]

    @property
    def twin_key(self) -> str:
        text = " ".join([str(self.nproc), *self.eager_argv()])
        return "eager-" + hashlib.sha1(text.encode()).hexdigest()[:10]


def _fault(var: str, value: str) -> tuple[tuple[str, str], ...]:
    return ((f"MCGRAPH_PROBE_{var}", value),)


SCENARIOS: tuple[Scenario, ...] = (
    # -- one GPU --------------------------------------------------------------------------
    Scenario("full_iteration", (), FULL),
    Scenario("full_iteration_eval", EVAL, FULL, stages=("training", "validation")),
    Scenario(
        "full_iteration_te_spec_eval",
        (*TE_SPEC, *EVAL),
        FULL,
        te=True,
        stages=("training", "validation"),
    ),
    Scenario("full_iteration_overlap", OVERLAP, FULL, toggles=HOST_TOGGLES),
    Scenario("te_attn", TE_SPEC, te("attn"), te=True),
    Scenario("te_attn_mlp", TE_SPEC, te("attn,mlp"), te=True),
    Scenario("te_moe", (*TE_SPEC, *MOE), te("attn,moe_router,moe_preprocess"), te=True),
    Scenario(
        # Captured while the host still has the pre-hooks off for its first step, before the
        # first optimizer step: Adam's state comes after the "before capture" snapshot.
        "te_overlap_w0",
        (*TE_SPEC, *OVERLAP),
        (*te("attn,mlp"), *warmup(0)),
        capture_step=0,
        te=True,
        toggles=HOST_TOGGLES,
        slack_mib=64.0,
    ),
    Scenario(
        "te_overlap_w2",
        (*TE_SPEC, *OVERLAP),
        (*te("attn,mlp"), *warmup(2)),
        capture_step=2,
        te=True,
        toggles=HOST_TOGGLES * 2,
    ),
    Scenario(
        # A resumed run warms up again: capture at start step + warm-up.
        "te_overlap_w2_resumed",
        (*TE_SPEC, *OVERLAP, "--start-step", "4"),
        (*te("attn,mlp"), *warmup(2)),
        capture_step=6,
        start_step=4,
        te=True,
        toggles=HOST_TOGGLES * 2,
    ),
    Scenario(
        "full_iteration_early_exit",
        ("--exit-interval", "8"),
        FULL,
        last_step=7,
        end="early_exit",
        parity=False,
    ),
    Scenario(
        "te_attn_mlp_early_exit",
        (*TE_SPEC, "--exit-interval", "8"),
        te("attn,mlp"),
        last_step=7,
        end="early_exit",
        te=True,
        parity=False,
    ),
    Scenario(
        "fp8_te_attn_mlp",
        (*TE_SPEC, *FP8),
        te("attn,mlp"),
        te=True,
        tolerance=tuple(FP8_PARITY_TOLERANCE.items()),
    ),
    Scenario(
        "fp8_full_iteration",
        (*TE_SPEC, *FP8),
        FULL,
        te=True,
        tolerance=tuple(FP8_PARITY_TOLERANCE.items()),
    ),
    Scenario(
        # fp16 with a constant loss scale: one scale tensor for the run, read by the graph.
        "full_iteration_fp16_constant_scale",
        (),
        FULL,
        precision=("--fp16", "--loss-scale", "4096"),
    ),
    Scenario(
        # Full-iteration and optimizer graphs, captured in the same step (megatron-core 0.17+).
        "full_iteration_optimizer_graph",
        (),
        (*FULL, "--optimizer-cuda-graph"),
        stages=("training", "optimizer"),
        needs_optimizer_graph=True,
    ),
    Scenario(
        "exception_full_iteration",
        (),
        FULL,
        end="exception",
        fault=_fault("RAISE", "6:0"),
        failing_ranks=(0,),
        parity=False,
    ),
    Scenario(
        "exception_te_attn_mlp",
        TE_SPEC,
        te("attn,mlp"),
        te=True,
        end="exception",
        fault=_fault("RAISE", "6:0"),
        failing_ranks=(0,),
        parity=False,
    ),
    Scenario(
        "sigterm_full_iteration",
        (),
        FULL,
        end="signal",
        fault=_fault("SIGTERM", "6:0"),
        failing_ranks=(0,),
        parity=False,
    ),
    Scenario(
        # a check of step 6 refuses the run after the capture: the graphs freed, the refusal
        # said once without a traceback, exit status 2
        "refuse_full_iteration",
        (),
        FULL,
        end="exception",
        fault=_fault("REFUSE", "6:0"),
        failing_ranks=(0,),
        parity=False,
    ),
    Scenario(
        "sigterm_te_attn_mlp",
        TE_SPEC,
        te("attn,mlp"),
        te=True,
        end="signal",
        fault=_fault("SIGTERM", "6:0"),
        failing_ranks=(0,),
        parity=False,
    ),
    Scenario(
        "capture_failure_te_attn_mlp",
        TE_SPEC,
        te("attn,mlp"),
        te=True,
        end="exception",
        fault=_fault("FAIL_CAPTURE", "all"),
        failing_ranks=(0,),
        parity=False,
    ),
    # No "midway" TE capture failure: the probe raises from a module forward pre-hook, and
    # Transformer Engine refuses modules with hooks before capturing ("Modules must not have
    # hooks registered at the time they are passed", seen on the H200). A TE capture that
    # fails midway is covered on the CPU (tests/test_plugin_lifecycle.py).
    Scenario(
        "capture_failure_inside_full_iteration",
        (),
        FULL,
        end="exception",
        fault=(*_fault("FAIL_CAPTURE", "all"), *_fault("FAIL_CAPTURE_AT", "inside")),
        failing_ranks=(0,),
        parity=False,
    ),
    # -- two GPUs -------------------------------------------------------------------------
    Scenario("dp2_full_iteration", (), FULL, nproc=2),
    # an evaluation (forward-only, the pre-hooks' all-gather done) before the capture and
    # between replays: the capture must record the all-gather, eager calls after a replay
    # must gather again; training and evaluation losses equal the eager twin's
    Scenario(
        "dp2_full_iteration_overlap_eval",
        (*OVERLAP, "--eval-interval", "3", "--eval-iters", "2"),
        FULL,
        nproc=2,
        stages=("training", "validation"),
        toggles=HOST_TOGGLES,
    ),
    Scenario(
        "dp2_te_attn_mlp_distopt",
        (*TE_SPEC, "--use-distributed-optimizer"),
        te("attn,mlp"),
        nproc=2,
        te=True,
    ),
    Scenario("tp2_sp_te_attn", (*TE_SPEC, *TP2_SP), te("attn"), nproc=2, te=True),
    Scenario(
        # TE graphs per model chunk and per micro-batch, in the pipeline schedule's order.
        "pp2_te_attn_mlp",
        (*TE_SPEC, *PP2),
        te("attn,mlp"),
        nproc=2,
        te=True,
        loss_ranks=(1,),
    ),
    Scenario(
        "pp2_vpp2_te_attn",
        (*TE_SPEC, *PP2, "--num-layers-per-virtual-pipeline-stage", "1"),
        te("attn"),
        nproc=2,
        te=True,
        loss_ranks=(1,),
    ),
    Scenario(
        # Batched p2p synchronises the device (refused by the validation); unbatched p2p.
        "pp2_full_iteration_unbatched_p2p",
        (*PP2, "--no-batch-p2p-comm"),
        FULL,
        nproc=2,
        loss_ranks=(1,),
    ),
    Scenario(
        "dp2_raise_rank1_full_iteration",
        (),
        FULL,
        nproc=2,
        end="exception",
        fault=_fault("RAISE", "6:1"),
        failing_ranks=(1,),
        parity=False,
    ),
    Scenario(
        "dp2_raise_rank1_te_attn_mlp",
        TE_SPEC,
        te("attn,mlp"),
        nproc=2,
        te=True,
        end="exception",
        fault=_fault("RAISE", "6:1"),
        failing_ranks=(1,),
        parity=False,
    ),
    Scenario(
        "tp2_capture_failure_te_attn",
        (*TE_SPEC, *TP2_SP),
        te("attn"),
        nproc=2,
        te=True,
        end="exception",
        fault=_fault("FAIL_CAPTURE", "all"),
        failing_ranks=(0, 1),
        parity=False,
    ),
    Scenario(
        "pp2_raise_rank1_te_attn_mlp",
        (*TE_SPEC, *PP2),
        te("attn,mlp"),
        nproc=2,
        te=True,
        end="exception",
        fault=_fault("RAISE", "6:1"),
        failing_ranks=(1,),
        parity=False,
        loss_ranks=(1,),
    ),
    Scenario(
        # The capture fails on rank 1 only: rank 0 has captured and is replaying.
        "dp2_capture_failure_rank1_full_iteration",
        (),
        FULL,
        nproc=2,
        end="exception",
        fault=_fault("FAIL_CAPTURE", "1"),
        failing_ranks=(1,),
        parity=False,
    ),
    Scenario(
        "dp2_raise_rank1_te_attn_mlp_distopt",
        (*TE_SPEC, *OVERLAP),
        te("attn,mlp"),
        nproc=2,
        te=True,
        toggles=HOST_TOGGLES,
        end="exception",
        fault=_fault("RAISE", "6:1"),
        failing_ranks=(1,),
        parity=False,
    ),
    Scenario(
        # Rank 1 alone refuses the run at step 6 (as a check of that step does) while rank 0
        # replays: rank 1 says it, once, and exits 2; rank 0 is told (PeerRefused), runs
        # its shutdown and says nothing.
        "dp2_refuse_rank1_full_iteration",
        (),
        FULL,
        nproc=2,
        end="exception",
        fault=_fault("REFUSE", "6:1"),
        failing_ranks=(1,),
        parity=False,
    ),
    Scenario(
        "dp2_sigterm_rank1_full_iteration",
        (),
        FULL,
        nproc=2,
        end="signal",
        fault=_fault("SIGTERM", "6:1"),
        failing_ranks=(1,),
        parity=False,
    ),
)

BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
assert len(BY_NAME) == len(SCENARIOS), "scenario names must be unique"

# -------------------------------------------------------------------------------------------
# Selection, skips and markers.
# -------------------------------------------------------------------------------------------

HAS_OPTIMIZER_GRAPH = bool(compat.has_optimizer_graph())
# megatron-core's optimizer step is capturable only with a gradient norm computed on the
# device: the plugin supplies device-side kernels wherever megatron-core has a tensor-scale
# global (0.17+), and refuses the optimizer graph otherwise (tests/test_optimizer_graph.py).
GRAD_NORM_ON_DEVICE = HAS_OPTIMIZER_GRAPH
CUDA = torch.cuda.is_available()
DEVICE_COUNT = torch.cuda.device_count() if CUDA else 0


def _marks(scenario: Scenario) -> list[Any]:
    marks: list[Any] = []
    if scenario.nproc == 1:
        marks.append(pytest.mark.gpu)
        marks.append(pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))
    else:
        marks.append(pytest.mark.multigpu)
        marks.append(
            pytest.mark.skipif(
                DEVICE_COUNT < scenario.nproc,
                reason=f"needs {scenario.nproc} CUDA devices (found {DEVICE_COUNT})",
            )
        )
    if scenario.te:
        marks.append(
            pytest.mark.skipif(
                not HAS_TE,
                reason="needs Transformer Engine (pip install 'megatron-cudagraph-plugin[te]')",
            )
        )
    if scenario.needs_optimizer_graph:
        marks.append(
            pytest.mark.skipif(
                not HAS_OPTIMIZER_GRAPH,
                reason="needs megatron-core >= 0.17.0 (OptimizerCudaGraphWrapper)",
            )
        )
        marks.append(
            pytest.mark.skipif(
                not GRAD_NORM_ON_DEVICE,
                reason="megatron-core computes the gradient norm with its host-reading "
                "fallback here (no Apex, no TE multi-tensor kernels): the optimizer step "
                "cannot be captured",
            )
        )
    if scenario.parity:
        marks.append(pytest.mark.xdist_group(scenario.twin_key))
    return marks


def _params(good: bool) -> list[Any]:
    return [
        pytest.param(scenario, id=scenario.name, marks=_marks(scenario))
        for scenario in SCENARIOS
        if scenario.failure != good
    ]


# -------------------------------------------------------------------------------------------
# Running jobs.
# -------------------------------------------------------------------------------------------


def _current_test() -> str | None:
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.rsplit(" ", 1)[0] if current else None


def run_scenario_job(
    scenario: Scenario, role: str, argv: list[str], jobs_root: Path, env: dict[str, str]
) -> TrainJob:
    job_env = dict(env)
    if scenario.nproc == 1:
        job_env.update(single_gpu_env(DEVICE_COUNT))
    job = launch(
        f"{scenario.name}/{role}",
        argv,
        job_dir=jobs_root / f"{scenario.name}-{role}-{uuid.uuid4().hex[:6]}",
        timeout_s=FAILURE_TIMEOUT_S if role == "fault" else GOOD_TIMEOUT_S,
        nproc=scenario.nproc,
        env=job_env,
        dump_signal=signal.SIGUSR1,
    )
    append_result(result_line(job, scenario.name, role, test=_current_test()))
    return job


class EagerTwins:
    """Each eager twin runs once per pytest process, by whichever test needs it first."""

    def __init__(self, jobs_root: Path) -> None:
        self.jobs_root = jobs_root
        self.jobs: dict[str, TrainJob] = {}

    def get(self, scenario: Scenario) -> TrainJob:
        if scenario.twin_key not in self.jobs:
            job = run_scenario_job(scenario, "eager", scenario.eager_argv(), self.jobs_root, {})
            check_eager_twin(scenario, job)
            self.jobs[scenario.twin_key] = job
        return self.jobs[scenario.twin_key]


@pytest.fixture(scope="session")
def eager_twins(jobs_root: Path) -> EagerTwins:
    return EagerTwins(jobs_root)


# -------------------------------------------------------------------------------------------
# Assertions.
# -------------------------------------------------------------------------------------------


def capture_stages(events: list[list[Any]]) -> list[tuple[str, int]]:
    """``(stage, step)`` of each completed capture, the stage told by the events around it
    (the optimizer graph's capture has the scope ``["optimizer"]``)."""
    stages, evaluating, scope = [], False, None
    for event in events:
        if event[0] == "evaluation_start":
            evaluating = True
        elif event[0] == "evaluation_end":
            evaluating = False
        elif event[0] == "before_capture":
            scope = list(event[3])
        elif event[0] == "after_capture":
            if scope == ["optimizer"]:
                stages.append(("optimizer", event[1]))
            else:
                stages.append(("validation" if evaluating else "training", event[1]))
    return stages


def memory_levels(record: dict[str, Any]) -> tuple[float | None, float | None]:
    """(allocated before the capture, allocated after the free), in MiB: the plugin's
    numbers where it has them, else the probe's own readings around the same moments."""
    report = record.get("report") or {}
    facts = record.get("graph_plugin") or {}
    memory = record.get("memory") or {}
    before = (report.get("memory_before_capture") or {}).get("allocated_mib")
    if before is None:
        before = memory.get("before_capture_mib")
    after = facts.get("allocated_after_free_mib")
    if after is None:
        after = memory.get("at_record_mib")
    return before, after


def check_memory_back(job: TrainJob, rank: int, slack_mib: float) -> None:
    before, after = memory_levels(job.record(rank))
    assert before is not None and after is not None, (rank, before, after, job.context())
    assert after <= before + slack_mib, (
        f"rank {rank}: allocated {after:.1f} MiB after the free, {before:.1f} MiB before the "
        f"capture (slack {slack_mib} MiB)"
    )


def check_graphed_rank(scenario: Scenario, job: TrainJob, rank: int) -> None:
    record = job.record(rank)
    context = f"rank {rank}\n{job.context()}"
    assert record["shutdown_reason"] == scenario.end, context
    assert RUN_PLUGIN_NAME in record["plugins"], f"the CUDA graph plugin did not load\n{context}"
    report = record["report"]
    assert report is not None and report["graphs_captured"], (report, context)
    assert report["capture_step"] == scenario.capture_step, (report["capture_step"], context)
    assert report["replay_steps"] == list(range(scenario.capture_step + 1, scenario.last_step + 1))
    assert report["capture_seconds"] > 0
    assert report["memory_before_capture"] is not None
    facts = record["graph_plugin"]
    assert facts is not None, context
    assert facts["graphs_freed"] == report["graph_count"] > 0, (facts, report["graph_count"])
    check_memory_back(job, rank, scenario.slack_mib)

    events = record["events"]
    stages = capture_stages(events)
    assert [stage for stage, _ in stages] == list(scenario.stages), (stages, context)
    assert stages[0][1] == scenario.capture_step
    if facts.get("captures") is not None:
        assert [c["stage"] for c in facts["captures"]] == list(scenario.stages)
    steps = [event[1] for event in events if event[0] == "step"]
    assert steps == list(range(scenario.start_step, scenario.last_step + 1))
    if scenario.toggles is not None:
        toggles = [tuple(e) for e in events if e[0] in ("disable_pre_hook", "enable_pre_hook")]
        assert toggles == list(scenario.toggles), toggles
    if "--eval-interval" in scenario.base:
        assert record["eval_losses"] and all(math.isfinite(x) for x in record["eval_losses"])

    losses = job.losses(rank)
    if scenario.computes_loss(rank):
        assert record["loss_steps"] == steps
        assert len(losses) == len(steps) and all(math.isfinite(x) for x in losses), losses
    else:  # an earlier pipeline stage: no loss on this rank
        assert losses == [], losses
    at_exit = record.get("at_exit")
    assert at_exit == {"process_group_initialized": False}, f"at exit: {at_exit}\n{context}"


def check_eager_twin(scenario: Scenario, job: TrainJob) -> None:
    check_job_ended_cleanly(job)
    assert job.result.rc == 0, f"the eager twin failed\n{job.context()}"
    for rank in range(scenario.nproc):
        record = job.record(rank)
        assert record["shutdown_reason"] == scenario.end
        assert record["report"] is not None and not record["report"]["graphs_captured"]


def check_parity(scenario: Scenario, graphed: TrainJob, eager: TrainJob) -> None:
    for rank in range(scenario.nproc):
        if not scenario.computes_loss(rank):
            continue
        torch.testing.assert_close(
            torch.tensor(graphed.losses(rank)),
            torch.tensor(eager.losses(rank)),
            **dict(scenario.tolerance),
            msg=lambda text, rank=rank: f"rank {rank}: graphed vs eager losses: {text}",
        )
        if "--eval-interval" in scenario.base:  # (the validation graph's too)
            torch.testing.assert_close(
                torch.tensor(graphed.record(rank)["eval_losses"]),
                torch.tensor(eager.record(rank)["eval_losses"]),
                **dict(scenario.tolerance),
                msg=lambda text, rank=rank: f"rank {rank}: graphed vs eager eval losses: {text}",
            )


def check_failure(scenario: Scenario, job: TrainJob) -> None:
    check_job_ended_cleanly(job)
    result = job.result
    assert result.rc != 0, f"the job succeeded despite the fault\n{job.context()}"
    if scenario.nproc == 1 and scenario.end == "signal":
        assert result.signal == signal.SIGTERM, job.context()
    if scenario.nproc == 1 and scenario.refusal:
        assert result.rc == 2, job.context()  # print_refusal's exit status
    assert result.wall_s < NO_HANG_S, f"took {result.wall_s:.1f} s to end\n{job.context()}"
    after_fault = end_after_fault_s(job)
    assert after_fault is not None and after_fault < PEER_END_S, (after_fault, job.context())
    every_rank_fails = set(scenario.failing_ranks) == set(range(scenario.nproc))
    for rank in scenario.failing_ranks:
        record = job.record(rank)
        context = f"rank {rank}\n{job.context()}"
        if every_rank_fails:  # the slower rank may hear of the first one's failure first
            assert record["shutdown_reason"] in (scenario.end, "peer_failed"), context
        else:
            assert record["shutdown_reason"] == scenario.end, context
        assert record["losses"] is None  # never read from the device on an error path
        assert any(event[0] == "fault" for event in record["events"]), context
        report, facts = record["report"], record["graph_plugin"]
        assert report is not None and facts is not None, context
        if scenario.fault_step is not None:  # the fault comes after the capture
            assert report["capture_step"] == scenario.capture_step, context
            assert facts["graphs_freed"] == report["graph_count"] > 0, (facts, report)
        else:  # the capture itself failed: whatever it made is freed
            assert not report["graphs_captured"], report
            assert facts["graphs_freed"] >= report["graph_count"] == 0, (facts, report)
        check_memory_back(job, rank, scenario.slack_mib)
    if every_rank_fails:
        reasons = [job.record(rank)["shutdown_reason"] for rank in scenario.failing_ranks]
        assert scenario.end in reasons, job.context()
    for rank in sorted(set(range(scenario.nproc)) - set(scenario.failing_ranks)):
        check_peer_ended(scenario, job, rank)
    if scenario.refusal:
        check_refusal_said_once(scenario, job)


# What the rank that says a refusal, and a told rank, leave in torchrun's summary.
REFUSAL_ENTRY = (
    "the run was refused as configured; its problems and fixes are printed on this rank's "
    "standard error"
)
TOLD_ENTRY = "PeerFailed: this rank's run ended because of another rank: "


def check_refusal_said_once(scenario: Scenario, job: TrainJob) -> None:
    """A run refused at a step by one rank: the refusal said once, by that rank (naming
    itself unless it is rank 0), with no worker's traceback."""
    [rank] = scenario.failing_ranks
    assert scenario.fault_step is not None
    output = job.result.output()
    said = [line for line in output.splitlines() if line.startswith("error: ")]
    assert said == [probe_refusal_said(rank, scenario.fault_step)], (said, job.context())
    if scenario.nproc > 1:  # the speaker exited first, with the refusal's status
        assert first_failure(2, rank) in output, job.context()
        # its entry in torchrun's summary points at the refusal (hookspecs.errors.tell_launcher)
        assert REFUSAL_ENTRY in output, job.context()
    # torchrun's own ChildFailedError at most; nothing from a worker
    assert output.count("Traceback") <= 1, job.context()
    assert 'train_gpt.py", line' not in output, job.context()


def check_peer_ended(scenario: Scenario, job: TrainJob, rank: int) -> None:
    """A rank the fault did not hit: its watch of the job ended its run (``peer_failed``,
    naming the failing rank), its shutdown ran and freed whatever it had captured."""
    record = job.record(rank)
    context = f"rank {rank}\n{job.context()}"
    assert record["shutdown_reason"] == "peer_failed", context
    failing = ", ".join(str(r) for r in scenario.failing_ranks)
    exception = record["exception"] or ""
    if scenario.refusal:  # told of the refusal, not of a failure (the probe names rank 1 too)
        assert exception.startswith("PeerRefused("), context
        assert refused_by(failing, "") in exception, context
    else:
        assert f"rank {failing}" in exception, context
        # said in one line, no traceback of its own (print_peer_failure), and left for
        # torchrun's summary of the failed job (hookspecs.errors.tell_launcher)
        assert f"[rank {rank}] run ended: rank {failing} (" in job.result.output(), context
        assert f"{TOLD_ENTRY}rank {failing} (" in job.result.output(), context
    report, facts = record["report"], record["graph_plugin"]
    assert report is not None and facts is not None, context
    assert facts["graphs_freed"] == report["graph_count"], (facts, report)
    check_memory_back(job, rank, scenario.slack_mib)


# Job-wide lines of every graphed run (issue 22: said by rank 0 alone in a multi-rank job).
JOB_WIDE_LINES = ("RNG tracker is CUDA-graph safe: ", "CUDA graph report (rank 0 of ")


def check_said_once(job: TrainJob) -> None:
    """A multi-rank job says each job-wide line once, and each rank tags its own shutdown
    line with its rank."""
    output = job.result.output()
    for line in JOB_WIDE_LINES:
        assert output.count(line) == 1, (line, output.count(line), job.context())
    for rank in range(job.nproc):
        said = output.count(f"[rank {rank}] shutdown (")
        assert said == 1, (f"rank {rank}'s shutdown line", said, job.context())


@pytest.mark.parametrize("scenario", _params(good=True))
def test_scenario(scenario: Scenario, jobs_root: Path, eager_twins: EagerTwins) -> None:
    job = run_scenario_job(scenario, "graphed", scenario.argv(), jobs_root, {})
    check_job_ended_cleanly(job)
    assert job.result.rc == 0, job.context()
    for rank in range(scenario.nproc):
        check_graphed_rank(scenario, job, rank)
    if scenario.nproc > 1:
        check_said_once(job)
    if scenario.parity:
        check_parity(scenario, job, eager_twins.get(scenario))


@pytest.mark.parametrize("scenario", _params(good=False))
def test_failure_scenario_ends_the_job(scenario: Scenario, jobs_root: Path) -> None:
    job = run_scenario_job(scenario, "fault", scenario.argv(), jobs_root, dict(scenario.fault))
    check_failure(scenario, job)


# A rank that dies without a word (SIGKILL: the OOM killer, a lost node) marks nothing: torchrun
# sends SIGTERM to the others, whose main thread waits in C for the replayed step's all-reduce
# and cannot act on it. The run's stuck-signal watch asks the peer watch's release (NCCL only):
# its abort of the process groups ends the wait, the SIGTERM's handler ends the run and its
# shutdown frees the graphs. Before: the stuck-signal watch ended rank 0 5 s after the SIGTERM
# without its shutdown (no record, graphs left to the process's end).
KILLED = dataclasses.replace(
    BY_NAME["dp2_sigterm_rank1_full_iteration"],
    name="dp2_sigkill_rank1_full_iteration",
    fault=_fault("SIGKILL", "6:1"),
)
RELEASED_LINE = "rank 0: SIGTERM came while this rank's main thread was blocked in C"
# torchrun's wait before its SIGKILL: the survivor must end by itself, within the run's
# stuck-signal wait (5 s) and the peer exit deadline (12 s) after the signal
KILLED_END_S = 30.0


def check_killed_without_a_word(job: TrainJob) -> None:
    check_job_ended_cleanly(job)
    result = job.result
    assert result.rc != 0 and result.wall_s < NO_HANG_S, job.context()
    killed = job.record(1)
    assert killed["events"][-1] == ["fault", "sigkill", KILLED.fault_step], job.context()
    assert killed["shutdown_reason"] is None, job.context()  # (nothing ran after the kill)
    after_fault = end_after_fault_s(job)
    assert after_fault is not None and after_fault < KILLED_END_S, (after_fault, job.context())
    record = job.record(0)
    context = f"rank 0\n{job.context()}"
    # torchrun's SIGTERM, handled; or the aborted collective's error first, the signal held
    assert record["shutdown_reason"] in ("signal", "exception"), context
    assert RELEASED_LINE in result.output(), context
    assert "ending the process now with status" not in result.output(), context
    report, facts = record["report"], record["graph_plugin"]
    assert report is not None and facts is not None, context
    assert facts["graphs_freed"] == report["graph_count"] > 0, (facts, report)
    check_memory_back(job, 0, KILLED.slack_mib)


@pytest.mark.multigpu
@pytest.mark.skipif(DEVICE_COUNT < 2, reason=f"needs 2 CUDA devices (found {DEVICE_COUNT})")
def test_a_rank_killed_without_a_word_leaves_the_other_to_its_shutdown(jobs_root: Path) -> None:
    job = run_scenario_job(KILLED, "fault", KILLED.argv(), jobs_root, dict(KILLED.fault))
    check_killed_without_a_word(job)


# Rank 1's own loop ends early after step 6 (``sys.exit(0)`` on that rank alone: no failure,
# exit status 0) while rank 0 replays step 7, whose all-reduce waits for rank 1 for good (NCCL
# sees no peer's exit; no launcher ends a job whose rank exited 0). Rank 0's watch reads rank
# 1's early end and ends its run as after a peer's failure, naming rank 1 and both steps.
LEFT_EARLY = dataclasses.replace(
    BY_NAME["dp2_raise_rank1_full_iteration"],
    name="dp2_exit_rank1_full_iteration",
    end="early_exit",
    fault=_fault("EXIT", "6:1"),
)
# rank 0's host is at step 7 or later when told: its loop may queue a replay ahead of the
# device (the step named is the host's, not the one whose all-reduce waits)
LEFT_EARLY_SAID = re.compile(
    r"ended its run early: early_exit after step 6, while rank 0 went on to step (\d+)"
)


def check_left_early(job: TrainJob) -> None:
    check_job_ended_cleanly(job)
    result = job.result
    assert result.rc != 0 and result.wall_s < NO_HANG_S, job.context()
    after_fault = end_after_fault_s(job)
    assert after_fault is not None and after_fault < PEER_END_S, (after_fault, job.context())
    left = job.record(1)
    context = f"rank 1\n{job.context()}"
    assert left["shutdown_reason"] == "early_exit", context
    assert ["fault", "exit", LEFT_EARLY.fault_step] in left["events"], context
    for rank in (0, 1):
        report, facts = job.record(rank)["report"], job.record(rank)["graph_plugin"]
        assert report is not None and facts is not None, (rank, job.context())
        assert facts["graphs_freed"] == report["graph_count"] > 0, (rank, facts, report)
        check_memory_back(job, rank, LEFT_EARLY.slack_mib)
    told = job.record(0)
    assert told["shutdown_reason"] == "peer_failed", job.context()
    said = LEFT_EARLY_SAID.search(told["exception"] or "")
    assert said is not None and int(said.group(1)) >= 7, job.context()
    assert "[rank 0] run ended: rank 1 (" in result.output(), job.context()
    assert f"{TOLD_ENTRY}rank 1 (" in result.output(), job.context()


@pytest.mark.multigpu
@pytest.mark.skipif(DEVICE_COUNT < 2, reason=f"needs 2 CUDA devices (found {DEVICE_COUNT})")
def test_a_rank_going_on_past_a_peers_early_end_is_ended(jobs_root: Path) -> None:
    job = run_scenario_job(
        LEFT_EARLY, "fault", LEFT_EARLY.argv(), jobs_root, dict(LEFT_EARLY.fault)
    )
    check_left_early(job)


# -------------------------------------------------------------------------------------------
# Asked for graphs, got none (issue 22): the run stops with the missing wiring, unless eager
# is accepted explicitly; then it runs, warns once, and claims no speed-up.
# -------------------------------------------------------------------------------------------

NOTHING_CAPTURED = [
    # TE scope matching no layer of the example's GPT (it has no Mamba layers)
    pytest.param("mamba", (*TE_SPEC, *te("mamba")), {}, "No graphable layers found", id="mamba"),
    # the loop's forward/backward never routed through the run
    pytest.param(
        "plain_forward_backward",
        FULL,
        {"MCGRAPH_PROBE_PLAIN_FWD_BWD": "1"},
        "ended without a full-iteration capture",
        id="plain_forward_backward",
    ),
]


def _single_gpu_env() -> dict[str, str]:
    return single_gpu_env(DEVICE_COUNT)


def run_nothing_captured(
    name: str,
    graphs: tuple[str, ...],
    env: dict[str, str],
    accept_eager: bool,
    jobs_root: Path,
    nproc: int = 1,
) -> TrainJob:
    """One job of the "asked for graphs, got none" tests, on one GPU or ``nproc`` ranks."""
    if "transformer_engine" in graphs and not HAS_TE:
        pytest.skip("needs Transformer Engine")
    argv = ["--train-iters", str(STEPS), *MODEL, *graphs]
    if accept_eager:
        argv.append("--cuda-graph-accept-eager")
    role = "accept-eager" if accept_eager else "error"
    suffix = "" if nproc == 1 else f"_dp{nproc}"
    job = launch(
        f"{name}{suffix}/{role}",
        argv,
        job_dir=jobs_root / f"nothing-{name}{suffix}-{role}-{uuid.uuid4().hex[:6]}",
        timeout_s=FAILURE_TIMEOUT_S if nproc > 1 and not accept_eager else GOOD_TIMEOUT_S,
        nproc=nproc,
        env={**env, **(_single_gpu_env() if nproc == 1 else {})},
        dump_signal=signal.SIGUSR1 if nproc > 1 else None,
    )
    scenario = f"nothing_captured_{name}{suffix}"
    append_result(result_line(job, scenario, role, test=_current_test()))
    check_job_ended_cleanly(job)
    return job


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("accept_eager", [False, True], ids=["error", "accept-eager"])
@pytest.mark.parametrize("name,graphs,env,phrase", NOTHING_CAPTURED)
def test_asked_for_graphs_got_none(name, graphs, env, phrase, accept_eager, jobs_root):
    job = run_nothing_captured(name, graphs, env, accept_eager, jobs_root)
    output = job.result.output()
    report = job.record(0)["report"]
    assert report is not None and not report["graphs_captured"], job.context()
    assert report["verdict"] == "unknown" and report["speedup"] is None, report
    if not accept_eager:
        assert job.result.rc == 2, job.context()  # a refused configuration, said once
        assert phrase in output and "--cuda-graph-accept-eager" in output, job.context()
        assert "Traceback" not in output, job.context()
        return
    assert job.result.rc == 0, job.context()
    assert output.count("running eagerly as cuda_graph_accept_eager allows") == 1, job.context()
    assert "faster than eager" not in output


@pytest.mark.multigpu
@pytest.mark.skipif(DEVICE_COUNT < 2, reason=f"needs 2 CUDA devices (found {DEVICE_COUNT})")
@pytest.mark.parametrize("accept_eager", [False, True], ids=["error", "accept-eager"])
@pytest.mark.parametrize("name,graphs,env,phrase", NOTHING_CAPTURED)
def test_asked_for_graphs_got_none_on_two_ranks(name, graphs, env, phrase, accept_eager, jobs_root):
    """The same over NCCL, DP=2: every rank stops at the capture step (with its own refusal,
    or told of the rank that got there first), each runs its shutdown, and the job says the
    problem once, without a worker's traceback, and ends at once; under
    ``--cuda-graph-accept-eager`` each rank warns for itself and the job-wide lines are said
    once."""
    job = run_nothing_captured(name, graphs, env, accept_eager, jobs_root, nproc=2)
    output = job.result.output()
    for rank in (0, 1):
        record = job.record(rank)  # the probe's shutdown hook ran on every rank
        report = record["report"]
        assert report is not None and not report["graphs_captured"], (rank, job.context())
        assert report["verdict"] == "unknown" and report["speedup"] is None, (rank, report)
        assert record["graph_plugin"]["graphs_freed"] == 0, (rank, job.context())
        ends = ("completed",) if accept_eager else ("exception", "peer_failed")
        assert record["shutdown_reason"] in ends, (rank, job.context())
    if not accept_eager:
        assert job.result.rc != 0 and job.result.wall_s < NO_HANG_S, job.context()
        said = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(said) == 1, (said, job.context())  # once, by the rank whose mark came first
        assert "CUDA graphs were asked for but" in said[0] and phrase in said[0], said
        speaker = 1 if said[0].startswith("error: " + refused_by(1, "")) else 0
        # the speaker exited first, with the refusal's status
        assert first_failure(2, speaker) in output, job.context()
        assert REFUSAL_ENTRY in output, job.context()  # (its entry in torchrun's summary)
        assert "--cuda-graph-accept-eager" in said[0], said
        # torchrun's own ChildFailedError at most; nothing from a worker
        assert output.count("Traceback") <= 1, job.context()
        assert 'train_gpt.py", line' not in output and "pluggy" not in output, job.context()
        return
    assert job.result.rc == 0, job.context()
    check_said_once(job)
    for rank in (0, 1):
        warning = f"[rank {rank}] CUDA graphs were asked for but"
        assert output.count(warning) == 1, (rank, job.context())
    assert output.count("running eagerly as cuda_graph_accept_eager allows") == 2, job.context()
    assert "faster than eager" not in output


# -------------------------------------------------------------------------------------------
# The optimizer graph's learning rate (issue 21): megatron-core's schedule, and a Python float
# written by the host, reach the captured step: the losses equal an eager optimizer step of the
# same capturable Adam, with the same device-side gradient norm.
# -------------------------------------------------------------------------------------------

OPTIMIZER_GRAPH_STEPS = 32
LR_CASES = [
    pytest.param(("--lr-warmup-iters", "4", "--lr-decay-style", "cosine"), None, id="schedule"),
    pytest.param(("--lr-decay-style", "constant"), "10:0.1", id="float-write"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.skipif(not HAS_OPTIMIZER_GRAPH, reason="megatron-core < 0.17 has no optimizer graph")
@pytest.mark.skipif(
    not HAS_TE,
    reason="the twin equals the graphed run only with Transformer Engine's FusedAdam: without "
    "TE megatron-core builds torch's AdamW, whose graphed run reads a tensor lr from the "
    "capture on (promote_lr_to_tensor) while the twin keeps a Python float: two code paths "
    "of torch's capturable Adam, whose roundings differ (2026-12-04, one H200, 0.19.2 "
    "without TE: 22 of 32 losses off by up to 5%, the same before and after that session's "
    "change)",
)
@pytest.mark.parametrize("schedule,write", LR_CASES)
def test_the_optimizer_graph_follows_the_learning_rate(schedule, write, jobs_root):
    """With ``write``, the host writes the learning rate x0.1 at step 10: a Python float in the
    graphed run (the captured step reads a device tensor: the plugin copies the value in),
    the same value filled into the tensor in the eager-optimizer run (TE's capturable Adam
    takes nothing else)."""
    common = ["--train-iters", str(OPTIMIZER_GRAPH_STEPS), *MODEL, *FULL, *schedule]
    twin = [*common, "--capturable-optimizer", "--cuda-graph-device-grad-norm"]
    jobs = {}
    for role, argv in (("graphed", [*common, "--optimizer-cuda-graph"]), ("eager-optimizer", twin)):
        env = {}
        if write is not None:
            env["MCGRAPH_PROBE_SCALE_LR"] = write if role == "graphed" else f"{write}:fill"
        job = launch(
            f"optimizer_lr/{role}",
            argv,
            job_dir=jobs_root / f"optimizer-lr-{role}-{uuid.uuid4().hex[:6]}",
            timeout_s=GOOD_TIMEOUT_S,
            env={**env, **_single_gpu_env()},
        )
        append_result(result_line(job, "optimizer_graph_lr", role, test=_current_test()))
        check_job_ended_cleanly(job)
        assert job.result.rc == 0, job.context()
        jobs[role] = job
    report = jobs["graphed"].record(0)["report"]
    assert [c for c in report["replays"]] == ["training", "optimizer"], report
    assert report["replays"]["optimizer"] == OPTIMIZER_GRAPH_STEPS - 1 - 3, report
    graphed, eager = jobs["graphed"].losses(0), jobs["eager-optimizer"].losses(0)
    assert all(math.isfinite(loss) for loss in graphed), graphed
    # the same kernels on both sides (full-iteration graph, capturable Adam, device-side norm)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=1e-5)
    if write is not None:
        [note] = [n for n in report["notes"] if "host writes copied before replays" in n]
        assert not note.endswith("replays: 0"), note
