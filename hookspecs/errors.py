"""Errors of the contract (imports only the leaves :mod:`hookspecs.reasons` and
:mod:`hookspecs.ranks`).

:class:`ConfigurationError` is what a plugin raises when it refuses the run as configured
(its message lists every problem with its fix). A host catches it and hands it to
:func:`print_refusal`, which prints the message without a traceback, once per job, and
gives the exit status 2, as command-line tools do for bad usage.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from hookspecs.ranks import launcher_rank, rank_tag
from hookspecs.reasons import PeerFailed, PeerRefused, refused_by

# How long a rank that does not say a refusal waits before it exits (see print_refusal).
REFUSAL_GRACE_S = 30.0


class ConfigurationError(ValueError):
    """A plugin refuses the run as configured; the message lists every problem and its fix.

    ``said_here`` tells :func:`print_refusal` which rank of a multi-rank job says it:
    ``None`` (not known: rank 0 does, as every rank usually has the same to say), ``True``
    (this rank's refusal was the job's first failure, which a plugin watching the job
    found, or the plugin could not find out: this rank says it) or ``False`` (another rank
    refused first and says it). A plugin that tells the other ranks of a refusal with
    :class:`~hookspecs.reasons.PeerRefused` (which they do not say) sets it on the refusing
    rank's error, or nobody says it where that rank is not rank 0."""

    exit_code = 2
    said_here: bool | None = None


def print_refusal(
    error: ConfigurationError | PeerRefused, stream: Any = None, grace_s: float = REFUSAL_GRACE_S
) -> int:
    """Say a refused configuration as a command-line tool does and return its exit status:
    the message alone (no traceback), printed once per job, to ``stream`` (standard error).
    The rank that says it is the one whose refusal was the job's first failure where a
    plugin watching the job found that out (``error.said_here``; a rank other than 0 names
    itself), else rank 0 of a launcher's job (``RANK``), every rank having the same to
    say. A :class:`~hookspecs.reasons.PeerRefused` (this rank was told of another rank's
    refusal) is said by that rank, never here. The plugin that refused is named on a line
    of its own where the run found it (the note ``raised by plugin ...``).

    The ranks that do not say it (``WORLD_SIZE`` > 1) return only after ``grace_s``
    seconds. A launcher that ends the whole job at the first worker that exits (torchrun)
    would otherwise stop the rank that says it, when it gets there a moment later, before
    it has said anything. That rank exits first and the launcher ends the waiting ranks, so
    a job under torchrun ends as soon as it has spoken. (The first refusing rank speaks
    itself rather than a told rank 0: over gloo a rank blocked in a collective is released
    only by its peer's exit, which an abort of its process group does not replace.)"""
    rank, world_size = launcher_rank()
    said_here = error.said_here if error.said_here is not None else rank == 0
    if said_here:
        said = refused_by(rank, str(error)) if rank != 0 else str(error)
        out = stream if stream is not None else sys.stderr
        # one write: print() writes the line and its newline apart, and on an unbuffered
        # stream (PYTHONUNBUFFERED) another process's log line can land between them
        # which plugin refused (the note TrainingRun adds naming it), on a line of its own
        who = [n for n in getattr(error, "__notes__", ()) if n.startswith("raised by plugin ")]
        out.write(f"error: {said}\n" + "".join(f"  ({note})\n" for note in who))
        out.flush()
    elif world_size > 1:
        time.sleep(grace_s)
    return error.exit_code


def print_peer_failure(error: PeerFailed, stream: Any = None) -> int:
    """Say that this rank ended its run because another rank failed first, in one line
    without a traceback (``[rank N] run ended: rank M ... failed: ...``), to ``stream``
    (standard error), and return its exit status (1). A :class:`PeerRefused` goes to
    :func:`print_refusal` (its refusal said once per job, exit status 2).

    The rank that failed says why, with its own traceback; a told rank's traceback would
    only show where the interrupt found it, once per rank: on a large job, N-1 of them
    burying the one that matters."""
    if isinstance(error, PeerRefused):
        return print_refusal(error, stream)
    out = stream if stream is not None else sys.stderr
    said = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
    out.write(f"{rank_tag()}run ended: {said}\n")  # (one line, one write: see print_refusal)
    out.flush()
    return error.exit_code


def traceback_without(error: BaseException, original: BaseException) -> str:
    """``error``'s traceback with its own causes and contexts, each link back to
    ``original`` cut (``original`` goes on to the host, which prints it: logged here too,
    it would be printed twice)."""
    cut: list[tuple[BaseException, str]] = []
    link: BaseException | None = error
    seen: set[int] = set()
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        for attr in ("__cause__", "__context__"):
            if getattr(link, attr) is original:
                cut.append((link, attr))
                setattr(link, attr, None)
        link = link.__cause__ or link.__context__
    try:
        return "".join(traceback.format_exception(error)).rstrip()
    finally:
        for link, attr in cut:
            setattr(link, attr, original)
