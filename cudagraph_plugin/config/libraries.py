"""Config objects of the libraries hosts keep their settings in, beyond dicts, namespaces
and dataclasses: OmegaConf containers, pydantic models, attrs instances and ml_collections
``ConfigDict`` s (user trials of 2026-12-05: a Hydra tree; pydantic, attrs and ConfigDict
configs).

Owns recognising them (:func:`library_of`), their field names (:func:`field_names`, for
the walk that finds CUDA graph fields where nothing reads them), a field named by its alias
(:func:`aliased`: a pydantic ``Field(alias="cuda_graph_impl")``, an attrs ``_cuda_graph_impl``
given as ``cuda_graph_impl``), and a write tried on a copy (:func:`trial_write`): whether the
write would be refused (a frozen model, a strict type, a ``FrozenConfigDict``, a read-only
property) and what the field holds after it (a converter, a coercing validator, a typed
OmegaConf field), seen without touching the host's config, so that ``check_config`` says
what the run's write will meet.

None of them is a dependency: each is recognised by its class, and only its objects' own
API is used. Pure Python: no torch, no megatron import.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

UNKNOWN = object()
"""What :func:`trial_write` gives where the field's value after the write is not known."""


@functools.lru_cache(maxsize=256)
def _library_of_class(cls: type) -> str | None:
    if cls.__module__.startswith("omegaconf."):
        return "omegaconf"
    for base in cls.__mro__:
        module = base.__module__ or ""
        if module.startswith("pydantic.") and base.__name__ == "BaseModel":
            return "pydantic"
        if module.startswith("ml_collections."):
            return "ml_collections"
    if hasattr(cls, "__attrs_attrs__"):
        return "attrs"
    return None


def library_of(obj: Any) -> str | None:
    """``omegaconf``, ``pydantic``, ``attrs`` or ``ml_collections`` for one of their
    config objects, else None."""
    try:
        return _library_of_class(type(obj))
    except TypeError:  # (a class that cannot be hashed)
        return None


def field_names(obj: Any) -> list[str] | None:
    """The field names of a pydantic model (its extra fields too), an attrs instance or a
    ConfigDict; None for anything else, or where listing them raised."""
    library = library_of(obj)
    try:
        if library == "pydantic":
            extra = getattr(obj, "__pydantic_extra__", None) or {}
            return [*type(obj).model_fields, *(name for name in extra if isinstance(name, str))]
        if library == "attrs":
            return [attribute.name for attribute in type(obj).__attrs_attrs__]
        if library == "ml_collections":
            return [name for name in obj.keys() if isinstance(name, str)]
    except Exception:
        return None
    return None


def aliased(obj: Any, name: str) -> str | None:
    """The attribute of ``obj`` that holds the field its user names ``name``: a pydantic
    field whose alias is ``name``, an attrs field whose ``__init__`` argument is ``name``
    (``_cuda_graph_impl``); None where ``name`` is no alias."""
    library = library_of(obj)
    try:
        if library == "pydantic":
            for attribute, info in type(obj).model_fields.items():
                aliases = (info.alias, info.validation_alias, info.serialization_alias)
                if attribute != name and name in aliases:
                    return attribute
        elif library == "attrs":
            for attribute in type(obj).__attrs_attrs__:
                if getattr(attribute, "alias", None) == name and attribute.name != name:
                    return attribute.name
    except Exception:
        return None
    return None


def error_text(error: BaseException) -> str:
    """An error in one line: pydantic's messages (its first line only counts the errors),
    else the first line (OmegaConf's next lines name the key and the object type)."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        try:
            said = "; ".join(str(item.get("msg")) for item in errors()[:3])
            if said:
                return f"{type(error).__name__}: {said}"
        except Exception:
            pass
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def trial_write(
    obj: Any, leaf: str, value: Any, write: Callable[[Any, str, Any], None], read: Callable
) -> tuple[str | None, Any]:
    """``write(copy, leaf, value)`` on a deep copy of ``obj`` (one of these libraries'
    objects): why the write was refused (None: it was taken) and what ``read(copy, leaf)``
    gives after it (:data:`UNKNOWN` where it was refused, for another kind of object, or
    where the copy itself failed: nothing is then known, nothing is said)."""
    if library_of(obj) is None:
        return None, UNKNOWN
    try:
        trial = copy.deepcopy(obj)
    except Exception:
        return None, UNKNOWN
    with warnings.catch_warnings():  # (OmegaConf 2.4 warns that it converts: said by callers)
        warnings.simplefilter("ignore")
        try:
            write(trial, leaf, value)
        except Exception as error:
            return error_text(error), UNKNOWN
        try:
            return None, read(trial, leaf)
        except Exception:
            return None, UNKNOWN
