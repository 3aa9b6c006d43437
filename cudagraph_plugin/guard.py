"""Deprecated: ``cudagraph_plugin.guard`` moved into ``cudagraph_plugin.runtime``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.runtime.guard``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.runtime.guard import (
    FIX,
    ShapeGuard,
    StaticShapeError,
    fingerprint,
    signature,
)

warnings.warn(
    "cudagraph_plugin.guard is deprecated (moved into cudagraph_plugin.runtime) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "FIX",
    "ShapeGuard",
    "StaticShapeError",
    "fingerprint",
    "signature",
]
