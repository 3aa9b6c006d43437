"""The job launcher (``tests/jobs.py``) on this machine's CPUs: exit codes and logs come
back, a timed-out torchrun job is ended whole (its workers live in their own sessions, so
killing torchrun alone would leave them running), an interrupted wait ends the job too, and
a process a job leaves behind is reported and killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jobs import _stat, job_pids, run_job, torchrun_command
from jobs import main as jobs_main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] in "ZX"


def test_a_job_that_ends_by_itself_reports_its_exit_code_and_logs(tmp_path: Path) -> None:
    code = "import sys; print('to stdout'); print('to stderr', file=sys.stderr); sys.exit(3)"
    result = run_job([sys.executable, "-c", code], log_dir=tmp_path, timeout_s=60, name="three")
    assert (result.rc, result.timed_out, result.signal) == (3, False, None)
    assert result.stdout.read_text() == "to stdout\n"
    assert result.stderr.read_text() == "to stderr\n"
    assert 0 < result.wall_s < 60
    assert result.leftovers == result.survivors == []
    assert "rc=3" in result.describe()


def test_the_tag_reaches_the_job_and_a_clean_job_passes(tmp_path: Path) -> None:
    code = "import os; print(os.environ['MCGRAPH_JOB_TAG'])"
    result = run_job([sys.executable, "-c", code], log_dir=tmp_path, timeout_s=60)
    assert result.rc == 0 and not result.timed_out
    assert result.stdout.read_text().strip() == result.tag
    assert job_pids(result.tag) == set()


def test_a_process_left_behind_is_reported_and_killed(tmp_path: Path) -> None:
    # The child escapes the parent links (own session, parent exits at once) but keeps the tag.
    code = textwrap.dedent(
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        print(child.pid)
        """
    )
    result = run_job([sys.executable, "-c", code], log_dir=tmp_path, timeout_s=60, linger_s=1)
    orphan = int(result.stdout.read_text())
    assert result.rc == 0 and not result.timed_out
    assert result.leftovers == [orphan]
    assert result.survivors == []
    assert gone(orphan)


HANGING_WORKER = textwrap.dedent(
    """
    import faulthandler, json, os, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank = os.environ["RANK"]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump({"pid": os.getpid(), "sid": os.getsid(0)}, out)
    while True:
        time.sleep(3600)
    """
)


@pytest.mark.slow
def test_a_hanging_torchrun_job_is_killed_whole_at_its_timeout(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANGING_WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = run_job(
        torchrun_command(2, script, str(ready)),
        log_dir=tmp_path / "logs",
        # long enough for torchrun and both workers to start on a loaded 2-core machine (at
        # 12 s, a clean-clone run beside a second test session once found no worker ready)
        timeout_s=20,
        env=env,
        name="hang",
        dump_signal=signal.SIGUSR1,
        dump_grace_s=1.0,
    )
    workers = [json.loads((ready / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert result.timed_out, result.describe() + "\n" + result.tail()
    assert result.signal in (signal.SIGKILL, signal.SIGUSR1)  # killed, or ended by the dump
    assert 20 <= result.wall_s < 28
    # The point of the tag: torchrun's workers are session leaders of their own sessions, so
    # neither killing torchrun nor its process group reaches them.
    for worker in workers:
        assert worker["sid"] == worker["pid"]
    assert all(gone(worker["pid"]) for worker in workers)
    assert result.survivors == [] and job_pids(result.tag) == set()
    # Before the kill, each worker was asked for its stack: where it hung is in the log.
    output = result.output()
    assert output.count("most recent call first") >= 2, output[-3000:]
    assert "hang.py" in output


class _Interrupt(BaseException):
    pass


def test_an_interrupted_wait_ends_the_job_before_the_interrupt_goes_on(tmp_path: Path) -> None:
    def interrupt(signum, frame):
        raise _Interrupt

    code = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(_Interrupt):
            run_job([sys.executable, "-c", code], log_dir=tmp_path, timeout_s=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pid = int((tmp_path / "stdout.log").read_text())
    assert gone(pid)


def test_torchrun_command_uses_this_python_and_a_free_port() -> None:
    command = torchrun_command(2, "x.py", "--a", "1")
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in command
    assert command[-3:] == ["x.py", "--a", "1"]


def test_a_driver_ends_what_is_left_of_the_jobs_it_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tags = tmp_path / "tags"
    monkeypatch.setenv("MCGRAPH_JOB_TAGS_FILE", str(tags))
    result = run_job([sys.executable, "-c", "pass"], log_dir=tmp_path, timeout_s=60)
    assert tags.read_text().split() == [result.tag]
    # as if the launcher had been killed outright: a tagged process nobody ended
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, "MCGRAPH_JOB_TAG": result.tag},
    )
    try:
        assert job_pids(result.tag) == {stray.pid}
        assert jobs_main(["--kill-tags", str(tags)]) == 0
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        stray.kill()
    assert f"processes left and killed: [{stray.pid}]" in capsys.readouterr().out
