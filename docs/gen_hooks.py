"""Generate ``docs/hooks.md``, the hook reference, from the hook specifications.

    python docs/gen_hooks.py           # rewrite docs/hooks.md
    python docs/gen_hooks.py --check   # exit 1 with a diff if docs/hooks.md is stale

Everything in the reference comes from ``hookspecs``: the sections are the banner comments of
``hookspecs/spec.py`` in file order, each hook's signature and docstring come from its spec,
its nature from the pluggy spec options, the order table from a torch-free run of
:class:`hookspecs.TrainingRun`, and the run report's table from
``hookspecs.report_schema``. Only the "fired by" column is written here, and a hook
missing from it stops the generator.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOOKS_MD = ROOT / "docs" / "hooks.md"

if __name__ == "__main__":
    # Document this tree's specs, not whatever copy of hookspecs is installed.
    sys.path.insert(0, str(ROOT))

import pluggy  # noqa: E402

from hookspecs import PROJECT_NAME, TrainingRun, get_plugin_manager, hookimpl  # noqa: E402
from hookspecs import spec as default_spec  # noqa: E402
from hookspecs.report_schema import (  # noqa: E402
    MEMORY_SNAPSHOT_FIELDS,
    REPORT_FIELDS,
    REPORT_SCHEMA_VERSION,
    VERSIONS_KEYS,
)

# Which host call fires each hook that TrainingRun fires.
FIRED_BY_RUN = {
    "mcgraph_configure": "entering `with TrainingRun(...)`",
    "mcgraph_rng_options": "`run.rng_options()`",
    "mcgraph_rng_initialized": "`run.rng_initialized()`",
    "mcgraph_model_config_kwargs": "`run.model_config_kwargs()`",
    "mcgraph_model_build_context": "`with run.model_build_context():`",
    "mcgraph_model_built": "`run.model_built(...)`",
    "mcgraph_forward_backward_func": "`run.forward_backward_func(fn)`",
    "mcgraph_warmup_steps": "the first `with run.train_step(step):`",
    "mcgraph_train_start": "the first `with run.train_step(step):`",
    "mcgraph_train_step_start": "entering `with run.train_step(step):`",
    "mcgraph_post_warmup_step": (
        "entering `with run.train_step(step):` when `step - start_step == warmup_steps`"
    ),
    "mcgraph_train_step_end": "leaving `with run.train_step(step):` without an exception",
    "mcgraph_evaluation_start": "entering `with run.evaluation():`",
    "mcgraph_evaluation_end": "leaving `with run.evaluation():` without an exception",
    "mcgraph_shutdown": "leaving `with TrainingRun(...)`, by any path, exactly once",
}

# Who fires the hooks that a plain TrainingRun does not.
FIRED_ELSEWHERE = {
    "mcgraph_add_arguments": "the host, before it parses its command line",
    "mcgraph_disable_forward_pre_hook": (
        "a plugin around a capture (or the host: `run.disable_forward_pre_hook(...)`)"
    ),
    "mcgraph_enable_forward_pre_hook": (
        "a plugin after a capture (or the host: `run.enable_forward_pre_hook(...)`)"
    ),
    "mcgraph_step_padded": "the host: `run.step_padded(...)`, inside a step it padded",
    "mcgraph_invalidate_graphs": "the host: `run.invalidate_graphs(reason)`, before the next "
    "training call",
    "mcgraph_before_capture": "the CUDA graph plugin, right before a capture",
    "mcgraph_after_capture": "the CUDA graph plugin, right after a successful capture",
    "mcgraph_report": "the CUDA graph plugin, inside `mcgraph_shutdown`",
}

INTRO = """\
Hooks a Megatron-Core training loop (the *host*) fires and plugins implement. Import the
marker from the contract package: `from hookspecs import hookimpl` (the distribution
`mcgraph-hookspecs`, pure Python: a plugin depends on it alone); every hook name starts
with `{prefix}_`, and `{prefix}` is also the entry-point group plugins register under.

**No hook ever runs inside a captured or replayed CUDA graph.** Hooks are Python (about
1-3 µs a call); they run between graph replays, never inside them. Captures happen between
`mcgraph_before_capture` and `mcgraph_after_capture`: per-layer (`transformer_engine`)
graphs inside `mcgraph_post_warmup_step`, `full_iteration` graphs inside the
forward/backward call of the capture step.
"""


# -- reading the specs ----------------------------------------------------------------------


def spec_functions(spec_module: ModuleType) -> dict[str, Any]:
    """The hook specs of ``spec_module`` by name."""
    mark = f"{PROJECT_NAME}_spec"
    return {
        name: func
        for name, func in vars(spec_module).items()
        if inspect.isfunction(func) and hasattr(func, mark)
    }


_BANNER = re.compile(r"^# -{20,}\n# (?P<title>[^\n]+?)\.?\n# -{20,}$", re.MULTILINE)
_DEF = re.compile(r"^def (?P<name>\w+)\(", re.MULTILINE)


def sections(spec_module: ModuleType) -> list[tuple[str, list[str]]]:
    """``(banner title, hook names)`` in file order; titles lose their trailing period."""
    source = inspect.getsource(spec_module)
    specs = spec_functions(spec_module)
    events = [(m.start(), "banner", m.group("title")) for m in _BANNER.finditer(source)]
    events += [(m.start(), "def", m.group("name")) for m in _DEF.finditer(source)]
    result: list[tuple[str, list[str]]] = []
    for _, kind, text in sorted(events):
        if kind == "banner":
            result.append((text, []))
        elif text in specs:
            if not result:
                raise SystemExit(f"gen_hooks: {text} comes before the first banner section")
            result[-1][1].append(text)
    missing = set(specs) - {name for _, names in result for name in names}
    if missing:
        raise SystemExit(f"gen_hooks: specs not found in the source: {sorted(missing)}")
    return [(title, names) for title, names in result if names]


def nature(opts: pluggy.HookspecOpts, func: Any) -> str:
    """firstresult / historic / collected / notification, from the pluggy options."""
    parts = []
    if opts.get("historic"):
        parts.append("historic")
    if opts.get("firstresult"):
        parts.append("firstresult")
    elif inspect.signature(func).return_annotation in ("None", None):
        parts.append("notification")
    else:
        parts.append("collected")
    return ", ".join(parts)


def decorator(opts: pluggy.HookspecOpts) -> str:
    flags = [f"{key}=True" for key in ("firstresult", "historic") if opts.get(key)]
    flags += [
        f"{key}=..." for key in ("warn_on_impl", "warn_on_impl_args") if opts.get(key) is not None
    ]
    return f"@hookspec({', '.join(flags)})" if flags else "@hookspec"


def signature(name: str, func: Any) -> str:
    sig = inspect.signature(func)
    params = [f"{p.name}: {p.annotation}" for p in sig.parameters.values()]
    returns = f" -> {sig.return_annotation}"
    one_line = f"def {name}({', '.join(params)}){returns}: ..."
    if len(one_line) <= 90:
        return one_line
    body = "".join(f"    {param},\n" for param in params)
    return f"def {name}(\n{body}){returns}: ..."


# -- docstring to Markdown ------------------------------------------------------------------

_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc):`~?(?P<target>[^`]+)`")
_DOUBLE_BACKTICK = re.compile(r"``(?P<text>[^`]+)``")


def inline(text: str, hook_names: set[str]) -> str:
    def role(match: re.Match[str]) -> str:
        target = match.group("target")
        if target in hook_names:
            return f"[`{target}`](#{target})"
        return f"`{target}`"

    return _ROLE.sub(role, _DOUBLE_BACKTICK.sub(r"`\g<text>`", text))


def docstring_markdown(func: Any, hook_names: set[str]) -> str:
    """Paragraphs as they are, ``:param x:`` lines as a list, the ``Result:`` line in bold."""
    doc = inspect.getdoc(func) or ""
    out: list[str] = []
    params: list[list[str]] = []
    for block in doc.split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith(":param "):
            for line in lines:
                match = re.match(r":param (\w+):\s*(.*)", line)
                if match:
                    params.append([f"- `{match.group(1)}`: {match.group(2)}"])
                else:
                    params[-1].append(f"  {line.strip()}")
            continue
        if params:
            out.append("**Parameters**\n\n" + "\n".join("\n".join(p) for p in params))
            params = []
        if lines and lines[0].startswith("Result:"):
            block = "**Result:**" + block[len("Result:") :]
        out.append(block)
    if params:
        out.append("**Parameters**\n\n" + "\n".join("\n".join(p) for p in params))
    return inline("\n\n".join(out), hook_names)


# -- the order TrainingRun fires the hooks in -----------------------------------------------


def recorded_order() -> list[tuple[str, str]]:
    """Drive a torch-free host loop (3 steps, 1 warm-up step, then an evaluation) and
    record every hook call: ``(hook name, step or "")``."""
    pm = get_plugin_manager(load_entrypoints=False)
    calls: list[tuple[str, str]] = []

    def before(hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        calls.append((hook_name, str(kwargs.get("step", ""))))

    def after(outcome: Any, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        pass

    class OneWarmupStep:
        @hookimpl
        def mcgraph_warmup_steps(self) -> int:
            return 1

        # implemented, so that the run dispatches them (it skips step hooks nobody implements)
        @hookimpl
        def mcgraph_train_step_start(self) -> None:
            pass

        @hookimpl
        def mcgraph_train_step_end(self) -> None:
            pass

    pm.register(OneWarmupStep())
    pm.add_hookcall_monitoring(before, after)
    with TrainingRun(pm, None, train_iters=3, handle_signals=()) as run:
        run.rng_options(base={"seed": 1234})
        run.rng_initialized()
        run.model_config_kwargs()
        with run.model_build_context():
            model: list[Any] = []
        run.model_built(
            model=model, optimizer=None, model_config=None, seq_length=8, micro_batch_size=2
        )
        fwd_bwd = run.forward_backward_func(lambda **kwargs: None)
        for step in range(run.start_step, 3):
            with run.train_step(step):
                fwd_bwd()
        with run.evaluation():
            pass
    return calls


def order_table(spec_names: set[str]) -> str:
    calls = recorded_order()
    unknown = sorted({name for name, _ in calls} - set(FIRED_BY_RUN))
    if unknown:
        raise SystemExit(f"gen_hooks: say which host call fires {unknown} in FIRED_BY_RUN")
    rows = ["| # | hook | step | fired by |", "|---|---|---|---|"]
    for number, (name, step) in enumerate(calls, start=1):
        rows.append(f"| {number} | [`{name}`](#{name}) | {step} | {FIRED_BY_RUN[name]} |")
    fired = {name for name, _ in calls}
    elsewhere = sorted(spec_names - fired, key=list(FIRED_ELSEWHERE).index)
    other = ["| hook | fired by |", "|---|---|"]
    other += [f"| [`{name}`](#{name}) | {FIRED_ELSEWHERE[name]} |" for name in elsewhere]
    explanation = (
        "Recorded from a run of 3 training steps with 1 warm-up step, then one evaluation. "
        "The set-up hooks, from `mcgraph_rng_options` to `mcgraph_forward_backward_func`, "
        "fire when the host calls the matching `TrainingRun` method, so their order is the "
        "host's; this is the order of the `TrainingRun` docstring example."
    )
    return "\n".join(
        [
            "## The order `TrainingRun` fires them in\n",
            explanation + "\n",
            *rows,
            "",
            "Hooks that a `TrainingRun` does not fire itself:\n",
            *other,
            "",
        ]
    )


# -- the run report -------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def report_section() -> str:
    """The run report's schema, from :mod:`hookspecs.report_schema`."""
    rows = ["| key | type | unit | meaning | `None` when |", "|---|---|---|---|---|"]
    for field in REPORT_FIELDS:
        rows.append(
            f"| `{field.name}` | `{_cell(field.type)}` | {field.unit} | {_cell(field.meaning)} "
            f"| {_cell(field.none) or 'never'} |"
        )
    memory = ", ".join(f"`{key}`" for key in MEMORY_SNAPSHOT_FIELDS)
    versions = ", ".join(f"`{key}`" for key in VERSIONS_KEYS)
    text = f"""\\
## The run report

The CUDA graph plugin passes the run report to [`mcgraph_report`](#mcgraph_report) at
shutdown, in every run mode, and writes it as JSON with `--cuda-graph-report-json PATH`
(rank N > 0 of a multi-process run writes `<stem>.rankN<suffix>`). Read it with
`report.to_dict()`: a dict of JSON-ready values with exactly the keys below, the same as
the JSON file's (`report.format_table()` is the logged table, for people; nothing else of
the object is public). Steps are numbered as the hooks number them.

- The memory snapshots are dicts with the keys {memory}.
- `versions` has the keys {versions}.

**Schema version {REPORT_SCHEMA_VERSION}** (the `schema_version` key). Every change to
these fields (one added, removed or renamed, or a change of type, unit or meaning)
increases it; check it before you rely on the fields. The same schema, as data, with a
checker a plugin's tests can use: `hookspecs.report_schema` (`REPORT_FIELDS`,
`schema_problems(report.to_dict())`), in the `mcgraph-hookspecs` distribution.

"""
    return text + "\n".join(rows) + "\n"


# -- the page -------------------------------------------------------------------------------


def render(spec_module: ModuleType = default_spec) -> str:
    """The whole of ``docs/hooks.md`` for the specs in ``spec_module``."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(spec_module)
    specs = spec_functions(spec_module)
    names = set(specs)
    undocumented = sorted(names - set(FIRED_BY_RUN) - set(FIRED_ELSEWHERE))
    if undocumented:
        raise SystemExit(
            f"gen_hooks: say who fires {undocumented} in FIRED_BY_RUN or FIRED_ELSEWHERE"
        )
    grouped = sections(spec_module)

    out = [
        "<!-- Generated by docs/gen_hooks.py from hookspecs/spec.py: do not edit. -->\n",
        f"# Hook reference (`{PROJECT_NAME}_*`)\n",
        INTRO.format(prefix=PROJECT_NAME),
        "## Conventions\n",
        inline(_module_conventions(spec_module), names) + "\n",
        order_table(names),
        report_section(),
        "## Hooks at a glance\n",
        "| section | hook | nature |",
        "|---|---|---|",
    ]
    for title, hooks in grouped:
        for index, name in enumerate(hooks):
            opts = getattr(pm.hook, name).spec.opts
            section = title if index == 0 else ""
            out.append(f"| {section} | [`{name}`](#{name}) | {nature(opts, specs[name])} |")
    out.append("")
    for title, hooks in grouped:
        out.append(f"## {title}\n")
        for name in hooks:
            opts = getattr(pm.hook, name).spec.opts
            out.append(f"### `{name}`\n")
            out.append(f"```python\n{decorator(opts)}\n{signature(name, specs[name])}\n```\n")
            out.append(f"*Nature:* {nature(opts, specs[name])}\n")
            out.append(docstring_markdown(specs[name], names) + "\n")
    return "\n".join(out)


def _module_conventions(spec_module: ModuleType) -> str:
    """The bullet list of conventions from the spec module's docstring, one line a bullet."""
    doc = inspect.getdoc(spec_module) or ""
    bullets = []
    for block in doc.split("\n\n"):
        if block.startswith("* "):
            bullets += re.split(r"\n(?=\* )", block)
    return "\n".join("- " + re.sub(r"\s*\n\s*", " ", bullet[2:]) for bullet in bullets)


def main(
    argv: list[str] | None = None,
    *,
    target: Path = HOOKS_MD,
    spec_module: ModuleType = default_spec,
) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 with a diff if the file is stale"
    )
    args = parser.parse_args(argv)
    text = render(spec_module)
    current = target.read_text() if target.exists() else ""
    if args.check:
        if current == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"{target} (committed)",
                tofile=f"{target} (from the specs)",
            )
        )
        print(f"\n{target} is stale: run `python docs/gen_hooks.py`", file=sys.stderr)
        return 1
    if current != text:
        target.write_text(text)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
