"""pytest-xdist's ``--dist loadgroup`` still groups by ``xdist_group`` with the installed pytest.

``make test`` relies on it (the tests reading one module-scoped job run share a worker, so the
job runs once) and so does ``tests/gpu_suite.sh`` (the GPU scenarios sharing an eager twin run
on one worker). A pytest/xdist pair where the grouping silently stops (pytest 9.2 with xdist
3.8: pytest-dev/pytest-xdist#1386) would only show as slower or duplicated runs; here it fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = textwrap.dedent(
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


def test_loadgroup_runs_each_group_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's configuration
    (tmp_path / "test_groups.py").write_text(TESTS)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:randomly", "-p", "no:cacheprovider", "test_groups.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    grouped = re.findall(r"\[(gw\d)\] .*PASSED test_groups\.py::test_grouped\[\d\](\S*)", output)
    assert len(grouped) == 4, output
    # the group's suffix is what the scheduler groups by (and what tests/gpu_table.py strips)
    assert {suffix for _, suffix in grouped} == {"@shared"}, output
    assert len({worker for worker, _ in grouped}) == 1, output
