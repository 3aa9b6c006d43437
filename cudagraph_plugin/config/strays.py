"""CUDA graph fields a config holds where nothing reads them.

The reader looks at fixed places (:data:`~cudagraph_plugin.config.fields.FIELD_PATHS`). A
CUDA graph field put elsewhere (``train.cuda_graph_impl``, ``model.optimizer_cuda_graph``)
or misspelt (``model.cuda_graphs_impl``, ``cuda_graph_bucket``) was ignored without a word,
and its run went eagerly or without the feature (user trial, 2026-12-05). This module
finds them and says where the field is read (as notes: a name close to ours may be a field
of someone else's):

* at the top of the config and one section down, whatever the read places hold;
* further down (a Hydra tree passed whole: ``actor.megatron.cuda_graph_impl``; user trial
  of 2026-12-05, the run eager without a word), up to :data:`DEPTH` sections, only names
  that no read place holds (Megatron-LM's ``GPTModelConfig`` hands its ``transformer``'s
  fields out as its own: ``model.transformer.cuda_graph_impl`` is read as
  ``model.cuda_graph_impl``), with the section to pass instead.

A ``cuda_graph_impl`` (or a near spelling of it) that turns graphs on where nothing reads
it, in a config whose read places do not say the implementation, asks for graphs the run
would not give: :attr:`Stray.asks_for_graphs` (a problem, :mod:`~cudagraph_plugin.config.
rules.names`).

Only config containers are looked into: mappings (an OmegaConf ``DictConfig`` too),
namespaces, dataclass instances, pydantic models, attrs instances and ml_collections
``ConfigDict`` s (:mod:`~cudagraph_plugin.config.libraries`; a host's model or optimizer
object is never walked).
Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
from collections.abc import Iterator, Mapping
from typing import Any

from cudagraph_plugin.config.fields import FIELD_PATHS, MISSING, is_omegaconf, lookup, resolve
from cudagraph_plugin.config.libraries import field_names, library_of
from cudagraph_plugin.config.values import to_bool
from cudagraph_plugin.config.vocabulary import IMPLS

MARK = "cuda_graph"
CLOSE = 0.85  # (difflib's ratio: "cuda_graph_bucket" is close to "cuda_graph_buckets")
DEPTH = 4  # sections walked below the top (verl's actor_rollout_ref.actor.megatron is 3)
MAX_SECTIONS = 2_000  # containers looked into at most (a large tree costs no more)
_GRAPH_IMPLS = (*(impl for impl in IMPLS if impl != "none"), "full_iteration")  # (0.18+'s)


@dataclasses.dataclass(frozen=True)
class Stray:
    """A CUDA graph field where nothing reads it: ``path`` (as the config names it), its
    value, what to say of it, and whether it asks for graphs that the run, reading none,
    would not give."""

    path: str
    value: Any
    said: str  # where it is and where it is read
    move: str  # what to do with it
    hold: str = ""  # further down: the section to pass instead
    asks_for_graphs: bool = False

    @property
    def text(self) -> str:
        """The note."""
        return f"{self.said} ({self.hold})" if self.hold else self.said


def _names(obj: Any) -> list[str] | None:
    """The field names of a plain container or a config library's object (a pydantic
    model, an attrs instance, a ConfigDict: user trial, 2026-12-05), else None (also where
    listing them raised)."""
    if library_of(obj) not in (None, "omegaconf"):
        return field_names(obj)
    try:
        if isinstance(obj, Mapping):
            return [name for name in obj if isinstance(name, str)]
        if isinstance(obj, argparse.Namespace | types.SimpleNamespace):
            return list(vars(obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return [field.name for field in dataclasses.fields(obj)]
    except Exception:  # (a host's mapping whose iteration raises: nothing to look into)
        return None
    return None


def _section(container: Any, name: str) -> Any:
    """The part at ``name`` to look into, read without running OmegaConf's resolvers (the
    walk evaluates no interpolation on its way down; review of 2026-12-05: only the value
    of a CUDA graph field it finds is read, its interpolation resolved)."""
    if is_omegaconf(container):
        try:
            return container._get_node(name)  # (a DictConfig is its own node; a leaf: no)
        except Exception:
            return None
    return resolve(container, name)


def _places(config: Any) -> Iterator[tuple[str, str, int]]:
    """``(prefix, name, depth)`` of each field, section by section (breadth first) down to
    :data:`DEPTH` sections below the top, each container once."""
    level: list[tuple[str, Any]] = [("", config)]
    seen = {id(config)}
    walked = 0
    for depth in range(DEPTH + 1):
        below: list[tuple[str, Any]] = []
        for prefix, container in level:
            walked += 1
            if walked > MAX_SECTIONS:
                return
            for name in _names(container) or []:
                yield prefix, name, depth
                if depth == DEPTH:
                    continue
                # (MISSING, or Unreadable where a property raised: no container, no names)
                section = _section(container, name)
                if _names(section) is not None and id(section) not in seen:
                    seen.add(id(section))
                    below.append((f"{prefix}{name}.", section))
        level = below


def _turns_graphs_on(value: Any) -> bool:
    """An implementation megatron-core would capture with (another engine's value, such as
    a generation server's ``sglang``, is not this run's request; review of 2026-12-05)."""
    return isinstance(value, str) and value.strip().lower() in _GRAPH_IMPLS


def _impl_said(config: Any) -> bool:
    """The config says the implementation where it is read, or turns graphs on by a
    deprecated flag there (``enable_cuda_graph``: a problem of its own)."""
    if lookup(config, "impl")[0] is not None:
        return True
    for setting in ("enable_cuda_graph", "external_cuda_graph"):
        value = lookup(config, setting)[0]
        try:
            if value is not None and to_bool(value):
                return True
        except ValueError:
            continue
    return False


def stray_fields(config: Any) -> tuple[Stray, ...]:
    """Each CUDA graph field of ``config`` that no setting reads there."""
    read_at: dict[str, list[str]] = {}  # a field's name: every path it is read at, in order
    for path in sorted({path for paths in FIELD_PATHS.values() for path in paths}):
        if MARK in path:
            read_at.setdefault(path.rpartition(".")[2], []).append(path)
    read = {path for paths in read_at.values() for path in paths}
    known = sorted(read_at)
    impl_said = _impl_said(config)
    found = []
    for prefix, name, depth in _places(config):
        path = prefix + name
        if MARK not in name or path in read:
            continue
        if name in read_at:
            meant = name
            places = " or ".join(read_at[name])
            text = f"{path} is not read there: {name} is read at {places}"
            move = f"move it to {places}"
        else:
            close = difflib.get_close_matches(name, known, n=1, cutoff=CLOSE)
            if not close:
                continue
            meant = close[0]
            places = prefix + meant
            if places not in read:  # (the name is close, the place wrong too)
                places = " or ".join(read_at[meant])
            text = f"{path} is not a field the CUDA graph checks read (did you mean {places}?)"
            move = f"spell it {places}"
        value = resolve(config, path)
        hold = ""
        if depth > 1:
            held = [resolve(config, p) for p in read_at[meant]]
            # (a null there holds nothing: review of 2026-12-05)
            held = [v for v in held if v is not MISSING and v is not None]
            hold = f"pass the section that holds it, {prefix[:-1]}, as the config"
            move = f"{hold}, or {move}"
            if held:  # (a read place holds it: a copy, or the same field handed out)
                if not (
                    meant == "cuda_graph_impl"
                    and _turns_graphs_on(value)
                    and not any(_turns_graphs_on(v) for v in held)
                ):
                    continue
                # graphs asked for deep down, off where read (a base YAML's top-level none
                # under a deeper override: a note, that section may be another engine's)
                text += ", where it turns graphs off"
        asks = meant == "cuda_graph_impl" and not impl_said and _turns_graphs_on(value)
        found.append(Stray(path, value, text, move, hold, asks))
    return tuple(found)
