"""Deprecated: ``cudagraph_plugin.plugin`` moved into ``cudagraph_plugin.runtime``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.runtime.fallback``
* ``cudagraph_plugin.runtime.plugin``
* ``cudagraph_plugin.runtime.state``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.runtime.fallback import (
    FALLBACK_REPLAY_STEPS,
)
from cudagraph_plugin.runtime.plugin import (
    CudaGraphPlugin,
)
from cudagraph_plugin.runtime.state import (
    Phase,
)

warnings.warn(
    "cudagraph_plugin.plugin is deprecated (moved into cudagraph_plugin.runtime) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "FALLBACK_REPLAY_STEPS",
    "CudaGraphPlugin",
    "Phase",
]
