"""Deprecated: ``cudagraph_plugin.settings`` moved into ``cudagraph_plugin.config``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.config.fields``
* ``cudagraph_plugin.config.settings``
* ``cudagraph_plugin.config.values``
* ``cudagraph_plugin.config.vocabulary``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.config.fields import (
    FIELD_PATHS,
    INVERTED_FLAGS,
    MISSING,
    assign,
    display_name,
    existing_paths,
    lookup,
    resolve,
)
from cudagraph_plugin.config.settings import (
    Settings,
    read_settings,
)
from cudagraph_plugin.config.values import (
    BOOL_SETTINGS,
    FieldProblem,
    normalise,
    parse_layer_pattern,
    parse_scope,
    to_bool,
)
from cudagraph_plugin.config.vocabulary import (
    DEFAULT_WARMUP_STEPS,
    DEPRECATED_SCOPES,
    IMPLS,
    SCOPES,
)

warnings.warn(
    "cudagraph_plugin.settings is deprecated (moved into cudagraph_plugin.config) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "BOOL_SETTINGS",
    "DEFAULT_WARMUP_STEPS",
    "DEPRECATED_SCOPES",
    "FIELD_PATHS",
    "IMPLS",
    "INVERTED_FLAGS",
    "MISSING",
    "SCOPES",
    "FieldProblem",
    "Settings",
    "assign",
    "display_name",
    "existing_paths",
    "lookup",
    "normalise",
    "parse_layer_pattern",
    "parse_scope",
    "read_settings",
    "resolve",
    "to_bool",
]
