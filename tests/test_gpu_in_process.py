"""Two runs in one process, on a CUDA device: the only GPU tests that run in-process.

Every other GPU scenario is a fresh process per run (``tests/test_gpu.py``), as users run
them. These cannot be: what they check is in-process state itself, that a second
``train_gpt.run()`` in the same process, after a completed run or after one that raised,
starts clean and captures again at its own step (megatron-core 0.16 keeps full-iteration
graphs in class-level state; streams, cuBLAS workspaces and TE's capture flag are
process-wide). Each test does both runs itself, so it passes alone and in any order; the
CUDA context it creates lives in the pytest process (under pytest-xdist, on that worker's
first visible GPU).

Skipped without CUDA (marker ``gpu``); the TE variant also without Transformer Engine. With
``MCGRAPH_GPU_RESULTS`` set, each run's report is appended there (role ``in-process``).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import test_gpu
import torch

from recording import RaiseAt, Recorder
from train_jobs import HAS_TE, TE_SPEC, append_result, report_fields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# The suite's tiny bf16 GPT (tests/test_gpu.py), as arguments of train_gpt.run.
MODEL = list(test_gpu.MODEL)
FULL = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
TE_ATTN_MLP = [
    *TE_SPEC,
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-scope",
    "attn,mlp",
]


def run(
    name: str,
    *argv: str,
    steps: int,
    plugins: tuple[Any, ...] = (),
    recorder: Recorder | None = None,
) -> Recorder:
    import train_gpt

    recorder = recorder or Recorder()
    try:
        train_gpt.run(["--train-iters", str(steps), *MODEL, *argv], plugins=[recorder, *plugins])
    finally:
        _record(name, argv, recorder)
        gc.collect()
        torch.cuda.empty_cache()
    return recorder


def _record(name: str, argv: tuple[str, ...], recorder: Recorder) -> None:
    if recorder.report is None:
        return
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    append_result(
        {
            "scenario": name,
            "role": "in-process",
            "test": current.rsplit(" ", 1)[0] or None,
            "command": "train_gpt.run([...]) in the pytest process: " + " ".join(argv),
            "argv": list(argv),
            "nproc": 1,
            "rc": None,
            "wall_s": None,
            "timed_out": False,
            **report_fields(recorder.report.to_dict()),
        }
    )


def assert_captured_and_freed(recorder: Recorder, capture_step: int, steps: int) -> None:
    report = recorder.report
    assert report.graphs_captured, report.no_graph_reason
    assert report.capture_step == capture_step
    assert report.replay_steps == list(range(capture_step + 1, steps))
    plugin = recorder.graph_plugin
    assert plugin.graphs_freed == report.graph_count > 0
    assert plugin.allocated_after_free_mib <= report.memory_before_capture.allocated_mib + 8.0
    assert not torch.distributed.is_initialized()


def test_two_runs_in_one_process_capture_again() -> None:
    first = run("two_runs_1", *FULL, "--cuda-graph-warmup-steps", "2", steps=6)
    second = run(
        "two_runs_2", *FULL, "--cuda-graph-warmup-steps", "3", "--start-step", "10", steps=16
    )
    assert_captured_and_freed(first, capture_step=2, steps=6)
    assert_captured_and_freed(second, capture_step=13, steps=16)


@pytest.mark.parametrize("mode", ["full_iteration", "te_attn_mlp"])
def test_a_run_after_one_that_raised_captures_again(mode: str) -> None:
    if mode == "te_attn_mlp" and not HAS_TE:
        pytest.skip("needs Transformer Engine")
    argv = FULL if mode == "full_iteration" else TE_ATTN_MLP
    raised = Recorder()
    with pytest.raises(RuntimeError, match="injected"):
        run(
            f"raised_{mode}",
            *argv,
            steps=12,
            plugins=(RaiseAt(6, RuntimeError("injected")),),
            recorder=raised,
        )
    assert raised.events[-1] == ("shutdown", "exception")
    assert raised.report.capture_step == 3
    assert raised.graph_plugin.graphs_freed == raised.report.graph_count > 0
    before = raised.report.memory_before_capture.allocated_mib
    assert raised.graph_plugin.allocated_after_free_mib <= before + 8.0
    assert not torch.distributed.is_initialized()
    # the next run in this process starts clean and captures at its own step
    after = run(f"after_raise_{mode}", *argv, "--cuda-graph-warmup-steps", "2", steps=6)
    assert_captured_and_freed(after, capture_step=2, steps=6)
