"""The run report's public schema (hookspecs/report_schema.py, docs/hooks.md "The run
report"): pinned per version, and the CUDA graph plugin's report follows it exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cpu_only import needs_mcore_on_cpu
from test_report import UNCAPTURED, make_report

import train_gpt
from cudagraph_plugin.runtime.timing import MemorySnapshot
from hookspecs import REPORT_SCHEMA_VERSION
from hookspecs.report_schema import (
    MEMORY_SNAPSHOT_FIELDS,
    REPORT_FIELDS,
    VERSIONS_KEYS,
    schema_problems,
)

HOOKS_MD = Path(__file__).resolve().parent.parent / "docs" / "hooks.md"

# Version 1 as released: (key, type, unit). A change here is a change of the public schema:
# increase REPORT_SCHEMA_VERSION with it, and say so in CHANGELOG.md.
VERSION_1 = [
    ("schema_version", "int", ""),
    ("impl", "str", ""),
    ("scope", "list[str]", ""),
    ("graphs_captured", "bool", ""),
    ("no_graph_reason", "str | None", ""),
    ("warmup_steps", "int", "steps"),
    ("start_step", "int | None", "step"),
    ("capture_step", "int | None", "step"),
    ("capture_seconds", "float | None", "s"),
    ("graph_count", "int", "graphs"),
    ("steps_timed", "int", "steps"),
    ("eager_steps", "list[int]", "step"),
    ("eager_step_ms", "float | None", "ms"),
    ("replay_steps", "list[int]", "step"),
    ("replay_step_ms", "float | None", "ms"),
    ("speedup", "float | None", "ratio"),
    ("verdict", "str", ""),
    ("verdict_text", "str", ""),
    ("noise", "float", "fraction"),
    ("memory_before_capture", "dict[str, float] | None", "MiB"),
    ("memory_after_capture", "dict[str, float] | None", "MiB"),
    ("peak_allocated_at_end_mib", "float | None", "MiB"),
    ("memory_overhead_mib", "float | None", "MiB"),
    ("memory_overhead_pct", "float | None", "%"),
    ("peak_overhead_mib", "float | None", "MiB"),
    ("peak_overhead_pct", "float | None", "%"),
    ("fallback_step", "int | None", "step"),
    ("graphs_held", "int", "graphs"),
    ("shutdown_reason", "str", ""),
    ("device", "str", ""),
    ("versions", "dict[str, str | None]", ""),
    ("rank", "int", ""),
    ("world_size", "int", "ranks"),
]


# Version 2 (unreleased): after ``capture_seconds``, ``capture_cost_seconds`` (what break-even
# uses); after ``graphs_held``, ``replays`` per captured stage (issue 22), ``notes`` and
# ``thin_sample`` (issue 21), ``break_even_steps``, ``pays_off``, ``buckets``,
# ``invalidations`` (issue 23) and ``captures`` (each capture's stage and step).
_COST = [name for name, _, _ in VERSION_1].index("capture_seconds") + 1
_AT = [name for name, _, _ in VERSION_1].index("graphs_held") + 1
VERSION_2 = [
    *VERSION_1[:_COST],
    ("capture_cost_seconds", "float | None", "s"),
    *VERSION_1[_COST:_AT],
    ("replays", "dict[str, int]", "replays"),
    ("notes", "list[str]", ""),
    ("thin_sample", "bool", ""),
    ("break_even_steps", "int | None", "steps"),
    ("pays_off", "bool | None", ""),
    ("buckets", "list[dict[str, Any]]", ""),
    ("invalidations", "list[dict[str, Any]]", ""),
    ("captures", "list[dict[str, Any]]", ""),
    *VERSION_1[_AT:],
]


def test_schema_version_2_is_pinned():
    assert REPORT_SCHEMA_VERSION == 2
    assert [(f.name, f.type, f.unit) for f in REPORT_FIELDS] == VERSION_2
    assert MEMORY_SNAPSHOT_FIELDS == ("allocated_mib", "reserved_mib", "peak_allocated_mib")
    assert VERSIONS_KEYS == ("torch", "megatron-core", "transformer-engine")


def test_every_field_says_what_it_means_and_when_it_is_none():
    for field in REPORT_FIELDS:
        assert field.meaning, field.name
        assert field.type.endswith(" | None") == bool(field.none), field.name


def test_the_memory_snapshot_has_the_documented_keys():
    assert [f.name for f in MemorySnapshot.__dataclass_fields__.values()] == list(
        MEMORY_SNAPSHOT_FIELDS
    )


@pytest.mark.parametrize("overrides", [{}, UNCAPTURED], ids=["captured", "not captured"])
def test_the_plugins_report_follows_the_schema(overrides):
    data = make_report(**overrides).to_dict()
    assert set(data) == {f.name for f in REPORT_FIELDS}
    assert schema_problems(data) == []
    assert data["schema_version"] == REPORT_SCHEMA_VERSION


def test_the_json_file_follows_the_schema(tmp_path: Path):
    path = make_report(**UNCAPTURED).write_json(tmp_path / "report.json")
    assert schema_problems(json.loads(path.read_text())) == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d.pop("verdict"), "missing key 'verdict'"),
        (lambda d: d.update(extra=1), "unknown key 'extra'"),
        (lambda d: d.update(capture_step="3"), "capture_step='3' is not int | None"),
        (lambda d: d.update(graphs_captured=1), "graphs_captured=1 is not bool"),
        (lambda d: d.update(eager_steps=[1, None]), "eager_steps=[1, None] is not list[int]"),
        (lambda d: d.update(schema_version=3), "schema_version 3, this schema is 2"),
        (lambda d: d["versions"].pop("torch"), "versions has keys"),
        (lambda d: d["memory_before_capture"].pop("reserved_mib"), "memory_before_capture has"),
    ],
)
def test_schema_problems_finds_what_does_not_conform(change, problem):
    data = make_report().to_dict()
    change(data)
    assert any(found.startswith(problem) for found in schema_problems(data)), schema_problems(data)


def test_hooks_md_documents_every_field_with_the_schema_version():
    text = HOOKS_MD.read_text()
    section = text.split("\n## The run report\n", 1)[1].split("\n## ", 1)[0]
    assert f"**Schema version {REPORT_SCHEMA_VERSION}**" in section
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| ([^|]*) \|", section, flags=re.MULTILINE)
    documented = [(name, kind.replace("\\|", "|"), unit.strip()) for name, kind, unit in rows]
    assert documented == VERSION_2
    # No pointer at the plugin's internals: the schema is the public interface.
    assert "cudagraph_plugin.report" not in text and "RunReport" not in text


@needs_mcore_on_cpu
def test_a_cpu_run_writes_a_report_that_follows_the_schema(tmp_path: Path):
    out = tmp_path / "report.json"
    argv = ["--cpu", "--train-iters", "3", "--log-interval", "0"]
    train_gpt.run([*argv, "--cuda-graph-report-json", str(out)])
    data = json.loads(out.read_text())
    assert schema_problems(data) == []
    # The warm-up is known in every run mode, graphs off included.
    assert (data["impl"], data["warmup_steps"], data["start_step"]) == ("none", 3, 0)
    assert data["eager_steps"] == [1, 2] and data["steps_timed"] == 3
