"""The project's one name and its pluggy markers (a leaf: imports only pluggy).

``mcgraph`` is the marker name, the hook prefix (``mcgraph_``) and the entry-point group.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "mcgraph"
"""Marker name, hook prefix (``mcgraph_``) and entry-point group."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks a hook specification (used only in :mod:`hookspecs.spec`)."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a hook implementation: ``@hookimpl`` / ``@hookimpl(wrapper=True)`` in plugins."""
