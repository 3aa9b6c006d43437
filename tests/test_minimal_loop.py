"""The guide's minimal training loop (``examples/minimal_loop.py``) runs and fires the hooks.

docs/guide.md shows the file verbatim; these tests run it as a user would (a fresh
interpreter, ``--trace``) and check that the guide still shows exactly that file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

REPO = Path(__file__).resolve().parent.parent
LOOP = REPO / "examples" / "minimal_loop.py"
GUIDE = REPO / "docs" / "guide.md"


@pytest.fixture(scope="module")
def traced_run(subprocess_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # No GPU even on a CUDA machine: the run is the CPU one the guide describes.
    env = {**subprocess_env, "CUDA_VISIBLE_DEVICES": ""}
    argv = ["--trace", "--train-iters", "3"]
    argv += ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    return subprocess.run(
        [sys.executable, str(LOOP), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@needs_mcore_on_cpu
# The tests of the module-scoped run share a pytest-xdist worker (make test runs --dist
# loadgroup), so the loop runs once, not once on each worker.
@pytest.mark.slow
@pytest.mark.xdist_group("minimal_loop_run")
def test_the_minimal_loop_trains_and_fires_every_host_hook_in_order(
    traced_run: subprocess.CompletedProcess[str],
) -> None:
    assert traced_run.returncode == 0, traced_run.stderr[-4000:]
    traced = [line[len("hook: ") :] for line in traced_run.stdout.splitlines() if "hook: " in line]
    steps = ["mcgraph_train_step_start", "mcgraph_train_step_end"] * 3
    assert traced == [
        "mcgraph_configure",
        "mcgraph_rng_options",
        "mcgraph_rng_initialized",
        "mcgraph_model_config_kwargs",
        "mcgraph_model_build_context",
        "mcgraph_model_built",
        "mcgraph_forward_backward_func",
        "mcgraph_warmup_steps",
        "mcgraph_train_start",
        *steps,
        "mcgraph_evaluation_start",
        "mcgraph_evaluation_end",
        "mcgraph_shutdown",
        "mcgraph_report",
    ]
    assert re.findall(r"^step (\d): loss \d+\.\d+$", traced_run.stdout, re.MULTILINE) == [
        "0",
        "1",
        "2",
    ]


@needs_mcore_on_cpu
@pytest.mark.slow
@pytest.mark.xdist_group("minimal_loop_run")
def test_the_cuda_graph_plugin_validates_reports_and_shuts_down(
    traced_run: subprocess.CompletedProcess[str],
) -> None:
    log = traced_run.stderr
    assert log.count("CUDA graphs need a CUDA device") == 1, log[-4000:]
    assert "INFO cudagraph_plugin: CUDA graph report:" in log
    assert "NO GRAPH CAPTURED: no CUDA device" in log
    assert "INFO cudagraph_plugin: shutdown (completed)" in log


def test_the_guide_shows_the_file_verbatim() -> None:
    guide = GUIDE.read_text()
    match = re.search(r"<!-- examples/minimal_loop\.py -->\n```python\n(.*?)```\n", guide, re.S)
    assert match, "docs/guide.md lost its copy of examples/minimal_loop.py"
    assert match[1] == LOOP.read_text(), "docs/guide.md and examples/minimal_loop.py differ"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--train-iters", "-1"], "--train-iters must not be negative"),
        # argparse's own errors, the plugin's flags' among them: before, the usage of
        # every flag (some twenty lines) on every rank
        (["--cuda-graph-scope", "atn"], "unknown scope(s) 'atn' in 'atn'"),
        (["--cuda-graph-warmup", "2"], "(--cuda-graph-warmup: did you mean "),
    ],
)
def test_a_bad_command_line_is_refused_in_two_lines_once_per_job(
    argv: list[str],
    said: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import minimal_loop

    from cudagraph_plugin.runtime import configure_refusal
    from hookspecs import errors

    monkeypatch.setattr(sys, "argv", ["minimal_loop.py"])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exited:
        minimal_loop.main(argv)
    assert exited.value.code == 2
    error, where = capsys.readouterr().err.splitlines()[-2:]
    assert error.startswith("minimal_loop.py: error: ") and said in error, error
    assert where == "(minimal_loop.py --help lists the flags)"
    # rank 1 of a torchrun job: said by it where torchrun's store counted its refusal
    # first (a check that failed on its node alone), else left to that rank (after a wait)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    slept: list[float] = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    for first in (True, False):
        monkeypatch.setattr(
            configure_refusal,
            "_note_first",
            lambda error, *_, first=first: setattr(error, "said_here", first),
        )
        with pytest.raises(SystemExit) as exited:
            minimal_loop.main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        if first:
            assert "[rank 1] minimal_loop.py: error: " in err and said in err, err
            assert slept == []
        else:
            assert "error" not in err and slept == [errors.REFUSAL_GRACE_S], err


@needs_mcore_on_cpu
def test_a_ctrl_c_ends_the_loop_after_its_shutdown_in_one_line_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run shuts down as ``interrupted``, the loop says the Ctrl-C in one line, and the
    interrupt goes on to the caller (the process then ends by SIGINT)."""
    import minimal_loop

    def interrupted(run, args, cuda):
        raise KeyboardInterrupt

    ended = []
    end_distributed = minimal_loop.end_distributed

    def record_end(run):
        ended.append(str(run.shutdown_reason))
        end_distributed(run)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # (put back afterwards)
    monkeypatch.setattr(minimal_loop, "train", interrupted)
    monkeypatch.setattr(minimal_loop, "end_distributed", record_end)
    with pytest.raises(KeyboardInterrupt):
        minimal_loop.main(["--train-iters", "2"])
    assert ended == ["interrupted"]
    assert capsys.readouterr().err == "interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)\n"
