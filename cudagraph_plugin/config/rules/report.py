"""Rules on the run report: the JSON file (``cuda_graph_report_json``) is written at shutdown,
after the whole run, so a path it cannot be written to is refused before the run starts (the
permission bits, then the filesystem itself: a file opened, or created and removed, in the
nearest directory that exists)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cudagraph_plugin.config.environment import Environment
from cudagraph_plugin.config.errors import Note, Violation
from cudagraph_plugin.config.rules.base import rule, violation
from cudagraph_plugin.config.settings import Settings
from hookspecs.ranks import launcher_rank


def rank_path(path: str, rank: int) -> str:
    """Rank 0 writes ``path``; rank N writes ``<stem>.rankN<suffix>`` beside it."""
    if rank == 0:
        return path
    target = Path(path)
    return str(target.with_name(f"{target.stem}.rank{rank}{target.suffix}"))


def _why_unwritable(path: Path) -> str | None:
    """Why the report cannot be written to ``path`` here, or None. Missing directories are
    fine where they can be created (the report's writer creates them): the nearest existing
    one must be a writable directory."""
    try:
        return _why_not(path)
    except OSError as error:  # (a directory on the way that cannot be entered, a long name)
        return _reason(error)


def _why_not(path: Path) -> str | None:
    if path.is_symlink() and not path.exists():
        with contextlib.suppress(FileNotFoundError):
            path.stat()  # (a loop of links raises its reason, said as the refusal's)
        # a link to nothing: the report would go to its target, whose directory the writer
        # does not create (it creates the link's)
        target = Path(os.path.realpath(path))
        if not target.parent.is_dir():
            return f"it is a symbolic link to {str(target)!r}, whose directory does not exist"
        path = target
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        if not os.access(path, os.W_OK):
            return "the file exists and is not writable"
        return _open_for_writing(path)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():  # (the writer's mkdir would find it in the way)
            return f"{str(parent)!r} is a symbolic link to a directory that does not exist"
        parent = parent.parent
    if not parent.is_dir():
        return f"{str(parent)!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {str(parent)!r} is not writable"
    return _create_in(parent)


# os.access answers yes to root wherever the permission bits would let root write, also where
# the filesystem itself refuses (/proc, an NFS export that squashes root): the two probes
# below ask the filesystem, leaving nothing behind.


def _open_for_writing(path: Path) -> str | None:
    try:  # (no O_TRUNC: the file is left as it is; O_NONBLOCK: a FIFO without reader refuses)
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as error:
        return f"the file exists and cannot be opened for writing ({_reason(error)})"
    return None


def _reason(error: OSError) -> str:
    return error.strerror or repr(error)


def _create_in(directory: Path) -> str | None:
    try:
        handle, name = tempfile.mkstemp(prefix=".mcgraph-report-probe-", dir=directory)
    except OSError as error:
        return f"no file can be created in the directory {str(directory)!r} ({_reason(error)})"
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


@rule
def _report_json_writable(s: Settings, env: Environment) -> Iterator[Violation]:
    if not s.report_json:
        return
    if not env.paths_here:
        yield Note(
            f"{s.field('report_json')}={str(s.report_json)!r}: whether the run report can be "
            "written there is not checked here (the run's filesystem may not be mounted); the "
            "run checks it when it starts, before anything is built"
        )
        return
    rank = launcher_rank()[0]  # the path checked is the one this rank writes
    written = rank_path(str(s.report_json), rank)
    why = _why_unwritable(Path(written))
    if why is not None:
        where = "there" if rank == 0 else f"to {written!r}, rank {rank}'s own file"
        yield violation(
            s,
            ("report_json",),
            str(s.report_json),
            f"the run report cannot be written {where} ({why}); it is written at shutdown, "
            "so the run would fail after its last step",
            f"point {s.field('report_json')} at a file in a writable directory (missing "
            "directories are created), or drop it",
        )
