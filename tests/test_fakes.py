"""The fakes (``tests/fakes.py``) against the real APIs they mirror, for both megatron-core
generations, and the snapshot of those APIs (``tests/real_apis.json``) against the sources
it was taken from."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path

import pytest
import torch

import fakes
import real_apis
from fakes import (
    FakeCUDAGraph,
    FakeTECudaGraphHelper,
    FakeTECudaGraphHelper019,
    _fake_full_cuda_graph_019,
    fake_graph,
)

SNAPSHOT = real_apis.load()
HELPER = "megatron/core/transformer/cuda_graphs.py::TECudaGraphHelper."
WRAPPER = "megatron/core/full_cuda_graph.py::FullCudaGraphWrapper."
GRAPHS = "torch/cuda/graphs.py::"


def _mirrors():
    """(generation, real API, the fake that mirrors it, whether the first parameter differs
    in name only: a function for a method, ``__init__`` for ``__new__``)."""
    wrapper_019 = _fake_full_cuda_graph_019()
    helper_methods = [
        "graphs_created",
        "create_cudagraphs",
        "cuda_graph_set_manual_hooks",
        "delete_cuda_graphs",
    ]
    yield "megatron-core 0.16", HELPER + "__init__", FakeTECudaGraphHelper.__init__, False
    for name in helper_methods:
        yield "megatron-core 0.16", HELPER + name, getattr(FakeTECudaGraphHelper, name), False
    yield "megatron-core 0.19", HELPER + "__init__", FakeTECudaGraphHelper019.__init__, False
    for name in [*helper_methods, "capture_finished"]:
        yield "megatron-core 0.19", HELPER + name, getattr(FakeTECudaGraphHelper019, name), False
    yield "megatron-core 0.19", WRAPPER + "__init__", wrapper_019.__init__, False
    yield "megatron-core 0.19", WRAPPER + "reset_cuda_graph", wrapper_019.reset_cuda_graph, False
    yield "torch", GRAPHS + "CUDAGraph.__new__", FakeCUDAGraph.__init__, True
    for name in ("capture_begin", "capture_end", "replay", "reset", "pool"):
        yield "torch", GRAPHS + f"CUDAGraph.{name}", getattr(FakeCUDAGraph, name), False
    yield "torch", GRAPHS + "graph.__init__", fake_graph, True


def _parameters(function) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    [definition] = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    return real_apis.parameters(definition)


def _without_first(parameters: str) -> str:
    return parameters.partition(", ")[2] if ", " in parameters else ""


@pytest.mark.parametrize(
    "generation,api,fake,first_differs",
    list(_mirrors()),
    ids=[f"{generation}:{api.split('::')[1]}" for generation, api, *_ in _mirrors()],
)
def test_fake_takes_exactly_the_real_parameters(generation, api, fake, first_differs):
    real = SNAPSHOT[generation]["signatures"][api]
    assert real is not None, f"{api} does not exist in {generation}"
    mine = _parameters(fake)
    if first_differs:
        real, mine = _without_first(real), (mine if fake is fake_graph else _without_first(mine))
    assert mine == real


def test_the_016_helper_fake_has_no_019_api():
    """0.16's helper has no capture_finished(): compat must not find one on its fake."""
    assert SNAPSHOT["megatron-core 0.16"]["signatures"][HELPER + "capture_finished"] is None
    assert not hasattr(FakeTECudaGraphHelper, "capture_finished")


@pytest.mark.parametrize("generation", ["megatron-core 0.16", "megatron-core 0.19"])
def test_fake_helpers_set_the_attributes_compat_and_megatron_core_read(generation):
    tree = ast.parse(Path(fakes.__file__).read_text())
    assert set(SNAPSHOT[generation]["TECudaGraphHelper attributes"]) <= set(
        real_apis._self_attributes(tree, "FakeTECudaGraphHelper")
    )


# -- the snapshot against its sources ------------------------------------------------------------


def test_snapshot_is_the_installed_megatron_core():
    import megatron.core

    root = Path(megatron.core.__file__).parents[2]
    installed = real_apis.extract_megatron(root)
    entries = [entry for entry in SNAPSHOT.values() if entry["version"] == installed["version"]]
    if not entries:
        pytest.skip(f"megatron-core {installed['version']} is not a generation of the snapshot")
    [entry] = entries
    assert installed["signatures"] == entry["signatures"]
    assert installed["TECudaGraphHelper attributes"] == entry["TECudaGraphHelper attributes"]


def _mcore_019_sources() -> Path | None:
    for candidate in (os.environ.get("MCORE_019_SRC"), "/tmp/mc19"):
        if candidate and (Path(candidate) / "megatron/core/package_info.py").exists():
            return Path(candidate)
    return None


@pytest.mark.skipif(
    _mcore_019_sources() is None, reason="megatron-core 0.19 sources not here (MCORE_019_SRC)"
)
def test_snapshot_is_megatron_core_019s_sources():
    sources = real_apis.extract_megatron(_mcore_019_sources())
    entry = SNAPSHOT["megatron-core 0.19"]
    assert sources == {key: entry[key] for key in sources}


def test_fake_graph_accepts_every_parameter_of_the_installed_torch():
    """Exactly the snapshot's torch (above); at least everything the installed one takes."""
    root = Path(torch.__file__).parents[1]
    installed = real_apis.extract(root, real_apis.TORCH_APIS)
    for api, fake in [
        (GRAPHS + "CUDAGraph.capture_begin", FakeCUDAGraph.capture_begin),
        (GRAPHS + "graph.__init__", fake_graph),
    ]:
        names = {name.split("=")[0] for name in installed[api].split(", ")} - {"self"}
        fake_names = {name.split("=")[0] for name in _parameters(fake).split(", ")} - {"self"}
        assert names <= fake_names, api
    if SNAPSHOT["torch"]["version"] == torch.__version__:
        assert installed == SNAPSHOT["torch"]["signatures"]
