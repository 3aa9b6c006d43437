"""CUDA graph fields a config holds where nothing reads them.

The reader looks at fixed places (:data:`~cudagraph_plugin.config.fields.FIELD_PATHS`). A
CUDA graph field put elsewhere (``train.cuda_graph_impl``, ``model.optimizer_cuda_graph``)
or misspelt (``model.cuda_graphs_impl``, ``cuda_graph_bucket``) was ignored without a word,
and its run went eagerly or without the feature (user trial, 2026-12-05). This module
finds them, at the top of the config and one section down, and says where the field is
read (said as notes: a name close to ours may be a field of someone else's).

Only plain containers are looked into: dicts, namespaces and dataclass instances (a host's
model or optimizer object is never walked). Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
from collections.abc import Iterator, Mapping
from typing import Any

from cudagraph_plugin.config.fields import FIELD_PATHS, resolve

MARK = "cuda_graph"
CLOSE = 0.85  # (difflib's ratio: "cuda_graph_bucket" is close to "cuda_graph_buckets")


def _names(obj: Any) -> list[str] | None:
    """The field names of a plain container, else None."""
    if isinstance(obj, Mapping):
        return [name for name in obj if isinstance(name, str)]
    if isinstance(obj, argparse.Namespace | types.SimpleNamespace):
        return list(vars(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [field.name for field in dataclasses.fields(obj)]
    return None


def _places(config: Any) -> Iterator[tuple[str, str]]:
    """``(prefix, name)`` of each field at the top and one section down."""
    top = _names(config) or []
    for name in top:
        yield "", name
    for section in top:
        # (MISSING, or Unreadable where a property raised: no container, so no names)
        for name in _names(resolve(config, section)) or []:
            yield f"{section}.", name


def stray_fields(config: Any) -> tuple[str, ...]:
    """What to say of each CUDA graph field of ``config`` that no setting reads there."""
    read = {path for paths in FIELD_PATHS.values() for path in paths if MARK in path}
    known = sorted({path.rpartition(".")[2] for path in read})
    said = []
    for prefix, name in _places(config):
        path = prefix + name
        if MARK not in name or path in read:
            continue
        if name in known:
            where = " or ".join(sorted(p for p in read if p.rpartition(".")[2] == name))
            said.append(f"{path} is not read there: {name} is read at {where}")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=CLOSE)
        if close:
            meant = prefix + close[0]
            if meant not in read:  # (the name is close, the place wrong too)
                meant = " or ".join(sorted(p for p in read if p.rpartition(".")[2] == close[0]))
            said.append(f"{path} is not a field the CUDA graph checks read (did you mean {meant}?)")
    return tuple(said)
