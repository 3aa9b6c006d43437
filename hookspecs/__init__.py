"""The contract between a Megatron-Core training loop (the host) and its plugins.

This package owns the hook specifications (``spec``), the plugin manager factory with
entry-point discovery and blocking (``manager``), the host's default implementations of the
"perform" hooks (``host_defaults``), and the host-side :class:`TrainingRun` helper that fires
the hooks in order and guarantees the shutdown hook on every exit path (``run``).

Leaf modules come first and nothing imports this package's ``__init__`` from inside it:
``markers`` (the name and pluggy markers), ``reasons`` (why a run ended), ``ranks`` (this
process's rank as its launcher set it) and ``run_args`` (the checks of ``TrainingRun``'s
arguments) import nothing of the contract; ``errors``
(:class:`ConfigurationError`) imports ``reasons`` and ``ranks``; ``spec`` and
``host_defaults`` import ``markers``; ``manager`` imports them; ``run`` imports ``manager``,
``reasons`` and ``run_args``.

It imports neither torch nor megatron at run time, so a plugin author can depend on it alone:
it is its own distribution, ``mcgraph-hookspecs`` (built by ``hookspecs/pyproject.toml``;
pluggy is its only dependency), and ``megatron-cudagraph-plugin`` depends on it. The run
report's public schema is ``report_schema``.

One name, ``mcgraph``, is the marker name, the hook prefix and the entry-point group.
"""

from __future__ import annotations

from hookspecs.answers import SettledKwargs
from hookspecs.errors import (
    PLAIN_ENDINGS,
    ConfigurationError,
    print_ending,
    print_interrupted,
    print_peer_failure,
    print_refusal,
)
from hookspecs.manager import (
    BLOCK_ENV_VAR,
    McgraphPluginManager,
    get_plugin_manager,
    plugin_name,
)
from hookspecs.markers import PROJECT_NAME, hookimpl, hookspec
from hookspecs.progress import StepProgress
from hookspecs.reasons import PeerFailed, PeerRefused, ShutdownReason, SignalReceived
from hookspecs.report_schema import REPORT_SCHEMA_VERSION, Report
from hookspecs.run import TrainingRun, call_hook, merge_kwargs

__version__ = "0.1.0"
"""The contract's version (the ``mcgraph-hookspecs`` distribution's): a hook or report change
that breaks plugins raises the minor version while it is 0.x."""

__all__ = [
    "BLOCK_ENV_VAR",
    "PLAIN_ENDINGS",
    "PROJECT_NAME",
    "REPORT_SCHEMA_VERSION",
    "ConfigurationError",
    "McgraphPluginManager",
    "PeerFailed",
    "PeerRefused",
    "Report",
    "SettledKwargs",
    "ShutdownReason",
    "SignalReceived",
    "StepProgress",
    "TrainingRun",
    "call_hook",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "merge_kwargs",
    "plugin_name",
    "print_ending",
    "print_interrupted",
    "print_peer_failure",
    "print_refusal",
]
