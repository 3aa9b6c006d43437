"""Errors of the contract (imports only the leaves :mod:`hookspecs.reasons` and
:mod:`hookspecs.ranks`).

:class:`ConfigurationError` is what a plugin raises when it refuses the run as configured
(its message lists every problem with its fix). A host catches it and hands it to
:func:`print_refusal`, which prints the message without a traceback, once per job, and
gives the exit status 2, as command-line tools do for bad usage.

The endings a host says without a traceback (:data:`PLAIN_ENDINGS`: a refusal, another
rank's failure, a Ctrl-C) go to :func:`print_ending`, which hands each to its printer:
:func:`print_refusal`, :func:`print_peer_failure` or :func:`print_interrupted` (which says
the Ctrl-C and raises it again: it stops the host's callers too, and the process ends by
SIGINT).

Where a launcher asks its workers to say why they failed (torchrun's error file), what a
rank says of its ending is left there too (:func:`tell_launcher`), so that the launcher's
own summary of the failed job says it instead of "To enable traceback see ...": a told
rank's reason (naming the rank that failed), a pointer to a refusal from the rank that
says it (the silent ranks leave nothing), and a failure's traceback said where a signal
ends the process in its shutdown (:func:`say_ending`). A Ctrl-C leaves nothing: the
signal says it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any, NoReturn

from hookspecs.ranks import launcher_rank, rank_tag
from hookspecs.reasons import PeerFailed, PeerRefused, SignalReceived, refused_by

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
    error: ConfigurationError | PeerRefused,
    stream: Any = None,
    grace_s: float = REFUSAL_GRACE_S,
    said: str | None = None,
) -> int:
    """Say a refused configuration as a command-line tool does and return its exit status:
    the message alone (no traceback), printed once per job, to ``stream`` (standard error).
    The rank that says it is the one whose refusal was the job's first failure where a
    plugin watching the job found that out (``error.said_here``; a rank other than 0 names
    itself), else rank 0 of a launcher's job (``RANK``), every rank having the same to
    say. A :class:`~hookspecs.reasons.PeerRefused` (this rank was told of another rank's
    refusal) is said by that rank, never here. The plugin that refused is named on a line
    of its own where the run found it (the note ``raised by plugin ...``). ``said``: a
    host's own words for its refusal instead (``prog: error: ...``, as argparse says a
    usage error), this rank's tag first where it is not rank 0.

    The ranks that do not say it (``WORLD_SIZE`` > 1) return only after ``grace_s``
    seconds. A launcher that ends the whole job at the first worker that exits (torchrun)
    would otherwise stop the rank that says it, when it gets there a moment later, before
    it has said anything. That rank exits first and the launcher ends the waiting ranks, so
    a job under torchrun ends as soon as it has spoken. (The first refusing rank speaks
    itself rather than a told rank 0: over gloo a rank blocked in a collective is released
    only by its peer's exit, which an abort of its process group does not replace.)"""
    if not _say_refusal(error, stream, said) and launcher_rank()[1] > 1:
        try:
            time.sleep(grace_s)
        except KeyboardInterrupt as interrupt:  # (the job is being stopped: nothing to add)
            _end_quietly(interrupt)
    return error.exit_code


def _say_refusal(
    error: ConfigurationError | PeerRefused, stream: Any, said: str | None = None
) -> bool:
    """Print the refusal where this rank says it (:func:`speaker`); whether it did."""
    if not speaker(error):
        return False
    rank = launcher_rank()[0]
    _tell_launcher_refused(error)  # (first, as a told rank's: see _say_peer_failure)
    if said is not None:
        _write(stream, (f"[rank {rank}] " if rank != 0 else "") + said)
        return True
    said = refused_by(rank, str(error)) if rank != 0 else str(error)
    # which plugin refused (the note TrainingRun adds naming it), on a line of its own
    who = [n for n in getattr(error, "__notes__", ()) if n.startswith("raised by plugin ")]
    _write(stream, f"error: {said}\n" + "".join(f"  ({note})\n" for note in who))
    return True


def _tell_launcher_refused(error: ConfigurationError | PeerRefused) -> None:
    # the launcher's summary points at the refusal this rank said: printed there again, it
    # would not be said once per job
    tell_launcher(
        f"{type(error).__name__}: the run was refused as configured; its problems and fixes "
        "are printed on this rank's standard error (once for the job, without a traceback)"
    )


def write_stderr(message: str) -> None:
    """One write to standard error's descriptor, nothing raised: from a signal handler, or
    a thread that then ends the process (no Python stream, its lock or its buffer)."""
    try:
        os.write(2, message.encode())
    except OSError:
        pass


LAUNCHER_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""The variable in which a launcher names the file where a worker says why it failed
(torchrun sets it for each worker)."""


def tell_launcher(message: str, detail: str | None = None) -> bool:
    """Leave ``message`` and its ``detail`` (a traceback; else the message itself) in the
    file a launcher gave this worker to say why it failed (:data:`LAUNCHER_ERROR_FILE`),
    where it gave one; whether it did. The format is the one torch's
    ``torch.distributed.elastic`` ``ErrorHandler.record_exception`` writes (what its
    ``record`` decorator leaves for an exception that reaches the top): torchrun reads it
    for each failed worker and prints ``detail`` as that worker's entry in its summary of
    the failed job, the entry with the earliest time as the job's root cause; without the
    file an entry says only "To enable traceback see ..." (or the signal that ended it).

    The file appears whole or not at all (written aside, then renamed over it): the process
    is ending, and a launcher's SIGTERM, a Ctrl-C or the run's exit deadline may end it
    mid-write, where a file cut short would stop torchrun's own report of the failed job (it
    raises on an entry it cannot parse). A file that cannot be written is one line on
    standard error, nothing raised but an interrupt."""
    path = os.environ.get(LAUNCHER_ERROR_FILE)
    if not path:
        return False
    entry = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": message if detail is None else detail,
                "timestamp": str(int(time.time())),
            },
        }
    }
    aside = f"{path}.{os.getpid()}.part"
    try:
        with open(aside, "w") as out:
            out.write(json.dumps(entry))
        os.replace(aside, path)
    except (OSError, ValueError) as unwritten:
        _remove(aside)
        write_stderr(f"{rank_tag()}the launcher's error file {path} was not written: {unwritten}\n")
        return False
    except BaseException:
        _remove(aside)
        raise
    return True


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write(stream: Any, text: str) -> None:
    """One write, flushed: print() writes a line and its newline apart, and on an unbuffered
    stream (PYTHONUNBUFFERED) another process's log line can land between them."""
    out = stream if stream is not None else sys.stderr
    out.write(text)
    out.flush()


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
    _say_peer_failure(error, stream)
    return error.exit_code


def _say_peer_failure(error: PeerFailed, stream: Any) -> None:
    said = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
    # the launcher's entry first: a line said is then never without it, whatever ends the
    # process next (torchrun's SIGTERM once the failing rank exited)
    tell_launcher(f"{type(error).__name__}: this rank's run ended because of another rank: {said}")
    _write(stream, f"{rank_tag()}run ended: {said}\n")


def speaker(error: BaseException) -> bool:
    """Whether this rank says ``error`` for the job: ``error.said_here`` where a plugin
    watching the job set it (True: this rank's failure was the job's first, or that is not
    known), else rank 0 of a launcher's job (``RANK``), every rank having the same to say."""
    said_here = getattr(error, "said_here", None)
    return said_here if said_here is not None else launcher_rank()[0] == 0


def print_interrupted(error: KeyboardInterrupt, stream: Any = None) -> NoReturn:
    """Say that a Ctrl-C (SIGINT, a ``KeyboardInterrupt``) ended the run, in one line
    without a traceback (``interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)``), to
    ``stream`` (standard error), and raise ``error`` again: a Ctrl-C stops the host's
    callers too (a script, a sweep calling ``main()`` in a loop). Where nothing catches
    it, Python's ``sys.excepthook`` (wrapped once, see :func:`_quiet_hook`) prints nothing
    for it and ends the process by SIGINT, so that a shell script running the job stops as
    well (Python's own death by SIGINT after an uncaught ``KeyboardInterrupt`` is lost
    once megatron-core or Transformer Engine is imported: exit status 1, seen on an H100).

    A Ctrl-C usually reaches every rank at once (torchrun passes the SIGINT it receives on
    to each worker): where a plugin watching the job found whose interrupt was the job's
    first failure (``error.said_here``, as for a refusal), that rank alone says it and the
    others end without a word. Where none did (the interrupt came before the run watched
    the job, or no such plugin is installed), every rank says it, each line with its rank:
    rank 0 alone could not say a Ctrl-C that reached one other rank only. A traceback
    would only show where the interrupt found each rank.

    A Ctrl-C held during the shutdown of a run that was ending otherwise (``TrainingRun``
    raises it once the shutdown ended, with that ending as ``error.run_ended_by``) says
    that ending instead: a told rank's line or a refusal the way their printers do
    (without the refusal's grace wait), and a failure (an ``Exception``) keeps its
    traceback (``error`` is raised as it is: the failure printed first, then the
    interrupt)."""
    ending = getattr(error, "run_ended_by", None)
    if isinstance(ending, Exception) and not isinstance(ending, PLAIN_ENDINGS):
        raise error  # (the failure's traceback, then the interrupt's)
    say_interrupted(error, stream)
    _end_quietly(error)


def say_interrupted(error: KeyboardInterrupt, stream: Any = None) -> None:
    """What :func:`print_interrupted` says for ``error``, without raising it: also said
    where a signal held during the shutdown ends the process before the host could say it
    (``hookspecs.run_signals``: torchrun's SIGTERM once another rank exited). Nothing for
    an interrupt held during the shutdown of a failure (its traceback says it)."""
    ending = getattr(error, "run_ended_by", None)
    if isinstance(ending, ConfigurationError | PeerRefused):
        _say_refusal(ending, stream)
    elif isinstance(ending, PeerFailed):
        _say_peer_failure(ending, stream)
    elif isinstance(ending, Exception):
        return
    elif getattr(_told_which(error), "said_here", None) is not False:
        _write(stream, f"{rank_tag()}interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)\n")


def say_ending_anyway(error: BaseException | None) -> None:
    """:func:`say_ending` where the process ends next, whatever happens: what saying it
    raises (a closed pipe, a second Ctrl-C) becomes one line on standard error's
    descriptor instead of stopping that end."""
    try:
        say_ending(error)
    except BaseException as unsaid:
        write_stderr(f"{rank_tag()}the run's ending could not be said: {unsaid!r}\n")


def say_ending(error: BaseException | None, stream: Any = None) -> None:
    """What the host (or Python, for a failure) would have said of the run's ending
    ``error``, said where a signal held during the run's shutdown ends the process first
    (``hookspecs.run_signals``: torchrun's SIGTERM, sent once another rank exited): a
    Ctrl-C's line (:func:`say_interrupted`), a told rank's ``run ended:`` line, a refusal
    by the rank that says it (without the grace wait of :func:`print_refusal`), and a
    failure's traceback, as ``sys.excepthook`` prints it (else the process would end
    without a word of why, on the very rank that failed), a ``SystemExit``'s message.
    Nothing for a run that completed or one ended by a handled signal (the signal says
    it)."""
    if error is None or isinstance(error, SignalReceived):
        return
    if isinstance(error, SystemExit):  # (as Python says it: a message, not a status)
        if error.code is not None and not isinstance(error.code, int):
            _write(stream, f"{error.code}\n")
        return
    if isinstance(error, KeyboardInterrupt):
        say_interrupted(error, stream)
    elif isinstance(error, ConfigurationError | PeerRefused):
        _say_refusal(error, stream)
    elif isinstance(error, PeerFailed):
        _say_peer_failure(error, stream)
    else:
        said = "".join(traceback.format_exception(error))
        _write(stream, said)
        tell_launcher(f"{type(error).__name__}: {error}", said)


def _told_which(error: KeyboardInterrupt) -> BaseException:
    """The interrupt a plugin told whether this rank says it (``said_here``): ``error``, or
    a first Ctrl-C it was raised while handling (a second Ctrl-C) where only that one was."""
    earlier = error.__context__
    if isinstance(earlier, KeyboardInterrupt) and getattr(error, "said_here", None) is None:
        return earlier
    return error


_SAID = "_mcgraph_said"
"""The mark of an interrupt already said (:func:`_quiet_hook` prints nothing for it)."""


def _end_quietly(error: BaseException) -> NoReturn:
    """Raise ``error`` on, marked as said, with :func:`_quiet_hook` in place."""
    setattr(error, _SAID, True)
    if sys.excepthook is not _quiet_hook:
        global _previous_excepthook
        _previous_excepthook = sys.excepthook
        sys.excepthook = _quiet_hook
    raise error


_previous_excepthook: Any = sys.__excepthook__


def _quiet_hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """``sys.excepthook`` once an interrupt was said: for that interrupt, reaching the top
    uncaught, end the process by SIGINT (logs flushed; Python's exit handlers do not run,
    as after the run's SIGTERM); in an interactive session, only print nothing. Anything
    else goes to the hook it replaced."""
    if not (isinstance(value, KeyboardInterrupt) and getattr(value, _SAID, False)):
        _previous_excepthook(kind, value, tb)
        return
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return
    end_by_signal(signal.SIGINT)


def end_by_signal(signum: int) -> NoReturn:
    """End the process by ``signum`` with its default action, as it would have ended
    without a Python handler (a shell sees the signal), logs and streams flushed first
    (Python's exit handlers do not run); where that action does not end it, as for the
    first process of a PID namespace (a container's ``python train.py``, whose own
    default-action signals the kernel drops), exit with status 128 + ``signum``, what a
    shell reports for that signal."""
    logging.shutdown()
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except (OSError, ValueError, AttributeError):  # (a closed pipe: end all the same)
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # (delivered to this thread before it returns)
    os._exit(128 + signum)


PLAIN_ENDINGS: tuple[type[BaseException], ...] = (ConfigurationError, PeerFailed, KeyboardInterrupt)
"""What a host catches around its run and hands to :func:`print_ending`: the endings said
without a traceback (a refusal, :class:`~hookspecs.reasons.PeerRefused` and
:class:`~hookspecs.reasons.PeerFailed` included, and a Ctrl-C). Anything else keeps its
traceback."""


def print_ending(error: BaseException, stream: Any = None) -> int:
    """Say one of :data:`PLAIN_ENDINGS` the way its printer does and return the exit status:
    a ``ConfigurationError`` or ``PeerRefused`` by :func:`print_refusal` (2), another
    ``PeerFailed`` by :func:`print_peer_failure` (1); a ``KeyboardInterrupt`` goes to
    :func:`print_interrupted`, which says it and raises it again (the process ends by
    SIGINT). ``TypeError`` for anything else: its traceback is what says it."""
    if isinstance(error, ConfigurationError):
        return print_refusal(error, stream)
    if isinstance(error, PeerFailed):  # (a PeerRefused goes on to print_refusal)
        return print_peer_failure(error, stream)
    if isinstance(error, KeyboardInterrupt):
        return print_interrupted(error, stream)
    raise TypeError(f"print_ending: {error!r} is not one of PLAIN_ENDINGS; re-raise it") from error


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
