"""Launch one job (a whole process tree) with a wall-clock timeout, and leave nothing behind.

This module owns the launcher the subprocess tests use: :func:`run_job` starts a command
(``python examples/train_gpt.py ...`` or ``python -m torch.distributed.run --standalone
--nproc-per-node N ...``) with its output in files and returns a :class:`JobResult` (exit
code, wall seconds, whether it timed out, log paths).

Why not ``subprocess.run(timeout=...)``: torchrun starts its workers in their own sessions,
so killing torchrun (or its process group) leaves the workers running, holding GPUs and
spoiling every later measurement. Every job is therefore tagged: its environment carries
``MCGRAPH_JOB_TAG=<unique id>``, which every descendant inherits, and the job is ended by
killing every process whose ``/proc/<pid>/environ`` carries the tag, plus the descendants of
the job's first process found through ``/proc`` parent links (for a child that cleared its
environment). They are all stopped (``SIGSTOP``) before they are killed, so none can react
by starting another. After every job, ended by the timeout or not, the launcher looks for
tagged processes once more: any it finds are reported as ``leftovers`` (and killed), and
callers assert there are none. The same happens when the caller is interrupted while it
waits (Ctrl-C, a pytest timeout): the job is ended before the exception propagates.

Linux only (``/proc``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

TAG_VAR = "MCGRAPH_JOB_TAG"
TAGS_FILE_VAR = "MCGRAPH_JOB_TAGS_FILE"
"""If set, every job's tag is appended to this file, so that a driver can end what is left
even after the process that launched the jobs was killed (``python tests/jobs.py
--kill-tags FILE``)."""

# A process exits in a few steps: a process that just ended may still be listed for a moment.
_LINGER_S = 5.0
_KILL_DEADLINE_S = 15.0


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What one job did.

    :ivar rc: The exit code of the job's first process (negative: ended by that signal).
    :ivar wall_s: Seconds from the start until the first process ended (or was killed).
    :ivar timed_out: The job ran past its timeout and was killed.
    :ivar leftovers: Tagged processes still running after the job ended by itself, or after
        an interrupt or timeout killed it; each was killed (``survivors`` lists those that
        would not die).
    """

    name: str
    command: list[str]
    rc: int
    wall_s: float
    timed_out: bool
    stdout: Path
    stderr: Path
    tag: str
    leftovers: list[int]
    survivors: list[int]
    ended_at: float = 0.0
    """Wall-clock time (seconds since the epoch) when the job's first process ended."""

    @property
    def signal(self) -> int | None:
        """The signal that ended the job's first process, if one did."""
        return -self.rc if self.rc < 0 else None

    def output(self) -> str:
        return _read(self.stdout) + _read(self.stderr)

    def tail(self, chars: int = 3000) -> str:
        """The ends of both logs, for assertion messages."""
        return (
            f"--- {self.stdout} (tail) ---\n{_read(self.stdout)[-chars:]}\n"
            f"--- {self.stderr} (tail) ---\n{_read(self.stderr)[-chars:]}"
        )

    def describe(self) -> str:
        how = "TIMED OUT (killed)" if self.timed_out else f"rc={self.rc}"
        return f"job {self.name!r}: {how} after {self.wall_s:.1f} s: {' '.join(self.command)}"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# -------------------------------------------------------------------------------------------
# /proc
# -------------------------------------------------------------------------------------------


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return None
    # The command name (in parentheses) may contain anything, spaces and ')' included.
    fields = data[data.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def _carries_tag(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return needle in environ.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def _protected() -> set[int]:
    """This process and its ancestors: never ours to kill, whatever their environment."""
    protected, pid = set(), os.getpid()
    while pid > 1 and pid not in protected:
        protected.add(pid)
        stat = _stat(pid)
        if stat is None:
            break
        pid = stat[1]
    return protected


def job_pids(tag: str, root: int | None = None) -> set[int]:
    """Live processes of the job: those carrying the tag, and ``root``'s descendants.

    Zombies are left out: they hold no memory, device or port, and their parent (or init)
    reaps them.
    """
    needle = f"{TAG_VAR}={tag}".encode()
    protected = _protected()
    states: dict[int, tuple[str, int]] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            states[pid] = stat
    found = {pid for pid in states if pid not in protected and _carries_tag(pid, needle)}
    if root is not None and root in states:
        found.add(root)
        children: dict[int, list[int]] = {}
        for pid, (_, ppid) in states.items():
            children.setdefault(ppid, []).append(pid)
        stack = [root]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return {pid for pid in found - protected if states.get(pid, ("X",))[0] not in "ZX"}


def _signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def kill_job(tag: str, root: int | None = None, deadline_s: float = _KILL_DEADLINE_S) -> list[int]:
    """Stop, then kill, every process of the job until none is left; returns survivors."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = job_pids(tag, root)
        if not pids:
            return []
        if time.monotonic() > deadline:
            return sorted(pids)
        # Frozen first, so that none can start another process (or restart a worker) while
        # its relatives are being killed.
        _signal_all(pids, signal.SIGSTOP)
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.05)


def _wait_gone(tag: str, linger_s: float) -> set[int]:
    deadline = time.monotonic() + linger_s
    while (pids := job_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


# -------------------------------------------------------------------------------------------
# The launcher.
# -------------------------------------------------------------------------------------------


def run_job(
    command: Sequence[str],
    *,
    log_dir: Path,
    timeout_s: float,
    name: str = "job",
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    dump_signal: int | None = None,
    dump_grace_s: float = 2.0,
    linger_s: float = _LINGER_S,
) -> JobResult:
    """Run ``command`` as a tagged job; end the whole job on timeout or interrupt.

    :param log_dir: Where ``stdout.log`` and ``stderr.log`` go (created).
    :param timeout_s: Wall-clock limit; past it every process of the job is killed.
    :param env: The job's environment (``os.environ`` when ``None``), the tag added.
    :param dump_signal: Sent to every process of a timed-out job ``dump_grace_s`` before
        the kill, e.g. ``SIGUSR1`` where the job's processes registered ``faulthandler``
        for it: their stacks then show in the logs where they hung (a process without a
        handler for it, torchrun's agent for one, may end by it: it is being killed anyway).
    :param linger_s: How long processes may take to disappear after the job ended by
        itself before they count as leftovers.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError("jobs.run_job needs Linux (/proc)")
    log_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    job_env = dict(os.environ if env is None else env)
    job_env[TAG_VAR] = tag
    if os.environ.get(TAGS_FILE_VAR):
        with open(os.environ[TAGS_FILE_VAR], "a") as tags:
            tags.write(tag + "\n")
    stdout, stderr = log_dir / "stdout.log", log_dir / "stderr.log"
    timed_out = False
    survivors: list[int] = []
    leftovers: set[int] = set()
    start = time.monotonic()
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=job_env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
            ended_at = time.time()
            wall_s = time.monotonic() - start
        except subprocess.TimeoutExpired:
            wall_s = time.monotonic() - start
            timed_out = True
            if dump_signal is not None:
                _signal_all(job_pids(tag, proc.pid), dump_signal)
                time.sleep(dump_grace_s)
            survivors = kill_job(tag, proc.pid)
            rc = proc.wait()
            ended_at = time.time()
        except BaseException:
            # Interrupted while waiting: end the job, then let the interrupt through.
            kill_job(tag, proc.pid)
            proc.wait()
            raise
    if not timed_out:
        leftovers = _wait_gone(tag, linger_s)
        if leftovers:
            survivors = kill_job(tag)
    return JobResult(
        name=name,
        command=list(command),
        rc=rc,
        wall_s=wall_s,
        timed_out=timed_out,
        stdout=stdout,
        stderr=stderr,
        tag=tag,
        leftovers=sorted(leftovers),
        survivors=survivors,
        ended_at=ended_at,
    )


def torchrun_command(nproc: int, script: str | Path, *args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N script args`` with this Python.

    ``--standalone`` picks a free rendezvous port, so jobs can run side by side.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *args,
    ]


CPU_RANKS = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""What the environment of a job of gloo ranks on the CPU adds to this process's: no GPU
seen, one thread per rank (the ranks share the machine's cores), output unbuffered."""


def run_cpu_ranks(
    nproc: int, script: str | Path, *args: str, log_dir: Path, name: str, timeout_s: float
) -> JobResult:
    """``script args`` under torchrun as ``nproc`` gloo ranks on the CPU (:data:`CPU_RANKS`);
    on a timeout every rank's stacks are dumped (``SIGUSR1``, where the script registered
    ``faulthandler`` for it) before the kill. Asserts the job ended by itself with status 0
    and left no process."""
    result = run_job(
        torchrun_command(nproc, script, *args),
        log_dir=log_dir,
        timeout_s=timeout_s,
        name=name,
        env={**os.environ, **CPU_RANKS},
        dump_signal=signal.SIGUSR1,
    )
    assert not result.timed_out and result.rc == 0, f"{result.describe()}\n{result.tail()}"
    assert result.leftovers == []
    return result


def first_failure(status: int, local_rank: int) -> str:
    """What torchrun logs of the first worker it saw fail (``failed (exitcode: 2)
    local_rank: 1 (pid: ...) of binary: ...``): which rank ended the job, and how."""
    return f"failed (exitcode: {status}) local_rank: {local_rank}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/jobs.py --kill-tags FILE``: kill what is left of the jobs listed."""
    import argparse

    parser = argparse.ArgumentParser(description="End what is left of tagged jobs.")
    parser.add_argument("--kill-tags", type=Path, required=True, help="one job tag per line")
    args = parser.parse_args(argv)
    tags = args.kill_tags.read_text().split() if args.kill_tags.exists() else []
    left = {tag: sorted(job_pids(tag)) for tag in tags}
    survivors = [pid for tag in tags if left[tag] for pid in kill_job(tag)]
    killed = sorted(pid for pids in left.values() for pid in pids)
    print(f"jobs: {len(tags)}; processes left and killed: {killed or 'none'}", end="")
    print(f"; would not die: {survivors}" if survivors else "")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
