"""The plugin author's contract, checked against a plugin installed for real.

``tests/probe_plugin/`` is a plugin written from the docs alone (distribution
``mcgraph-probe``, entry point ``probe``, depending on the hook contract only). A session
fixture builds and installs it, with the contract distribution ``mcgraph-hookspecs`` built
from ``hookspecs/``, offline into an empty directory (``pip install --target``); tests put
that directory on ``sys.path``, so plugin managers find the probe through its dist-info,
as for a user who ran ``pip install``. Nothing registers it in-process.

Each promise of docs/hooks.md and docs/guide.md is checked here: the documented hook order
on the CPU in every run mode, post-warmup included, and when it cannot fire; the shutdown
layers whatever the install order; the report's schema; one name in the registry, the
logs, error notes and blocking; one step numbering in hooks, report and the example
host's log lines; and a plugin's own tests on the contract alone, without torch.
"""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pluggy
import pytest
from cpu_only import needs_mcore_on_cpu

import hookspecs
import train_gpt
from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from hookspecs import BLOCK_ENV_VAR, get_plugin_manager, hookimpl
from hookspecs.report_schema import REPORT_SCHEMA_VERSION, schema_problems

REPO = Path(__file__).resolve().parent.parent
PROBE_SRC = REPO / "tests" / "probe_plugin"
HOOKSPECS_SRC = REPO / "hookspecs"
HOOKS_MD = REPO / "docs" / "hooks.md"

OUT_ENV_VAR = "MCGRAPH_PROBE_OUT"
FAIL_ENV_VAR = "MCGRAPH_PROBE_FAIL_AT"
GRAPH_ARGS = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
TE_ARGS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "--bf16"]
NOT_SOURCES = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")


# -------------------------------------------------------------------------------------------
# Installing the distributions.
# -------------------------------------------------------------------------------------------


def pip_install_target(target: Path, *sources: Path) -> None:
    """``pip install --target`` offline, no dependencies, no build isolation."""
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
            str(target),
            *map(str, sources),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty directory with ``mcgraph-hookspecs`` and ``mcgraph-probe`` installed."""
    base = tmp_path_factory.mktemp("contract")
    # Copies: setuptools writes build/ and *.egg-info next to the sources it builds.
    shutil.copytree(HOOKSPECS_SRC, base / "src" / "hookspecs", ignore=NOT_SOURCES)
    shutil.copytree(PROBE_SRC, base / "src" / "probe", ignore=NOT_SOURCES)
    target = base / "site"
    pip_install_target(target, base / "src" / "hookspecs", base / "src" / "probe")
    return target


def _forget_probe_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.partition(".")[0] == "mcgraph_probe"]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def out(site: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The probe installed and visible to this test (first on ``sys.path``); its events go
    to the returned file."""
    monkeypatch.syspath_prepend(str(site))
    _forget_probe_modules(monkeypatch)
    for name in (BLOCK_ENV_VAR, FAIL_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "probe.jsonl"
    monkeypatch.setenv(OUT_ENV_VAR, str(path))
    return path


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Witness:
    """A plugin of the test: the run's plugin manager."""

    pluginmanager: Any = None

    @hookimpl
    def mcgraph_configure(self, pluginmanager: Any) -> None:
        self.pluginmanager = pluginmanager


def train(*argv: str, plugins: tuple[Any, ...] = ()) -> dict[str, Any]:
    return train_gpt.run(["--cpu", "--log-interval", "0", *argv], plugins=plugins)


# -------------------------------------------------------------------------------------------
# What docs/hooks.md promises, read from it.
# -------------------------------------------------------------------------------------------

_ORDER_ROW = re.compile(r"^\| (\d+) \| \[`(mcgraph_\w+)`\]\(#mcgraph_\w+\) \| *(\d*) *\| (.*) \|$")

# The shutdown layers of docs/hooks.md (mcgraph_shutdown), as the probe records them: its
# tryfirst wrapper, the report (from the CUDA graph plugin's wrapper), its trylast wrapper,
# its plain implementation, then the two wrappers' finally blocks, inside out.
SHUTDOWN_LAYERS = [
    ("mcgraph_shutdown", "tryfirst"),
    ("mcgraph_report", None),
    ("mcgraph_shutdown", "trylast"),
    ("mcgraph_shutdown", "plain"),
    ("mcgraph_shutdown.finally", "trylast"),
    ("mcgraph_shutdown.finally", "tryfirst"),
]


def order_table() -> list[tuple[str, int | None, str]]:
    rows = [
        (match[2], int(match[3]) if match[3] else None, match[4])
        for match in map(_ORDER_ROW.match, HOOKS_MD.read_text().splitlines())
        if match
    ]
    assert rows, f"no order table in {HOOKS_MD}"
    return rows


def documented_order(
    start: int, train_iters: int, warmup: int | None, evaluate_after: set[int] = frozenset()
) -> list[tuple[str, Any]]:
    """The ``(hook, step)`` sequence hooks.md promises, then the shutdown layers."""
    rows = order_table()
    first = next(i for i, (_, step, _) in enumerate(rows) if step is not None)
    setup = [(hook, None) for hook, _, _ in rows[:first]]
    by_hook = {hook: fired_by for hook, _, fired_by in rows}
    # What this reading of the table relies on; a change of the docs should be looked at.
    assert rows[first][0] == "mcgraph_train_step_start"
    assert "step - start_step == warmup_steps" in by_hook["mcgraph_post_warmup_step"]
    post = [i for i, (hook, _, _) in enumerate(rows) if hook == "mcgraph_post_warmup_step"]
    assert len(post) == 1 and rows[post[0] - 1][0] == "mcgraph_train_step_start"
    assert rows[post[0] + 1][0] == "mcgraph_train_step_end"
    assert rows[-1][0] == "mcgraph_shutdown"

    order = list(setup)
    for step in range(start, train_iters):
        order.append(("mcgraph_train_step_start", step))
        if warmup is not None and step - start == warmup:
            order.append(("mcgraph_post_warmup_step", step))
        order.append(("mcgraph_train_step_end", step))
        if step in evaluate_after:
            order += [("mcgraph_evaluation_start", step), ("mcgraph_evaluation_end", step)]
    return order + SHUTDOWN_LAYERS


def recorded_order(recorded: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [
        (e["hook"], e.get("layer") if e["hook"].startswith("mcgraph_shutdown") else e.get("step"))
        for e in recorded
    ]


def test_the_shutdown_layers_read_here_are_the_documented_ones():
    section = HOOKS_MD.read_text().split("### `mcgraph_shutdown`", 1)[1]
    layers = re.findall(r"^(\d)\. (.+)$", section, flags=re.MULTILINE)
    assert [number for number, _ in layers] == ["1", "2", "3"]
    assert "tryfirst=True" in layers[0][1]
    assert "CUDA graph plugin's wrapper" in layers[1][1]
    assert "trylast=True" in layers[2][1]


# -------------------------------------------------------------------------------------------
# The documented order on the CPU, post-warmup included.
# -------------------------------------------------------------------------------------------

RUN_MODES = {
    "graphs on, default warm-up": ([*GRAPH_ARGS, "--train-iters", "5"], 0, 5, 3),
    "graphs on, warm-up 1": ([*GRAPH_ARGS, "--cuda-graph-warmup-steps", "1"], 0, 4, 1),
    # full_iteration needs a warm-up step (validation): TE scopes allow warm-up 0
    "graphs on, warm-up 0": (
        [*TE_ARGS, "--cuda-graph-warmup-steps", "0"],
        0,
        3,
        0,
    ),
    "graphs off": (["--cuda-graph-impl", "none", "--cuda-graph-warmup-steps", "2"], 0, 4, 2),
    "graphs off, default": (["--train-iters", "4"], 0, 4, 3),
    "resumed": ([*GRAPH_ARGS, "--cuda-graph-warmup-steps", "1", "--start-step", "2"], 2, 5, 1),
}


@needs_mcore_on_cpu
@pytest.mark.parametrize("mode", list(RUN_MODES))
def test_the_documented_order_with_post_warmup_in_every_cpu_run_mode(out: Path, mode: str):
    argv, start, train_iters, warmup = RUN_MODES[mode]
    if "--train-iters" not in argv:
        argv = [*argv, "--train-iters", str(train_iters)]
    summary = train(*argv, "--eval-interval", "2", "--eval-iters", "1")

    assert summary["shutdown_reason"] == "completed"
    recorded = events(out)
    evaluated = {step for step in range(start, train_iters) if (step + 1) % 2 == 0}
    assert recorded_order(recorded) == documented_order(start, train_iters, warmup, evaluated)
    (answer,) = [e["answer"] for e in recorded if e["hook"] == "mcgraph_warmup_steps"]
    assert answer == warmup
    (report,) = [e["report"] for e in recorded if e["hook"] == "mcgraph_report"]
    assert schema_problems(report) == []
    assert (report["warmup_steps"], report["start_step"]) == (warmup, start)
    assert report["graphs_captured"] is False


@needs_mcore_on_cpu
def test_post_warmup_cannot_fire_when_the_run_ends_before_its_step(out: Path):
    train(*GRAPH_ARGS, "--train-iters", "3")  # warm-up 3: steps 0-2 are all warm-up

    recorded = recorded_order(events(out))
    assert ("mcgraph_warmup_steps", None) in recorded
    assert not [hook for hook, _ in recorded if hook == "mcgraph_post_warmup_step"]
    assert recorded == documented_order(0, 3, None)


@needs_mcore_on_cpu
def test_post_warmup_cannot_fire_when_nobody_answers_the_warmup(
    out: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(BLOCK_ENV_VAR, "cudagraph")  # the plugin that answers it
    train("--train-iters", "3")

    recorded = events(out)
    assert [e["answer"] for e in recorded if e["hook"] == "mcgraph_warmup_steps"] == [None]
    order = recorded_order(recorded)
    without_report = [entry for entry in SHUTDOWN_LAYERS if entry[0] != "mcgraph_report"]
    assert order == documented_order(0, 3, None)[: -len(SHUTDOWN_LAYERS)] + without_report


# -------------------------------------------------------------------------------------------
# The shutdown layers hold whatever the install order.
# -------------------------------------------------------------------------------------------


def _registration_order(pluginmanager: Any) -> list[str]:
    names = [name for name, _ in pluginmanager.list_name_plugin()]
    return [name for name in names if name in (RUN_PLUGIN_NAME, "probe:Outermost")]


SHUTDOWN_EVENTS = ("mcgraph_shutdown", "mcgraph_report ")


def _shutdown_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The shutdown as the two plugins log it, in order."""
    lines = []
    for record in caplog.records:
        text = record.getMessage()
        if record.name == "cudagraph_plugin" and text.startswith("shutdown ("):
            lines.append("cudagraph: graphs freed")
        elif record.name == "cudagraph_plugin" and text.startswith("CUDA graph report"):
            lines.append("cudagraph: report")
        elif record.name == "mcgraph_probe" and text.startswith(SHUTDOWN_EVENTS):
            hook, details = text.split(" ", 1)
            lines.append(f"probe: {hook} {json.loads(details).get('layer', '')}".strip())
    return lines


@needs_mcore_on_cpu
@pytest.mark.parametrize("ending", ["completed", "exception"])
def test_the_shutdown_layers_hold_in_either_install_order(
    site: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    ending: str,
):
    caplog.set_level(logging.INFO, logger="cudagraph_plugin")
    caplog.set_level(logging.INFO, logger="mcgraph_probe")
    for name in (BLOCK_ENV_VAR, FAIL_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    if ending == "exception":
        monkeypatch.setenv(FAIL_ENV_VAR, "mcgraph_train_step_end")
    registration_orders, logs = [], []
    for first in (True, False):  # the probe's distribution before, then after, the project's
        with monkeypatch.context() as inner:
            path = [str(site), *sys.path] if first else [*sys.path, str(site)]
            inner.setattr(sys, "path", path)
            importlib.invalidate_caches()
            _forget_probe_modules(inner)
            inner.setenv(OUT_ENV_VAR, str(tmp_path / f"probe-{first}.jsonl"))
            caplog.clear()
            witness = Witness()
            try:
                summary = train(*GRAPH_ARGS, "--train-iters", "2", plugins=(witness,))
                reason = summary["shutdown_reason"]
            except RuntimeError as exc:
                assert "mcgraph-probe fails" in str(exc)
                reason = "exception"
            assert reason == ending
            registration_orders.append(_registration_order(witness.pluginmanager))
            logs.append(_shutdown_log(caplog))
            recorded = recorded_order(events(tmp_path / f"probe-{first}.jsonl"))
            assert recorded[-len(SHUTDOWN_LAYERS) :] == SHUTDOWN_LAYERS

    # The two runs did register the plugins in opposite orders ...
    assert registration_orders[0] == registration_orders[1][::-1], registration_orders
    # ... and the layers held in both: tryfirst outside, the report and graphs freed by the
    # CUDA graph plugin in the middle, trylast and plain inside.
    expected = [
        "probe: mcgraph_shutdown tryfirst",
        "cudagraph: report",
        "probe: mcgraph_report",
        "probe: mcgraph_shutdown trylast",
        "probe: mcgraph_shutdown plain",
        "probe: mcgraph_shutdown.finally trylast",
        "cudagraph: graphs freed",
        "probe: mcgraph_shutdown.finally tryfirst",
    ]
    assert logs == [expected, expected]


# -------------------------------------------------------------------------------------------
# The report, as the installed plugin receives it.
# -------------------------------------------------------------------------------------------


@needs_mcore_on_cpu
def test_the_report_arrives_as_documented_and_matches_its_json(out: Path, tmp_path: Path):
    json_path = tmp_path / "report.json"
    train(*GRAPH_ARGS, "--train-iters", "3", "--cuda-graph-report-json", str(json_path))

    (received,) = [e["report"] for e in events(out) if e["hook"] == "mcgraph_report"]
    assert schema_problems(received) == []
    assert received["schema_version"] == REPORT_SCHEMA_VERSION
    assert received == json.loads(json_path.read_text())
    documented = re.findall(r"^\| `(\w+)` \| `", HOOKS_MD.read_text(), flags=re.MULTILINE)
    assert sorted(received) == sorted(documented)


# -------------------------------------------------------------------------------------------
# One name: registry, log lines, error notes, blocking.
# -------------------------------------------------------------------------------------------


@needs_mcore_on_cpu
def test_one_name_in_the_registry_and_the_log(out: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="hookspecs.manager")
    witness = Witness()
    train("--train-iters", "1", plugins=(witness,))

    pm = witness.pluginmanager
    module = pm.get_plugin("probe")
    dist = importlib.metadata.distribution("mcgraph-probe")
    assert Path(module.__file__).is_relative_to(Path(str(dist.locate_file(""))))
    per_run = ["probe:Recorder", "probe:Outermost", "probe:Innermost"]
    assert all(pm.get_plugin(name) is not None for name in per_run)
    assert {pm.plugin_name(name) for name in ["probe", *per_run]} == {"probe"}
    assert pm.plugin_name(RUN_PLUGIN_NAME) == "cudagraph"
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mcgraph ")]
    assert len(loaded) == 1 and "probe (mcgraph-probe 0.1.0)" in loaded[0], loaded


@needs_mcore_on_cpu
@pytest.mark.parametrize("hook", ["mcgraph_configure", "mcgraph_train_step_end"])
def test_its_errors_name_it_by_its_one_name(out: Path, monkeypatch: pytest.MonkeyPatch, hook: str):
    monkeypatch.setenv(FAIL_ENV_VAR, hook)  # the entry module, then a per-run object
    with pytest.raises(RuntimeError, match="mcgraph-probe fails") as excinfo:
        train(*GRAPH_ARGS, "--train-iters", "2")
    assert excinfo.value.__notes__ == [
        f"raised by plugin 'probe' (mcgraph-probe 0.1.0) in its {hook} implementation"
    ]


def test_blocked_by_its_name_and_told_so_when_given_its_distribution(
    out: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setenv(BLOCK_ENV_VAR, "probe")
    pm = get_plugin_manager()
    assert pm.get_plugin("probe") is None and pm.is_blocked("probe")

    monkeypatch.setenv(BLOCK_ENV_VAR, "mcgraph-probe")
    with caplog.at_level(logging.WARNING, logger="hookspecs.manager"):
        pm = get_plugin_manager()
    assert pm.get_plugin("probe") is not None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "the distribution of plugin 'probe'" in warning
    assert f"{BLOCK_ENV_VAR}=probe" in warning


# -------------------------------------------------------------------------------------------
# One step numbering: hooks, report and the example host's log lines.
# -------------------------------------------------------------------------------------------


@needs_mcore_on_cpu
def test_hooks_report_and_host_logs_number_steps_alike(out: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="train_gpt")
    argv = [
        "--start-step",
        "1",
        "--train-iters",
        "5",
        "--eval-interval",
        "2",
        "--log-interval",
        "1",
    ]
    train_gpt.run(["--cpu", *argv, "--eval-iters", "1", "--exit-interval", "4"])

    recorded = events(out)
    hook_steps = [e["step"] for e in recorded if e["hook"] == "mcgraph_train_step_end"]
    eval_steps = [e["step"] for e in recorded if e["hook"] == "mcgraph_evaluation_end"]
    (report,) = [e["report"] for e in recorded if e["hook"] == "mcgraph_report"]
    log = [r.getMessage() for r in caplog.records if r.name == "train_gpt"]
    assert hook_steps == [1, 2, 3]  # the exit interval: 4 finished steps (0 counts as done)
    assert [int(m[1]) for m in map(re.compile(r"step (\d+) \| loss").match, log) if m] == (
        hook_steps
    )
    assert [int(m[1]) for m in map(re.compile(r"step (\d+) \| eval loss").match, log) if m] == (
        eval_steps
    )
    assert eval_steps == [1, 3]
    assert "training steps 1 to 4" in log
    assert "exit interval (4 steps) reached after step 3" in log
    assert report["start_step"] == 1 and report["eager_steps"] == [2, 3]


# -------------------------------------------------------------------------------------------
# Packaging: the contract alone, without torch or megatron-core.
# -------------------------------------------------------------------------------------------


def _metadata(site: Path, distribution: str) -> importlib.metadata.PackageMetadata:
    (dist,) = [
        d
        for d in importlib.metadata.distributions(path=[str(site)])
        if d.metadata["Name"] == distribution
    ]
    return dist.metadata


def test_the_contract_distribution_is_the_hookspecs_directory(site: Path):
    meta = _metadata(site, "mcgraph-hookspecs")
    assert meta["Version"] == hookspecs.__version__
    assert meta.get_all("Requires-Dist") == ["pluggy>=1.5"]
    installed = sorted(p.name for p in (site / "hookspecs").iterdir() if p.is_file())
    sources = [*sorted(p.name for p in HOOKSPECS_SRC.glob("*.py")), "py.typed"]
    assert installed == sorted(sources)
    for name in sources:
        assert (site / "hookspecs" / name).read_bytes() == (HOOKSPECS_SRC / name).read_bytes()


def test_a_plugin_depends_on_the_contract_alone(site: Path):
    """The dependency closure of the probe, as its metadata declares it: no torch."""
    probe = _metadata(site, "mcgraph-probe")
    assert probe.get_all("Requires-Dist") == ["mcgraph-hookspecs<0.2,>=0.1"]
    closure = {"mcgraph-probe"}
    for dist in ("mcgraph-probe", "mcgraph-hookspecs"):
        for requirement in _metadata(site, dist).get_all("Requires-Dist") or []:
            closure.add(re.split(r"[<>=!~; ]", requirement, maxsplit=1)[0])
    assert closure == {"mcgraph-probe", "mcgraph-hookspecs", "pluggy"}


def test_the_package_depends_on_the_contract_instead_of_shipping_it():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    # every package of the tree, and nothing else (not the contract's hookspecs)
    tree = sorted(
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "cudagraph_plugin").rglob("__init__.py")
    )
    assert sorted(config["options"]["packages"].split()) == tree
    requires = config["options"]["install_requires"]
    assert re.search(rf"^mcgraph-hookspecs>={hookspecs.__version__},<", requires, re.MULTILINE)


TORCH_FREE_HOST = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{site!r}, {deps!r}]
    import hookspecs
    from hookspecs import TrainingRun, get_plugin_manager, hookimpl
    from hookspecs.report_schema import schema_problems

    class OneWarmupStep:  # what the CUDA graph plugin answers in a real host
        @hookimpl
        def mcgraph_warmup_steps(self):
            return 1

    pm = get_plugin_manager()
    pm.register(OneWarmupStep())
    with TrainingRun(pm, None, train_iters=3) as run:
        for step in range(3):
            with run.train_step(step):
                pass
    try:
        import torch  # noqa: F401
        torch_importable = True
    except ModuleNotFoundError:
        torch_importable = False
    print(json.dumps({{
        "hookspecs": hookspecs.__file__,
        "plugins": [name for name, _ in pm.list_name_plugin()],
        "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron")),
        "torch_importable": torch_importable,
        "schema_check": schema_problems({{}})[:1],
    }}))
    """
)


def test_a_plugins_own_tests_run_on_the_contract_alone(site: Path, tmp_path: Path):
    """The probe and the contract, installed into an empty directory, in an interpreter
    that has neither site-packages nor torch: discovery, the hooks, post-warmup."""
    deps = tmp_path / "deps"
    shutil.copytree(Path(pluggy.__file__).parent, deps / "pluggy", ignore=NOT_SOURCES)
    out = tmp_path / "probe.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in (BLOCK_ENV_VAR, FAIL_ENV_VAR)}
    env[OUT_ENV_VAR] = str(out)
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", TORCH_FREE_HOST.format(site=str(site), deps=str(deps))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert Path(seen["hookspecs"]).is_relative_to(site)
    assert seen["torch_importable"] is False and seen["heavy"] == []
    assert "probe" in seen["plugins"] and "probe:Recorder" in seen["plugins"]
    assert seen["schema_check"] == ["missing key 'break_even_steps'"]  # the first, sorted
    recorded = recorded_order(events(out))
    assert ("mcgraph_post_warmup_step", 1) in recorded
    # This host makes none of the model set-up calls, and has no CUDA graph plugin to report.
    set_up = {hook for hook, _, by in order_table() if re.match(r"`(with )?run\.", by)}
    not_called = {"mcgraph_report", *set_up}
    expected = [entry for entry in documented_order(0, 3, 1) if entry[0] not in not_called]
    assert recorded == expected


# -------------------------------------------------------------------------------------------
# The guide's example plugin is valid against the specs.
# -------------------------------------------------------------------------------------------


def test_the_guides_example_plugin_registers_and_runs_on_the_contract(caplog):
    guide = (REPO / "docs" / "guide.md").read_text()
    section = guide.split("### Implement hooks", 1)[1]
    source = re.search(r"```python\n(.*?)```", section, re.S)[1]
    module = type(sys)("mcgraph_steptimer_from_the_guide")
    exec(compile(source, "docs/guide.md", "exec"), module.__dict__)

    class OneWarmupStep:
        @hookimpl
        def mcgraph_warmup_steps(self):
            return 1

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(module, name="steptimer")
    pm.register(OneWarmupStep())
    caplog.set_level(logging.INFO, logger="mcgraph_steptimer")
    config = type("Config", (), {"steptimer_out": None})()
    with hookspecs.TrainingRun(pm, config, train_iters=2, handle_signals=()) as run:
        for step in range(2):
            with run.train_step(step):
                pass
    pm.check_pending()
    assert pm.plugin_name("steptimer:StepTimer") == "steptimer"
    assert "warm-up over at step 1" in [r.getMessage() for r in caplog.records]
