"""How a log line of the plugin says whom it concerns.

A line that is the same on every rank of a job (configuration advice, an auto-fix, the RNG
tracker check, the warm-up warning) carries ``extra=JOB_WIDE``; in a multi-rank run rank 0
alone logs it, unless ``cuda_graph_log_all_ranks`` is on. Every other line concerns its own
rank and is prefixed with it there (``[rank 1] captured ...``), unless it names its rank
itself (``extra=RANK_NAMED``). The filter that does this
is :mod:`cudagraph_plugin.runtime.ranklog`; without it (a laptop, the ``check`` command) the
marker does nothing.
"""

from __future__ import annotations

LOGGER_NAME = "cudagraph_plugin"
JOB_WIDE = {"mcgraph_job_wide": True}
RANK_NAMED = {"mcgraph_rank_tagged": True}
"""A line that names its rank itself (``rank 1: ...``; the peer watch's, some logged after
the run's filter is gone): no ``[rank N]`` before it."""
