"""Medians of the before/after host-time runs (BENCHMARKS.md 2f) from the two A/B windows'
archives beside this script (`ab_window2.tgz`, `ab_window3.tgz`; 4L-512H runs only)::

    python benchmarks/results/host-2026-12-01/fastpath/summarise.py
"""

import io
import json
import statistics
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIECES = ("hooks", "forward_backward", "guard", "optimizer")
runs: dict[tuple[str, str], list[dict]] = {}
for archive in ("ab_window2.tgz", "ab_window3.tgz"):
    with tarfile.open(HERE / archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not name.endswith(".json") or "hb" in name:
                continue
            data = json.load(io.TextIOWrapper(tar.extractfile(member)))
            side = "before" if "_base" in name else "after"
            runs.setdefault((data["mode"], side), []).append(data)
out = sys.stdout
out.write("| mode | code | runs | " + " | ".join(PIECES) + " | total | steps not timed | timed |\n")
out.write("|---|---|---:|" + "---:|" * (len(PIECES) + 3) + "\n")
for (mode, side), group in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != "before")):
    cells = [statistics.median(r["us_per_step"][p] or 0.0 for r in group) for p in PIECES]
    cells += [
        statistics.median(r["total_us_per_step"] for r in group),
        statistics.median(r["untimed_steps"]["total_us_per_step"] for r in group),
        statistics.median(r["timed_steps"]["total_us_per_step"] for r in group),
    ]
    out.write(
        f"| {mode} | {side} | {len(group)} | " + " | ".join(f"{c:.1f}" for c in cells) + " |\n"
    )
