"""The plugin manager factory: specs, the host's default plugin, entry-point discovery,
blocking by environment variable, and ``check_pending()``.

No global manager exists: every run calls :func:`get_plugin_manager` and gets a fresh one.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

import pluggy

from hookspecs import PROJECT_NAME, host_defaults, spec

logger = logging.getLogger(__name__)

BLOCK_ENV_VAR = "MCGRAPH_BLOCK_PLUGINS"
"""Comma-separated entry-point names of plugins not to load, e.g. ``cudagraph,my_plugin``."""

HOST_DEFAULTS_NAME = "mcgraph-host-defaults"


def blocked_plugin_names(environ: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """Plugin names listed in :data:`BLOCK_ENV_VAR` (spaces and empty items ignored)."""
    raw = (os.environ if environ is None else environ).get(BLOCK_ENV_VAR, "")
    return [name.strip() for name in raw.split(",") if name.strip()]


def _installed_entry_point_names() -> set[str]:
    return {ep.name for ep in importlib.metadata.entry_points(group=PROJECT_NAME)}


def get_plugin_manager(load_entrypoints: bool = True) -> pluggy.PluginManager:
    """Create a plugin manager for one run.

    It knows every hook of :mod:`hookspecs.spec`, has the host's default implementations
    of the perform hooks registered (``mcgraph-host-defaults``), and, unless
    ``load_entrypoints`` is false, every plugin installed under the ``mcgraph``
    entry-point group except those named in ``MCGRAPH_BLOCK_PLUGINS``.

    :raises pluggy.PluginValidationError: if a loaded plugin implements an unknown hook
        or a hook with unknown arguments (``check_pending``).
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(spec)
    pm.register(host_defaults, name=HOST_DEFAULTS_NAME)
    if load_entrypoints:
        blocked = blocked_plugin_names()
        installed = _installed_entry_point_names()
        for name in blocked:
            pm.set_blocked(name)
            if name in installed:
                logger.info("plugin %r is blocked by %s", name, BLOCK_ENV_VAR)
            else:
                logger.warning(
                    "%s names %r, but no installed plugin has that name (installed: %s)",
                    BLOCK_ENV_VAR,
                    name,
                    ", ".join(sorted(installed)) or "none",
                )
        count = pm.load_setuptools_entrypoints(PROJECT_NAME)
        logger.debug("loaded %d plugin(s) from entry points", count)
    pm.check_pending()
    return pm
