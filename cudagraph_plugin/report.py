"""Deprecated: ``cudagraph_plugin.report`` moved into ``cudagraph_plugin.runtime``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.runtime.report``
* ``cudagraph_plugin.runtime.timing``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.runtime.report import (
    NOISE_FLOOR,
    RunReport,
    verdict,
)
from cudagraph_plugin.runtime.timing import (
    MIB,
    MemorySnapshot,
    StepTimer,
    median_or_none,
)

warnings.warn(
    "cudagraph_plugin.report is deprecated (moved into cudagraph_plugin.runtime) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "MIB",
    "NOISE_FLOOR",
    "MemorySnapshot",
    "RunReport",
    "StepTimer",
    "median_or_none",
    "verdict",
]
