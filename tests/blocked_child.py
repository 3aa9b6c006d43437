"""A child process whose main thread waits in C, and the SIGTERM sent to it there: the steps
shared by the tests of the run's stuck-signal watch (``test_hookspecs_stuck_signal.py``) and
of what takes the process's end over from it (``test_peer_deadline.py``). The child's script
prints ``blocking`` just before its wait (a store wait nothing answers)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping, Sequence


def start_blocked(command: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
    """Start ``command`` and return once its main thread is in the wait (its ``blocking``
    line read, half a second more); a child that never says it is killed."""
    proc = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env)
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "blocking"
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    time.sleep(0.5)  # (in the wait by now)
    return proc


def sigterm_and_wait(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """SIGTERM to ``proc``, then its remaining standard output and error once it ended
    (killed if it has not within ``timeout_s``: ``TimeoutExpired``)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
