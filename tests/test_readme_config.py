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


def test_the_fields_table_is_generated_from_the_paths_read(tmp_path):
    """docs/configuration.md says where each setting is read (user trial, 2026-12-05: a
    nested config's author found the places by experiment); docs/gen_fields.py writes the
    table from the reader's own paths, so it cannot go stale unnoticed."""
    import importlib.util

    from cudagraph_plugin.config.fields import FIELD_PATHS

    path = pathlib.Path(__file__).parent.parent / "docs" / "gen_fields.py"
    spec = importlib.util.spec_from_file_location("gen_fields_under_test", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, "run `python docs/gen_fields.py`"
    assert "| cuda_graph_impl | `model.cuda_graph_impl`, `cuda_graph_impl` |" in README
    for paths in FIELD_PATHS.values():
        assert f"| {', '.join(f'`{p}`' for p in paths)} |" in README, paths
    stale = tmp_path / "configuration.md"
    stale.write_text(README.replace("| bf16 | `model.bf16`, `bf16` |\n", ""))
    assert gen.main(["--check"], target=stale) == 1
    assert gen.main([], target=stale) == 0 and stale.read_text() == README
