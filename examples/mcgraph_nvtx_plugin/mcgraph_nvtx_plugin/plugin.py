"""The entry-point module (group ``mcgraph``, name ``nvtx``).

Stateless, like every module a plugin manager loads: it adds the command-line option and,
when a run is configured, registers a fresh :class:`~mcgraph_nvtx_plugin.tracer.RunTracer`
for that run on the run's plugin manager, so nothing carries over from one run to the next.
"""

from __future__ import annotations

import argparse
from typing import Any

from hookspecs import hookimpl
from mcgraph_nvtx_plugin.sink import REPORT_ENV_VAR
from mcgraph_nvtx_plugin.tracer import RunTracer

RUN_PLUGIN_NAME = "nvtx:RunTracer"
"""The name the plugin manager gives the per-run tracer, registered without a name: it
counts as plugin ``nvtx``, the name error notes, log lines and blocking use."""


@hookimpl
def mcgraph_add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NVTX ranges and report sink (mcgraph-nvtx-plugin)")
    group.add_argument(
        "--nvtx-report-jsonl",
        default=None,
        metavar="PATH",
        help=(
            "append the CUDA graph run report and this plugin's hook timeline to PATH as "
            f"JSON lines ({{rank}} expands to the rank; default: ${REPORT_ENV_VAR})"
        ),
    )


@hookimpl
def mcgraph_configure(config: Any, pluginmanager: Any) -> None:
    pluginmanager.register(RunTracer.from_config(config))
