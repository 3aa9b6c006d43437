"""Errors of the contract (a leaf: imports nothing).

:class:`ConfigurationError` is what a plugin raises when it refuses the run as configured
(its message lists every problem with its fix). A host catches it and hands it to
:func:`print_refusal`, which prints the message without a traceback, once per job, and
gives the exit status 2, as command-line tools do for bad usage.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a leaf at run time
    from hookspecs.reasons import PeerRefused

# How long a rank other than 0 waits before it exits after a refusal (see print_refusal).
REFUSAL_GRACE_S = 30.0


class ConfigurationError(ValueError):
    """A plugin refuses the run as configured; the message lists every problem and its fix."""

    exit_code = 2


def print_refusal(
    error: ConfigurationError | PeerRefused, stream: Any = None, grace_s: float = REFUSAL_GRACE_S
) -> int:
    """Say a refused configuration as a command-line tool does and return its exit status:
    the message alone (no traceback), printed once per job — by rank 0 of a launcher's job
    (``RANK``), every rank having the same to say — to ``stream`` (standard error). A
    :class:`~hookspecs.reasons.PeerRefused` (rank 0 was told of another rank's refusal
    before it reached its own) says that rank's refusal, naming the rank.

    The other ranks of a job (``WORLD_SIZE`` > 1) return only after ``grace_s`` seconds. A
    launcher that ends the whole job at the first worker that exits (torchrun) would
    otherwise stop rank 0, when it reaches its refusal a moment later, before it has said
    anything. Rank 0 exits first and the launcher ends the waiting ranks, so a job under
    torchrun ends as soon as rank 0 has spoken."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=stream if stream is not None else sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(grace_s)
    return error.exit_code
