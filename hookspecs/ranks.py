"""This process's place in a launcher's job, and the run's log lines that say it (a leaf:
imports nothing of the contract).

The contract runs before ``torch.distributed`` exists (configuration, a refusal) and never
imports torch, so it reads what the launcher set: ``RANK`` and ``WORLD_SIZE`` (torchrun,
the Slurm and MPI wrappers Megatron-LM's launchers use). In a job of several ranks a line
that one rank says about itself ("SIGTERM received ...") carries its rank, as the
plugin's own lines do (``cudagraph_plugin.runtime.ranklog``): N copies of a line without
it would not say whose each is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any


def launcher_rank() -> tuple[int, int]:
    """``(rank, world size)`` as the launcher set them: each 0 and 1 without a launcher, or
    where its value is not a whole number (a rank below 0 counts as 0, a size below 1 as 1;
    a bad size leaves a good rank as it is, so that rank 3 still does not speak for rank 0)."""
    return max(_whole("RANK", 0), 0), max(_whole("WORLD_SIZE", 1), 1)


def _whole(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def rank_tag() -> str:
    """``"[rank N] "`` in a job of several ranks, else nothing."""
    rank, world = launcher_rank()
    return f"[rank {rank}] " if world > 1 else ""


class RankTagged(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger whose lines begin with :func:`rank_tag` (read as each line is logged: a
    launcher's variables may be set after import, by a host that spawns its ranks)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"{rank_tag()}{msg}", kwargs
