"""Which rank says a refusal made in ``mcgraph_configure``, where no peer watch runs yet,
or a host's own refusal of its command line (:func:`note_refusal_speaker`).

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

A host that checks its own arguments before the run (the example hosts' command-line
checks, whose problems may depend on the node: a missing Transformer Engine, no CUDA
device) has the same need: :func:`note_refusal_speaker` counts its refusal the same way,
under a key of its own. :class:`JobArgumentParser` is an ``argparse`` parser that says its
usage errors (and a host's list of problems) that way: in two lines, once per job, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from cudagraph_plugin.config.values import whole_number
from cudagraph_plugin.runtime.peer_mark import BoundedCall, first_line
from hookspecs import ConfigurationError, print_refusal

logger = logging.getLogger("cudagraph_plugin")

KEY = "mcgraph/configure_refused"
"""The store key counting the refusing ranks, per torchrun run, restart attempt and
configured run of the process."""

HOST_KEY = "mcgraph/host_refused"
"""The same for a host's own refusals (:func:`note_refusal_speaker`), per refusal of the
process."""

WAIT_S = 10.0
"""How long a refusing rank waits for the store's count (the ranks that do not say the
refusal wait 30 s before they exit: there is time)."""

_configured = 0
_host_refusals = 0


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
    _note_first(error, KEY, run, "configure-refusal", environ)


def note_refusal_speaker(
    error: ConfigurationError, environ: Mapping[str, str] | None = None
) -> ConfigurationError:
    """For a host that refuses its own command line or config before its run (its checks
    run on every rank, and some may fail on one node only): set ``error.said_here`` as for
    a configure refusal (the first rank of a torchrun job to refuse says it, once; where
    the store does not answer, this rank says it), so that ``hookspecs.print_refusal``
    says it once per job. Under another launcher of several ranks (no agent store to
    count in) every rank says it, with its rank: rank 0 alone would not say a refusal of
    one node's. Returns ``error``."""
    global _host_refusals
    _host_refusals += 1
    env = os.environ if environ is None else environ
    _note_first(error, HOST_KEY, _host_refusals, "host-refusal", env)
    if error.said_here is None and (whole_number(env.get("WORLD_SIZE")) or 1) > 1:
        error.said_here = True
    return error


class JobArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` for a host whose every rank parses the same command
    line. A usage error (an unknown flag, a value a flag refuses, a missing argument, a
    call of :meth:`error`) is said in two lines, ``prog: error: ...`` and where ``--help``
    lists the flags, instead of the usage of every flag (a plugin adds some twenty); an
    unknown flag close to one of this parser's own (not a subcommand's) gets the flag it
    likely means. It is said once per job, by the first rank to refuse
    (:func:`note_refusal_speaker`, ``hookspecs.print_refusal``), and the process exits
    with status 2. :meth:`refuse` says a host's own list of problems the same way. (As
    with argparse's own parser, ``exit_on_error=False`` turns only some errors into an
    ``ArgumentError`` to catch: unknown and missing arguments still come here.)"""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments: "):
            flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            for token in message.removeprefix("unrecognized arguments: ").split():
                close = difflib.get_close_matches(token.split("=")[0], flags, n=1, cutoff=0.8)
                if token.startswith("--") and close:
                    hint += f" ({token}: did you mean {close[0]}?)"
        self._exit_saying(message + hint)

    def refuse(self, problems: Sequence[str]) -> None:
        """Exit with status 2 saying every problem, once per job: one line for one, a
        numbered list for several. With no problem, return.

        :raises TypeError: for a single string (a list of its characters, otherwise)."""
        if isinstance(problems, str):
            raise TypeError(f"refuse() takes a list of problems: refuse([{problems!r}])")
        if not problems:
            return
        self._exit_saying(
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems:\n"
            + "\n".join(f"  {n}. {p}" for n, p in enumerate(problems, 1))
        )

    def _exit_saying(self, said: str) -> NoReturn:
        # where the parser's own help is, if it has one (add_help=False, prefix_chars="+")
        help_flag = next(
            (
                max(a.option_strings, key=len)
                for a in self._actions
                if isinstance(a, argparse._HelpAction) and a.option_strings
            ),
            None,
        )
        where = f"({self.prog} {help_flag} lists the flags)\n" if help_flag else ""
        text = f"{self.prog}: error: {said}\n{where}"
        sys.exit(print_refusal(note_refusal_speaker(ConfigurationError(text)), said=text))


def _note_first(
    error: ConfigurationError,
    key_prefix: str,
    count: int,
    what: str,
    environ: Mapping[str, str] | None,
) -> None:
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
    key = f"{key_prefix}/{env.get('TORCHELASTIC_RUN_ID', '')}/{attempt}/{count}"
    import torch.distributed as dist  # (outside the bounded wait: its first import is slow)

    def count_it() -> int:
        timeout = datetime.timedelta(seconds=WAIT_S)
        return dist.TCPStore(address, port, is_master=False, timeout=timeout).add(key, 1)

    call = BoundedCall(what, count_it)
    ended, interrupted = call.wait_through(WAIT_S)
    if ended and call.error is None:
        error.said_here = call.result == 1
    else:
        # its count may still land and silence the others: this rank says it
        error.said_here = True
        why = "no answer in time" if not ended else first_line(call.error)
        logger.debug("%s: the agent store did not count it (%s)", what, why)
    if interrupted is not None:
        raise interrupted
