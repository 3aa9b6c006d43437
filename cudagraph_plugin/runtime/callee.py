"""What a full-iteration graph baked in besides its inputs: the model and the
``forward_step_func`` of the call it captured.

A replay runs the captured call's computation: another model's parameters are not in it,
and the Python values the step function used (a ``functools.partial``'s arguments, a
closure's variables, its defaults) were baked into the kernels. :func:`snapshot` records
those values when the graph is captured (a copy of the plain values, the objects
themselves otherwise), and a later call's snapshot must match it (:func:`same_snapshot`):
the same function, equal plain values (numbers, strings, numpy scalars, devices, dtypes, the
fields of a dataclass or of a callable object) and the same objects (tensors, modules,
anything else). A step function made again alike passes; one whose value changed, in a
new object or in the same closure cell, does not. A module-level variable the function
reads (``__globals__``) and a value changed inside an object compared by identity cannot
be seen.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from typing import Any

_MAX_DEPTH = 6
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """One value as recorded: ``tag`` says how it compares (``"="`` by value, ``"is"`` by
    identity, ``"cycle"``/``"empty"`` always equal, anything else part by part)."""

    tag: str
    kind: Any = None  # compared by identity: a type, a code object, a function
    value: Any = None  # the plain value, the object, or a tuple of Snapshots


def snapshot(value: Any) -> Snapshot:
    """``value`` (a step function, usually) as a graph captured with it depends on it."""
    return _snap(value, 0, frozenset())


def same_snapshot(a: Snapshot, b: Snapshot) -> bool:
    if a.tag != b.tag or a.kind is not b.kind:
        return False
    if a.tag == "is":
        return a.value is b.value
    if a.tag == "=":
        return bool(a.value == b.value) or (a.value != a.value and b.value != b.value)  # NaN
    if a.tag in ("cycle", "empty"):
        return True
    return len(a.value) == len(b.value) and all(
        same_snapshot(x, y) for x, y in zip(a.value, b.value, strict=True)
    )


def same_callable(a: Any, b: Any) -> bool:
    """``a`` does what ``b`` does as far as a captured graph can tell (see the module)."""
    return a is b or same_snapshot(snapshot(a), snapshot(b))


def is_fixed(recorded: Snapshot) -> bool:
    """Nothing the snapshot compares can change while the object stays the same: a plain
    function without closure variables, or a bound method (its object is compared by
    identity). Such a step function, passed again as the same object, needs no new
    snapshot (the replay's shortcut)."""
    if recorded.tag == "method":
        return True
    if recorded.tag != "function":
        return False
    _, cells, defaults, kwdefaults = recorded.value
    return not cells.value and _all_plain(defaults) and _all_plain(kwdefaults)


def same_models(given: Any, captured: Any) -> bool:
    """The same model chunks (a list made again of the same chunks is the same model)."""
    if given is captured:
        return True
    if isinstance(given, (list, tuple)) and isinstance(captured, (list, tuple)):
        return len(given) == len(captured) and all(
            a is b for a, b in zip(given, captured, strict=True)
        )
    return False


def modes(model: Any) -> tuple[Any, ...]:
    """Each model chunk's ``training`` flag: a full-iteration graph replays the mode it was
    captured in (dropout on or off, whatever mode the model is in at the replay)."""
    chunks = model if isinstance(model, (list, tuple)) else (model,)
    return tuple(getattr(chunk, "training", None) for chunk in chunks)


def describe(func: Any) -> str:
    inner = func.func if isinstance(func, functools.partial) else func
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"partial({name}, ...)" if isinstance(func, functools.partial) else name


def _all_plain(recorded: Snapshot) -> bool:
    if recorded.tag == "=":
        return True
    return recorded.tag == "seq" and all(_all_plain(part) for part in recorded.value)


def _snap(x: Any, depth: int, path: frozenset[int]) -> Snapshot:
    kind = type(x)
    if isinstance(x, _PLAIN) or isinstance(x, enum.Enum):
        return Snapshot("=", kind, x)
    if kind.__module__ == "numpy" and getattr(x, "shape", None) == () and hasattr(x, "item"):
        return Snapshot("=", kind, x.item())
    if kind.__module__ == "torch" and kind.__name__ in ("device", "dtype"):
        return Snapshot("=", kind, str(x))
    if hasattr(x, "data_ptr") or hasattr(x, "named_parameters"):
        return Snapshot("is", None, x)  # a tensor or a module: only the same one
    if id(x) in path:
        return Snapshot("cycle")  # (a closure that refers to itself, say)
    if depth >= _MAX_DEPTH:
        return Snapshot("is", None, x)
    inner, d = path | {id(x)}, depth + 1
    if isinstance(x, (list, tuple)):
        return Snapshot("seq", kind, tuple(_snap(item, d, inner) for item in x))
    if isinstance(x, dict):
        pairs = [_snap(part, d, inner) for item in x.items() for part in item]
        return Snapshot("dict", kind, tuple(pairs))
    if isinstance(x, functools.partial):
        parts = (x.func, x.args, x.keywords)
        return Snapshot("partial", None, tuple(_snap(part, d, inner) for part in parts))
    if isinstance(x, types.MethodType):
        return Snapshot("method", x.__func__, (Snapshot("is", None, x.__self__),))
    if isinstance(x, types.FunctionType):
        cells = tuple(_cell(cell, d, inner) for cell in x.__closure__ or ())
        return Snapshot(
            "function",
            x.__code__,
            (
                Snapshot("is", None, x.__globals__),
                Snapshot("seq", tuple, cells),
                _snap(x.__defaults__, d, inner),
                _snap(x.__kwdefaults__, d, inner),
            ),
        )
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
        return Snapshot("object", kind, (_snap(fields, d, inner),))
    if callable(x) and not isinstance(x, type) and hasattr(x, "__dict__"):
        return Snapshot("object", kind, (_snap(dict(vars(x)), d, inner),))
    return Snapshot("is", None, x)


def _cell(cell: Any, depth: int, path: frozenset[int]) -> Snapshot:
    try:
        contents = cell.cell_contents
    except ValueError:
        return Snapshot("empty")
    return _snap(contents, depth, path)
