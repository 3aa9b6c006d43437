"""Mutation testing of the lifecycle core with cosmic-ray, module by module, time-capped.

For each module: a copy of the repository (``.mutation/tree``, so the working tree is never
mutated), cosmic-ray's mutants of the module (minus the operator replacements listed in
``EXCLUDED_OPERATORS``), each tested by the module's tests through the pytest fork server
(``forkserver.py``: torch and megatron-core imported once). A module's run stops at its time
cap; what ran is reported, the rest counted as not run. Results: ``.mutation/<module>.sqlite``
(cosmic-ray's session; ``cr-report`` reads it) and ``.mutation/<module>-survivors.txt``.

    python tools/mutation/tool_run.py                      # every module, default caps
    python tools/mutation/tool_run.py --module guard --cap-minutes 10
    python tools/mutation/tool_run.py --module plugin --resume   # go on where the cap stopped
    python tools/mutation/tool_run.py --module run --recheck     # survivors again (new tests)

docs/mutation-testing.md records the last run and why each survivor is acceptable.
"""

from __future__ import annotations

import argparse
import ast
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

# module -> (the tests that run for each of its mutants, fastest and sharpest first; cap in
# minutes). hookspecs/run.py is the host helper: its own tests exercise all of it, fast.
MODULES: dict[str, tuple[tuple[str, ...], float]] = {
    "cudagraph_plugin/runtime/plugin.py": (LIFECYCLE, 8),
    "cudagraph_plugin/runtime/state.py": (LIFECYCLE, 4),
    "cudagraph_plugin/runtime/capture.py": (LIFECYCLE, 5),
    "cudagraph_plugin/runtime/interceptor.py": (LIFECYCLE, 8),
    "cudagraph_plugin/runtime/te_capture.py": (LIFECYCLE, 5),
    "cudagraph_plugin/runtime/shutdown.py": (LIFECYCLE, 5),
    "cudagraph_plugin/runtime/release_plan.py": (LIFECYCLE, 5),
    "hookspecs/run.py": (
        (
            "tests/test_hookspecs_run.py",
            "tests/test_hookspecs_shutdown.py",
            "tests/test_hookspecs_blame.py",
            "tests/test_hookspecs_host_defaults.py",
            "tests/test_hookspecs_signals.py",
        ),
        12,
    ),
    "hookspecs/run_signals.py": (
        (
            "tests/test_hookspecs_run.py",
            "tests/test_hookspecs_shutdown.py",
            "tests/test_hookspecs_signals.py",
        ),
        6,
    ),
    "cudagraph_plugin/runtime/mechanisms.py": (("tests/test_compat.py", *LIFECYCLE), 8),
    "cudagraph_plugin/runtime/release.py": (("tests/test_cleanup.py", *LIFECYCLE), 6),
    "cudagraph_plugin/compat/ddp.py": (("tests/test_compat.py", *LIFECYCLE), 4),
    "cudagraph_plugin/compat/full_iteration.py": (("tests/test_compat.py", *LIFECYCLE), 5),
    "cudagraph_plugin/compat/te.py": (("tests/test_compat.py", *LIFECYCLE), 4),
    "cudagraph_plugin/runtime/guard.py": (("tests/test_guard.py", *LIFECYCLE), 8),
}

# Where a module also holds code that is not the lifecycle, only these functions are
# mutated; the others' mutants are skipped as "outside the lifecycle focus". Since the
# package was split by concern (0.2), every module listed above is lifecycle code whole.
FOCUS: dict[str, tuple[str, ...]] = {}


def _focus_rows(path: Path, qualnames: tuple[str, ...]) -> list[tuple[int, int]]:
    tree = ast.parse(path.read_text())
    rows = []

    def visit(scope: list[ast.stmt], prefix: str) -> None:
        for node in scope:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if f"{prefix}{node.name}" in qualnames:
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    rows.append((first, node.end_lineno or node.lineno))

    visit(tree.body, "")
    found = len(rows)
    assert found == len(qualnames), f"{path}: {found} of the {len(qualnames)} focus functions"
    return rows


def _skip_outside_focus(database: Path, module: str, tree: Path) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    rows = _focus_rows(tree / module, FOCUS[module])
    with use_db(database, WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            row = item.mutations[0].start_pos[0]
            if not any(first <= row <= last for first, last in rows):
                db.set_result(
                    item.job_id,
                    WorkResult(
                        output="outside the lifecycle focus", worker_outcome=WorkerOutcome.SKIPPED
                    ),
                )


# Replacements that only restate a kept one: an arithmetic or comparison operator turned
# into a bitwise, power, modulo or identity operator (what a kept replacement to +, -, *,
# /, <, <=, ==, ... does not already test, these do not either; they mostly raise).
EXCLUDED_OPERATORS = (
    r"core/ReplaceBinaryOperator_.*_(Pow|RShift|LShift|BitOr|BitAnd|BitXor|FloorDiv|Mod)$",
    r"core/ReplaceComparisonOperator_(Eq|NotEq|Lt|LtE|Gt|GtE)_(Is|IsNot)$",
)
# Outside guard.py, ``|`` occurs only in annotations (``X | None``), which are never
# evaluated (``from __future__ import annotations``): replacing it cannot change behaviour.
ANNOTATION_ONLY_BITOR = r"core/ReplaceBinaryOperator_BitOr_.*"

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
            "select worker_outcome, test_outcome, output = 'outside the lifecycle focus', "
            "count(*) from work_results group by 1, 2, 3"
        ).fetchall()
    counts = dict.fromkeys(("killed", "survived", "excluded operator", "outside focus", "other"), 0)
    for worker, test, outside_focus, count in rows:
        if worker == "SKIPPED":
            counts["outside focus" if outside_focus else "excluded operator"] += count
        elif test in ("KILLED", "SURVIVED"):
            counts[test.lower()] += count
        else:
            counts["other"] += count
    return {"mutants": total, **counts, "not run": total - sum(counts.values())}


def _survivors(database: Path) -> str:
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "select s.operator_name, s.start_pos_row, r.diff from work_results r "
            "join mutation_specs s on s.job_id = r.job_id "
            "where r.test_outcome = 'SURVIVED' order by s.start_pos_row"
        ).fetchall()
    return "\n".join(f"## line {row} {operator}\n{diff}" for operator, row, diff in rows)


def run_module(
    module: str,
    tests: tuple[str, ...],
    cap_minutes: float,
    socket: Path,
    execute: bool = True,
    resume: bool = False,
    recheck: bool = False,
) -> dict:
    name = module.replace("/", "_").removesuffix(".py")
    config, database = WORK / f"{name}.toml", WORK / f"{name}.sqlite"
    operators = [*EXCLUDED_OPERATORS]
    if module != "cudagraph_plugin/runtime/guard.py":
        operators.append(ANNOTATION_ONLY_BITOR)
    excluded = ", ".join(f'"{e}"' for e in operators).replace("\\", "\\\\")
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
    tree = WORK / "tree"
    if recheck and database.exists():  # survivors of an earlier session run again
        with sqlite3.connect(database) as db:
            db.execute("delete from work_results where test_outcome = 'SURVIVED'")
    elif not (resume and database.exists()):
        database.unlink(missing_ok=True)
        subprocess.run([BIN / "cosmic-ray", "init", config, database], cwd=tree, check=True)
        subprocess.run([BIN / "cr-filter-operators", database, config], cwd=tree, check=True)
        if module in FOCUS:
            _skip_outside_focus(database, module, tree)
    start = time.monotonic()
    try:
        if execute:
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
    parser.add_argument("--count", action="store_true", help="count the mutants, run none")
    parser.add_argument(
        "--resume", action="store_true", help="go on with a module's earlier session"
    )
    parser.add_argument(
        "--recheck", action="store_true", help="run an earlier session's survivors again"
    )
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
            results[module] = run_module(
                module,
                tests,
                args.cap_minutes or cap,
                socket,
                execute=not args.count,
                resume=args.resume,
                recheck=args.recheck,
            )
    finally:
        server.kill()
        server.wait()
    columns = ["mutants", "killed", "survived", "excluded operator", "outside focus"]
    columns += ["other", "not run", "minutes"]
    print("\n| module | " + " | ".join(columns) + " |")
    for module, counts in results.items():
        print(f"| {module} | " + " | ".join(str(counts[c]) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
