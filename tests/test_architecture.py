"""The package's architecture, kept by a test: layers, no import circle, small modules.

Layers (docs/architecture.md): ``hookspecs`` < ``config`` < ``cli`` / ``compat`` <
``runtime`` < the top-level wiring (``entry``, ``__main__``, the deprecated re-exports).
A module may import only from its own layer and the layers its layer lists below. The
import graph is read statically (every ``import`` statement, including those inside
functions and under ``TYPE_CHECKING``), so a lazy import cannot hide a violation.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hookspecs", "cudagraph_plugin")

# layer -> the layers it may import from (its own layer always allowed)
LAYERS: dict[str, frozenset[str]] = {
    "hookspecs": frozenset(),
    "cudagraph_plugin.config": frozenset({"hookspecs"}),
    "cudagraph_plugin.cli": frozenset({"hookspecs", "cudagraph_plugin.config"}),
    "cudagraph_plugin.compat": frozenset({"hookspecs", "cudagraph_plugin.config"}),
    "cudagraph_plugin.runtime": frozenset(
        {"hookspecs", "cudagraph_plugin.config", "cudagraph_plugin.compat"}
    ),
}
# Pure layers: no torch or megatron import at all, not even a lazy one.
PURE = ("hookspecs", "cudagraph_plugin.config", "cudagraph_plugin.cli")
DEPRECATED = tuple(
    f"cudagraph_plugin.{name}"
    for name in (
        "settings",
        "validation",
        "preflight",
        "config_check",
        "check",
        "guard",
        "report",
        "plugin",
        "mechanisms",
        "cleanup",
    )
)
MAX_MODULE_LINES = 600
MAX_PLUGIN_CLASS_LINES = 250


@dataclasses.dataclass(frozen=True)
class Module:
    name: str
    path: Path
    imports: frozenset[tuple[str, str | None]]  # (module, name imported from it or None)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def scan(root: Path, packages: Iterable[str]) -> dict[str, Module]:
    """Every module of ``packages`` under ``root`` with the names it imports."""
    modules: dict[str, Module] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "egg-info" in str(path):
                continue
            name = _module_name(root, path)
            is_package = path.name == "__init__.py"
            imports: set[tuple[str, str | None]] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imports.update((alias.name, None) for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = _absolute(name, is_package, node.module, node.level)
                    imports.update((base, alias.name) for alias in node.names)
            modules[name] = Module(name, path, frozenset(imports))
    return modules


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (level - 1)]
    return ".".join([*anchor, target] if target else anchor)


def imported_modules(module: Module, known: Iterable[str]) -> set[str]:
    """The modules ``module`` imports: ``from a import b`` imports module ``a.b`` when
    there is one, else (a name defined in ``a``) module ``a``."""
    known = set(known)
    found = set()
    for base, name in module.imports:
        found.add(f"{base}.{name}" if name and f"{base}.{name}" in known else base)
    return found


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    return {
        m.name: {i for i in imported_modules(m, modules) if i in modules and i != m.name}
        for m in modules.values()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (strongly connected components of 2+ modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> str | None:
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def layer_violations(modules: dict[str, Module]) -> list[str]:
    problems = []
    for source, targets in edges(modules).items():
        layer = layer_of(source)
        for target in sorted(targets):
            if target in DEPRECATED and source not in DEPRECATED:
                problems.append(f"{source} imports the deprecated {target}")
            if layer is None:
                continue  # the top-level wiring may import anything
            target_layer = layer_of(target)
            if target_layer is None and target.startswith("cudagraph_plugin"):
                if target != "cudagraph_plugin":
                    problems.append(f"{source} ({layer}) imports {target} (top-level wiring)")
                continue
            if target_layer not in (None, layer) and target_layer not in LAYERS[layer]:
                problems.append(f"{source} ({layer}) imports {target} ({target_layer})")
    return problems


def impure_imports(modules: dict[str, Module]) -> list[str]:
    return [
        f"{m.name} imports {name}"
        for m in modules.values()
        if any(m.name == p or m.name.startswith(p + ".") for p in PURE)
        for name in sorted({base for base, _ in m.imports})
        if name.split(".")[0] in ("torch", "megatron", "transformer_engine")
    ]


@pytest.fixture(scope="module")
def project() -> dict[str, Module]:
    return scan(ROOT, PACKAGES)


def test_no_import_circle_anywhere(project):
    assert cycles(edges(project)) == []


def test_each_layer_imports_only_the_layers_below_it(project):
    assert layer_violations(project) == []


def test_the_pure_layers_never_import_torch_or_megatron(project):
    assert impure_imports(project) == []


def test_no_module_is_longer_than_600_lines(project):
    long = {
        m.name: n
        for m in project.values()
        if (n := len(m.path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_the_plugin_class_fits_on_a_screen(project):
    tree = ast.parse(project["cudagraph_plugin.runtime.plugin"].path.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaGraphPlugin"]
    assert cls.end_lineno - cls.lineno + 1 <= MAX_PLUGIN_CLASS_LINES


def test_importing_the_package_loads_no_torch():
    code = (
        "import sys, cudagraph_plugin.entry, cudagraph_plugin.config.check, hookspecs; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# -- the checks themselves catch what they are for ------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checks_find_a_circle_a_layer_breach_and_a_lazy_torch_import(tmp_path):
    _write(
        tmp_path,
        {
            "hookspecs/__init__.py": "",
            "hookspecs/a.py": "from hookspecs.b import x\n",
            "hookspecs/b.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from hookspecs.a import y\n",
            "cudagraph_plugin/__init__.py": "",
            "cudagraph_plugin/guard.py": "",
            "cudagraph_plugin/config/__init__.py": "",
            "cudagraph_plugin/config/rules.py": "def f():\n    import torch\n"
            "    from cudagraph_plugin.runtime import state\n",
            "cudagraph_plugin/runtime/__init__.py": "",
            "cudagraph_plugin/runtime/state.py": "from cudagraph_plugin import guard\n",
        },
    )
    modules = scan(tmp_path, PACKAGES)
    assert cycles(edges(modules)) == [["hookspecs.a", "hookspecs.b"]]
    assert layer_violations(modules) == [
        "cudagraph_plugin.config.rules (cudagraph_plugin.config) imports "
        "cudagraph_plugin.runtime.state (cudagraph_plugin.runtime)",
        "cudagraph_plugin.runtime.state imports the deprecated cudagraph_plugin.guard",
        "cudagraph_plugin.runtime.state (cudagraph_plugin.runtime) imports "
        "cudagraph_plugin.guard (top-level wiring)",
    ]
    assert impure_imports(modules) == ["cudagraph_plugin.config.rules imports torch"]


def test_relative_imports_are_resolved(tmp_path):
    _write(
        tmp_path,
        {
            "hookspecs/__init__.py": "from .a import x\n",
            "hookspecs/a.py": "from . import b\n",
            "hookspecs/b.py": "from .a import z\n",
        },
    )
    graph = edges(scan(tmp_path, ("hookspecs",)))
    assert graph == {
        "hookspecs": {"hookspecs.a"},
        "hookspecs.a": {"hookspecs.b"},
        "hookspecs.b": {"hookspecs.a"},
    }
    assert cycles(graph) == [["hookspecs.a", "hookspecs.b"]]
