"""``benchmarks/gpu_modes.py --resume``: one benchmark continued over several processes.

Real (tiny, CPU) runs: the second process keeps the first one's runs, makes only the missing
ones and refuses a results file made with other settings.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_modes

pytestmark = needs_mcore_on_cpu


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """gpu_modes.main() sets logger levels for a benchmark process (megatron and the plugin
    quiet); the tests after these must still see the plugin's INFO lines."""
    names = ("", "megatron", "cudagraph_plugin", "train_gpt", "gpu_modes")
    levels = {name: logging.getLogger(name).level for name in names}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


SMOKE = ["--cpu", "--smoke", "--modes", "eager", "--no-warmup-run", "--time-budget", "0"]


def test_resume_keeps_the_runs_and_makes_only_the_missing_ones(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert gpu_modes.main([*SMOKE, "--repeats", "1", "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    assert [(r["kind"], r["repeat"]) for r in first["runs"]] == [("plugin", 0), ("baseline", 0)]

    assert gpu_modes.main([*SMOKE, "--repeats", "2", "--resume", str(out), "--out", str(out)]) == 0
    both = json.loads(out.read_text())
    assert both["runs"][:2] == first["runs"]
    assert sorted((r["kind"], r["repeat"]) for r in both["runs"][2:]) == [
        ("baseline", 1),
        ("plugin", 1),
    ]
    assert both["processes"] == 2
    assert both["date"] == first["date"]
    assert "--resume" in both["command"] and " ; then " in both["command"]
    assert both["results"][0]["runs_ok"] == {"plugin": 2, "baseline": 2}

    # Nothing is missing any more: a third process makes no run.
    assert gpu_modes.main([*SMOKE, "--repeats", "2", "--resume", str(out), "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["runs"]) == 4


def test_resume_refuses_other_settings(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert gpu_modes.main([*SMOKE, "--repeats", "1", "--out", str(out)]) == 0
    with pytest.raises(SystemExit, match="its settings"):
        gpu_modes.main([*SMOKE, "--steps", "7", "--resume", str(out), "--out", str(out)])
