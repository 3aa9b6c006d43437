"""Plot the GPU benchmark and print the BENCHMARKS.md tables (runs on the CPU).

Reads the JSON that ``gpu_modes.py`` wrote (and, when given, ``gpu_limit.py``'s and
``hook_overhead.py``'s), writes a PNG bar chart of the step time per mode and model size
(plugin and hand-written baseline side by side, whiskers spanning the repeats' medians)
and prints the markdown tables::

    python benchmarks/plot.py bench.json --limit limit.json --hook hook.json \\
        --png benchmarks/step_time.png

With ``--pairs`` it charts ``pairs.py``'s ``summary.json`` instead (fresh-process pairs:
each side's median step time, whiskers spanning its runs, the runs as dots, the profiled
GPU kernel time per step as a black line, the median pair ratio in grey) and prints only
the PNG's path::

    python benchmarks/plot.py --pairs <out>/summary.json --png benchmarks/pairs_step_time.png

Needs matplotlib (``pip install -e '.[bench]'``); the tables print without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import tables  # noqa: E402  (after the sys.path set-up above)

COLORS = {"plugin": "#1f77b4", "baseline": "#ff7f0e"}
# pairs.py's sides, in bar order, with their colour key and legend text.
PAIR_SIDES = (
    ("plugin", "plugin", "through the plugin"),
    ("handwritten", "baseline", "hand-written loop (no plugin)"),
)


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: the charts are written, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _suptitle(data: dict[str, Any], note: str) -> str:
    versions = data.get("versions", {})
    return (
        f"{data.get('gpu') or data.get('device')}: torch {versions.get('torch')}, "
        f"megatron-core {versions.get('megatron-core')}, TE {versions.get('transformer-engine')}"
        f" ({(data.get('date') or '')[:10]}; {note})"
    )


def _save(fig: Any, png: Path) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    _pyplot().close(fig)
    return png


def _measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r for r in rows if not r.get("skipped") and (r.get("plugin_ms") or r.get("baseline_ms"))
    ]


def plot(data: dict[str, Any], png: Path) -> Path:
    plt = _pyplot()
    rows = _measured(data.get("results", []))
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    if not sizes:
        raise SystemExit("no measured mode in the results: nothing to plot")
    fig, axes = plt.subplots(
        1, len(sizes), figsize=(5.5 * len(sizes), 4.8), squeeze=False, constrained_layout=True
    )
    width = 0.38
    for ax, size in zip(axes[0], sizes, strict=True):
        mine = [r for r in rows if r["size"] == size]
        for offset, kind in ((-width / 2, "plugin"), (width / 2, "baseline")):
            xs, heights, low, high = [], [], [], []
            for i, row in enumerate(mine):
                value = row.get(f"{kind}_ms")
                if value is None:
                    continue
                repeats = row.get(f"{kind}_ms_per_repeat") or [value]
                xs.append(i + offset)
                heights.append(value)
                low.append(max(0.0, value - min(repeats)))
                high.append(max(0.0, max(repeats) - value))
            label = "through the plugin" if kind == "plugin" else "hand-written loop (no plugin)"
            bars = ax.bar(
                xs,
                heights,
                width,
                yerr=[low, high],
                capsize=3,
                color=COLORS[kind],
                label=label,
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
        for i, row in enumerate(mine):
            if row.get("ratio") is not None:
                top = max(row.get("plugin_ms") or 0, row.get("baseline_ms") or 0)
                ax.annotate(
                    f"{row['ratio']:.3f}",
                    (i, top),
                    xytext=(0, 14),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                    color="dimgray",
                )
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([r["label"].replace(" (", "\n(") for r in mine], fontsize=8)
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{size}: step time per CUDA-graph mode", fontsize=10)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(_suptitle(data, "grey numbers: plugin/baseline step time"), fontsize=9)
    return _save(fig, png)


@dataclasses.dataclass(frozen=True)
class PairBar:
    """One side of one mode in ``pairs.py``'s summary, as drawn."""

    side: str  # "plugin" or "handwritten"
    median_ms: float  # the median of the runs' median step times: the bar
    runs_ms: tuple[float, ...]  # each run's median step time: the dots
    kernel_ms: float | None  # profiled kernel time per step (None: no profile): the line

    @property
    def low_ms(self) -> float:
        return min(self.runs_ms, default=self.median_ms)

    @property
    def high_ms(self) -> float:
        return max(self.runs_ms, default=self.median_ms)


@dataclasses.dataclass(frozen=True)
class PairMode:
    """One mode's bars (sides without a timed run have none) and its median pair ratio."""

    mode: str
    label: str
    bars: tuple[PairBar, ...]
    median_ratio: float | None
    kernel_unit: str | None


def pair_series(summary: dict[str, Any]) -> list[PairMode]:
    """What :func:`plot_pairs` draws, from ``pairs.py``'s ``summary.json``: the modes with a
    timed run on either side, in the summary's order (a skipped mode has none)."""
    modes = []
    for row in summary.get("results", []):
        profiles = row.get("profile") or {}
        bars = tuple(
            PairBar(
                side=side,
                median_ms=row[f"{side}_ms"],
                runs_ms=tuple(row.get(f"{side}_ms_per_run") or ()),
                kernel_ms=(profiles.get(side) or {}).get("time_ms_per_step"),
            )
            for side, _, _ in PAIR_SIDES
            if row.get(f"{side}_ms") is not None
        )
        if bars:
            modes.append(
                PairMode(
                    mode=row["mode"],
                    label=row.get("label") or row["mode"],
                    bars=bars,
                    median_ratio=row.get("median_ratio"),
                    kernel_unit=row.get("kernel_unit"),
                )
            )
    return modes


def plot_pairs(summary: dict[str, Any], png: Path) -> Path:
    """One chart of ``pairs.py``'s summary: per mode, plugin and hand-written bars (median
    step time, log scale) with min-max whiskers, per-run dots and kernel-time lines."""
    modes = pair_series(summary)
    if not modes:
        raise SystemExit("no measured mode in the pairs' summary: nothing to plot")
    plt = _pyplot()
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(2.3 * len(modes) + 2.5, 5.2), constrained_layout=True)
    lowest = min(v for m in modes for b in m.bars for v in (b.low_ms, b.kernel_ms) if v)
    bottom = lowest / 2
    width = 0.38
    offsets = {side: (-width / 2, width / 2)[i] for i, (side, _, _) in enumerate(PAIR_SIDES)}
    colors = {side: COLORS[key] for side, key, _ in PAIR_SIDES}
    labels = {side: text for side, _, text in PAIR_SIDES}
    kernel_labelled = False
    for i, mode in enumerate(modes):
        for bar in mode.bars:
            x = i + offsets[bar.side]
            ax.bar(
                x,
                bar.median_ms,
                width,
                yerr=[[bar.median_ms - bar.low_ms], [bar.high_ms - bar.median_ms]],
                capsize=3,
                color=colors[bar.side],
                label=labels.pop(bar.side, None),
            )
            # Spread the runs' dots across the bar so equal values stay visible.
            n = len(bar.runs_ms)
            xs = [x + width * 0.5 * (k / (n - 1) - 0.5) if n > 1 else x for k in range(n)]
            ax.scatter(
                xs, bar.runs_ms, s=10, color="white", edgecolors="black", linewidths=0.6, zorder=3
            )
            # The median at the foot of the bar, clear of the whiskers and dots at its top.
            ax.annotate(
                f"{bar.median_ms:.2f}",
                (x, bottom),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                color="white",
                fontweight="bold",
            )
            if bar.kernel_ms is not None:
                unit = mode.kernel_unit or "GPU kernels"
                ax.hlines(
                    bar.kernel_ms,
                    x - width * 0.45,
                    x + width * 0.45,
                    color="black",
                    linewidth=2,
                    zorder=4,
                    label=None if kernel_labelled else f"{unit}: time per step (profiled run)",
                )
                kernel_labelled = True
        if mode.median_ratio is not None:
            ax.annotate(
                f"ratio {mode.median_ratio:.3f}",
                (i, max(b.high_ms for b in mode.bars)),
                xytext=(0, 8),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color="dimgray",
            )
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom, max(b.high_ms for m in modes for b in m.bars) * 1.6)
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels([m.label.replace(" (", "\n(").replace(" + ", "\n+ ") for m in modes])
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("median step time (ms, log scale)")
    ax.set_title(
        "plugin vs hand-written loop, one fresh process per run: bar = median of the runs, "
        "whiskers = min-max, dots = runs",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    skipped = [r.get("label") or r["mode"] for r in summary.get("results", []) if r.get("skipped")]
    note = "grey: median plugin/hand-written ratio of the pairs"
    if skipped:
        note += "; skipped: " + ", ".join(skipped)
    fig.suptitle(_suptitle(summary, note), fontsize=9)
    return _save(fig, png)


def markdown(
    modes: dict[str, Any], limit: dict[str, Any] | None, hook: dict[str, Any] | None
) -> str:
    parts = [
        "### CUDA-graph modes: plugin vs hand-written loop",
        "",
        *tables.environment_lines(modes),
        "",
        tables.modes_table(modes),
        "",
        *tables.checks_lines(modes),
    ]
    parts += [f"- note: {note}" for note in modes.get("notes", [])]
    if limit is not None:
        parts += [
            "",
            "### GPU limit: kernel time per step (torch.profiler)",
            "",
            *tables.environment_lines(limit),
            "",
            tables.limit_table(limit),
        ]
    if hook is not None:
        parts += [
            "",
            "### Hook dispatch overhead per training step (CPU)",
            "",
            f"- date: {hook.get('date')}",
            "- host: " + ", ".join(f"{k} {v}" for k, v in (hook.get("host") or {}).items() if v),
            f"- versions: {', '.join(f'{k} {v}' for k, v in hook.get('versions', {}).items())}",
            f"- command: `{hook.get('command')}`",
            "",
            tables.hook_table(hook),
        ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes_json", nargs="?", help="gpu_modes.py output")
    parser.add_argument("--limit", metavar="JSON", help="gpu_limit.py output")
    parser.add_argument("--hook", metavar="JSON", help="hook_overhead.py --json output")
    parser.add_argument(
        "--pairs",
        metavar="JSON",
        help="pairs.py's summary.json: chart it (instead of modes_json) and print no table",
    )
    parser.add_argument(
        "--png",
        help="chart to write (default: benchmarks/step_time.png, with --pairs "
        "benchmarks/pairs_step_time.png)",
    )
    parser.add_argument("--no-png", action="store_true", help="print the tables only")
    args = parser.parse_args(argv)

    def load(path: str | None) -> dict[str, Any] | None:
        return json.loads(Path(path).read_text()) if path else None

    if args.pairs:
        given = [
            name
            for name, value in (
                ("modes_json", args.modes_json),
                ("--limit", args.limit),
                ("--hook", args.hook),
                ("--no-png", args.no_png),
            )
            if value
        ]
        if given:
            parser.error(f"--pairs charts the pairs alone: drop {', '.join(given)}")
        summary = load(args.pairs)
        assert summary is not None
        print(plot_pairs(summary, Path(args.png or HERE / "pairs_step_time.png")))
        return 0
    if args.modes_json is None:
        parser.error("give modes_json (gpu_modes.py output) or --pairs JSON")
    modes = load(args.modes_json)
    assert modes is not None
    print(markdown(modes, load(args.limit), load(args.hook)))
    if not args.no_png:
        print(f"\nwrote {plot(modes, Path(args.png or HERE / 'step_time.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
