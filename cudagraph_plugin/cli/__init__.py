"""The command line: the CUDA-graph flags for any argparse parser (``flags``), the
performance-harness overrides (``overrides``) and ``python -m cudagraph_plugin check``
(``check``). Builds on ``config``.

The names below were importable from the old ``cudagraph_plugin.cli`` module and stay so.
"""

from __future__ import annotations

from cudagraph_plugin.cli.flags import (
    FLAG_DESTS,
    RawScopeAction,
    ScopeAction,
    add_cuda_graph_arguments,
    join_scope_tokens,
    parse_scope_arg,
)
from cudagraph_plugin.cli.overrides import apply_overrides

__all__ = [
    "FLAG_DESTS",
    "RawScopeAction",
    "ScopeAction",
    "add_cuda_graph_arguments",
    "apply_overrides",
    "join_scope_tokens",
    "parse_scope_arg",
]
