"""Errors of the contract (a leaf: imports nothing).

:class:`ConfigurationError` is what a plugin raises when it refuses the run as configured
(its message lists every problem with its fix). A host catches it and hands it to
:func:`print_refusal`, which prints the message without a traceback, once per job, and
gives the exit status 2, as command-line tools do for bad usage.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class ConfigurationError(ValueError):
    """A plugin refuses the run as configured; the message lists every problem and its fix."""

    exit_code = 2


def print_refusal(error: ConfigurationError, stream: Any = None) -> int:
    """Say a refused configuration as a command-line tool does and return its exit status:
    the message alone (no traceback), printed once per job — by rank 0 of a launcher's job
    (``RANK``), every rank having the same to say — to ``stream`` (standard error)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=stream if stream is not None else sys.stderr, flush=True)
    return error.exit_code
