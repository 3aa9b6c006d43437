"""Releasing resources one guarded step at a time.

Shutdown releases many independent things (each graph, megatron-core's class state,
static buffers, the graph pool handle, cuBLAS workspaces, capture flags, references). One
that raises — or a second Ctrl-C arriving in the middle — must not skip the others, and
must never hide the exception that ended the run. :func:`release_each` runs every
:class:`ReleaseStep`, logs each failure and returns them; :func:`settle` attaches them as
notes to the run's own exception, or raises the first when the run had none.
(The run's own plan is :mod:`~cudagraph_plugin.runtime.release_plan`.)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("cudagraph_plugin")


@dataclasses.dataclass(frozen=True)
class ReleaseStep:
    """One resource and how to release it. With ``frees_graphs``, ``release`` returns how
    many CUDA graphs it freed."""

    resource: str
    release: Callable[[], Any]
    frees_graphs: bool = False


@dataclasses.dataclass
class ReleaseResult:
    graphs_freed: int = 0
    failures: list[tuple[str, BaseException]] = dataclasses.field(default_factory=list)


DURING_TRAINING = "while freeing graphs during training"
""":func:`settle`'s ``where`` for a release between steps (an invalidation, the fallback)."""

PLAN_ATTEMPTS = 2
"""How often :func:`release_each` draws up a plan that raised while being drawn up."""


def release_each(
    steps: Iterable[ReleaseStep] | Callable[[], Iterable[ReleaseStep]],
) -> ReleaseResult:
    """Run every step; a step that raises (anything, KeyboardInterrupt included) is logged
    and recorded, and the next step runs. So is an exception that arrives between two steps
    (the handler of a second Ctrl-C runs wherever the interpreter checks for signals, the
    loop's own jump included): the steps left still run.

    ``steps`` may be a plan to draw up (a callable returning the steps), drawn up inside
    the same guard: interrupted, it is drawn up again (:data:`PLAN_ATTEMPTS` times in all;
    a plan that keeps raising is recorded as a failure and nothing runs)."""
    result = ReleaseResult()
    draw = steps if callable(steps) else lambda: steps
    pending: collections.deque[ReleaseStep] | None = None
    attempts = 0
    while pending is None or pending:
        try:
            if pending is None:
                attempts += 1
                pending = collections.deque(draw())
            _release_pending(pending, result)
        except BaseException as exc:
            if pending is None:
                logger.error("cleanup: drawing up the release plan failed: %r", exc, exc_info=exc)
                result.failures.append(("the release plan", exc))
                if attempts >= PLAN_ATTEMPTS:
                    break
                continue
            logger.error("cleanup: interrupted between two steps: %r", exc, exc_info=exc)
            result.failures.append(("the release (between two steps)", exc))
    return result


def _release_pending(pending: collections.deque[ReleaseStep], result: ReleaseResult) -> None:
    while pending:
        step = pending[0]  # taken off once run: an interruption before that runs it again
        try:
            freed = step.release()
        except BaseException as exc:
            pending.popleft()
            logger.error("cleanup: releasing %s failed: %r", step.resource, exc, exc_info=exc)
            result.failures.append((step.resource, exc))
            continue
        pending.popleft()
        if step.frees_graphs:
            result.graphs_freed += freed


def settle(
    failures: list[tuple[str, BaseException]],
    run_exception: BaseException | None,
    where: str = "at shutdown",
) -> None:
    """Report cleanup failures without hiding the run's own exception.

    With a run exception, each failure becomes a note on it. Without one, the first
    failure is raised (a KeyboardInterrupt first, so a Ctrl-C during cleanup still stops
    the program) with notes naming the others (``where``: when the release ran).
    """
    if not failures:
        return
    if run_exception is not None:
        for resource, exc in failures:
            run_exception.add_note(f"cleanup: releasing {resource} failed: {exc!r}")
        return
    ordered = sorted(failures, key=lambda item: not isinstance(item[1], KeyboardInterrupt))
    (resource, first), rest = ordered[0], ordered[1:]
    first.add_note(f"raised while releasing {resource} {where}")
    for other_resource, exc in rest:
        first.add_note(f"cleanup: releasing {other_resource} also failed: {exc!r}")
    raise first
