"""What a rank says of its ending is left where torchrun reads it (``hookspecs.errors``:
``tell_launcher``), read back with torch's own reader of that file (``ProcessFailure``) and
printed by torch's own summary of a failed job (``ChildFailedError.format_msg``): a told
rank's reason naming the rank that failed, a pointer to a refusal said once, a failure's
traceback said where a signal ends the process in its shutdown. Without it each entry of
torchrun's summary said only "To enable traceback see ..."."""

from __future__ import annotations

import io
import time
import types

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hookspecs import ConfigurationError, PeerFailed, PeerRefused, errors

NO_FILE = "To enable traceback see"


@pytest.fixture
def error_file(tmp_path, monkeypatch):
    """Rank 0 of a 2-rank torchrun job, whose error file is ``tmp_path/error.json``."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "error.json"
    monkeypatch.setenv(errors.LAUNCHER_ERROR_FILE, str(path))
    return path


def summary(path, exitcode: int = 1) -> tuple[ProcessFailure, str]:
    """torch's reading of the worker's error file, and its entry in torchrun's summary."""
    failure = ProcessFailure(local_rank=0, pid=7, exitcode=exitcode, error_file=str(path))
    return failure, ChildFailedError("train_gpt.py", {0: failure}).format_msg()


def test_a_told_rank_leaves_its_reason_naming_the_rank_that_failed(error_file) -> None:
    before = int(time.time())
    told = PeerFailed(1, "exception: RuntimeError: boom", "rank 1 (h, pid 9) failed: a\n  b")
    assert errors.print_peer_failure(told, stream=io.StringIO()) == 1
    failure, said = summary(error_file)
    reason = "rank 1 (h, pid 9) failed: a | b"  # (one line, as the rank says it)
    assert failure.message["message"] == (
        f"PeerFailed: this rank's run ended because of another rank: {reason}"
    )
    assert (
        f"traceback : PeerFailed: this rank's run ended because of another rank: {reason}" in said
    )
    assert NO_FILE not in said
    assert before <= failure.timestamp <= time.time()  # (torchrun's root cause: the earliest)


def test_the_rank_that_says_a_refusal_points_at_it_and_the_silent_ranks_leave_nothing(
    error_file,
) -> None:
    problems = "1 problem(s) with the CUDA graph configuration:\n  1. scope attn: fix it"
    assert errors.print_refusal(ConfigurationError(problems), stream=io.StringIO()) == 2
    _, said = summary(error_file, exitcode=2)
    assert "the run was refused as configured; its problems and fixes are printed on" in said
    assert "problem(s)" not in said  # (said once per job: not again in torchrun's summary)
    error_file.unlink()
    told = PeerRefused(1, "exception: ConfigurationError", refusal=problems)
    assert errors.print_refusal(told, stream=io.StringIO(), grace_s=0) == 2
    assert not error_file.exists()  # (rank 1 says it; this rank's entry stays torchrun's own)
    stream = io.StringIO()  # a host's own words for its refusal (argparse's usage error)
    errors.print_refusal(ConfigurationError("bad"), stream=stream, said="prog: error: bad\n")
    assert stream.getvalue() == "prog: error: bad\n"
    assert "refused as configured" in summary(error_file, exitcode=2)[1]


def test_a_failure_said_at_a_signal_in_its_shutdown_leaves_its_traceback(error_file) -> None:
    try:
        raise RuntimeError("boom at step 6")
    except RuntimeError as failed:
        error = failed
    stream = io.StringIO()
    errors.say_ending(error, stream=stream)
    failure, said = summary(error_file, exitcode=-15)
    assert failure.message["message"] == "RuntimeError: boom at step 6"
    assert "Traceback (most recent call last)" in said and "RuntimeError: boom at step 6" in said
    assert failure.message["extraInfo"]["py_callstack"] == stream.getvalue()
    assert "Signal 15" not in said


def test_nothing_is_written_without_a_launchers_file(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(errors.LAUNCHER_ERROR_FILE, raising=False)
    monkeypatch.chdir(tmp_path)
    assert errors.tell_launcher("x") is False
    errors.print_peer_failure(PeerFailed(1, "x", "rank 1 failed"), stream=io.StringIO())
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_cannot_be_written_is_one_line_and_the_ending_goes_on(
    error_file, monkeypatch, capfd
) -> None:
    monkeypatch.setenv(errors.LAUNCHER_ERROR_FILE, str(error_file.parent))  # (a directory)
    stream = io.StringIO()
    assert errors.print_peer_failure(PeerFailed(1, "x", "rank 1 failed"), stream=stream) == 1
    assert stream.getvalue() == "[rank 0] run ended: rank 1 failed\n"
    err = capfd.readouterr().err
    assert err.startswith(
        f"[rank 0] the launcher's error file {error_file.parent} was not written: "
    )
    assert err.count("\n") == 1


def test_an_interrupt_mid_write_leaves_the_file_whole(error_file, monkeypatch) -> None:
    """A launcher's SIGTERM, a Ctrl-C or the exit deadline may end the process while it
    writes: the entry written before stays whole (a file cut short stops torchrun's own
    report of the failed job: its reader raises on it), and nothing is left aside."""
    errors.print_peer_failure(PeerFailed(1, "x", "rank 1 failed first"), stream=io.StringIO())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(errors, "json", types.SimpleNamespace(dumps=interrupted))
    with pytest.raises(KeyboardInterrupt):
        errors.tell_launcher("RuntimeError: later")
    failure, _ = summary(error_file)
    assert failure.message["message"].endswith("rank 1 failed first")
    assert sorted(p.name for p in error_file.parent.iterdir()) == ["error.json"]
