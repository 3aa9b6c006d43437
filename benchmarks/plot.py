"""Plot the GPU benchmark and print the BENCHMARKS.md tables (runs on the CPU).

Reads the JSON that ``gpu_modes.py`` wrote (and, when given, ``gpu_limit.py``'s and
``hook_overhead.py``'s), writes a PNG bar chart of the step time per mode and model size
(plugin and hand-written baseline side by side, whiskers spanning the repeats' medians)
and prints the markdown tables::

    python benchmarks/plot.py bench.json --limit limit.json --hook hook.json \\
        --png benchmarks/step_time.png

Needs matplotlib (``pip install -e '.[bench]'``); the tables print without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import tables  # noqa: E402  (after the sys.path set-up above)

COLORS = {"plugin": "#1f77b4", "baseline": "#ff7f0e"}


def _measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r for r in rows if not r.get("skipped") and (r.get("plugin_ms") or r.get("baseline_ms"))
    ]


def plot(data: dict[str, Any], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    versions = data.get("versions", {})
    fig.suptitle(
        f"{data.get('gpu') or data.get('device')}: torch {versions.get('torch')}, "
        f"megatron-core {versions.get('megatron-core')}, TE {versions.get('transformer-engine')}"
        f" ({data.get('date', '')[:10]}; grey numbers: plugin/baseline step time)",
        fontsize=9,
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


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
    parser.add_argument("modes_json", help="gpu_modes.py output")
    parser.add_argument("--limit", metavar="JSON", help="gpu_limit.py output")
    parser.add_argument("--hook", metavar="JSON", help="hook_overhead.py --json output")
    parser.add_argument("--png", default=str(HERE / "step_time.png"), help="chart to write")
    parser.add_argument("--no-png", action="store_true", help="print the tables only")
    args = parser.parse_args(argv)

    def load(path: str | None) -> dict[str, Any] | None:
        return json.loads(Path(path).read_text()) if path else None

    modes = load(args.modes_json)
    assert modes is not None
    print(markdown(modes, load(args.limit), load(args.hook)))
    if not args.no_png:
        print(f"\nwrote {plot(modes, Path(args.png))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
