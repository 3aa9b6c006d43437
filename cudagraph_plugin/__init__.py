"""megatron-cudagraph-plugin: CUDA graphs for any Megatron-Core training loop.

Modules (each owns one thing; ``grep`` for the name):

* ``settings``   — read the CUDA-graph settings from whatever config the host has.
* ``validation`` — every constraint, one error listing all violations with their fixes.
* ``preflight``  — environment facts (``NCCL_GRAPH_REGISTER`` with expandable segments).
* ``cli``        — argparse flags and the performance-harness overrides.
* ``check``      — ``python -m cudagraph_plugin check``.
* ``compat``     — the only module that knows megatron-core / TE version differences.
* ``guard``      — the static-shape guard for captured graphs.
* ``report``     — eager-vs-replay timing, capture time, memory; the run report.
* ``plugin``     — the hook implementations: one small state machine per run.
* ``entry``      — the entry-point module that registers a plugin per run.
"""

from __future__ import annotations

__version__ = "0.1.0"
