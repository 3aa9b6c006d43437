"""Which rank says a refusal made in ``mcgraph_configure``, where no peer watch runs yet.

A run refused in configure ends before the plugin is registered, so no watch of the job
(:mod:`~cudagraph_plugin.runtime.peers`) tells the ranks apart, and ``print_refusal`` lets
rank 0 say it. Where only some ranks refuse (a check of this machine's environment on one
node, say), rank 0 is not among them: it sits in its process-group set-up until the
launcher ends the job, and the refusal was never printed. Under torchrun the refusing ranks
count themselves in the agent's store, which every worker reaches before any process group
exists, and the first one says the refusal (``ConfigurationError.said_here``): once, however
many refuse. Elsewhere (another launcher, a store that does not answer in time) the error
is left as it was.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping

from cudagraph_plugin.runtime.peer_mark import STORE_WAIT_S, BoundedCall, first_line
from hookspecs import ConfigurationError

logger = logging.getLogger("cudagraph_plugin")

KEY = "mcgraph/configure_refused"
"""The store key counting the refusing ranks, per torchrun run and restart attempt."""


def note_configure_speaker(
    error: ConfigurationError, environ: Mapping[str, str] | None = None
) -> None:
    """Set ``error.said_here`` from the count of refusing ranks in torchrun's agent store:
    True for the first, False for the others; left as it was outside torchrun, in a job of
    one process, or where the store does not answer within ``STORE_WAIT_S``."""
    env = os.environ if environ is None else environ
    if error.said_here is not None or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        if int(env.get("WORLD_SIZE", "1")) < 2:
            return
        address, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return
    key = f"{KEY}/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def count() -> int:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=STORE_WAIT_S)
        return dist.TCPStore(address, port, is_master=False, timeout=timeout).add(key, 1)

    call = BoundedCall("configure-refusal", count)
    ended, interrupted = call.wait_through(STORE_WAIT_S)
    if ended and call.error is None:
        error.said_here = call.result == 1
    else:
        why = "no answer in time" if not ended else first_line(call.error)
        logger.debug("configure refusal: the agent store was not counted (%s)", why)
    if interrupted is not None:
        raise interrupted
