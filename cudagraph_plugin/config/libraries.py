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
    if (cls.__module__ or "").startswith("omegaconf."):
        return "omegaconf"
    for base in cls.__mro__:
        module = getattr(base, "__module__", None) or ""
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
    except Exception:  # (a class that cannot be hashed, an odd __module__)
        return None


def field_names(obj: Any) -> list[str] | None:
    """The field names of a pydantic model (its extra fields too), an attrs instance or a
    ConfigDict; None for anything else, or where listing them raised."""
    library = library_of(obj)
    try:
        if library == "pydantic":
            extra = getattr(obj, "__pydantic_extra__", None) or {}
            named = [_input_names(n, i)[0] for n, i in type(obj).model_fields.items()]
            return [*named, *(name for name in extra if isinstance(name, str))]
        if library == "attrs":
            return [_init_name(attribute) for attribute in type(obj).__attrs_attrs__]
        if library == "ml_collections":
            return [name for name in obj.keys() if isinstance(name, str)]
    except Exception:
        return None
    return None


def aliased(obj: Any, name: str) -> str | None:
    """The attribute of ``obj`` that holds the field its user names ``name``: a pydantic
    field one of whose input names is ``name`` (``alias``, ``validation_alias``, an
    ``AliasChoices`` member, a one-step ``AliasPath``), an attrs field whose ``__init__``
    argument is ``name`` (``_cuda_graph_impl``); None where ``name`` is no alias."""
    library = library_of(obj)
    try:
        if library == "pydantic":
            for attribute, info in type(obj).model_fields.items():
                if attribute != name and name in _input_names(attribute, info):
                    return attribute
        elif library == "attrs":
            for attribute in type(obj).__attrs_attrs__:
                if attribute.name != name and _init_name(attribute) == name:
                    return attribute.name
    except Exception:
        return None
    return None


def _input_names(attribute: str, info: Any) -> list[str]:
    """The names a pydantic field is given by, its alias first (a serialization alias is
    an output name: not one)."""
    names: list[str] = []
    for alias in (info.alias, info.validation_alias):
        for choice in getattr(alias, "choices", None) or [alias]:  # (AliasChoices)
            path = getattr(choice, "path", None)  # (AliasPath: one step only)
            choice = path[0] if isinstance(path, list) and len(path) == 1 else choice
            if isinstance(choice, str) and choice not in names:
                names.append(choice)
    return [*names, attribute] if attribute not in names else names


def _init_name(attribute: Any) -> str:
    """An attrs field's ``__init__`` argument (attrs before 22.2 has no ``alias``: its rule,
    the name without leading underscores)."""
    alias = getattr(attribute, "alias", None)
    return alias if isinstance(alias, str) else attribute.name.lstrip("_")


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


def trial_copy(obj: Any) -> Any:
    """A copy of one of these libraries' objects to try writes on, or ``UNKNOWN`` (another
    kind of object, or one that cannot be copied: nothing is then known, nothing is said).
    A pydantic model or an attrs instance is copied shallowly (a write sets one attribute
    of the copy; a big tensor in the config is not duplicated); OmegaConf and ml_collections
    containers deeply (their nodes and ``FieldReference`` s are shared otherwise)."""
    library = library_of(obj)
    if library is None:
        return UNKNOWN
    try:
        return copy.copy(obj) if library in ("pydantic", "attrs") else copy.deepcopy(obj)
    except Exception:
        return UNKNOWN


def trial_write(
    trial: Any, leaf: str, value: Any, write: Callable[[Any, str, Any], None], read: Callable
) -> tuple[str | None, Any]:
    """``write(trial, leaf, value)`` on a copy from :func:`trial_copy`: why the write was
    refused (None: it was taken) and what ``read(trial, leaf)`` gives after it
    (:data:`UNKNOWN` where it was refused or the reading raised)."""
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
