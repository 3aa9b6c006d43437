"""``benchmarks/plot.py --pairs``: the chart of ``pairs.py``'s fresh-process pairs.

The series the chart draws (bars, whiskers, dots, kernel lines, ratios) from a hand-made
summary and from the recorded GPU run, without matplotlib; with it, what the figure holds
and the command line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import plot

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "pairs-2026-12-01" / "summary.json"


def _profile(time_ms: float) -> dict[str, Any]:
    return {"unit": "GPU kernels", "count_per_step": 500.0, "time_ms_per_step": time_ms}


def _summary() -> dict[str, Any]:
    return {
        "gpu": "Test GPU",
        "versions": {"torch": "9.9", "megatron-core": "0.99", "transformer-engine": "3.3"},
        "date": "2027-01-02T03:04:05+00:00",
        "results": [
            {
                "mode": "eager",
                "label": "eager (local spec)",
                "plugin_ms": 20.0,
                "plugin_ms_per_run": [21.0, 20.0, 18.0],
                "handwritten_ms": 25.0,
                "handwritten_ms_per_run": [25.0, 30.0, 24.0],
                "median_ratio": 0.8,
                "kernel_unit": "GPU kernels",
                "profile": {"plugin": _profile(2.1), "handwritten": _profile(2.2)},
            },
            {
                # Profiled on one side only, as an interrupted session leaves it.
                "mode": "full_iteration",
                "label": "full_iteration (local spec)",
                "plugin_ms": 5.0,
                "plugin_ms_per_run": [5.0, 6.0],
                "handwritten_ms": 5.5,
                "handwritten_ms_per_run": [5.5, 4.5],
                "median_ratio": 1.0,
                "profile": {"plugin": None, "handwritten": _profile(2.0)},
            },
            {
                # No profile at all, and no hand-written run that finished.
                "mode": "te_attn_mlp",
                "label": "TE attn,mlp",
                "plugin_ms": 12.0,
                "plugin_ms_per_run": [12.0],
                "handwritten_ms": None,
                "handwritten_ms_per_run": [],
                "median_ratio": None,
            },
            {
                "mode": "full_iteration_optimizer",
                "label": "full_iteration + optimizer graph (local spec)",
                "skipped": "megatron-core 0.16.1 has no optimizer graph",
            },
        ],
    }


def _sides(mode: plot.PairMode) -> dict[str, plot.PairBar]:
    return {bar.side: bar for bar in mode.bars}


def test_pair_series_gives_bars_whiskers_dots_and_kernel_lines() -> None:
    modes = plot.pair_series(_summary())
    assert [m.mode for m in modes] == ["eager", "full_iteration", "te_attn_mlp"]  # no skipped

    eager = _sides(modes[0])
    assert list(eager) == ["plugin", "handwritten"]  # the plugin's bar on the left
    assert eager["plugin"].median_ms == 20.0
    assert eager["plugin"].runs_ms == (21.0, 20.0, 18.0)
    assert (eager["plugin"].low_ms, eager["plugin"].high_ms) == (18.0, 21.0)
    assert (eager["handwritten"].low_ms, eager["handwritten"].high_ms) == (24.0, 30.0)
    assert (eager["plugin"].kernel_ms, eager["handwritten"].kernel_ms) == (2.1, 2.2)
    assert modes[0].median_ratio == 0.8 and modes[0].label == "eager (local spec)"


def test_sides_without_a_profile_get_no_kernel_line_and_without_a_run_no_bar() -> None:
    _, full, te = plot.pair_series(_summary())
    assert _sides(full)["plugin"].kernel_ms is None
    assert _sides(full)["handwritten"].kernel_ms == 2.0
    assert list(_sides(te)) == ["plugin"]
    assert _sides(te)["plugin"].kernel_ms is None and te.median_ratio is None
    assert (_sides(te)["plugin"].low_ms, _sides(te)["plugin"].high_ms) == (12.0, 12.0)


def test_pair_series_of_the_recorded_gpu_run() -> None:
    summary = json.loads(RECORDED.read_text())
    modes = {m.mode: m for m in plot.pair_series(summary)}
    assert list(modes) == ["eager", "full_iteration", "full_iteration_optimizer", "te_attn_mlp"]
    graphed = _sides(modes["full_iteration_optimizer"])
    assert graphed["plugin"].median_ms == pytest.approx(2.4530, abs=1e-4)
    assert graphed["handwritten"].median_ms == pytest.approx(2.5369, abs=1e-4)
    assert graphed["plugin"].kernel_ms == pytest.approx(2.0225, abs=1e-4)
    assert modes["eager"].median_ratio == pytest.approx(0.9433, abs=1e-4)
    for mode in modes.values():
        for bar in mode.bars:
            assert len(bar.runs_ms) == 5 and bar.low_ms <= bar.median_ms <= bar.high_ms
            assert bar.kernel_ms is not None and bar.kernel_ms < bar.low_ms


def test_a_summary_with_nothing_measured_is_refused(tmp_path: Path) -> None:
    summary = {"results": [{"mode": "eager", "label": "eager", "skipped": "no CUDA"}]}
    with pytest.raises(SystemExit, match="nothing to plot"):
        plot.plot_pairs(summary, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_the_command_line_wants_modes_json_or_pairs_not_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        plot.main([])
    assert "modes_json" in capsys.readouterr().err
    for extra in (["modes.json"], ["--limit", "limit.json"], ["--no-png"]):
        with pytest.raises(SystemExit):
            plot.main(["--pairs", str(RECORDED), *extra])
        assert "--pairs charts the pairs alone" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# -- the figure (needs matplotlib) -----------------------------------------------------------


def test_the_chart_draws_each_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection, PathCollection

    saved = {}
    save = plot._save

    def keep(fig: Any, png: Path) -> Path:
        ax = fig.axes[0]
        saved["title"] = fig._suptitle.get_text()
        saved["yscale"] = ax.get_yscale()
        saved["heights"] = [patch.get_height() for patch in ax.patches]
        saved["dots"] = sorted(
            float(y)
            for c in ax.collections
            if isinstance(c, PathCollection)
            for _, y in c.get_offsets()
        )
        saved["kernel_lines"] = sorted(
            float(seg[0][1])
            for c in ax.collections
            if isinstance(c, LineCollection)
            for seg in c.get_segments()
            if seg[0][0] != seg[1][0]  # horizontal: the error bars are vertical
        )
        saved["texts"] = [t.get_text() for t in ax.texts]
        saved["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        return save(fig, png)

    monkeypatch.setattr(plot, "_save", keep)
    png = plot.plot_pairs(_summary(), tmp_path / "out" / "pairs.png")

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved["yscale"] == "log"
    assert saved["heights"] == [20.0, 25.0, 5.0, 5.5, 12.0]
    assert saved["dots"] == sorted([21.0, 20.0, 18.0, 25.0, 30.0, 24.0, 5.0, 6.0, 5.5, 4.5, 12.0])
    assert saved["kernel_lines"] == [2.0, 2.1, 2.2]  # none for the unprofiled sides
    assert [t for t in saved["texts"] if t.startswith("ratio")] == ["ratio 0.800", "ratio 1.000"]
    assert saved["legend"][0] == "GPU kernels: time per step (profiled run)"
    assert "through the plugin" in saved["legend"]
    for part in ("Test GPU", "torch 9.9", "megatron-core 0.99", "TE 3.3", "2027-01-02"):
        assert part in saved["title"]
    assert "skipped: full_iteration + optimizer graph (local spec)" in saved["title"]


def test_the_command_line_writes_the_png_and_prints_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "pairs_step_time.png"
    assert plot.main(["--pairs", str(RECORDED), "--png", str(png)]) == 0
    assert capsys.readouterr().out.strip() == str(png)
    assert png.stat().st_size > 10_000
