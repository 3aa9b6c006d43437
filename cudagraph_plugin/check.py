"""Deprecated: ``cudagraph_plugin.check`` moved into ``cudagraph_plugin.cli``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.cli.check``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.cli.check import (
    FP8_FORMATS,
    LIST_FLAGS,
    USAGE,
    build_parser,
    main,
    run_check,
)

warnings.warn(
    "cudagraph_plugin.check is deprecated (moved into cudagraph_plugin.cli) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "FP8_FORMATS",
    "LIST_FLAGS",
    "USAGE",
    "build_parser",
    "main",
    "run_check",
]
