"""Sequence-length buckets (pure Python): the setting's accepted form and the arithmetic
of padding to them. The padding itself (torch) is :mod:`cudagraph_plugin.runtime.padding`;
the graphs per bucket are :mod:`cudagraph_plugin.runtime.buckets`.
"""

from __future__ import annotations

import numbers
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _length(value: Any) -> int | None:
    """An integer of any integral type (a NumPy or a 0-d tensor's item included) as an int;
    None for anything else (bools too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def check_buckets(buckets: Iterable[Any], field: str = "buckets") -> tuple[int, ...]:
    """The bucket lengths, sorted, as ints; a clear error for anything that is not a
    non-empty set of distinct positive integers."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise ValueError(
            f"{field}={buckets!r} is not a list of sequence lengths: give one, e.g. [512, 1024]"
        )
    given = list(buckets)
    if not given:
        raise ValueError(f"{field} is empty: give at least one sequence length, e.g. 512,1024")
    lengths = [_length(value) for value in given]
    bad = [value for value, length in zip(given, lengths, strict=True) if not (length or 0) > 0]
    values = [length for length in lengths if length is not None and length > 0]
    problems = []  # every one at once
    if bad:
        problems.append(
            f"{field} must be positive integers (sequence lengths), got "
            f"{', '.join(map(repr, bad))} in {given!r}"
        )
    if len(set(values)) != len(values):
        twice = sorted({length for length in values if values.count(length) > 1})
        problems.append(
            f"{field} has a length twice: {', '.join(map(str, twice))} in {values!r}; give each "
            "length once"
        )
    if problems:
        raise ValueError("; and ".join(problems))
    return tuple(sorted(values))


def parse_buckets(value: Any, field: str = "buckets") -> tuple[int, ...]:
    """The setting's accepted form: a list of ints or a string ``"256,512,1024"`` (commas or
    spaces, in brackets or not; digit strings count as ints), checked by
    :func:`check_buckets`. Raises ``ValueError`` saying what is wrong."""
    problems = []
    if isinstance(value, str):
        # a list written as text ("[256, 512]": a quoted Hydra override, a JSON or YAML
        # list kept as a string; user trial, 2026-12-05) is that list
        bracketed = re.fullmatch(r"\s*\[(.*)\]\s*", value, re.DOTALL)
        value = bracketed.group(1) if bracketed else value
        if re.search(r"(^|,)\s*(,|$)", value.strip()) and value.strip():
            # "256,,512", "256,512,": an unset variable in a launcher drops a bucket
            problems.append(
                "an empty length between commas (an unset variable in the command?): give "
                "every length, or leave the comma out"
            )
        value = [part for part in re.split(r"[,\s]+", value.strip()) if part]
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise ValueError("not a list of sequence lengths")
    lengths, not_lengths = [], []
    for item in value:
        if isinstance(item, str) and re.fullmatch(r"\s*[+-]?\d+\s*", item):
            item = int(item)
        (not_lengths if _length(item) is None else lengths).append(item)
    if not not_lengths and not problems:
        return check_buckets(lengths, field)
    if not_lengths:
        said = ", ".join(map(repr, not_lengths))
        verb = "is not a sequence length" if len(not_lengths) == 1 else "are not sequence lengths"
        problems.append(f"{said} {verb}")
    try:  # and what is wrong with the rest, in the same message
        if lengths:
            check_buckets(lengths, field)
    except ValueError as more:
        problems.append(str(more))
    raise ValueError("; and ".join(problems))


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``length``, or ``None`` when it exceeds every bucket."""
    return next((bucket for bucket in sorted(buckets) if bucket >= length), None)


def padding_waste_percent(real_tokens: int, padded_tokens: int) -> float | None:
    """Padded positions as a percentage of all positions computed; ``None`` without any."""
    total = real_tokens + padded_tokens
    return None if total == 0 else 100.0 * padded_tokens / total
