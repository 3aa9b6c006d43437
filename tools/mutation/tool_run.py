"""Mutation testing of the lifecycle core with cosmic-ray, module by module, time-capped.

For each module: a copy of the repository (``.mutation/tree``, so the working tree is never
mutated), cosmic-ray's mutants of the module (minus the operator replacements listed in
``EXCLUDED_OPERATORS``), each tested by the module's tests through the pytest fork server
(``forkserver.py``: torch and megatron-core imported once). A module's run stops at its time
cap; what ran is reported, the rest counted as not run. Results: ``.mutation/<module>.sqlite``
(cosmic-ray's session; ``cr-report`` reads it) and ``.mutation/<module>-survivors.txt``.

    python tools/mutation/tool_run.py                      # every module, default caps
    python tools/mutation/tool_run.py --module guard --cap-minutes 10

docs/mutation-testing.md records the last run and why each survivor is acceptable.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from handmade import ROOT, _copy_tree

WORK = ROOT / ".mutation"
BIN = Path(sys.executable).parent
LIFECYCLE = ("tests/test_plugin_lifecycle.py", "tests/test_plugin_failures.py")

# module -> (the tests that run for each of its mutants, fastest and sharpest first; cap)
MODULES: dict[str, tuple[tuple[str, ...], float]] = {
    "hookspecs/run.py": (
        (
            "tests/test_hookspecs_run.py",
            "tests/test_hookspecs_shutdown.py",
            "tests/test_hookspecs_blame.py",
            "tests/test_hookspecs_host_defaults.py",
            *LIFECYCLE,
        ),
        40,
    ),
    "cudagraph_plugin/guard.py": (("tests/test_guard.py", *LIFECYCLE), 20),
    "cudagraph_plugin/cleanup.py": (LIFECYCLE, 15),
    "cudagraph_plugin/mechanisms.py": (("tests/test_compat.py", *LIFECYCLE), 15),
    "cudagraph_plugin/compat.py": (("tests/test_compat.py", *LIFECYCLE), 40),
    "cudagraph_plugin/plugin.py": (LIFECYCLE, 60),
}

# Replacements that only restate a kept one: an arithmetic or comparison operator turned
# into a bitwise, power, modulo or identity operator (what a kept replacement to +, -, *,
# /, <, <=, ==, ... does not already test, these do not either; they mostly raise).
EXCLUDED_OPERATORS = (
    r"core/ReplaceBinaryOperator_.*_(Pow|RShift|LShift|BitOr|BitAnd|BitXor|FloorDiv|Mod)$",
    r"core/ReplaceComparisonOperator_(Eq|NotEq|Lt|LtE|Gt|GtE)_(Is|IsNot)$",
)

CONFIG = """\
[cosmic-ray]
module-path = "{module}"
timeout = 300.0
excluded-modules = []
test-command = "{python} tools/mutation/forkserver.py {socket} -- {pytest_args} {tests}"

[cosmic-ray.distributor]
name = "local"

[cosmic-ray.filters.operators-filter]
exclude-operators = [{excluded}]
"""


def _counts(database: Path) -> dict[str, int]:
    with sqlite3.connect(database) as db:
        total = db.execute("select count(*) from work_items").fetchone()[0]
        rows = db.execute(
            "select worker_outcome, test_outcome, count(*) from work_results group by 1, 2"
        ).fetchall()
    counts = {"mutants": total, "killed": 0, "survived": 0, "skipped": 0, "other": 0}
    for worker, test, count in rows:
        if worker == "SKIPPED":
            counts["skipped"] += count
        elif test == "KILLED":
            counts["killed"] += count
        elif test == "SURVIVED":
            counts["survived"] += count
        else:
            counts["other"] += count
    counts["not run"] = total - sum(counts[k] for k in ("killed", "survived", "skipped", "other"))
    return counts


def _survivors(database: Path) -> str:
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "select s.operator_name, s.start_pos_row, r.diff from work_results r "
            "join mutation_specs s on s.job_id = r.job_id "
            "where r.test_outcome = 'SURVIVED' order by s.start_pos_row"
        ).fetchall()
    return "\n".join(f"## line {row} {operator}\n{diff}" for operator, row, diff in rows)


def run_module(module: str, tests: tuple[str, ...], cap_minutes: float, socket: Path) -> dict:
    name = module.replace("/", "_").removesuffix(".py")
    config, database = WORK / f"{name}.toml", WORK / f"{name}.sqlite"
    excluded = ", ".join(f'"{e}"' for e in EXCLUDED_OPERATORS).replace("\\", "\\\\")
    config.write_text(
        CONFIG.format(
            module=module,
            python=sys.executable,
            socket=socket,
            pytest_args="-x -q -p no:randomly -p no:cacheprovider",
            tests=" ".join(tests),
            excluded=excluded,
        )
    )
    database.unlink(missing_ok=True)
    tree = WORK / "tree"
    subprocess.run([BIN / "cosmic-ray", "init", config, database], cwd=tree, check=True)
    subprocess.run([BIN / "cr-filter-operators", database, config], cwd=tree, check=True)
    start = time.monotonic()
    try:
        subprocess.run(
            [BIN / "cosmic-ray", "exec", config, database], cwd=tree, timeout=cap_minutes * 60
        )
    except subprocess.TimeoutExpired:
        print(f"{module}: time cap of {cap_minutes:.0f} min reached")
    counts = _counts(database) | {"minutes": round((time.monotonic() - start) / 60, 1)}
    (WORK / f"{name}-survivors.txt").write_text(_survivors(database) + "\n")
    print(f"{module}: {counts}", flush=True)
    return counts


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens, also in a log
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", help="a module (substring); default all")
    parser.add_argument("--cap-minutes", type=float, help="override each module's time cap")
    args = parser.parse_args()
    modules = [m for m in MODULES if not args.module or any(k in m for k in args.module)]
    tree = WORK / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    _copy_tree(tree)
    socket = WORK / "forkserver.sock"
    server = subprocess.Popen(
        [sys.executable, "tools/mutation/forkserver.py", socket],
        cwd=tree,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        print(server.stdout.readline().strip(), flush=True)  # "ready" once it imported torch
        results = {}
        for module in modules:
            tests, cap = MODULES[module]
            results[module] = run_module(module, tests, args.cap_minutes or cap, socket)
    finally:
        server.kill()
        server.wait()
    print("\nmodule | mutants | killed | survived | skipped (excluded operator) | other | not run")
    for module, c in results.items():
        print(
            f"{module} | {c['mutants']} | {c['killed']} | {c['survived']} | {c['skipped']} | "
            f"{c['other']} | {c['not run']} ({c['minutes']} min)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
