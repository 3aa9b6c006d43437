"""The configuration reference (docs/configuration.md) matches the code: the check recipes
print what it shows, and the accepted-forms table names every field whose value is
normalised."""

from __future__ import annotations

import io
import pathlib
import re
import shlex

import pytest

from cudagraph_plugin.cli.check import run_check
from cudagraph_plugin.config import environment
from cudagraph_plugin.config.fields import FIELD_PATHS
from cudagraph_plugin.config.values import _PARSERS

README = (pathlib.Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


def _section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n## ", start + len(title))
    return README[start : end if end != -1 else len(README)]


def _recipes() -> list[tuple[list[str], list[str]]]:
    block = _section("## Checking a configuration without a GPU").split("```text\n")[1]
    block = block.split("```")[0].replace("\\\n", " ")
    recipes = []
    for chunk in block.split("$ python -m cudagraph_plugin check")[1:]:
        command, *output = chunk.strip("\n").splitlines()
        recipes.append((shlex.split(command), [line for line in output if line]))
    return recipes


RECIPES = _recipes()


def test_readme_has_the_recipes():
    assert len(RECIPES) == 5


@pytest.mark.parametrize("argv, expected", RECIPES, ids=[" ".join(a[:4]) for a, _ in RECIPES])
def test_readme_check_recipe_prints_what_readme_shows(monkeypatch, argv, expected):
    monkeypatch.setattr(environment, "installed_te_version", lambda: None)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    out = io.StringIO()
    code = run_check(argv, out=out)
    version = f"megatron-core {environment.mcore_version()}"
    assert out.getvalue().splitlines() == [
        line.replace("megatron-core 0.16.1", version) for line in expected
    ]
    assert code == (0 if expected[-1] == "OK" else 1)


def test_accepted_forms_table_names_every_normalised_field():
    table = _section("## Accepted forms")
    named = set(re.findall(r"`([a-z0-9_\[\]]+)`", table))
    named |= {n.replace("[_and_grad]", "") for n in named} | {
        n.replace("[_and_grad]", "_and_grad") for n in named
    }
    for setting in [*_PARSERS, "scope"]:
        flat = [path for path in FIELD_PATHS[setting] if "." not in path]
        assert any(name in named for name in flat), setting
