"""The entry-point module (group ``mcgraph``, name ``cudagraph``).

Stateless: it adds the command-line flags and, when a run is configured, validates the
configuration and registers a fresh :class:`~cudagraph_plugin.runtime.plugin.CudaGraphPlugin` for
that run on the run's plugin manager, with its
:class:`~cudagraph_plugin.runtime.plugin.OutermostHooks`.
"""

from __future__ import annotations

import argparse
from typing import Any

from cudagraph_plugin.cli.flags import add_cuda_graph_arguments
from cudagraph_plugin.runtime.configure_refusal import configured, note_configure_speaker
from cudagraph_plugin.runtime.plugin import CudaGraphPlugin, OutermostHooks
from hookspecs import ConfigurationError, hookimpl

RUN_PLUGIN_NAME = "cudagraph:CudaGraphPlugin"
"""The name the plugin manager gives the per-run plugin (``<plugin>:<ClassName>``): it is
registered without a name, so it counts as plugin ``cudagraph`` in error notes."""


@hookimpl
def mcgraph_add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cuda_graph_arguments(parser)


@hookimpl
def mcgraph_configure(config: Any, pluginmanager: Any) -> None:
    run = configured()
    try:
        plugin = CudaGraphPlugin.configure(config, pluginmanager)
    except ConfigurationError as refused:
        note_configure_speaker(refused, run)  # (which rank says it: no watch runs yet)
        raise
    try:
        if pluginmanager.register(plugin) is None:
            raise _half_blocked(RUN_PLUGIN_NAME)
    except BaseException:
        plugin.forget_log_filter()  # (a refused registration: no shutdown will)
        raise
    try:
        # (kept outermost: see its docstring)
        if pluginmanager.register(OutermostHooks(plugin)) is None:
            raise _half_blocked("cudagraph:OutermostHooks")
    except BaseException:
        pluginmanager.unregister(plugin)
        plugin.forget_log_filter()
        raise


def _half_blocked(name: str) -> ConfigurationError:
    """A registration the manager refused because ``name`` is blocked (``register``
    answers None): the run would have validated its flags, then ignored them."""
    return ConfigurationError(
        f"MCGRAPH_BLOCK_PLUGINS blocks {name!r}, a part of the CUDA graph plugin: the run "
        "would check its CUDA graph flags and then ignore them (no graphs, no report, no "
        "shutdown of its own). Fix: block 'cudagraph' to run without the plugin, or take "
        f"{name!r} out of MCGRAPH_BLOCK_PLUGINS"
    )
