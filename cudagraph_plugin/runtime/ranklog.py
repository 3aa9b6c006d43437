"""Talk once per job: the plugin's log lines in a multi-rank run.

:class:`RankFilter`, installed on the plugin's logger for the length of one run, lets rank
0 alone log the job-wide lines (``extra=JOB_WIDE``, see :mod:`cudagraph_plugin.config.logs`)
and prefixes every other line with its rank; where every rank logs them (``log_all_ranks``),
they carry the rank too, or N copies of a line would not say whose each is. The rank comes
from ``torch.distributed`` once it is initialised, before that from the launcher's
``RANK``/``WORLD_SIZE`` (torchrun sets them), so configuration lines are sorted too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

from cudagraph_plugin.config.logs import LOGGER_NAME, RANK_NAMED
from hookspecs.ranks import launcher_rank


def rank_and_world() -> tuple[int, int]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return launcher_rank()


class RankFilter(logging.Filter):
    def __init__(self, every_rank: bool) -> None:
        super().__init__()
        self.every_rank = every_rank

    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = rank_and_world()
        if world <= 1:
            return True
        if getattr(record, "mcgraph_job_wide", False) and not self.every_rank:
            return rank == 0
        # (a job-wide line logged by every rank carries its rank, as the others do)
        if not getattr(record, "mcgraph_rank_tagged", False):
            record.msg = f"[rank {rank}] {record.msg}"
            record.mcgraph_rank_tagged = True
        return True


class RankNamed(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The plugin's logger for lines that name their rank themselves (``rank 1: ...``, the
    peer watch's): :class:`RankFilter` puts no ``[rank N]`` before them. A caller's own
    ``extra`` is kept (a plain ``LoggerAdapter`` replaces it before Python 3.13)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger(LOGGER_NAME), RANK_NAMED)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        kwargs["extra"] = {**RANK_NAMED, **(kwargs.get("extra") or {})}
        return msg, kwargs


def install(every_rank: bool) -> RankFilter:
    log_filter = RankFilter(every_rank)
    logging.getLogger(LOGGER_NAME).addFilter(log_filter)
    return log_filter


def remove(log_filter: RankFilter) -> None:
    logging.getLogger(LOGGER_NAME).removeFilter(log_filter)
