"""The rule registry and the helpers every rule uses.

A rule is a function ``(settings, environment) -> iterator of Violation | Note``,
registered with :func:`rule` in the order its module is imported (the order problems are
listed in).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import Note, Violation
from cudagraph_plugin.config.settings import Settings

Rule = Callable[[Settings, Environment], Iterator["Violation | Note"]]
RULES: list[Rule] = []


def rule(func: Rule) -> Rule:
    RULES.append(func)
    return func


def violation(
    s: Settings,
    settings: tuple[str, ...],
    value: Any,
    problem: str,
    fix: str,
    *references: tuple[str, str],
) -> Violation:
    """A violation naming ``settings`` as the user knows them (``Settings.field``)."""
    return Violation(
        tuple(s.field(name) for name in settings), repr(value), problem, fix, references
    )


def scope_value(s: Settings) -> str:
    return ",".join(s.scope) if s.scope else "(empty)"


def did_you_mean(name: Any, choices: tuple[str, ...]) -> str:
    if isinstance(name, Enum) and not isinstance(name, str):
        # (a plain enum member: megatron-core compares the implementation as a string;
        # "<Impl.local: 'local'>: use one of none, local, ..." puzzled; user trial)
        meant = [str(x) for x in (name.value, name.name) if str(x) in choices]
        if meant:
            return f" (give the string {meant[0]!r}: an enum member is not the string itself)"
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""
