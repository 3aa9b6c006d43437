"""A table of `benchmarks/plugin_host_time.py` results: per side and mode, each process's
steady-state total and pieces, and each piece's share of that process's plugin time.

The plugin's host time moves by up to 2x between processes on one machine, and every piece
of a process moves with it (BENCHMARKS.md 2i): totals of a few processes cannot resolve a
change of a few microseconds. A changed piece's share of its own process's time can: the
other pieces run the same code on both sides. (Not quite evenly: in slow processes the
guard grows more than the rest, so one piece against the guard alone is biased by the
process's speed.) Runs are grouped by mode and side; the
side is the file's tag without its trailing run number (``full_iteration_base2.json`` is
mode ``full_iteration``, side ``base``), which is how `tools/host_ab.sh` names them. The
last column is each process's step period (``step_period_us``): the device's step where the
host waits for it, the host's own work per step where it does not; then its probe of the
CPU's speed and the memory's latency (``host_probe_before``)::

    python benchmarks/host_summary.py host-19.tgz [more archives or folders ...]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PIECES = ("hooks", "forward_backward", "guard", "optimizer")
# the pieces the shares are of, adding up to the plugin's time of the process:
# "shortcut" is forward_backward without the guard inside it
SHARES = ("hooks", "shortcut", "guard", "optimizer")


def results(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, JSON) of every result in an archive or folder."""
    if path.is_dir():
        for file in sorted(path.rglob("*.json")):
            yield file.name, json.loads(file.read_text())
        return
    with tarfile.open(path) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.endswith(".json"):
                data = json.load(io.TextIOWrapper(tar.extractfile(member)))
                yield Path(member.name).name, data


def side_of(name: str, mode: str) -> str | None:
    """``base`` of ``full_iteration_base2.json`` (mode ``full_iteration``); None for a file
    that is no result of that mode (e.g. ``guard_floor_base.json``)."""
    stem = name.removesuffix(".json")
    if not stem.startswith(mode):
        return None
    tag = stem[len(mode) :].lstrip("_")
    return re.sub(r"\d+$", "", tag) or "-"


def shares(data: dict[str, Any]) -> dict[str, float | None]:
    """Each of :data:`SHARES` as a fraction of their sum (None for a piece that is 0)."""
    pieces = data["us_per_step"]
    guard = pieces.get("guard") or 0.0
    values = {
        "hooks": pieces.get("hooks") or 0.0,
        "shortcut": (pieces.get("forward_backward") or 0.0) - guard,
        "guard": guard,
        "optimizer": pieces.get("optimizer") or 0.0,
    }
    total = sum(values.values())
    return {key: (value / total if total and value else None) for key, value in values.items()}


def _period(data: dict[str, Any]) -> str:
    # one step's start to the next (results from before the harness recorded it: "-")
    period = data.get("step_period_us")
    return "-" if period is None else f"{period:.0f}"


def _probe(data: dict[str, Any]) -> str:
    # plugin_host_time.host_probe before the run: the CPU's speed and the memory's latency
    probe = data.get("host_probe_before")
    if not probe:
        return "-"
    return f"{probe['l1_chase_ns']:.0f} / {probe['memory_chase_ns']:.0f}"


def table(paths: list[Path]) -> str:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in paths:
        for name, data in results(path):
            if "us_per_step" not in data or "mode" not in data:
                continue
            side = side_of(name, data["mode"])
            if side is not None:
                groups.setdefault((data["mode"], side), []).append(data)
    lines = [
        "| mode | side | runs | steady µs (per run) | "
        + " | ".join(f"{p} µs (median)" for p in PIECES)
        + " | "
        + " | ".join(f"{r} share (per run)" for r in SHARES)
        + " | step period µs (per run) | chase ns, L1 / memory (per run) |",
        "|---|---|---:|---|" + "---:|" * len(PIECES) + "---|" * (len(SHARES) + 2),
    ]
    for (mode, side), runs in sorted(groups.items()):
        steady = [r["untimed_steps"]["total_us_per_step"] for r in runs]
        cells = [statistics.median(r["us_per_step"][p] or 0.0 for r in runs) for p in PIECES]
        per_run = [shares(r) for r in runs]
        share_cells = [
            ", ".join("-" if x[key] is None else f"{x[key]:.2f}" for x in per_run) for key in SHARES
        ]
        lines.append(
            f"| {mode} | {side} | {len(runs)} | "
            + f"**{statistics.median(steady):.1f}** ("
            + ", ".join(f"{s:.1f}" for s in steady)
            + ") | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + " | "
            + " | ".join(share_cells)
            + " | "
            + ", ".join(_period(r) for r in runs)
            + " | "
            + ", ".join(_probe(r) for r in runs)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help=".tgz archives or folders")
    args = parser.parse_args(argv)
    sys.stdout.write(table(args.paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
