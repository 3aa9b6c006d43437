"""Two data-parallel ranks on CPUs (gloo, torchrun): the hook and shutdown paths of a
multi-process run, as far as a machine without GPUs can show them.

The NCCL runs with CUDA graphs (DP=2, TP=2) need a 2-GPU machine; see the issue notes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

pytestmark = needs_mcore_on_cpu

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

HOST = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {examples!r})
    import train_gpt
    from hookspecs import hookimpl

    class Fail:
        @hookimpl
        def mcgraph_train_step_end(self, step, metrics):
            if os.environ["RANK"] == {rank!r} and step == 2:
                raise RuntimeError("rank {rank} fails at step 2")

    class Shutdowns:
        @hookimpl
        def mcgraph_report(self, report):
            print(f"rank {{os.environ['RANK']}} report {{report.no_graph_reason}}", flush=True)

        @hookimpl
        def mcgraph_shutdown(self, reason, exception):
            print(f"rank {{os.environ['RANK']}} shutdown {{reason}}", flush=True)

    train_gpt.run(["--train-iters", "6", "--log-interval", "0",
                   "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
                  plugins=[Fail(), Shutdowns()])
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(tmp_path: Path, failing_rank: str, env: dict[str, str]):
    script = tmp_path / "host.py"
    script.write_text(HOST.format(examples=str(EXAMPLES), rank=failing_rank))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


@pytest.fixture
def env(subprocess_env):
    return {**subprocess_env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow
def test_two_ranks_complete_with_one_shutdown_each(tmp_path, env):
    result = torchrun(tmp_path, failing_rank="none", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("rank 0 shutdown completed") == 1
    assert output.count("rank 1 shutdown completed") == 1
    assert output.count("report no CUDA device") == 2


@pytest.mark.slow
def test_one_rank_raising_ends_every_rank_cleanly_without_a_hang(tmp_path, env):
    """Rank 1 raises; rank 1 marks its failure in the job's store and rank 0's watch ends
    its run with peer_failed (issue 22): every rank fires its shutdown hook once, nothing
    waits forever."""
    result = torchrun(tmp_path, failing_rank="1", env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("rank 1 shutdown exception") == 1, output[-4000:]
    rank0 = [line for line in output.splitlines() if line.startswith("rank 0 shutdown")]
    assert rank0 == ["rank 0 shutdown peer_failed"], output[-4000:]
    assert "rank 1 fails at step 2" in output


PIPELINE_HOST = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {examples!r})
    import train_gpt
    summary = train_gpt.run({argv!r})
    with open(os.path.join({out!r}, "summary_" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(summary, f)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "virtual",
    [
        [],
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        ["--num-virtual-stages-per-pipeline-rank", "2"],
    ],
)
def test_pipeline_parallel_two_stages_train_with_the_loss_on_the_last_stage(tmp_path, env, virtual):
    """PP=2 over gloo, megatron-core's pipeline schedule (interleaved with virtual stages),
    4 micro-batches per step: both stages run every step, only the last computes the loss."""
    import json

    argv = [
        "--train-iters", "4", "--log-interval", "0", "--num-layers", "4",
        "--pipeline-model-parallel-size", "2", "--num-microbatches", "4", *virtual,
    ]  # fmt: skip
    script = tmp_path / "pipeline.py"
    script.write_text(PIPELINE_HOST.format(examples=str(EXAMPLES), argv=argv, out=str(tmp_path)))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), str(script)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    first, last = (json.loads((tmp_path / f"summary_{r}.json").read_text()) for r in (0, 1))
    assert first["steps"] == last["steps"] == 4
    assert first["losses"] == []  # the first stage computes no loss
    assert len(last["losses"]) == 4 and last["losses"][-1] < last["losses"][0]
