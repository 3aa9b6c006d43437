"""Deprecated: ``cudagraph_plugin.mechanisms`` moved into ``cudagraph_plugin.runtime``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.runtime.mechanisms``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.runtime.mechanisms import (
    FullIterationGraphs,
    OptimizerGraphs,
    TEGraphs,
)

warnings.warn(
    "cudagraph_plugin.mechanisms is deprecated (moved into cudagraph_plugin.runtime) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "FullIterationGraphs",
    "OptimizerGraphs",
    "TEGraphs",
]
