"""megatron-cudagraph-plugin: CUDA graphs for any Megatron-Core training loop.

Public API (imported on first use, so ``import cudagraph_plugin`` stays cheap)::

    from cudagraph_plugin import check_config, CudaGraphConfigError

    result = check_config(cfg, te_version="2.12")   # changes nothing
    result.problems, result.autofixes, result.advice, result.notes

Modules (each owns one thing; ``grep`` for the name):

* ``settings``     — read the CUDA-graph settings from whatever config the host has, and
  normalise the values launchers pass (strings of numbers, booleans, lists, patterns).
* ``validation``   — every constraint, one error listing all violations with their fixes;
  the auto-fixes, planned without touching the config; the warm-up warning.
* ``preflight``    — environment facts (``NCCL_GRAPH_REGISTER`` with expandable segments).
* ``config_check`` — ``check_config()``: the side-effect-free verdict the run and ``check``
  share.
* ``cli``          — argparse flags and the performance-harness overrides.
* ``check``        — ``python -m cudagraph_plugin check``.
* ``compat``       — the only module that knows megatron-core / TE version differences.
* ``guard``        — the static-shape guard for captured graphs.
* ``report``       — eager-vs-replay timing, capture time, memory; the run report.
* ``plugin``       — the hook implementations: one small state machine per run.
* ``entry``        — the entry-point module that registers a plugin per run.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "check_config": "cudagraph_plugin.config_check",
    "ConfigCheck": "cudagraph_plugin.config_check",
    "CudaGraphConfigError": "cudagraph_plugin.validation",
    "Violation": "cudagraph_plugin.validation",
    "AutoFix": "cudagraph_plugin.validation",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cudagraph_plugin' has no attribute {name!r}")
