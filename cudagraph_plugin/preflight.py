"""Environment preflight: the environment facts the CUDA-graph constraints name.

* ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF`` (or torch 2.9+'s
  ``PYTORCH_ALLOC_CONF``) needs ``NCCL_GRAPH_REGISTER=0``
  (megatron-core asserts it for TE graphs on every arch and for local graphs before
  sm_100). NCCL reads its environment when it initialises, so the variable is set when
  NCCL has not started yet (and the change is logged), otherwise the run fails with the fix.
* ``cuda_graph_impl=transformer_engine`` needs Transformer Engine's graph support.

:func:`inspect_environment` only looks (``check_config`` uses it); :func:`preflight`
also applies the change.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping

from cudagraph_plugin.settings import Settings
from cudagraph_plugin.validation import (
    EXPANDABLE,
    MCORE,
    AutoFix,
    CudaGraphConfigError,
    Violation,
    expandable_segments_source,
)

logger = logging.getLogger("cudagraph_plugin")

_NCCL_PHRASE = (
    MCORE,
    "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
)
TE_NOT_CHECKED = (
    "a run needs Transformer Engine (pip install 'megatron-cudagraph-plugin[te]'); not checked here"
)


def inspect_environment(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    nccl_initialized: bool | Callable[[], bool],
    te_available: bool | Callable[[], bool] | None,
) -> tuple[list[AutoFix], list[Violation], list[str]]:
    """The environment's auto-fixes, problems and notes for ``settings``; changes nothing.

    :param nccl_initialized: NCCL has already read its environment (or a query for it,
        asked only when it matters).
    :param te_available: Transformer Engine's graph support is usable (or a query, asked
        only for TE graphs); None: not known here.
    """
    fixes: list[AutoFix] = []
    violations: list[Violation] = []
    notes: list[str] = []
    if not settings.enabled:
        return fixes, violations, notes
    alloc_var = expandable_segments_source(environ)
    if alloc_var:
        register = environ.get("NCCL_GRAPH_REGISTER")
        if register is None and not _ask(nccl_initialized):
            fixes.append(
                AutoFix(
                    "NCCL_GRAPH_REGISTER",
                    "NCCL_GRAPH_REGISTER",
                    "0",
                    f"set NCCL_GRAPH_REGISTER=0: {alloc_var} has {EXPANDABLE} and "
                    "CUDA graphs are on (NCCL is not initialised yet, so it takes effect)",
                    environment=True,
                )
            )
        elif register is None:
            violations.append(
                Violation(
                    ("NCCL_GRAPH_REGISTER",),
                    "unset",
                    f"{alloc_var} has {EXPANDABLE}, so CUDA graphs need NCCL_GRAPH_REGISTER=0, "
                    "but NCCL is already initialised and has read its environment",
                    "export NCCL_GRAPH_REGISTER=0 before the process starts (or before "
                    "init_process_group), or drop expandable_segments:True",
                    (_NCCL_PHRASE,),
                )
            )
        elif register != "0":
            violations.append(
                Violation(
                    ("NCCL_GRAPH_REGISTER", alloc_var),
                    repr((register, environ[alloc_var])),
                    f"{alloc_var} has {EXPANDABLE}, so CUDA graphs need NCCL_GRAPH_REGISTER=0 "
                    "(NCCL's buffer registration otherwise makes illegal memory accesses)",
                    "export NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True",
                    (_NCCL_PHRASE,),
                )
            )
    if settings.impl == "transformer_engine":
        if te_available is None:
            notes.append(TE_NOT_CHECKED)
        elif not _ask(te_available):
            violations.append(
                Violation(
                    (settings.field("impl"),),
                    repr(settings.impl),
                    "Transformer Engine with its PyTorch part is not importable here",
                    "pip install 'megatron-cudagraph-plugin[te]', or use cuda_graph_impl=local "
                    "with scope full_iteration",
                    ((MCORE, "CUDA Graphs are not supported without TE"),),
                )
            )
    return fixes, violations, notes


def _ask(fact: bool | Callable[[], bool]) -> bool:
    return fact() if callable(fact) else fact


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
    fixes, violations, _ = inspect_environment(
        settings, env, nccl_initialized=nccl_initialized, te_available=te_available
    )
    if violations:
        raise CudaGraphConfigError(violations)
    for fix in fixes:
        if not dry_run:
            env[fix.path] = fix.value
        logger.warning("preflight: %s%s", "(dry run) would " if dry_run else "", fix.message)
    return [fix.message for fix in fixes]
