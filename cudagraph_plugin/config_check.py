"""Deprecated: ``cudagraph_plugin.config_check`` moved into ``cudagraph_plugin.config``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.config.check``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.config.check import (
    ConfigCheck,
    check_config,
)

warnings.warn(
    "cudagraph_plugin.config_check is deprecated (moved into cudagraph_plugin.config) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "ConfigCheck",
    "check_config",
]
