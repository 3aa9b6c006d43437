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
        pluginmanager.register(plugin)
    except BaseException:
        plugin.forget_log_filter()  # (a refused registration: no shutdown will)
        raise
    try:
        pluginmanager.register(OutermostHooks(plugin))  # (kept outermost: see its docstring)
    except BaseException:
        pluginmanager.unregister(plugin)
        plugin.forget_log_filter()
        raise
