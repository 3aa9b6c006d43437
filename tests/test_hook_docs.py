"""docs/hooks.md is generated from the hook specs and must not go stale."""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hookspecs import spec

ROOT = Path(__file__).resolve().parent.parent
GEN_HOOKS = ROOT / "docs" / "gen_hooks.py"
HOOKS_MD = ROOT / "docs" / "hooks.md"


def load_module(path: Path, name: str) -> ModuleType:
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return load_module(GEN_HOOKS, "gen_hooks_under_test")


@pytest.fixture
def spec_copy(tmp_path):
    """Write an edited copy of hookspecs/spec.py and import it (not into sys.modules)."""
    counter = iter(range(1000))

    def _copy(edit) -> ModuleType:
        source = edit(inspect.getsource(spec))
        assert source != inspect.getsource(spec), "the edit changed nothing"
        path = tmp_path / f"spec_copy_{next(counter)}.py"
        path.write_text(source)
        return load_module(path, path.stem)

    return _copy


NEW_HOOK = '''

# -------------------------------------------------------------------------------------------
# Checkpointing.
# -------------------------------------------------------------------------------------------


@hookspec
def mcgraph_checkpoint_saved(step: int) -> None:
    """A checkpoint was saved.

    :param step: The step of the checkpoint.

    Result: notification.
    """
'''


def test_hooks_md_is_up_to_date(gen, capsys):
    status = gen.main(["--check"])
    diff = capsys.readouterr().out
    assert status == 0, f"docs/hooks.md is stale: run `python docs/gen_hooks.py`\n{diff}"
    assert HOOKS_MD.read_text() == gen.render()


def test_check_fails_with_a_diff_when_a_docstring_changes(gen, spec_copy, capsys):
    changed = spec_copy(
        lambda src: src.replace(
            "Number of eager training steps before the post-warmup step.",
            "Number of eager steps before capture.",
        )
    )
    assert gen.main(["--check"], spec_module=changed) == 1
    out, err = capsys.readouterr()
    assert "-Number of eager training steps before the post-warmup step." in out
    assert "+Number of eager steps before capture." in out
    assert "gen_hooks.py" in err
    assert HOOKS_MD.read_text() == gen.render(), "--check must not write"


def test_check_fails_when_a_spec_option_changes(gen, spec_copy, capsys):
    changed = spec_copy(
        lambda src: src.replace(
            "@hookspec\ndef mcgraph_train_start(",
            "@hookspec(historic=True)\ndef mcgraph_train_start(",
        )
    )
    assert gen.main(["--check"], spec_module=changed) == 1
    out = capsys.readouterr().out
    assert "+@hookspec(historic=True)" in out
    assert "+*Nature:* historic, notification" in out


def test_check_fails_when_a_signature_changes(gen, spec_copy, capsys):
    changed = spec_copy(
        lambda src: src.replace(
            "def mcgraph_train_step_start(step: int) -> None:",
            "def mcgraph_train_step_start(step: int, num_microbatches: int) -> None:",
        )
    )
    assert gen.main(["--check"], spec_module=changed) == 1
    assert "num_microbatches: int" in capsys.readouterr().out


def test_a_new_hook_must_say_who_fires_it(gen, spec_copy):
    added = spec_copy(lambda src: src + NEW_HOOK)
    with pytest.raises(SystemExit, match="mcgraph_checkpoint_saved"):
        gen.render(added)


def test_a_new_hook_in_a_new_section_is_documented_last(gen, spec_copy, monkeypatch, capsys):
    added = spec_copy(lambda src: src + NEW_HOOK)
    monkeypatch.setitem(gen.FIRED_ELSEWHERE, "mcgraph_checkpoint_saved", "the host")
    text = gen.render(added)
    assert (
        text.index("## Shutdown")
        < text.index("## Checkpointing")
        < text.index("### `mcgraph_checkpoint_saved`")
    )
    assert "| Checkpointing | [`mcgraph_checkpoint_saved`]" in text
    assert gen.main(["--check"], spec_module=added) == 1
    assert "+### `mcgraph_checkpoint_saved`" in capsys.readouterr().out


def test_rewrite_writes_the_file_and_check_then_passes(gen, tmp_path, capsys):
    target = tmp_path / "hooks.md"
    target.write_text("stale\n")
    assert gen.main(["--check"], target=target) == 1
    assert gen.main([], target=target) == 0
    assert target.read_text() == gen.render()
    assert gen.main(["--check"], target=target) == 0


def test_every_hook_is_documented_in_spec_file_order_under_its_banner(gen):
    text = HOOKS_MD.read_text()
    source = inspect.getsource(spec)
    defined = re.findall(r"^def (mcgraph_\w+)\(", source, flags=re.MULTILINE)
    documented = re.findall(r"^### `(mcgraph_\w+)`$", text, flags=re.MULTILINE)
    assert documented == defined
    banners = re.findall(r"^# -+\n# (.+?)\.?\n# -+$", source, flags=re.MULTILINE)
    sections = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert sections[-len(banners) :] == banners
    # Each hook sits under the banner that precedes it in spec.py.
    for title, names in gen.sections(spec):
        body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        assert re.findall(r"^### `(mcgraph_\w+)`$", body, flags=re.MULTILINE) == names


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mcgraph_configure", "historic, notification"),
        ("mcgraph_forward_backward_func", "firstresult"),
        ("mcgraph_warmup_steps", "firstresult"),
        ("mcgraph_model_config_kwargs", "collected"),
        ("mcgraph_model_build_context", "collected"),
        ("mcgraph_shutdown", "notification"),
    ],
)
def test_nature_is_read_from_the_spec_options(gen, name, expected):
    section = HOOKS_MD.read_text().split(f"### `{name}`\n", 1)[1]
    assert section.split("\n### ", 1)[0].count(f"*Nature:* {expected}\n") == 1


def test_intro_says_hooks_never_run_inside_a_graph():
    text = HOOKS_MD.read_text()
    intro = text.split("\n## ", 1)[0]
    assert "No hook ever runs inside a captured or replayed CUDA graph" in intro


def test_order_table_is_recorded_from_a_training_run(gen):
    calls = gen.recorded_order()
    names = [name for name, _ in calls]
    assert names[0] == "mcgraph_configure"
    assert names[-1] == "mcgraph_shutdown"
    assert ("mcgraph_post_warmup_step", "1") in calls
    assert names.index("mcgraph_warmup_steps") < names.index("mcgraph_train_step_start")
    table = HOOKS_MD.read_text().split("## The order `TrainingRun` fires them in", 1)[1]
    rows = re.findall(r"^\| (\d+) \| \[`(mcgraph_\w+)`\]", table, flags=re.MULTILINE)
    assert [name for _, name in rows] == names
    assert [int(number) for number, _ in rows] == list(range(1, len(names) + 1))


def test_script_check_exits_zero_from_any_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, str(GEN_HOOKS), "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
