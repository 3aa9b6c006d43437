"""Medians of the host-time runs of BENCHMARKS.md 2g (one H200, megatron-core 0.19.2 without
TE, 4L-512H, 300 steps per process) from the archives beside this script. Each archive is
one device window (one machine). ``base`` runs are 0f4ae2d (the code before this change,
with today's harness: tools/host_baseline.sh); the others are the commit named. "total":
the median over the 296 steps after the capture; "steady state": over the steps the plugin
does not time (those after the window of 50 timed steps; before this change, 9 in 10 of
them)::

    python benchmarks/results/host-2026-12-01/listener/summarise.py
"""

import io
import json
import statistics
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIECES = ("hooks", "forward_backward", "guard", "optimizer")
WINDOWS = {  # archive: the commit its non-base runs measured
    "windows1-2.tgz": "92e1349 (step listener)",
    "window3_after_trims1.tgz": "7d0627a (+ fewer calls per replay)",
    "window4_after_trims2.tgz": "d4959f1 (+ TrainingRun in four calls)",
    "window5_final.tgz": "4f4c5c6 (final, after the review)",
}
out = sys.stdout
out.write(
    "| window | code | mode | runs | "
    + " | ".join(PIECES)
    + " | total (median) | totals of the runs"
    + " | steady state (median) | steady state of the runs |\n"
)
out.write("|---|---|---|---:|" + "---:|" * (len(PIECES) + 1) + "---|---:|---|\n")
for archive, commit in WINDOWS.items():
    runs: dict[tuple[str, str], list[dict]] = {}
    with tarfile.open(HERE / archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not name.endswith(".json"):
                continue
            data = json.load(io.TextIOWrapper(tar.extractfile(member)))
            code = "0f4ae2d (before)" if "_base" in name else commit
            runs.setdefault((data["mode"], code), []).append(data)
    for (mode, code), group in sorted(
        runs.items(), key=lambda kv: (kv[0][0], "before" not in kv[0][1])
    ):
        cells = [statistics.median(r["us_per_step"][p] or 0.0 for r in group) for p in PIECES]
        totals = sorted(r["total_us_per_step"] for r in group)
        # the steps the plugin does not time: after the capture's window of 50 timed steps
        # (with the listener, the steps it no longer listens to), i.e. a long run's steps
        steady = sorted(r["untimed_steps"]["total_us_per_step"] for r in group)
        out.write(
            f"| {archive} | {code} | {mode} | {len(group)} | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + f" | {statistics.median(totals):.1f} | "
            + ", ".join(f"{t:.1f}" for t in totals)
            + f" | **{statistics.median(steady):.1f}** | "
            + ", ".join(f"{t:.1f}" for t in steady)
            + " |\n"
        )
