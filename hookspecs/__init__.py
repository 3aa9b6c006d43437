"""The contract between a Megatron-Core training loop (the host) and its plugins.

This package owns the hook specifications (``spec``), the plugin manager factory with
entry-point discovery and blocking (``manager``), the host's default implementations of the
"perform" hooks (``host_defaults``), and the host-side :class:`TrainingRun` helper that fires
the hooks in order and guarantees the shutdown hook on every exit path (``run``).

It imports neither torch nor megatron at run time, so a plugin author can depend on it alone.

One name, ``mcgraph``, is the marker name, the hook prefix and the entry-point group.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "mcgraph"
"""Marker name, hook prefix (``mcgraph_``) and entry-point group."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks a hook specification (used only in :mod:`hookspecs.spec`)."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a hook implementation: ``@hookimpl`` / ``@hookimpl(wrapper=True)`` in plugins."""

from hookspecs.manager import BLOCK_ENV_VAR, get_plugin_manager  # noqa: E402
from hookspecs.run import (  # noqa: E402
    ShutdownReason,
    SignalReceived,
    TrainingRun,
    call_hook,
    merge_kwargs,
)

__all__ = [
    "BLOCK_ENV_VAR",
    "PROJECT_NAME",
    "ShutdownReason",
    "SignalReceived",
    "TrainingRun",
    "call_hook",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "merge_kwargs",
]
