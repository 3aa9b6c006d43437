"""The NVTX plugin as a third party ships it: installed for real, found through metadata.

A session fixture builds and installs the distribution (``pip install --target``, offline,
no build isolation) into a temporary directory; tests that put that directory on
``sys.path`` see its ``dist-info``, so ``get_plugin_manager()`` loads it through the
``mcgraph`` entry-point group, exactly as for a user who ran ``pip install``. Nothing
imports the plugin from its source directory.

The runs use the example host (``examples/train_gpt.py``) on real megatron-core, on the
CPU, asking for full-iteration CUDA graphs: the CUDA graph plugin validates the request,
runs eagerly and reports "no graph captured"; this plugin receives every hook on the way.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hookspecs import BLOCK_ENV_VAR, ConfigurationError, get_plugin_manager, hookimpl

PLUGIN_SRC = Path(__file__).resolve().parent.parent
REPO = PLUGIN_SRC.parent.parent
EXAMPLES = REPO / "examples"
HOOKS_MD = REPO / "docs" / "hooks.md"

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import cpu_redirect  # noqa: E402
import train_gpt  # noqa: E402

# The plugin's public interface, spelled out as its README gives it.
REPORT_ENV_VAR = "MCGRAPH_NVTX_REPORT"
FAIL_ENV_VAR = "MCGRAPH_NVTX_FAIL_AT"
GRAPH_ARGS = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]

# Runs of megatron-core on the CPU cannot work where it picked TE's or Apex's fused kernels
# (cpu_redirect.cpu_run_blocker says why); the suite's CPU tests are skipped there.
CPU_RUN_BLOCKER = cpu_redirect.cpu_run_blocker()
needs_mcore_on_cpu = pytest.mark.skipif(
    CPU_RUN_BLOCKER is not None, reason=f"CPU test: {CPU_RUN_BLOCKER}"
)
# The example scripts use the GPU when there is one, the CPU otherwise.
needs_mcore_here = pytest.mark.skipif(
    CPU_RUN_BLOCKER is not None and not torch.cuda.is_available(),
    reason=f"no CUDA device, and {CPU_RUN_BLOCKER}",
)


# -------------------------------------------------------------------------------------------
# Installing the distribution.
# -------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def nvtx_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the installed ``mcgraph-nvtx-plugin`` (package + dist-info)."""
    base = tmp_path_factory.mktemp("nvtx-plugin")
    source = base / "src"
    # A copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    shutil.copytree(
        PLUGIN_SRC,
        source,
        ignore=shutil.ignore_patterns("tests", "build", "dist", "*.egg-info", "__pycache__"),
    )
    site = base / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


@pytest.fixture
def installed(nvtx_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The installed plugin visible to this test only, with no blocking or fault injection."""
    monkeypatch.syspath_prepend(str(nvtx_site))
    # Imported fresh from the installation (another copy may be installed in the environment).
    for name in [m for m in sys.modules if m.partition(".")[0] == "mcgraph_nvtx_plugin"]:
        monkeypatch.delitem(sys.modules, name)
    for name in (BLOCK_ENV_VAR, REPORT_ENV_VAR, FAIL_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    return nvtx_site


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Witness:
    """A plugin of the test: the run's manager, shutdown reasons and reports it saw."""

    def __init__(self) -> None:
        self.pluginmanager: Any = None
        self.reasons: list[str] = []
        self.reports: list[dict[str, Any]] = []

    @hookimpl
    def mcgraph_configure(self, pluginmanager: Any) -> None:
        self.pluginmanager = pluginmanager

    @hookimpl
    def mcgraph_report(self, report: Any) -> None:
        self.reports.append(report.to_dict())

    @hookimpl
    def mcgraph_shutdown(self, reason: Any) -> None:
        self.reasons.append(str(reason))


def assert_cleaned_up() -> None:
    from megatron.core import parallel_state

    assert not torch.distributed.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    assert not cpu_redirect.is_active()


# -------------------------------------------------------------------------------------------
# The documented order (docs/hooks.md).
# -------------------------------------------------------------------------------------------

_ORDER_ROW = re.compile(r"^\| (\d+) \| \[`(mcgraph_\w+)`\]\(#mcgraph_\w+\) \| *(\d*) *\| .* \|$")
_OTHER_ROW = re.compile(r"^\| \[`(mcgraph_\w+)`\]\(#mcgraph_\w+\) \| (.*) \|$")


def documented_order(
    train_iters: int, warmup_steps: int, evaluate_after: set[int]
) -> list[tuple[str, int | None]]:
    """The ``(hook, step)`` sequence docs/hooks.md promises for a run from step 0 with
    ``warmup_steps`` (so a post-warmup step), evaluating after the given steps.

    Built from the order table: its set-up rows, its first (plain) step, its post-warmup
    row, its evaluation rows and its last row; ``mcgraph_report`` comes inside
    ``mcgraph_shutdown``, after this plugin's tryfirst wrapper is entered.
    """
    text = HOOKS_MD.read_text()
    rows = [
        (match[2], int(match[3]) if match[3] else None)
        for match in map(_ORDER_ROW.match, text.splitlines())
        if match
    ]
    assert rows, f"no order table found in {HOOKS_MD}"
    first_step = next(i for i, (_, step) in enumerate(rows) if step is not None)
    setup = [(hook, None) for hook, _ in rows[:first_step]]
    plain_step = [hook for hook, step in rows if step == rows[first_step][1]]
    post_warmup = [hook for hook, _ in rows if hook == "mcgraph_post_warmup_step"]
    evaluation = [hook for hook, _ in rows if hook.startswith("mcgraph_evaluation_")]
    last_hook, _ = rows[-1]
    fired_by = {m[1]: m[2] for m in map(_OTHER_ROW.match, text.splitlines()) if m}
    assert fired_by["mcgraph_report"].endswith("inside `mcgraph_shutdown`")
    # What this reading of the table gives; a change of the docs should be looked at here.
    assert plain_step == ["mcgraph_train_step_start", "mcgraph_train_step_end"]
    assert post_warmup == ["mcgraph_post_warmup_step"]
    assert evaluation == ["mcgraph_evaluation_start", "mcgraph_evaluation_end"]
    assert last_hook == "mcgraph_shutdown"

    order = list(setup)
    for step in range(train_iters):
        start, end = plain_step
        order.append((start, step))
        if step == warmup_steps:
            order.append((post_warmup[0], step))
        order.append((end, step))
        if step in evaluate_after:
            order += [(hook, step) for hook in evaluation]
    return [*order, (last_hook, None), ("mcgraph_report", None)]


# -------------------------------------------------------------------------------------------
# Discovery and blocking.
# -------------------------------------------------------------------------------------------


def test_discovered_through_the_installed_distribution(installed: Path) -> None:
    pm = get_plugin_manager()

    module = pm.get_plugin("nvtx")
    assert module is not None
    assert Path(module.__file__).is_relative_to(installed)
    dist = importlib.metadata.distribution("mcgraph-nvtx-plugin")
    assert Path(str(dist.locate_file(""))) == installed
    (entry_point,) = [ep for ep in dist.entry_points if ep.group == "mcgraph"]
    assert (entry_point.name, entry_point.value) == ("nvtx", "mcgraph_nvtx_plugin.plugin")
    assert [d.project_name for p, d in pm.list_plugin_distinfo() if p is module] == [
        "mcgraph-nvtx-plugin"
    ]


def test_not_discovered_without_its_metadata() -> None:
    try:
        dist = importlib.metadata.distribution("mcgraph-nvtx-plugin")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        where = dist.locate_file("")
        pytest.skip(f"mcgraph-nvtx-plugin is installed in this environment ({where})")
    # The sources sit in examples/ (on sys.path here); only an installation registers it.
    assert get_plugin_manager().get_plugin("nvtx") is None


def test_uses_only_the_public_contract(installed: Path) -> None:
    modules: set[str] = set()
    from_hookspecs: set[str] = set()
    for source in (installed / "mcgraph_nvtx_plugin").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module)
                if node.module == "hookspecs":
                    from_hookspecs |= {alias.name for alias in node.names}

    third_party = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names)
    assert third_party == {"hookspecs", "mcgraph_nvtx_plugin", "torch"}
    assert {m for m in modules if m.startswith("hookspecs")} == {"hookspecs"}
    assert from_hookspecs == {"ConfigurationError", "hookimpl", "ShutdownReason"}


@needs_mcore_on_cpu
def test_blocked_by_the_environment_variable(
    installed: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "nvtx.jsonl"
    monkeypatch.setenv(BLOCK_ENV_VAR, "nvtx")
    monkeypatch.setenv(REPORT_ENV_VAR, str(out))

    pm = get_plugin_manager()
    assert pm.get_plugin("nvtx") is None and pm.is_blocked("nvtx")
    assert pm.get_plugin("cudagraph") is not None
    summary = train_gpt.run(["--cpu", "--train-iters", "2", *GRAPH_ARGS])

    assert summary["steps"] == 2 and summary["shutdown_reason"] == "completed"
    assert not out.exists()
    with pytest.raises(SystemExit):
        train_gpt.run(["--cpu", "--nvtx-report-jsonl", str(out)])
    assert "unrecognized arguments: --nvtx-report-jsonl" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------
# A real run.
# -------------------------------------------------------------------------------------------


@needs_mcore_on_cpu
def test_a_run_feeds_the_plugin_the_documented_hooks_and_the_report(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mcgraph_nvtx_plugin")
    out = tmp_path / "runs" / "nvtx.jsonl"
    witness = Witness()
    argv = ["--cpu", "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"]
    summary = train_gpt.run(
        [*argv, *GRAPH_ARGS, "--nvtx-report-jsonl", str(out)], plugins=[witness]
    )
    # Every hook name of the per-run tracer is a known hook (no typo went unnoticed).
    witness.pluginmanager.check_pending()
    assert witness.pluginmanager.get_plugin("nvtx:RunTracer") is not None
    assert witness.pluginmanager.plugin_name("nvtx:RunTracer") == "nvtx"

    assert summary["steps"] == 4 and summary["shutdown_reason"] == "completed"
    report_line, timeline = read_jsonl(out)
    assert report_line["kind"] == "report"
    report = report_line["report"]
    assert report["graphs_captured"] is False
    assert "no CUDA device" in report["no_graph_reason"]
    assert (report["impl"], report["scope"]) == ("local", ["full_iteration"])
    assert report["shutdown_reason"] == "completed"

    assert timeline["kind"] == "timeline"
    assert timeline["shutdown_reason"] == "completed"
    assert timeline["step_events_dropped"] == 0
    events = timeline["events"]
    # On the CPU too: the CUDA graph plugin answers the warm-up (3) in every run mode.
    assert [(e["hook"], e.get("step")) for e in events] == documented_order(4, 3, {1, 3})
    assert all(e["memory"]["max_rss_mib"] > 0 for e in events)
    assert [e["seconds"] for e in events] == sorted(e["seconds"] for e in events)
    by_hook = {e["hook"]: e for e in events}
    assert by_hook["mcgraph_model_built"]["seq_length"] == 32
    assert by_hook["mcgraph_warmup_steps"]["answer"] == 3
    assert report["warmup_steps"] == 3 and report["schema_version"] == 2
    assert by_hook["mcgraph_report"]["graphs_captured"] is False

    # A memory line for every event: INFO for lifecycle events, DEBUG for steps.
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "mcgraph_nvtx_plugin"]
    memory_lines = [(level, text) for level, text in lines if "max RSS" in text]
    assert [text.split(":")[0].split()[0] for _, text in memory_lines] == [
        e["hook"] for e in events
    ]
    for level, text in memory_lines:
        per_step = text.startswith("mcgraph_train_step_")
        assert level == (logging.DEBUG if per_step else logging.INFO), text
    assert any(text.startswith("NVTX ranges off (no CUDA device)") for _, text in lines)


@needs_mcore_on_cpu
def test_each_run_appends_its_own_lines(installed: Path, tmp_path: Path) -> None:
    out = tmp_path / "nvtx.jsonl"
    for _ in range(2):
        train_gpt.run(["--cpu", "--train-iters", "1", "--nvtx-report-jsonl", str(out)])

    assert [record["kind"] for record in read_jsonl(out)] == ["report", "timeline"] * 2


@needs_mcore_on_cpu
@pytest.mark.parametrize(
    ("hook", "reason"),
    [("mcgraph_train_step_end", "exception"), ("mcgraph_shutdown", "completed")],
)
def test_its_exception_surfaces_and_shutdown_still_cleans_up(
    installed: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    hook: str,
    reason: str,
) -> None:
    caplog.set_level(logging.INFO, logger="cudagraph_plugin")
    monkeypatch.setenv(FAIL_ENV_VAR, hook)
    out = tmp_path / "nvtx.jsonl"
    witness = Witness()

    with pytest.raises(RuntimeError, match=f"mcgraph-nvtx-plugin fails in {hook}") as excinfo:
        train_gpt.run(
            ["--cpu", "--train-iters", "4", *GRAPH_ARGS, "--nvtx-report-jsonl", str(out)],
            plugins=[witness],
        )

    assert (
        f"raised by plugin 'nvtx' (mcgraph-nvtx-plugin 0.1.0) in its {hook} implementation"
        in excinfo.value.__notes__
    )
    # The CUDA graph plugin's shutdown ran in full: report, then graphs freed.
    assert witness.reasons == [reason]
    assert [r["shutdown_reason"] for r in witness.reports] == [reason]
    messages = [r.getMessage() for r in caplog.records if r.name == "cudagraph_plugin"]
    assert any(m.startswith("CUDA graph report:") for m in messages)
    assert any(m.startswith(f"shutdown ({reason}): ") for m in messages)
    # And the failing plugin's own cleanup ran: report and timeline written, file closed.
    assert [record["kind"] for record in read_jsonl(out)] == ["report", "timeline"]
    assert witness.pluginmanager.get_plugin("nvtx:RunTracer").sink.closed
    assert_cleaned_up()


@needs_mcore_on_cpu
def test_an_unwritable_report_path_fails_at_configure(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    witness = Witness()

    # A refusal, which hosts print without a traceback (exit status 2), not a crash.
    with pytest.raises(ConfigurationError, match="cannot open its report file") as excinfo:
        train_gpt.run(
            ["--cpu", "--nvtx-report-jsonl", str(not_a_dir / "nvtx.jsonl")], plugins=[witness]
        )

    assert excinfo.value.__notes__ == [
        "raised by plugin 'nvtx' (mcgraph-nvtx-plugin 0.1.0) in its mcgraph_configure "
        "implementation"
    ]
    assert witness.reasons == ["exception"]
    assert_cleaned_up()


@needs_mcore_here
def test_a_host_prints_its_refusal_of_a_directory_and_exits_2(
    installed: Path, tmp_path: Path, capsys: Any
) -> None:
    import minimal_loop

    status = minimal_loop.main(["--train-iters", "1", "--nvtx-report-jsonl", str(tmp_path)])

    assert status == 2
    err = capsys.readouterr().err
    refusal = f"error: mcgraph-nvtx-plugin cannot open its report file {str(tmp_path)!r}: "
    assert any(line.startswith(refusal) for line in err.splitlines()), err
    assert "point --nvtx-report-jsonl (or MCGRAPH_NVTX_REPORT) at a writable file" in err
    assert "Traceback" not in err
    assert_cleaned_up()


# -------------------------------------------------------------------------------------------
# NVTX ranges (a stand-in for torch.cuda.nvtx: real NVTX needs a CUDA device).
# -------------------------------------------------------------------------------------------


class FakeNvtx:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def range_push(self, msg: str) -> int:
        self.calls.append(("push", msg))
        return 0

    def range_pop(self) -> int:
        self.calls.append(("pop",))
        return 0

    def mark(self, msg: str) -> None:
        self.calls.append(("mark", msg))


def traced_run(nvtx: FakeNvtx, fail_in_step: int | None = None) -> Any:
    """Three steps and an evaluation, with a full-iteration capture during step 1."""
    from mcgraph_nvtx_plugin.tracer import RunTracer

    from hookspecs import TrainingRun

    pm = get_plugin_manager(load_entrypoints=False)
    tracer = RunTracer(nvtx=nvtx, cuda=False, sink=None)
    pm.register(tracer)
    capture = {"impl": "local", "scope": ["full_iteration"]}
    with TrainingRun(pm, config=None, train_iters=3) as run:
        for step in range(3):
            with run.train_step(step):
                if step == 1:
                    pm.hook.mcgraph_before_capture(step=step, **capture)
                    pm.hook.mcgraph_after_capture(step=step, **capture, seconds=0.5, graph_count=1)
                if step == fail_in_step:
                    raise KeyError("the step failed")
        with run.evaluation():
            pass
    return tracer


def test_nvtx_ranges_around_steps_capture_evaluation_and_shutdown(installed: Path) -> None:
    nvtx = FakeNvtx()
    traced_run(nvtx)

    assert nvtx.calls == [
        ("push", "mcgraph step 0"),
        ("pop",),
        ("push", "mcgraph step 1"),
        ("push", "mcgraph capture local full_iteration step 1"),
        ("pop",),
        ("pop",),
        ("mark", "mcgraph replay step 2"),
        ("push", "mcgraph step 2"),
        ("pop",),
        ("push", "mcgraph evaluation"),
        ("pop",),
        ("push", "mcgraph shutdown (completed)"),
        ("pop",),
    ]


def test_nvtx_ranges_stay_balanced_when_a_step_raises(installed: Path) -> None:
    nvtx = FakeNvtx()
    with pytest.raises(KeyError):
        traced_run(nvtx, fail_in_step=1)

    pushes = [call for call in nvtx.calls if call[0] == "push"]
    assert pushes[-1] == ("push", "mcgraph shutdown (exception)")
    assert len(pushes) == sum(call == ("pop",) for call in nvtx.calls)


# -------------------------------------------------------------------------------------------
# As a user runs it.
# -------------------------------------------------------------------------------------------


@needs_mcore_here
@pytest.mark.slow
def test_the_example_script_writes_the_report(installed: Path, tmp_path: Path) -> None:
    out = tmp_path / "nvtx.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in (BLOCK_ENV_VAR, FAIL_ENV_VAR)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(installed), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_gpt.py"),
            "--train-iters",
            "3",
            *GRAPH_ARGS,
            "--nvtx-report-jsonl",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )

    assert result.returncode == 0, result.stderr[-4000:]
    report_line, timeline = read_jsonl(out)
    assert report_line["report"]["steps_timed"] == 3
    assert timeline["shutdown_reason"] == "completed"
    assert "mcgraph_nvtx_plugin: mcgraph_model_built seq_length=32" in result.stderr


@needs_mcore_here
def test_the_guide_minimal_loop_hosts_it(
    installed: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    import minimal_loop

    out = tmp_path / "nvtx.jsonl"
    monkeypatch.setenv(REPORT_ENV_VAR, str(out))
    minimal_loop.main(["--train-iters", "2", "--trace", *GRAPH_ARGS])

    traced = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hook:")]
    assert traced[0] == "hook: mcgraph_configure"
    assert traced[-2:] == ["hook: mcgraph_shutdown", "hook: mcgraph_report"]
    report_line, timeline = read_jsonl(out)
    assert report_line["report"]["graphs_captured"] is False
    assert [e["hook"] for e in timeline["events"]][-2:] == ["mcgraph_shutdown", "mcgraph_report"]
    assert_cleaned_up()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_capture_and_replay_show_up_in_the_timeline(
    installed: Path, tmp_path: Path
) -> None:
    out = tmp_path / "nvtx.jsonl"
    argv = ["--train-iters", "6", "--cuda-graph-warmup-steps", "2", "--nvtx-report-jsonl"]
    train_gpt.run([*argv, str(out), *GRAPH_ARGS])

    report_line, timeline = read_jsonl(out)
    report = report_line["report"]
    assert report["graphs_captured"] is True
    events = [(e["hook"], e.get("step")) for e in timeline["events"]]
    step = report["capture_step"]
    start = events.index(("mcgraph_train_step_start", step))
    assert events[start + 1 : start + 5] == [
        ("mcgraph_post_warmup_step", step),
        ("mcgraph_before_capture", step),
        ("mcgraph_after_capture", step),
        ("mcgraph_train_step_end", step),
    ]
    assert all("allocated_mib" in e["memory"] for e in timeline["events"])
