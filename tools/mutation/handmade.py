"""Hand-made mutants of the lifecycle guarantees, each with the CPU tests that must kill it.

Each mutant breaks one guarantee the plugin makes (DESIGN.md, "The lifecycle the plugin must
get right") by a small textual change to a copy of the repository; the named tests run on
that copy and must fail. The unmutated copy must pass them first. A mutant whose text is no
longer in the source fails the run: update its ``find`` with the code.

    python tools/mutation/handmade.py            # every mutant; exit 1 if one survives
    python tools/mutation/handmade.py --list     # the mutants and their killing tests
    python tools/mutation/handmade.py -k guard   # those whose id contains "guard"

docs/mutation-testing.md records the last run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIFECYCLE = "tests/test_plugin_lifecycle.py::"


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    breaks: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant(
        "manual-hooks-not-set",
        "after a TE capture the manual hooks are never set (pre-hooks in use)",
        "cudagraph_plugin/runtime/te_capture.py",
        "        if toggle:\n            te.set_manual_hooks()\n",
        "        if toggle:\n            pass\n",
        (
            LIFECYCLE + "test_te_replay_gets_the_param_all_gather_through_the_manual_hooks",
            LIFECYCLE + "test_te_replay_fires_no_module_hook_of_a_graphed_layer",
        ),
    ),
    Mutant(
        "pending-manual-hooks-not-set",
        "warm-up 0: the manual hooks are never set when the host enables the pre-hooks",
        "cudagraph_plugin/runtime/te_capture.py",
        "        self.manual_hooks_pending = False\n        self.state.te.set_manual_hooks()\n",
        "        self.manual_hooks_pending = False\n",
        (
            LIFECYCLE + "test_te_warmup_zero_sets_manual_hooks_when_the_host_enables_the_pre_hooks",
            "tests/test_plugin_failures.py::"
            "test_manual_hooks_are_set_when_the_host_enables_pre_hooks_itself",
        ),
    ),
    Mutant(
        "pre-hooks-not-disabled",
        "the DDP forward pre-hooks stay on while the TE graphs are captured",
        "cudagraph_plugin/runtime/te_capture.py",
        "        if toggle:\n            call_hook(\n"
        '                state.pm, "mcgraph_disable_forward_pre_hook"',
        "        if False:\n            call_hook(\n"
        '                state.pm, "mcgraph_disable_forward_pre_hook"',
        (LIFECYCLE + "test_te_pre_hooks_toggled_around_capture_then_manual_hooks",),
    ),
    Mutant(
        "capture-one-step-late",
        "the post-warmup step (the TE capture) fires one step after the warm-up",
        "hookspecs/run.py",
        "and step - self.start_step == self._warmup_steps\n",
        "and step - self.start_step == self._warmup_steps + 1\n",
        (
            LIFECYCLE + "test_te_captures_once_at_the_post_warmup_step",
            "tests/test_hookspecs_run.py::test_post_warmup_fires_once_relative_to_start_step",
        ),
    ),
    Mutant(
        "capture-counted-from-step-0",
        "the capture step is counted from step 0 instead of the start step (resume)",
        "hookspecs/run.py",
        "and step - self.start_step == self._warmup_steps\n",
        "and step == self._warmup_steps\n",
        (
            LIFECYCLE + "test_te_captures_once_at_the_post_warmup_step[3-6]",
            "tests/test_hookspecs_run.py::test_post_warmup_fires_once_relative_to_start_step",
        ),
    ),
    Mutant(
        "static-buffers-not-released",
        "shutdown keeps megatron-core's full-iteration static input buffers",
        "cudagraph_plugin/runtime/mechanisms.py",
        '            ReleaseStep("full-iteration static input buffers", '
        "compat.clear_static_buffers),\n",
        "",
        (LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held[full]",),
    ),
    Mutant(
        "te-graphs-not-released",
        "shutdown keeps the TE per-layer graphs",
        "cudagraph_plugin/runtime/mechanisms.py",
        '            ReleaseStep("TE per-layer graphs", self._free, frees_graphs=True),\n',
        "",
        (
            LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held[te]",
            LIFECYCLE + "test_graphs_are_freed_once_on_every_exit_path",
        ),
    ),
    Mutant(
        "model-kept-after-shutdown",
        "shutdown keeps its references to the model, its config and the forward/backward",
        "cudagraph_plugin/runtime/plugin.py",
        '            ReleaseStep("model and optimizer references", self._drop_references),\n',
        "",
        (LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held",),
    ),
    Mutant(
        "cublas-workspaces-kept",
        "shutdown keeps the cuBLAS workspaces the capture allocated",
        "cudagraph_plugin/runtime/release_plan.py",
        '            steps.append(ReleaseStep("cuBLAS workspaces", '
        "compat.clear_cublas_workspaces))\n",
        "            pass\n",
        (
            LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held",
            LIFECYCLE + "test_te_captures_once_at_the_post_warmup_step",
        ),
    ),
    Mutant(
        "shutdown-fired-twice",
        "TrainingRun fires mcgraph_shutdown again when the run is left twice",
        "hookspecs/run.py",
        '(see signals)."""\n        if self.shutdown_reason is not None:\n',
        '(see signals)."""\n        if False:\n',
        (
            "tests/test_hookspecs_shutdown.py::test_shutdown_fires_once_even_if_exit_is_called_again",
        ),
    ),
    Mutant(
        "guard-skipped-after-full-capture",
        "full-iteration replays skip the static-shape guard (only the capture call is seen)",
        "cudagraph_plugin/runtime/interceptor.py",
        '        kwargs["data_iterator"] = self.guard.check_call(\n'
        "            stage, self.state.step, kwargs, record=capturing\n        )\n",
        "        if capturing:\n"
        '            kwargs["data_iterator"] = self.guard.check_call(\n'
        "                stage, self.state.step, kwargs, record=capturing\n            )\n",
        (
            LIFECYCLE + "test_shape_change_after_capture_raises_instead_of_replaying[full]",
            LIFECYCLE + "test_microbatch_count_change_after_capture_raises",
        ),
    ),
    Mutant(
        "guard-skipped-after-te-capture",
        "TE replays skip the static-shape guard (only the reference call is recorded)",
        "cudagraph_plugin/runtime/interceptor.py",
        '            kwargs["data_iterator"] = self.guard.check_call(\n'
        "                stage, state.step, kwargs, record=record\n            )\n",
        "            if record:\n"
        '                kwargs["data_iterator"] = self.guard.check_call(\n'
        "                    stage, state.step, kwargs, record=record\n                )\n",
        (LIFECYCLE + "test_shape_change_after_capture_raises_instead_of_replaying[te]",),
    ),
]


def _copy_tree(destination: Path) -> None:
    """The working tree as git sees it (tracked and new files, nothing ignored)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


_NO_CACHE = ("-p", "no:cacheprovider")
_WHERE = "import cudagraph_plugin, hookspecs; print(cudagraph_plugin.__file__)"


def _pytest(tree: Path, test: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *_NO_CACHE, test],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return result.returncode, lines[-1] if lines else result.stderr.strip()[-200:]


def _check_imports_the_copy(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    where = subprocess.run(
        [sys.executable, "-c", _WHERE],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(tree), f"the copy imports {where}, not its own package"


def run(mutants: list[Mutant]) -> int:
    failures = 0
    with tempfile.TemporaryDirectory(prefix="handmade-mutants-") as scratch:
        tree = Path(scratch)
        _copy_tree(tree)
        _check_imports_the_copy(tree)
        tests = sorted({test for mutant in mutants for test in mutant.tests})
        print(f"baseline: {len(tests)} named test(s) on the unmutated copy")
        for test in tests:
            code, last = _pytest(tree, test)
            if code != 0:
                print(f"  BROKEN BASELINE {test}: exit {code}: {last}")
                failures += 1
        if failures:
            return 1
        for mutant in mutants:
            path = tree / mutant.path
            original = path.read_text()
            count = original.count(mutant.find)
            if count != 1:
                print(f"{mutant.id}: its text occurs {count} times in {mutant.path}: update it")
                failures += 1
                continue
            path.write_text(original.replace(mutant.find, mutant.replace))
            try:
                print(f"{mutant.id} ({mutant.path}): {mutant.breaks}")
                for test in mutant.tests:
                    start = time.monotonic()
                    code, last = _pytest(tree, test)
                    verdict = "KILLED" if code == 1 else f"SURVIVED (exit {code})"
                    failures += code != 1
                    print(f"  {verdict:<8} by {test} in {time.monotonic() - start:.0f} s: {last}")
            finally:
                path.write_text(original)
    print("every hand-made mutant killed" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens, also in a log
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    parser.add_argument("-k", default="", help="only mutants whose id contains this")
    args = parser.parse_args()
    mutants = [mutant for mutant in MUTANTS if args.k in mutant.id]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.id} ({mutant.path}): {mutant.breaks}")
            for test in mutant.tests:
                print(f"    {test}")
        return 0
    return run(mutants)


if __name__ == "__main__":
    sys.exit(main())
