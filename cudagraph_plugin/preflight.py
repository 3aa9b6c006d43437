"""Environment preflight: the environment facts the CUDA-graph constraints name.

* ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF`` (or torch 2.9+'s
  ``PYTORCH_ALLOC_CONF``) needs ``NCCL_GRAPH_REGISTER=0``
  (megatron-core asserts it for TE graphs on every arch and for local graphs before
  sm_100). NCCL reads its environment when it initialises, so the variable is set here
  when NCCL has not started yet (and the change is logged), otherwise the run fails with
  the fix.
* ``cuda_graph_impl=transformer_engine`` needs Transformer Engine's graph support.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping

from cudagraph_plugin.settings import Settings
from cudagraph_plugin.validation import (
    EXPANDABLE,
    CudaGraphConfigError,
    Violation,
    expandable_segments_source,
)

logger = logging.getLogger("cudagraph_plugin")


def preflight(
    settings: Settings,
    *,
    environ: MutableMapping[str, str] | None = None,
    nccl_initialized: Callable[[], bool],
    te_available: Callable[[], bool],
    dry_run: bool = False,
) -> list[str]:
    """Check (and where safe, fix) the environment for ``settings``.

    :param environ: The environment to check and update (``os.environ`` by default).
    :param nccl_initialized: Tells whether NCCL has already read its environment.
    :param te_available: Tells whether Transformer Engine's graph support is usable.
    :param dry_run: Report what would be set without changing ``environ``.
    :returns: The changes made (or, with ``dry_run``, that would be made), each logged.
    :raises CudaGraphConfigError: listing every environment problem with its fix.
    """
    if not settings.enabled:
        return []
    env = os.environ if environ is None else environ
    changes: list[str] = []
    violations: list[Violation] = []
    alloc_var = expandable_segments_source(env)
    if alloc_var:
        register = env.get("NCCL_GRAPH_REGISTER")
        if register is None:
            if nccl_initialized():
                violations.append(
                    Violation(
                        ("NCCL_GRAPH_REGISTER",),
                        "unset",
                        "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using "
                        f"CUDA Graph with {alloc_var}={EXPANDABLE} is needed, but NCCL "
                        "is already initialised and has read its environment",
                        "export NCCL_GRAPH_REGISTER=0 before the process starts (or before "
                        "init_process_group), or drop expandable_segments:True",
                    )
                )
            else:
                if not dry_run:
                    env["NCCL_GRAPH_REGISTER"] = "0"
                changes.append(
                    f"set NCCL_GRAPH_REGISTER=0: {alloc_var} has {EXPANDABLE} and "
                    "CUDA graphs are on (NCCL is not initialised yet, so it takes effect)"
                )
        elif register != "0":
            violations.append(
                Violation(
                    ("NCCL_GRAPH_REGISTER", alloc_var),
                    repr((register, env[alloc_var])),
                    "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA "
                    f"Graph with {alloc_var}={EXPANDABLE}",
                    "export NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True",
                )
            )
    if settings.impl == "transformer_engine" and not te_available():
        violations.append(
            Violation(
                (settings.field("impl"),),
                repr(settings.impl),
                "CUDA Graphs are not supported without TE (Transformer Engine with its PyTorch "
                "part is not importable here)",
                "pip install 'megatron-cudagraph-plugin[te]', or use cuda_graph_impl=local with "
                "scope full_iteration",
            )
        )
    if violations:
        raise CudaGraphConfigError(violations)
    for change in changes:
        logger.warning("preflight: %s%s", "(dry run) would " if dry_run else "", change)
    return changes
