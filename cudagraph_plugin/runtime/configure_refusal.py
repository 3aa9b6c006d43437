"""Which rank says a refusal made in ``mcgraph_configure``, where no peer watch runs yet.

A run refused in configure ends before the plugin is registered, so no watch of the job
(:mod:`~cudagraph_plugin.runtime.peers`) tells the ranks apart, and ``print_refusal`` lets
rank 0 say it. Where only some ranks refuse (a check of this machine's environment on one
node, say), rank 0 is not among them: it sits in its process-group set-up until the
launcher ends the job, and the refusal was never printed. Under torchrun the refusing ranks
count themselves in the agent's store, which every worker reaches before any process group
exists, and the first one says the refusal (``ConfigurationError.said_here``): once, however
many refuse. The count is kept per torchrun run, restart attempt and configured run of the
process (:func:`configured`: every rank configures each of its runs), so a second refused
run in one process is said too. Another launcher leaves the error as it was (rank 0 says
it); a store that does not answer in time makes this rank say it (twice at worst, rather
than never).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping

from cudagraph_plugin.runtime.peer_mark import BoundedCall, first_line
from hookspecs import ConfigurationError

logger = logging.getLogger("cudagraph_plugin")

KEY = "mcgraph/configure_refused"
"""The store key counting the refusing ranks, per torchrun run, restart attempt and
configured run of the process."""

WAIT_S = 10.0
"""How long a refusing rank waits for the store's count (the ranks that do not say the
refusal wait 30 s before they exit: there is time)."""

_configured = 0


def configured() -> int:
    """Count one more configured run in this process (``mcgraph_configure``, refused or
    not) and return the count: the same on every rank of a job whose ranks run the same
    host code."""
    global _configured
    _configured += 1
    return _configured


def note_configure_speaker(
    error: ConfigurationError, run: int, environ: Mapping[str, str] | None = None
) -> None:
    """Set ``error.said_here`` for the refusal of this process's ``run``-th configured run
    (:func:`configured`) from the count of refusing ranks in torchrun's agent store: True
    for the first, False for the others, True where the store does not answer within
    ``WAIT_S``; left as it was outside torchrun or in a job of one process."""
    env = os.environ if environ is None else environ
    if error.said_here is not None or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        if int(env.get("WORLD_SIZE", "1")) < 2:
            return
        address, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"{KEY}/{env.get('TORCHELASTIC_RUN_ID', '')}/{attempt}/{run}"
    import torch.distributed as dist  # (outside the bounded wait: its first import is slow)

    def count() -> int:
        timeout = datetime.timedelta(seconds=WAIT_S)
        return dist.TCPStore(address, port, is_master=False, timeout=timeout).add(key, 1)

    call = BoundedCall("configure-refusal", count)
    ended, interrupted = call.wait_through(WAIT_S)
    if ended and call.error is None:
        error.said_here = call.result == 1
    else:
        # its count may still land and silence the others: this rank says it
        error.said_here = True
        why = "no answer in time" if not ended else first_line(call.error)
        logger.debug("configure refusal: the agent store did not count it (%s)", why)
    if interrupted is not None:
        raise interrupted
