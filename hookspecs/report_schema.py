"""The run report's public schema: what ``report.to_dict()`` holds in ``mcgraph_report``.

The CUDA graph plugin builds the report; this module is the contract for whoever reads it
(a plugin, a dashboard reading ``--cuda-graph-report-json``). ``docs/hooks.md`` renders it
as a table, and the tests check the plugin's report against it field by field.

``report.to_dict()`` is a flat dict of JSON-ready values whose keys are exactly
:data:`REPORT_FIELDS` (two of them, the memory snapshots, are dicts with the keys of
:data:`MEMORY_SNAPSHOT_FIELDS`, and ``versions`` has the keys of :data:`VERSIONS_KEYS`).
Steps are numbered as the hooks number them: from 0, ``start_step`` first.

:data:`REPORT_SCHEMA_VERSION` is in the dict as ``schema_version``. Every change to the
fields (one added, removed or renamed, or a change of type, unit or meaning) increases it;
a reader checks it before trusting the fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

REPORT_SCHEMA_VERSION = 2
"""The version of :data:`REPORT_FIELDS`, the value of the report's ``schema_version``."""


@dataclasses.dataclass(frozen=True)
class ReportField:
    """One key of ``report.to_dict()``.

    :param name: The key.
    :param type: Its value's type, as Python annotates it (``None`` is JSON ``null``).
    :param unit: The unit of a number, or ``""``.
    :param meaning: What the value says.
    :param none: When the value is ``None``, or ``""`` if it never is.
    """

    name: str
    type: str
    unit: str
    meaning: str
    none: str = ""


_NO_CAPTURE = "no graph was captured"

REPORT_FIELDS: tuple[ReportField, ...] = (
    ReportField("schema_version", "int", "", f"this schema's version ({REPORT_SCHEMA_VERSION})"),
    ReportField(
        "impl",
        "str",
        "",
        "the configured implementation: `none`, `local` (full-iteration graphs; megatron-core "
        "0.18+'s `full_iteration` impl is reported as `local`) or `transformer_engine`",
    ),
    ReportField(
        "scope",
        "list[str]",
        "",
        'the configured scopes, e.g. `["full_iteration"]` or `["attn", "mlp"]`; `[]` with '
        "impl `none`",
    ),
    ReportField(
        "graphs_captured",
        "bool",
        "",
        "whether any CUDA graph was captured (a capture that produced no graph does not count)",
    ),
    ReportField(
        "no_graph_reason",
        "str | None",
        "",
        "why no graph was captured (graphs off, no CUDA device, the run ended before its first "
        "training step or before the capture step, a capture that raised, with its error, or "
        "the capture produced no graph)",
        "a graph was captured",
    ),
    ReportField(
        "warmup_steps",
        "int",
        "steps",
        "the configured warm-up: eager steps from `start_step` before the post-warmup step "
        "(the answer to `mcgraph_warmup_steps`), in every run mode",
    ),
    ReportField(
        "start_step",
        "int | None",
        "step",
        "the first training step of the run (greater than 0 when resuming)",
        "training never started (the run ended before its first `run.train_step`)",
    ),
    ReportField(
        "capture_step",
        "int | None",
        "step",
        "the training step that captured the graphs (its post-warmup hook for "
        "`transformer_engine`, its forward/backward for `full_iteration`), else the step "
        "that captured the optimizer graph",
        "no graph was captured during training (a capture that produced no graph does not count)",
    ),
    ReportField(
        "capture_seconds",
        "float | None",
        "s",
        "wall-clock time of every capture of the run added up (training and evaluation), the "
        "device synchronised before and after each",
        _NO_CAPTURE,
    ),
    ReportField(
        "capture_cost_seconds",
        "float | None",
        "s",
        'what the captures cost the run, the figure `break_even_steps` and the "did not pay '
        "off\" warning use: the capture step's time beyond a replayed step's (megatron-core "
        "replays a full-iteration graph right after capturing it, so `capture_seconds` holds "
        "one step's own work), plus the time of any capture outside a timed step",
        f"{_NO_CAPTURE}, or buckets (each row of `buckets` has its own `capture_seconds`)",
    ),
    ReportField("graph_count", "int", "graphs", "the most CUDA graphs held at once; 0 without"),
    ReportField("steps_timed", "int", "steps", "training steps that finished and were timed"),
    ReportField(
        "eager_steps",
        "list[int]",
        "step",
        "the steps behind `eager_step_ms`: before the capture step, without the run's first "
        "step (it pays one-off costs); every timed step but the first when nothing was "
        "captured (also after a capture that produced no graph); with buckets, each bucket's "
        "warm-up steps but its first, of the buckets that replayed; with buckets where none "
        "replayed but the optimizer graph did, the steps whose optimizer step ran eagerly "
        "(before its capture, and while it warmed up again after an invalidation), each "
        "shape's first left out. Never a step whose timed "
        "span held a capture (the optimizer graph's, captured after its own warm-up; a "
        "validation graph is captured in an evaluation, outside it)",
    ),
    ReportField(
        "eager_step_ms",
        "float | None",
        "ms",
        "median time of the `eager_steps` (with buckets over every bucket's lengths, so "
        "only indicative: `speedup` compares each bucket with itself)",
        "`eager_steps` is empty (e.g. fewer than 2 warm-up steps)",
    ),
    ReportField(
        "replay_steps",
        "list[int]",
        "step",
        "the steps behind `replay_step_ms`: after the capture step, up to the last step that "
        "replayed (`fallback_step`, or the step after which `run.invalidate_graphs` freed the "
        "graphs for the rest of the run; later steps ran eagerly and are in neither list); "
        "with buckets, the steps that replayed a bucket's graph (also of a bucket with no "
        "eager step to compare with), or where no bucket replayed, the steps whose optimizer "
        "step replayed the optimizer graph. Never a step whose timed span held a capture",
    ),
    ReportField(
        "replay_step_ms",
        "float | None",
        "ms",
        "median time of the `replay_steps`",
        "`replay_steps` is empty",
    ),
    ReportField(
        "speedup",
        "float | None",
        "ratio",
        "above 1 means replay is faster: `eager_step_ms / replay_step_ms`; with buckets, "
        "each bucket's replayed steps against its own eager median instead (never one "
        "length against another)",
        "either median is missing",
    ),
    ReportField(
        "verdict",
        "str",
        "",
        "`faster` or `slower` (beyond `noise`), `no_gain` (within it), or `unknown` (no "
        "samples on one side, or nothing captured)",
    ),
    ReportField("verdict_text", "str", "", "the verdict in one sentence, for people"),
    ReportField(
        "noise",
        "float",
        "fraction",
        "the relative difference the verdict needed (at least 0.02, i.e. 2%, more when step "
        "times scatter); 0.0 with verdict `unknown`",
    ),
    ReportField(
        "memory_before_capture",
        "dict[str, float] | None",
        "MiB",
        "the CUDA allocator right before the captures of `capture_step` (the training "
        "graph's, and the optimizer graph's when it is captured in the same step; a "
        "validation graph captured at another step is not in it) (keys: `allocated_mib`, "
        "`reserved_mib`, `peak_allocated_mib`)",
        _NO_CAPTURE,
    ),
    ReportField(
        "memory_after_capture",
        "dict[str, float] | None",
        "MiB",
        "the same, right after the captures of `capture_step`",
        _NO_CAPTURE,
    ),
    ReportField(
        "peak_allocated_at_end_mib",
        "float | None",
        "MiB",
        "peak allocated device memory of the process when the report was made",
        _NO_CAPTURE,
    ),
    ReportField(
        "memory_overhead_mib",
        "float | None",
        "MiB",
        "allocated memory after minus before the captures of `capture_step`: what the "
        "training graph (and the optimizer graph captured with it) holds",
        _NO_CAPTURE,
    ),
    ReportField(
        "memory_overhead_pct",
        "float | None",
        "%",
        "`memory_overhead_mib` as a percentage of the allocated memory before the capture",
        f"{_NO_CAPTURE}, or nothing was allocated before it",
    ),
    ReportField(
        "peak_overhead_mib",
        "float | None",
        "MiB",
        "`peak_allocated_at_end_mib` minus the peak before the captures of `capture_step`",
        _NO_CAPTURE,
    ),
    ReportField(
        "peak_overhead_pct",
        "float | None",
        "%",
        "`peak_overhead_mib` as a percentage of the peak before the capture",
        f"{_NO_CAPTURE}, or the peak before it was 0",
    ),
    ReportField(
        "fallback_step",
        "int | None",
        "step",
        "the step after which the fallback policy (`--cuda-graph-fallback-on-slowdown`) freed "
        "the full-iteration graph; later steps ran eagerly",
        "no fallback happened",
    ),
    ReportField(
        "graphs_held",
        "int",
        "graphs",
        "CUDA graphs held when the report was made (they are freed right after it)",
    ),
    ReportField(
        "replays",
        "dict[str, int]",
        "replays",
        "replays of each captured graph after its capture, by stage (`training` — the "
        "full-iteration graph or the TE layers' graphs, counted per forward/backward call —, "
        "`validation`, `optimizer`); a stage appears once captured, so a graph captured but "
        "never replayed shows 0; the capture call's own replay is not counted; `{}` without "
        "a capture (or when the capture produced no graph)",
    ),
    ReportField(
        "notes",
        "list[str]",
        "",
        "what the plugin supplied or changed in megatron-core for this run, one sentence each "
        "(e.g. device-side gradient-norm kernels in place of megatron-core's host-reading "
        "fallback, the optimizer graph's hyperparameters kept in sync); `[]` when nothing",
    ),
    ReportField(
        "thin_sample",
        "bool",
        "",
        "the speed-up rests on fewer than 5 eager or 5 replayed steps (with buckets: fewer "
        "than 5 eager steps in one of the buckets that replayed, each being compared with its "
        "own, or fewer than 5 replayed steps in all) (`verdict_text` says so): measure more "
        "eager steps with `--cuda-graph-baseline-steps N`",
    ),
    ReportField(
        "break_even_steps",
        "int | None",
        "steps",
        "replayed steps after which the capture has paid for itself: what the captures cost "
        "(the capture step's time beyond a replayed step's, megatron-core's replay right after "
        "the capture being the step's own work; a capture outside a timed step, such as a "
        "validation graph's, its `capture_seconds` share) over the time each replayed step "
        "saves",
        "nothing was captured, a median is missing, replay saves nothing or nothing beyond "
        "the verdict's noise (`verdict` `slower` or `no_gain`), or buckets (each row of "
        "`buckets` has its own)",
    ),
    ReportField(
        "pays_off",
        "bool | None",
        "",
        "whether the steps the run did replay, from the step after `capture_step` to the last "
        "step that ran (one that raised counts), or to `fallback_step` or an invalidation, are "
        "at least `break_even_steps` (the report warns when not); `False` also when replay "
        "saves nothing beyond the verdict's noise",
        "nothing was captured, no training step ran, either median is missing (nothing "
        "known about the saving), or buckets (see `buckets`)",
    ),
    ReportField(
        "buckets",
        "list[dict[str, Any]]",
        "",
        "one entry per shape the bucketed full-iteration graphs saw (`--cuda-graph-buckets`): "
        "`seq_length`, `micro_batch_size`, `num_microbatches`, `in_bucket`, `eager_steps`, "
        "`capture_steps`, `replay_steps` (the steps of each action), `capture_seconds` (each "
        "capture's recording of the graph alone, what its break-even counts: the run's "
        "`captures` time the whole capture call, the replay that gives the capture step its "
        "results included), "
        "`replays` (after its capture calls, as `replays` counts them: they add up to its "
        "`training`), `graph_held`, `eager_step_ms`, `replay_step_ms` (medians without its "
        "first step and without steps that held another capture), `speedup`, "
        "`padding_waste_percent` (padded positions of all positions, from `run.step_padded`), "
        "`pool_mib` (what its last capture added to allocated memory; one pool serves every "
        "bucket), `break_even_steps`, `paid_off` (`None` as `pays_off`, and where the bucket "
        "was never captured; `false` where it was captured and never replayed); `[]` without "
        "buckets, and where graphs are off (no CUDA device: the padding is not counted then)",
    ),
    ReportField(
        "invalidations",
        "list[dict[str, Any]]",
        "",
        "each `run.invalidate_graphs(reason)`, and each time the bucket graphs' address "
        "check saw memory move (`reason` says what moved): `step` (the step running, or the "
        "last one run: `null` before the first), `reason`, `graphs_freed`, `then` (what "
        "followed); `[]` without, and where graphs are off (no CUDA device: there is nothing "
        "to free, so a call is not recorded)",
    ),
    ReportField(
        "captures",
        "list[dict[str, Any]]",
        "",
        "every capture of the run in the order they ran (recaptures after an invalidation "
        "and each bucket's included): `stage` (`training`, `validation` or `optimizer`), "
        "`step` (the training step counter when it ran: for `validation`, the last step "
        "begun; `None` before the first), `seconds` (as `capture_seconds` counts it), `mib` "
        "(what it added to allocated memory), `graphs` (the graphs it added: 0 where it "
        "produced none); `[]` without",
    ),
    ReportField(
        "shutdown_reason",
        "str",
        "",
        "how the run ended: `completed`, `early_exit`, `exception`, `interrupted`, `signal` "
        "or `peer_failed` (another rank failed first)",
    ),
    ReportField("device", "str", "", "`cpu`, or the CUDA device's name"),
    ReportField(
        "versions",
        "dict[str, str | None]",
        "",
        "installed versions (keys: `torch`, `megatron-core`, `transformer-engine`); a value "
        "is `None` when that package is not installed",
    ),
    ReportField(
        "rank",
        "int",
        "",
        "this process's rank in the default process group (0 without torch.distributed); "
        "rank N > 0 writes its JSON to `<stem>.rankN<suffix>`",
    ),
    ReportField("world_size", "int", "ranks", "processes in the default process group"),
)
"""Every key of ``report.to_dict()``, in the order the reference lists them."""

MEMORY_SNAPSHOT_FIELDS = ("allocated_mib", "reserved_mib", "peak_allocated_mib")
"""The keys of ``memory_before_capture`` and ``memory_after_capture`` (MiB, floats)."""

VERSIONS_KEYS = ("torch", "megatron-core", "transformer-engine")
"""The keys of ``versions``."""


class Report(Protocol):
    """What ``mcgraph_report`` passes: use only these two methods."""

    def to_dict(self) -> dict[str, Any]:
        """The report as a dict of JSON-ready values with the keys of :data:`REPORT_FIELDS`."""
        ...

    def format_table(self) -> str:
        """The report as the table the CUDA graph plugin logs (for people, not parsing)."""
        ...


def schema_problems(data: dict[str, Any]) -> list[str]:
    """What in ``data`` (a ``report.to_dict()`` or its JSON) does not follow this schema:
    missing or unknown keys, values of the wrong type, a different ``schema_version``.
    An empty list means it conforms; a plugin's tests can check a report they build."""
    problems = []
    expected = {field.name: field for field in REPORT_FIELDS}
    for name in sorted(expected.keys() - data.keys()):
        problems.append(f"missing key {name!r}")
    for name in sorted(data.keys() - expected.keys()):
        problems.append(f"unknown key {name!r}")
    for name, field in expected.items():
        if name in data and not _conforms(data[name], field.type):
            problems.append(f"{name}={data[name]!r} is not {field.type}")
    if data.get("schema_version") != REPORT_SCHEMA_VERSION:
        problems.append(
            f"schema_version {data.get('schema_version')!r}, this schema is {REPORT_SCHEMA_VERSION}"
        )
    for name in ("memory_before_capture", "memory_after_capture"):
        if isinstance(data.get(name), dict) and set(data[name]) != set(MEMORY_SNAPSHOT_FIELDS):
            problems.append(f"{name} has keys {sorted(data[name])}, not {MEMORY_SNAPSHOT_FIELDS}")
    if isinstance(data.get("versions"), dict) and set(data["versions"]) != set(VERSIONS_KEYS):
        problems.append(f"versions has keys {sorted(data['versions'])}, not {VERSIONS_KEYS}")
    return problems


def _split_top(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth == 0 and text.startswith(separator, index):
            parts.append(text[start:index])
            start = index + len(separator)
    return [*parts, text[start:]]


def _conforms(value: Any, annotation: str) -> bool:
    """Whether ``value`` is of the type ``annotation`` spells (the vocabulary of
    :data:`REPORT_FIELDS`: ``None``, ``bool``, ``int``, ``float``, ``str``, ``Any``,
    ``list[X]``, ``dict[str, X]`` and unions of them)."""
    alternatives = _split_top(annotation, " | ")
    if len(alternatives) > 1:
        return any(_conforms(value, alternative) for alternative in alternatives)
    if annotation.startswith("list["):
        return isinstance(value, list) and all(_conforms(v, annotation[5:-1]) for v in value)
    if annotation.startswith("dict["):
        key, item = _split_top(annotation[5:-1], ", ")
        return isinstance(value, dict) and all(
            _conforms(k, key) and _conforms(v, item) for k, v in value.items()
        )
    if annotation == "None":
        return value is None
    if annotation == "Any":
        return True
    if annotation == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return type(value).__name__ == annotation
