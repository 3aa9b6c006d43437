"""What bucketed full-iteration graphs should have done with a run's steps, for the tests
that read a run report (``tests/test_rl_loop.py`` on the CPU, ``tests/test_gpu_rl.py``).

The rule (``cudagraph_plugin.runtime.buckets``): a bucket's first ``warmup`` steps run
eagerly, its next step captures, every later step replays; an invalidation (the host's
word, or memory that moved) starts every bucket's warm-up again; a length outside every
bucket always runs eagerly.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from typing import Any

ACTIONS = ("eager_steps", "capture_steps", "replay_steps")


def expected_schedule(
    lengths: list[int],
    buckets: Collection[int],
    warmup: int,
    resets_before: Collection[int] = (),
    start_step: int = 0,
) -> dict[int, dict[str, list[int]]]:
    """Per length, the steps that run eagerly, capture and replay; ``lengths[i]`` is step
    ``start_step + i``'s padded length."""
    schedule: dict[int, dict[str, list[int]]] = collections.defaultdict(
        lambda: {action: [] for action in ACTIONS}
    )
    seen: collections.Counter[int] = collections.Counter()
    for step, length in enumerate(lengths, start=start_step):
        if step in resets_before:
            seen.clear()
        if length not in buckets:
            schedule[length]["eager_steps"].append(step)
            continue
        seen[length] += 1
        if seen[length] <= warmup:
            action = "eager_steps"
        elif seen[length] == warmup + 1:
            action = "capture_steps"
        else:
            action = "replay_steps"
        schedule[length][action].append(step)
    return dict(schedule)


def schedule_of(report: dict[str, Any]) -> dict[int, dict[str, list[int]]]:
    """The same, as the run report's ``buckets`` rows give it."""
    return {
        row["seq_length"]: {action: row[action] for action in ACTIONS} for row in report["buckets"]
    }


def lengths_of(report: dict[str, Any]) -> list[int]:
    """Each step's padded length, read back from the report's ``buckets`` rows."""
    by_step = {
        step: row["seq_length"]
        for row in report["buckets"]
        for action in ACTIONS
        for step in row[action]
    }
    return [by_step[step] for step in sorted(by_step)]
