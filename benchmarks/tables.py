"""Markdown tables for the benchmark JSON files (pure Python: no torch, no matplotlib).

Used by ``gpu_modes.py`` and ``gpu_limit.py`` to print their results and by ``plot.py`` to
print the tables that go into BENCHMARKS.md.
"""

from __future__ import annotations

from typing import Any


def _f(value: Any, fmt: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{fmt}}{suffix}"


def _x(value: Any) -> str:
    return _f(value, ".2f", "x")


def environment_lines(data: dict[str, Any]) -> list[str]:
    """Date, hardware, versions and command of one benchmark JSON, as markdown bullets."""
    versions = data.get("versions", {})
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items() if v) or "-"
    lines = [
        f"- date: {data.get('date', '-')}",
        f"- hardware: {data.get('gpu') or data.get('device', '-')}"
        + (f" ({data['host_cpu']})" if data.get("host_cpu") else ""),
        f"- versions: {version_text}",
        f"- command: `{data.get('command', '-')}`",
    ]
    settings = dict(data.get("settings") or {})
    sizes = settings.pop("sizes", None)
    if sizes:
        lines.append(
            "- model sizes: "
            + "; ".join(
                f"{z['name']} = {z['num_layers']} layers, hidden {z['hidden_size']}, "
                f"{z['num_attention_heads']} heads"
                for z in sizes
            )
        )
    if settings:
        lines.append("- settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return lines


def modes_table(data: dict[str, Any]) -> str:
    """Step time per size and mode: plugin vs hand-written baseline, speed-ups, report."""
    lines = [
        "| size | mode | plugin ms/step | baseline ms/step | "
        "plugin/baseline: step [95% interval]; iteration (per-pair range) | "
        "speed-up vs eager (plugin / baseline) | report: eager → replay ms (speed-up) | "
        "capture s (plugin / baseline) | graph memory +MiB (peak +MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data.get("results", []):
        if row.get("skipped"):
            lines.append(
                f"| {row['size']} | {row['label']} | skipped: {row['skipped']} |  |  |  |  |  |  |"
            )
            continue
        report = row.get("report") or {}
        replay = (
            f"{_f(report.get('eager_step_ms'))} → {_f(report.get('replay_step_ms'))} "
            f"({_x(report.get('speedup'))})"
            if report.get("replay_step_ms") is not None
            else "-"
        )
        speedup = (
            f"{_x(row.get('speedup_plugin'))} / {_x(row.get('speedup_baseline'))}"
            if row.get("speedup_plugin") is not None or row.get("speedup_baseline") is not None
            else "-"
        )
        capture = (
            f"{_f(report.get('capture_seconds'))} / {_f(row.get('baseline_capture_seconds'))}"
            if report.get("capture_seconds") is not None
            else "-"
        )
        memory = (
            f"{_f(report.get('memory_overhead_mib'), '+.0f')} "
            f"({_f(report.get('peak_overhead_mib'), '+.0f')})"
            if report.get("memory_overhead_mib") is not None
            else "-"
        )
        errors = "; ".join(row.get("errors", []))
        ci = row.get("ratio_ci95")
        ratio = _f(row.get("ratio"), ".3f")
        if ci:
            ratio += f" [{ci[0]:.2f}-{ci[1]:.2f}]"
        ratio += f"; {_f(row.get('iteration_ratio'), '.3f')}"
        pairs = row.get("ratio_per_repeat") or []
        if pairs:
            ratio += f" (pairs {min(pairs):.2f}-{max(pairs):.2f}, n={len(pairs)})"
        lines.append(
            f"| {row['size']} | {row['label']} | {_f(row.get('plugin_ms'))} | "
            f"{_f(row.get('baseline_ms'))} | {ratio} | {speedup} | {replay} | {capture} | "
            f"{memory} |" + (f" errors: {errors}" if errors else "")
        )
    return "\n".join(lines)


CHECK_WORDS = {
    True: "PASS",
    False: "FAIL",
    None: "n/a",
    "unresolved": (
        "NOT RESOLVED (some mode's interval is wider than the 2% band: more pairs needed)"
    ),
}


def checks_lines(data: dict[str, Any]) -> list[str]:
    return [f"- {name}: {CHECK_WORDS[ok]}" for name, ok in data.get("checks", {}).items()]


def limit_table(data: dict[str, Any]) -> str:
    """GPU kernel time per step (profiler) against the measured step times."""
    lines = [
        "| size | mode | step ms (unprofiled) | GPU kernel ms/step | kernels/step | "
        "GPU busy ms/step | step / kernel time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in data.get("runs", []):
        if row.get("error"):
            lines.append(f"| {row['size']} | {row['mode']} | error: {row['error']} |  |  |  |  |")
            continue
        lines.append(
            f"| {row['size']} | {row['mode']} | {_f(row.get('step_ms'))} | "
            f"{_f(row.get('kernel_ms_per_step'), '.3f')} | "
            f"{_f(row.get('kernels_per_step'), '.0f')} | "
            f"{_f(row.get('busy_ms_per_step'), '.3f')} | "
            f"{_x(row.get('step_over_own_kernel_time'))} |"
        )
    summary = data.get("summary") or {}
    if summary:
        lines.append("")
        lines.append(
            f"GPU limit (eager kernel time per step): "
            f"{_f(summary.get('kernel_ms_per_step'), '.3f')} ms; graphed step / kernel time "
            f"{_x(summary.get('graphed_over_kernel'))}, eager step / kernel time "
            f"{_x(summary.get('eager_over_kernel'))}."
        )
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return _f(None if value is None else value * 100.0, ".1f", "%")


def pairs_table(data: dict[str, Any]) -> str:
    """``pairs.py``'s summary: step times, per-pair ratios, spreads, kernels, losses, verdict."""
    unit = next(
        (r.get("kernel_unit") for r in data.get("results", []) if r.get("kernel_unit")), None
    )
    counted = "kernels" if unit is None or unit.startswith("GPU") else "CPU ops"
    lines = [
        "| mode | plugin ms/step | hand-written ms/step | plugin / hand-written per pair | "
        "median ratio | spread: pairs (plugin runs, hand-written runs) | "
        f"{counted}/step: plugin / hand-written | {counted} ms/step: plugin / hand-written | "
        "losses | verdict |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for row in data.get("results", []):
        if row.get("skipped"):
            lines.append(f"| {row['label']} | skipped: {row['skipped']} |  |  |  |  |  |  |  |  |")
            continue
        prof = row.get("profile") or {}
        p, h = prof.get("plugin") or {}, prof.get("handwritten") or {}
        equal = row.get("kernel_counts_equal")
        kernels = (
            f"{_f(p.get('count_per_step'), '.1f')} / {_f(h.get('count_per_step'), '.1f')}"
            + {True: " (equal)", False: " (DIFFER)", None: ""}[equal]
        )
        kernel_ms = (
            f"{_f(p.get('time_ms_per_step'), '.3f')} / {_f(h.get('time_ms_per_step'), '.3f')}"
        )
        losses = row.get("losses") or {}
        loss_text = (
            "identical"
            if losses.get("identical")
            else f"max diff {losses['max_abs_diff']:.2g}"
            if losses.get("max_abs_diff") is not None
            else "-"
        )
        if losses.get("pairs_compared"):
            loss_text += f" ({losses['pairs_compared']} pair(s), {losses['steps_compared']} steps)"
        ratios = ", ".join(f"{r:.3f}" for r in row.get("ratios") or []) or "-"
        spreads = (
            f"{_pct(row.get('spread'))} ({_pct(row.get('plugin_spread'))}, "
            f"{_pct(row.get('handwritten_spread'))})"
        )
        verdict = row.get("verdict", "-")
        if verdict != (row.get("rule") or {}).get("verdict"):
            verdict += f" (rule: {row['rule']['verdict']})"
        errors = "; ".join(row.get("errors", []))
        lines.append(
            f"| {row['label']} | {_f(row.get('plugin_ms'))} | {_f(row.get('handwritten_ms'))} | "
            f"{ratios} | {_f(row.get('median_ratio'), '.3f')} | {spreads} | {kernels} | "
            f"{kernel_ms} | {loss_text} | {verdict} |" + (f" errors: {errors}" if errors else "")
        )
    return "\n".join(lines)


def pairs_verdict_lines(data: dict[str, Any]) -> list[str]:
    """The done-when of ``pairs.py`` and each mode's reason, as markdown bullets."""
    done = data.get("done_when") or {}
    lines = [f"- done when {done.get('criterion', '-')}: **{done.get('verdict', '-')}**"]
    for row in data.get("results", []):
        if row.get("skipped"):
            continue
        rule = row.get("rule") or {}
        reason = rule.get("reason", "-")
        if rule.get("so_far"):
            reason += f"; so far: {rule['so_far']['verdict']} ({rule['so_far']['reason']})"
        diff = row.get("kernel_count_diff")
        if diff:
            reason += "; counts that differ (plugin, hand-written): " + ", ".join(
                f"{name[:60]} {a}/{b}" for name, (a, b) in list(diff.items())[:5]
            )
        lines.append(f"- {row['label']}: {row.get('verdict', '-')}: {reason}")
    return lines


def hook_table(data: dict[str, Any]) -> str:
    """The CPU hook-dispatch table (``hook_overhead.py --json``)."""
    lines = [
        "| plugins | µs/step (median) | min | max | Δ vs bare loop | Δ vs host defaults |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant, row in data["results"].items():
        lines.append(
            f"| {variant} | {row['us_per_step_median']:.2f} | {row['us_per_step_min']:.2f} | "
            f"{row['us_per_step_max']:.2f} | {row['delta_vs_bare_us']:+.2f} | "
            f"{row['delta_vs_host_defaults_us']:+.2f} |"
        )
    return "\n".join(lines)
