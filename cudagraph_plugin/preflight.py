"""Deprecated: ``cudagraph_plugin.preflight`` moved into ``cudagraph_plugin.config``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.config.environment``
* ``cudagraph_plugin.config.fixes``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.config.environment import (
    TE_NOT_CHECKED,
)
from cudagraph_plugin.config.fixes import (
    inspect_environment,
    preflight,
)

warnings.warn(
    "cudagraph_plugin.preflight is deprecated (moved into cudagraph_plugin.config) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "TE_NOT_CHECKED",
    "inspect_environment",
    "preflight",
]
