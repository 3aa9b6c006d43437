"""The real APIs the fakes (``tests/fakes.py``) mirror, read from source code with ``ast``.

``tests/real_apis.json`` is a snapshot of them for both megatron-core generations (and the
torch the CPU suite runs), so that the CPU suite can check the fakes against 0.19 without
0.19 installed (it needs Python 3.12). Regenerate it from source trees with::

    python tests/real_apis.py --megatron-016 .venv/lib/python3.11/site-packages \\
        --megatron-019 /tmp/mc19 --torch .venv/lib/python3.11/site-packages

(each path is the directory that contains ``megatron/`` or ``torch/``). The tests compare
the snapshot with the installed megatron-core and torch every run, and with 0.19's sources
when ``MCORE_019_SRC`` (or ``/tmp/mc19``) holds them.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("real_apis.json")

# (file under the source root, qualified name) of every real API a fake mirrors.
MEGATRON_APIS = [
    ("megatron/core/transformer/cuda_graphs.py", "TECudaGraphHelper.__init__"),
    ("megatron/core/transformer/cuda_graphs.py", "TECudaGraphHelper.graphs_created"),
    ("megatron/core/transformer/cuda_graphs.py", "TECudaGraphHelper.capture_finished"),
    ("megatron/core/transformer/cuda_graphs.py", "TECudaGraphHelper.create_cudagraphs"),
    ("megatron/core/transformer/cuda_graphs.py", "TECudaGraphHelper.cuda_graph_set_manual_hooks"),
    ("megatron/core/transformer/cuda_graphs.py", "TECudaGraphHelper.delete_cuda_graphs"),
    ("megatron/core/full_cuda_graph.py", "FullCudaGraphWrapper.__init__"),
    ("megatron/core/full_cuda_graph.py", "FullCudaGraphWrapper.reset_cuda_graph"),
]
TORCH_APIS = [
    ("torch/cuda/graphs.py", "CUDAGraph.__new__"),
    ("torch/cuda/graphs.py", "CUDAGraph.capture_begin"),
    ("torch/cuda/graphs.py", "CUDAGraph.capture_end"),
    ("torch/cuda/graphs.py", "CUDAGraph.replay"),
    ("torch/cuda/graphs.py", "CUDAGraph.reset"),
    ("torch/cuda/graphs.py", "CUDAGraph.pool"),
    ("torch/cuda/graphs.py", "graph.__init__"),
]
# Attributes the plugin (through compat) and megatron-core's layers read from the helper.
HELPER_ATTRIBUTES = ("model", "optimizers", "callables_per_chunk", "flattened_callables")


def parameters(function: ast.FunctionDef) -> str:
    """A function's parameter list as source, without annotations: ``self, a, b=1``."""
    args = function.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    return ast.unparse(args)


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | None:
    scope: list[ast.stmt] = tree.body
    *classes, name = qualname.split(".")
    for class_name in classes:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == class_name]
        if not found:
            return None
        scope = found[0].body
    for node in scope:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _self_attributes(tree: ast.Module, class_name: str) -> list[str]:
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return sorted(
        {
            target.attr
            for node in ast.walk(cls)
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        }
    )


def extract(root: Path, apis: list[tuple[str, str]]) -> dict[str, str | None]:
    """``{"file::qualname": "parameters"}``; ``None`` where the source has no such API."""
    found: dict[str, str | None] = {}
    trees: dict[str, ast.Module] = {}
    for file, qualname in apis:
        if file not in trees:
            trees[file] = ast.parse((root / file).read_text())
        function = _find(trees[file], qualname)
        found[f"{file}::{qualname}"] = None if function is None else parameters(function)
    return found


def _constants(path: Path) -> dict[str, object]:
    """The module's top-level ``NAME = literal`` assignments."""
    values = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def extract_megatron(root: Path) -> dict[str, object]:
    cuda_graphs = ast.parse((root / "megatron/core/transformer/cuda_graphs.py").read_text())
    info = _constants(root / "megatron/core/package_info.py")
    return {
        "version": f"{info['MAJOR']}.{info['MINOR']}.{info['PATCH']}",
        "signatures": extract(root, MEGATRON_APIS),
        "TECudaGraphHelper attributes": [
            name
            for name in _self_attributes(cuda_graphs, "TECudaGraphHelper")
            if name in HELPER_ATTRIBUTES
        ],
        "StaticBufferLoader.__call__": _method_source(
            root / "megatron/core/full_cuda_graph.py", "StaticBufferLoader", "__call__"
        ),
    }


def _method_source(path: Path, class_name: str, method: str) -> str:
    """The source text of one method, as ``inspect.getsource`` gives it (indented)."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    lines = text.splitlines(keepends=True)
                    return "".join(lines[item.lineno - 1 : item.end_lineno])
    raise LookupError(f"{class_name}.{method} not in {path}")


def extract_torch(root: Path) -> dict[str, object]:
    version = _constants(root / "torch/version.py")["__version__"]
    return {"version": version, "signatures": extract(root, TORCH_APIS)}


def load() -> dict[str, dict]:
    return json.loads(SNAPSHOT.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-016", type=Path, required=True)
    parser.add_argument("--megatron-019", type=Path, required=True)
    parser.add_argument("--torch", type=Path, required=True)
    args = parser.parse_args()
    snapshot = {
        "megatron-core 0.16": {
            "source": "the megatron-core 0.16.1 wheel (site-packages/megatron/core)",
            **extract_megatron(args.megatron_016),
        },
        "megatron-core 0.19": {
            "source": "megatron-core 0.19.2's sources (megatron/core, package_info 0.19.2)",
            **extract_megatron(args.megatron_019),
        },
        "torch": {"source": "the torch wheel of the CPU suite", **extract_torch(args.torch)},
    }
    SNAPSHOT.write_text(json.dumps(snapshot, indent=2) + "\n")
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    main()
