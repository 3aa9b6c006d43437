"""Turn the GPU suite's results file into the markdown tables BENCHMARKS.md shows.

Usage::

    python tests/gpu_table.py results.jsonl [--junit junit_single.xml junit_multi.xml]
        [--all] [--out table.md]

``results.jsonl`` is what ``tests/test_gpu.py`` appends with ``MCGRAPH_GPU_RESULTS`` set,
one line per job. The first table has a row per scenario job (scenario, command,
megatron-core / TE versions, GPUs, DP / TP, result, capture step, speed-up, memory); the
second lists the failure jobs with the time each took to end (the "no hang" numbers).
With ``--junit``, the result column starts with the test's outcome (passed / failed /
skipped); eager twins are left out unless ``--all``.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def junit_outcomes(paths: list[Path]) -> dict[str, str]:
    """Test name (``test_scenario[te_attn]``) -> passed / failed / error / skipped."""
    outcomes = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = "failed" if child.tag == "failure" else child.tag
            outcomes[_test_name(case.get("name", ""))] = outcome
    return outcomes


def _test_name(name: str) -> str:
    # pytest-xdist's --dist loadgroup appends "@<group>" to the ids of grouped tests.
    return name.rsplit("::", 1)[-1].split("@", 1)[0]


def _option(argv: list[str], flag: str, default: str) -> str:
    return (
        argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else default
    )


def parallel(line: dict[str, Any]) -> str:
    tp = int(_option(line.get("argv") or [], "--tensor-model-parallel-size", "1"))
    nproc = line.get("nproc") or 1
    return f"{max(nproc // tp, 1)} / {tp}"


def ended(line: dict[str, Any]) -> str:
    reasons = {
        rank: info.get("shutdown_reason") for rank, info in (line.get("ranks") or {}).items()
    }
    if len(set(reasons.values())) == 1:
        return str(next(iter(reasons.values())))
    return ", ".join(f"rank {rank}: {reason or 'no record'}" for rank, reason in reasons.items())


def result(line: dict[str, Any], outcomes: dict[str, str]) -> str:
    parts = []
    name = _test_name(line.get("test") or "")
    if name in outcomes:
        parts.append(f"**{outcomes[name]}**")
    if line.get("role") == "in-process":
        parts.append("in-process run")
    elif line.get("timed_out"):
        parts.append(f"TIMED OUT, killed after {line['wall_s']:.0f} s")
    else:
        parts.append(f"rc {line['rc']}, {ended(line)}, {line['wall_s']:.1f} s")
    return "; ".join(parts)


def _num(value: Any, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def memory(line: dict[str, Any]) -> str:
    before, after = line.get("memory_before_mib"), line.get("memory_after_mib")
    if before is None or after is None:
        return "-"
    return f"{before:.0f} → {after:.0f} (+{after - before:.0f})"


def versions(line: dict[str, Any]) -> str:
    return f"{line.get('mcore') or '-'} / {line.get('te') or '-'}"


def scenario_table(lines: list[dict[str, Any]], outcomes: dict[str, str]) -> str:
    header = (
        "| scenario | command | MCore / TE | GPUs | DP / TP | result | capture step | "
        "speed-up | allocated before → after capture (MiB) |\n"
        "|---|---|---|---:|---|---|---:|---:|---|"
    )
    rows = []
    for line in lines:
        name = line["scenario"] + (" (eager twin)" if line.get("role") == "eager" else "")
        cells = [
            name,
            f"`{line.get('command', '')}`",
            versions(line),
            str(line.get("nproc") or 1),
            parallel(line),
            result(line, outcomes),
            _num(line.get("capture_step"), "d"),
            _num(line.get("speedup"), ".2f", "x"),
            memory(line),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([header, *rows])


def failure_table(lines: list[dict[str, Any]]) -> str:
    header = (
        "| failure scenario | GPUs | MCore / TE | exit code | ended after (s) "
        "| shutdown per rank |\n"
        "|---|---:|---|---:|---:|---|"
    )
    rows = [
        f"| {line['scenario']} | {line.get('nproc') or 1} | {versions(line)} | {line['rc']} "
        f"| {'TIMED OUT ' if line.get('timed_out') else ''}{line['wall_s']:.1f} | "
        + ", ".join(
            f"{rank}: {info.get('shutdown_reason') or 'no record'}"
            for rank, info in (line.get("ranks") or {}).items()
        )
        + " |"
        for line in lines
        if line.get("role") == "fault"
    ]
    return "\n".join([header, *rows])


def render(lines: list[dict[str, Any]], outcomes: dict[str, str], include_eager: bool) -> str:
    shown = [line for line in lines if include_eager or line.get("role") != "eager"]
    parts = [scenario_table(shown, outcomes)]
    if any(line.get("role") == "fault" for line in lines):
        parts.append(failure_table(lines))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="the MCGRAPH_GPU_RESULTS file")
    parser.add_argument("--junit", type=Path, nargs="*", default=[], help="pytest junit XML")
    parser.add_argument("--all", action="store_true", help="include the eager twins")
    parser.add_argument("--out", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    text = render(
        load(args.results), junit_outcomes([p for p in args.junit if p.exists()]), args.all
    )
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
