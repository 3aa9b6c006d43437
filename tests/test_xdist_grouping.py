"""pytest-xdist's ``--dist loadgroup`` with the installed pytest and this suite's scheduler.

``make test`` relies on it (the tests reading one module-scoped job run share a worker, so the
job runs once) and so does ``tests/gpu_suite.sh`` (the GPU scenarios sharing an eager twin run
on one worker). A pytest/xdist pair where the grouping silently stops (pytest 9.2 with xdist
3.8: pytest-dev/pytest-xdist#1386) would only show as slower or duplicated runs; here it
fails. A test that ends its worker (the 300 s timeout does) must fail once while the others
still run (``tests/xdist_loadgroup.py``), not run again on each new worker or hang the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

GROUPS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.xdist_group("shared")
    @pytest.mark.parametrize("n", range(4))
    def test_grouped(n):
        pass

    @pytest.mark.parametrize("n", range(4))
    def test_free(n):
        pass
    """
)

CRASHES = textwrap.dedent(
    """
    import os, time
    import pytest

    @pytest.mark.xdist_group("hangs")
    def test_hangs():
        time.sleep(60)  # ended by the timeout, worker and all (thread method)

    @pytest.mark.xdist_group("hangs")
    @pytest.mark.parametrize("n", range(3))
    def test_after_the_hang(n):
        pass

    @pytest.mark.xdist_group("other")
    @pytest.mark.parametrize("n", range(2))
    def test_other_group(n):
        pass

    def test_exits():
        os._exit(3)

    @pytest.mark.parametrize("n", range(6))
    def test_free(n):
        pass
    """
)


def pytest_in(folder: Path, source: str, *args: str) -> str:
    """The output of ``pytest -n 2 --dist loadgroup`` over ``source``, with this suite's
    scheduler and not the project's configuration."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_it.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "xdist_loadgroup", "-p", "no:randomly", "-p", "no:cacheprovider", *args,
         "test_it.py"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return result.stdout + result.stderr


def test_loadgroup_runs_each_group_on_one_worker(tmp_path: Path) -> None:
    output = pytest_in(tmp_path, GROUPS)
    assert "8 passed" in output, output
    grouped = re.findall(r"\[(gw\d)\] .*PASSED test_it\.py::test_grouped\[\d\](\S*)", output)
    assert len(grouped) == 4, output
    # the group's suffix is what the scheduler groups by (and what tests/gpu_table.py strips)
    assert {suffix for _, suffix in grouped} == {"@shared"}, output
    assert len({worker for worker, _ in grouped}) == 1, output


def test_a_test_that_ends_its_worker_fails_once_and_the_rest_runs(tmp_path: Path) -> None:
    output = pytest_in(tmp_path, CRASHES, "--timeout", "2", "--timeout-method", "thread")
    assert "scheduling tests via LoadGroupAfterCrashes" in output, output
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\b2 failed, 11 passed\b", summary), output
    # once per failure: the FAILURES section's line and the short summary's line, counted
    # by line start (the summary line is cut to the terminal's width, or not, as it fits)
    for test in ("test_hangs@hangs", "test_exits"):
        crash = rf"^worker 'gw\d+' crashed while running 'test_it\.py::{test}'$"
        assert len(re.findall(crash, output, re.M)) == 1, output
        assert len(re.findall(rf"^FAILED test_it\.py::{test}\b", output, re.M)) == 1, output
