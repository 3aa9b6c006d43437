"""Talk once per job (issue 22): job-wide lines from rank 0 alone, rank-specific lines with
their rank, every rank on request; a refused configuration printed once, without a
traceback, exit status 2. The filter itself in-process; the example host as users run it,
one and two ranks (torchrun over gloo) on the CPU."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from cudagraph_plugin.config.logs import JOB_WIDE, LOGGER_NAME
from cudagraph_plugin.runtime import ranklog
from jobs import run_job, torchrun_command

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
FULL = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]


@pytest.fixture
def records():
    """The plugin logger's records that passed its filters."""
    logger = logging.getLogger(LOGGER_NAME)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)  # through setLevel: it clears the logger's level cache
    yield seen
    logger.setLevel(level)
    logger.removeHandler(handler)


def _log_both(every_rank: bool) -> None:
    log_filter = ranklog.install(every_rank=every_rank)
    try:
        logger = logging.getLogger(LOGGER_NAME)
        logger.warning("advice: the same everywhere", extra=JOB_WIDE)
        logger.info("captured %d graph(s)", 1)
    finally:
        ranklog.remove(log_filter)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_rank_0_alone_says_job_wide_lines_and_every_rank_tags_its_own(records, monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _log_both(every_rank=False)
    said = [record.getMessage() for record in records]
    expected = [f"[rank {rank}] captured 1 graph(s)"]
    assert said == (["advice: the same everywhere", *expected] if rank == "0" else expected)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_rank_says_job_wide_lines_on_request_each_with_its_rank(records, monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _log_both(every_rank=True)
    assert [r.getMessage() for r in records] == [
        f"[rank {rank}] advice: the same everywhere",
        f"[rank {rank}] captured 1 graph(s)",
    ]


def test_one_process_is_left_as_it_was(records, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _log_both(every_rank=False)
    assert [r.getMessage() for r in records] == [
        "advice: the same everywhere",
        "captured 1 graph(s)",
    ]


@pytest.mark.parametrize("fails", ["construction", "registration"])
def test_a_plugin_refused_after_its_configuration_leaves_no_rank_filter(monkeypatch, fails):
    """The rank filter goes on the logger when the configuration is checked; a plugin that
    then fails to be made or registered never runs, so no shutdown takes it off (third
    review: it stayed on the logger, into the next run of the process)."""
    from cudagraph_plugin import compat, entry
    from cudagraph_plugin.runtime import job_watch

    monkeypatch.setattr(compat, "cuda_available", lambda: False)
    logger = logging.getLogger(LOGGER_NAME)
    before = list(logger.filters)

    class RefusingManager:  # pluggy's PluginManager.register(plugin, name=None), refusing
        def register(self, plugin, name=None):
            raise ValueError("Plugin name already registered: cudagraph")

    def broken_watch(state):
        raise RuntimeError("the job watch could not be made")

    if fails == "construction":
        monkeypatch.setattr(job_watch, "JobWatch", broken_watch)
    with pytest.raises((RuntimeError, ValueError)):
        entry.mcgraph_configure(config={}, pluginmanager=RefusingManager())
    assert logger.filters == before


@pytest.mark.parametrize(
    "rank,world_size,said_here,said,waited",
    [
        ("0", "2", None, "error: 1 problem(s): scope attn", []),
        ("1", "2", None, "", [7.5]),
        ("1", "1", None, "", []),
        (None, None, None, "error: 1 problem(s): scope attn", []),
        # a plugin watching the job found whose refusal came first (issue 22)
        ("1", "2", True, "error: rank 1 refused the run: 1 problem(s): scope attn", []),
        ("0", "2", False, "", [7.5]),
    ],
)
def test_print_refusal_one_rank_says_it_and_the_other_ranks_wait_before_exiting(
    monkeypatch, capsys, rank, world_size, said_here, said, waited
):
    from hookspecs import errors

    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    slept: list[float] = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    refused = errors.ConfigurationError("1 problem(s): scope attn needs impl transformer_engine")
    refused.said_here = said_here
    assert errors.print_refusal(refused, grace_s=7.5) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and (err != "") is bool(said), err
    assert slept == waited
    assert errors.REFUSAL_GRACE_S >= 10  # a loaded machine starts ranks seconds apart


@pytest.fixture
def job_env(subprocess_env):
    return {**subprocess_env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow
def test_a_two_rank_run_says_each_job_wide_line_once(tmp_path, job_env):
    # 3 steps with the default warm-up of 3: the warm-up warning is a job-wide line too
    command = torchrun_command(2, EXAMPLE, *FULL, "--train-iters", "3", "--log-interval", "0")
    job = run_job(command, log_dir=tmp_path, timeout_s=180, env=job_env, name="talk-once")
    output = job.output()
    assert job.rc == 0 and not job.leftovers, job.tail()
    for line in (
        "mcgraph plugins: cudagraph",
        "CUDA graphs need a CUDA device and none is available",
        "the capture step 3 (start_step + warm-up) is never reached",
        "CUDA graph report (rank 0 of 2)",
    ):
        assert output.count(line) == 1, (line, job.tail())
    for rank in (0, 1):
        assert output.count(f"[rank {rank}] shutdown (completed)") == 1, job.tail()
    assert "advice:" not in output  # the demo's own default does not warn against itself


@pytest.mark.slow
def test_a_refused_configuration_is_said_once_without_a_traceback(tmp_path, job_env):
    bad = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "--train-iters", "3"]
    one = run_job(
        [sys.executable, str(EXAMPLE), *bad], log_dir=tmp_path / "one", timeout_s=120, env=job_env
    )
    assert one.rc == 2, one.tail()
    assert "Traceback" not in one.output()
    assert one.output().count("1 problem(s) with the CUDA graph configuration") == 1
    assert "fix: use cuda_graph_impl=transformer_engine for per-layer scopes" in one.output()
    two = run_job(
        torchrun_command(2, EXAMPLE, *bad), log_dir=tmp_path / "two", timeout_s=180, env=job_env
    )
    assert two.rc != 0 and not two.leftovers, two.tail()
    assert two.output().count("1 problem(s) with the CUDA graph configuration") == 1, two.tail()
    assert "exitcode  : 2" in two.output()  # torchrun's summary of the failed workers


def _rank_1_job(tmp_path, job_env, name: str, rank_1: str, *argv: str):
    """A torchrun job of 2 ranks of the example whose rank 1 runs ``rank_1`` (Python) at
    start-up (a ``sitecustomize``)."""
    start = tmp_path / name
    start.mkdir()
    (start / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '1':\n" + rank_1
    )
    paths = [str(start), *filter(None, [job_env.get("PYTHONPATH")])]
    env = {**job_env, "PYTHONPATH": os.pathsep.join(paths)}
    return run_job(
        torchrun_command(2, EXAMPLE, *argv), log_dir=tmp_path / f"{name}-job", timeout_s=180,
        env=env,
    )  # fmt: skip


def _said_once_by_one_worker(job, *said: str) -> None:
    """The refusal said once, in one of the forms ``said``, by one worker, no traceback."""
    output = job.output()
    assert job.rc != 0 and not job.leftovers, job.tail()
    assert output.count("1 problem(s) with the CUDA graph configuration") == 1, job.tail()
    assert sum(output.count(form) for form in said) == 1, job.tail()
    # the one traceback is torchrun's own ChildFailedError; none from a worker
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.tail()
    assert "pluggy" not in output and 'train_gpt.py", line' not in output, job.tail()
    assert "exitcode  : 2" in output, job.tail()
    # the speaker's entry there points at the refusal (it was "To enable traceback see ...")
    assert "the run was refused as configured; its problems and fixes are printed" in output, (
        job.tail()
    )


@pytest.mark.slow
def test_a_refusal_is_said_even_when_rank_0_gets_there_last(tmp_path, job_env):
    # torchrun ends the whole job at the first worker that exits non-zero. A rank with
    # nothing to print must not be that worker: the rank that says it would be stopped
    # before it says anything. Rank 0, slowed down by 3 s at start-up (as a loaded machine
    # does), mostly refuses last: the first to refuse (counted in torchrun's store) says it,
    # rank 1 then (naming itself), rank 0 on a machine that slowed rank 1 more.
    bad = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "--train-iters", "3"]
    job = _rank_1_job(
        tmp_path,
        job_env,
        "slow0",
        "    pass\nelif os.environ.get('RANK') == '0':\n    time.sleep(3)\n",
        *bad,
    )
    _said_once_by_one_worker(
        job, "error: rank 1 refused the run: 1 problem(s)", "error: 1 problem(s)"
    )


@pytest.mark.slow
def test_a_refusal_on_one_rank_alone_is_said_by_it(tmp_path, job_env):
    """Rank 1 alone refuses in configure (its environment differs); rank 0 goes on into its
    process-group set-up. The refusal was never printed: rank 1 left it to rank 0, which
    torchrun then ended (the configure refusal noticed and left on 2026-12-04)."""
    env_problem = (
        "    os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"
        "    os.environ['NCCL_GRAPH_REGISTER'] = '1'\n"
    )
    good = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    job = _rank_1_job(tmp_path, job_env, "env1", env_problem, *good, "--train-iters", "3")
    _said_once_by_one_worker(job, "error: rank 1 refused the run: 1 problem(s)")
    assert "fix: export NCCL_GRAPH_REGISTER=0" in job.output(), job.tail()


def test_print_refusal_writes_its_line_in_one_piece(monkeypatch):
    # On an unbuffered stream (PYTHONUNBUFFERED, as the GPU jobs run) each write is a
    # system call: print() wrote the line and its newline apart, so another rank's log
    # line sharing the stream could land between them and split the refusal's line.
    from hookspecs import errors

    class Unbuffered:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            self.writes.append("<flush>")

    monkeypatch.setenv("RANK", "0")
    stream = Unbuffered()
    errors.print_refusal(errors.ConfigurationError("scope attn: fix it"), stream=stream)
    assert stream.writes == ["error: scope attn: fix it\n", "<flush>"]


def test_a_refusal_names_the_plugin_that_refused_on_a_line_of_its_own(monkeypatch):
    """(review of 2026-12-05: a third-party plugin's refusal printed its message alone; the
    note naming the plugin, which the run adds, was dropped.)"""
    import io

    from hookspecs import ConfigurationError, TrainingRun, errors, get_plugin_manager, hookimpl

    class Refuses:
        @hookimpl
        def mcgraph_configure(self, config, pluginmanager):
            raise ConfigurationError("--cfgkw-dropout=1.5: must be in [0, 1); fix: lower it")

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Refuses(), name="cfgkw")
    with pytest.raises(ConfigurationError) as refused:
        with TrainingRun(pm, None, train_iters=1):
            pass
    monkeypatch.setenv("RANK", "0")
    stream = io.StringIO()
    assert errors.print_refusal(refused.value, stream=stream) == 2
    assert stream.getvalue() == (
        "error: --cfgkw-dropout=1.5: must be in [0, 1); fix: lower it\n"
        "  (raised by plugin 'cfgkw' in its mcgraph_configure implementation)\n"
    )


def test_a_told_rank_says_its_end_in_one_line_and_a_told_refusal_goes_to_print_refusal(
    monkeypatch,
):
    """(2026-12-05: over torchrun, each rank told of a peer's failure printed a full traceback
    of the interrupt that ended it, N-1 of them around the one of the rank that failed)"""
    import io

    from hookspecs import PeerFailed, PeerRefused, errors

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    stream = io.StringIO()
    told = PeerFailed(1, "exception: RuntimeError: boom", "rank 1 (h, pid 7) failed: boom")
    assert errors.print_peer_failure(told, stream=stream) == 1
    assert stream.getvalue() == "[rank 3] run ended: rank 1 (h, pid 7) failed: boom\n"
    stream = io.StringIO()  # (one line, whatever the message: a backend error's lines)
    errors.print_peer_failure(PeerFailed(1, "x", "rank 1 failed: a\n  b\n\n c"), stream=stream)
    assert stream.getvalue() == "[rank 3] run ended: rank 1 failed: a | b | c\n"
    stream = io.StringIO()
    slept: list[float] = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    refused = PeerRefused(1, "exception: ConfigurationError", refusal="scope attn: fix it")
    assert errors.print_peer_failure(refused, stream=stream) == 2
    assert stream.getvalue() == ""  # (the refusing rank says it, once)
    assert slept == [errors.REFUSAL_GRACE_S]  # (and this rank waits as a silent one does)


@pytest.fixture
def launcher(monkeypatch):
    """Set (or clear, with None) the launcher's RANK and WORLD_SIZE."""

    def set_ranks(rank: str | None, world_size: str | None) -> None:
        for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    return set_ranks


@pytest.fixture
def excepthook(monkeypatch):
    """sys.excepthook as it is now (a recording one), put back afterwards, with what the
    quiet hook would do to the process recorded instead (``killed``: the signals sent)."""
    from hookspecs import errors

    seen: list[BaseException] = []
    killed: list[int] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    monkeypatch.setattr(errors, "_previous_excepthook", errors._previous_excepthook)
    monkeypatch.setattr(errors, "end_by_signal", killed.append)
    monkeypatch.setattr(errors.logging, "shutdown", lambda: None)
    monkeypatch.delattr(sys, "ps1", raising=False)
    return seen, killed


LINE = "interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)\n"


@pytest.mark.parametrize(
    "rank,world_size,said_here,said",
    [
        # one process: it says it
        (None, None, None, LINE),
        # nobody found whose interrupt came first (before the run watched the job, or no
        # plugin that watches it): every rank says it, with its rank, as silence could hide
        # the one rank a Ctrl-C reached
        ("0", "4", None, "[rank 0] " + LINE),
        ("2", "4", None, "[rank 2] " + LINE),
        # a plugin watching the job found whose interrupt came first (issue 22)
        ("2", "4", True, "[rank 2] " + LINE),
        ("0", "4", False, ""),
    ],
)
def test_a_ctrl_c_is_said_in_one_line_and_raised_again_without_a_traceback(
    launcher, excepthook, rank, world_size, said_here, said
):
    """(2026-12-06: every rank printed a KeyboardInterrupt traceback through the loop and
    megatron-core, torchrun passing a Ctrl-C on to each worker.) The interrupt goes on (a
    Ctrl-C stops the host's callers too); reaching the top uncaught, Python's excepthook
    prints nothing for it and ends the process by SIGINT; it still prints anything else,
    another Ctrl-C not said included."""
    import io

    from hookspecs import errors

    seen, killed = excepthook
    launcher(rank, world_size)
    interrupt = KeyboardInterrupt()
    if said_here is not None:
        interrupt.said_here = said_here
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt) as info:
        errors.print_interrupted(interrupt, stream=stream)
    assert info.value is interrupt
    assert stream.getvalue() == said
    sys.excepthook(KeyboardInterrupt, interrupt, None)
    assert killed == [signal.SIGINT] and seen == []
    other, unsaid = RuntimeError("another"), KeyboardInterrupt()
    sys.excepthook(RuntimeError, other, None)
    sys.excepthook(KeyboardInterrupt, unsaid, None)
    assert seen == [other, unsaid] and killed == [signal.SIGINT]


def test_the_quiet_hook_is_installed_once_and_only_quiets_in_a_session(
    launcher, excepthook, monkeypatch
):
    """Several interrupts said in one process (a sweep that catches each) wrap the hook
    once, and keep no interrupt alive; in an interactive session the said interrupt is
    only not printed (the session goes on)."""
    import gc
    import io
    import weakref

    from hookspecs import errors

    seen, killed = excepthook
    launcher(None, None)

    class Interrupt(KeyboardInterrupt):  # (a built-in exception takes no weak reference)
        pass

    alive = []
    for _ in range(3):
        interrupt = Interrupt()
        with pytest.raises(KeyboardInterrupt):
            errors.print_interrupted(interrupt, stream=io.StringIO())
        alive.append(weakref.ref(interrupt))
        del interrupt
    gc.collect()
    assert sys.excepthook is errors._quiet_hook
    assert errors._previous_excepthook is not errors._quiet_hook  # (wrapped once)
    assert [ref() for ref in alive] == [None, None, None]
    said = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        errors.print_interrupted(said, stream=io.StringIO())
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    sys.excepthook(KeyboardInterrupt, said, None)
    assert killed == [] and seen == []


def test_a_ctrl_c_during_the_shutdown_of_a_failed_run_keeps_the_failures_traceback(
    launcher, excepthook
):
    """A Ctrl-C held during the shutdown of a run that raised, then acted on (TrainingRun
    raises it as its ``__exit__`` ends, the failure as its ``run_ended_by``): the failure is
    what matters, so the interrupt goes on as it is, its traceback (the failure's first)
    printed by Python (a review found "the real bug" said nowhere). A Ctrl-C raised in any
    other ``except`` block is still said in one line (argparse's, a retry's)."""
    import io

    from hookspecs import errors

    seen, killed = excepthook
    launcher("1", "2")
    stream = io.StringIO()
    interrupt = KeyboardInterrupt()
    interrupt.run_ended_by = RuntimeError("the real bug")
    with pytest.raises(KeyboardInterrupt) as info:
        errors.print_interrupted(interrupt, stream=stream)
    assert stream.getvalue() == ""
    sys.excepthook(KeyboardInterrupt, info.value, None)
    assert seen == [info.value] and killed == []  # (not quieted: Python prints both)
    with pytest.raises(KeyboardInterrupt):
        try:
            raise ValueError("argparse's own, or a retry's")
        except ValueError:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as plain:
                errors.print_interrupted(plain, stream=stream)
    assert stream.getvalue() == "[rank 1] " + LINE


def test_a_second_ctrl_c_keeps_the_first_ones_word_on_who_says_it(launcher, excepthook):
    """A second Ctrl-C raised while the first was handled: the plugin told the first one
    that another rank says it (``said_here`` False): the second is not said either."""
    import io

    from hookspecs import errors

    launcher("1", "2")
    stream = io.StringIO()
    first = KeyboardInterrupt()
    first.said_here = False
    with pytest.raises(KeyboardInterrupt):
        try:
            raise first
        except KeyboardInterrupt:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as second:
                errors.print_interrupted(second, stream=stream)
    assert stream.getvalue() == ""


def test_a_ctrl_c_during_a_told_ranks_or_a_refusals_shutdown_says_that_ending(
    launcher, excepthook, monkeypatch
):
    """A Ctrl-C held during the shutdown of a run that ended by a peer's failure or a
    refusal: the told line or the refusal is said (without the refusal's grace wait: the
    job is being stopped), and the interrupt goes on."""
    import io

    from hookspecs import ConfigurationError, PeerFailed, errors

    launcher("1", "2")
    monkeypatch.setattr(errors.time, "sleep", lambda s: pytest.fail("no grace wait"))
    told = PeerFailed(0, "exception", "rank 0 (h, pid 7) failed: boom")
    refused = ConfigurationError("scope attn: fix it")
    refused.said_here = True
    said = {
        told: "[rank 1] run ended: rank 0 (h, pid 7) failed: boom\n",
        refused: "error: rank 1 refused the run: scope attn: fix it\n",
    }
    for ending, line in said.items():
        stream = io.StringIO()
        interrupt = KeyboardInterrupt()
        interrupt.run_ended_by = ending
        with pytest.raises(KeyboardInterrupt):
            errors.print_interrupted(interrupt, stream=stream)
        assert stream.getvalue() == line, ending


def test_a_ctrl_c_during_the_refusals_grace_wait_ends_it_quietly(launcher, excepthook, monkeypatch):
    """(A review: a Ctrl-C while a silent rank waited out the refusal's grace printed a
    traceback ending in time.sleep.)"""
    import io

    from hookspecs import ConfigurationError, errors

    seen, killed = excepthook
    launcher("1", "2")

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(errors.time, "sleep", interrupted)
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt) as info:
        errors.print_refusal(ConfigurationError("scope attn: fix it"), stream=stream)
    assert stream.getvalue() == ""
    sys.excepthook(KeyboardInterrupt, info.value, None)
    assert killed == [signal.SIGINT] and seen == []


def test_print_ending_hands_each_plain_ending_to_its_printer(launcher, excepthook, monkeypatch):
    import io

    from hookspecs import (
        PLAIN_ENDINGS,
        ConfigurationError,
        PeerFailed,
        PeerRefused,
        SignalReceived,
        errors,
        print_ending,
    )

    launcher("0", "2")
    monkeypatch.setattr(errors.time, "sleep", lambda s: None)
    cases = [
        (ConfigurationError("scope attn: fix it"), 2, "error: scope attn: fix it\n"),
        (PeerRefused(1, "exception", refusal="scope attn: fix it"), 2, ""),
        (PeerFailed(1, "x", "rank 1 failed: boom"), 1, "[rank 0] run ended: rank 1 failed: boom\n"),
    ]
    for error, status, said in cases:
        assert isinstance(error, PLAIN_ENDINGS)
        stream = io.StringIO()
        assert print_ending(error, stream=stream) == status, error
        assert stream.getvalue() == said, error
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        print_ending(KeyboardInterrupt(), stream=stream)
    assert stream.getvalue() == "[rank 0] " + LINE
    # anything else keeps its traceback: the host re-raises it, never a made-up status
    for other in (RuntimeError("boom"), SignalReceived(15), SystemExit(3)):
        assert not isinstance(other, PLAIN_ENDINGS)
        with pytest.raises(TypeError, match="not one of PLAIN_ENDINGS"):
            print_ending(other, stream=io.StringIO())


@pytest.mark.parametrize("host", ["train_gpt", "rl_loop"])
def test_the_example_hosts_say_each_plain_ending_without_a_traceback(
    host, launcher, excepthook, monkeypatch, capsys
):
    """Each example host's ``main()`` hands a refusal, a peer's failure and a Ctrl-C to
    ``print_ending`` (anything else goes on with its traceback)."""
    import importlib

    from hookspecs import ConfigurationError, PeerFailed

    module = importlib.import_module(host)
    launcher("1", "2")
    refused = ConfigurationError("scope attn: fix it")
    refused.said_here = True
    said = {
        refused: (2, "error: rank 1 refused the run: scope attn: fix it\n"),
        PeerFailed(0, "x", "rank 0 failed: boom"): (1, "[rank 1] run ended: rank 0 failed: boom\n"),
        KeyboardInterrupt(): (None, "[rank 1] " + LINE),
        RuntimeError("a bug"): (None, ""),
    }
    for ending, (status, line) in said.items():

        def ends(*args, ending=ending, **kwargs):
            raise ending

        monkeypatch.setattr(module, "run", ends)
        if status is None:
            with pytest.raises(type(ending)) as info:
                module.main()
            assert info.value is ending
        else:
            assert module.main() == status
        assert capsys.readouterr().err == line, ending


@pytest.mark.slow
@pytest.mark.parametrize(
    "host, bad, said",
    [
        ("train_gpt.py", ["--loss-scale", "8", "--train-iters", "3"], "--loss-scale needs --fp16"),
        # (2026-12-06, second session: the guide's loop said argparse's errors, the plugin's
        # flags' among them, with the usage of every flag, on every rank)
        ("minimal_loop.py", ["--cuda-graph-scope", "atn"], "unknown scope(s) 'atn'"),
    ],
    ids=["train_gpt-own-check", "minimal_loop-plugin-flag"],
)
def test_the_hosts_own_refusal_is_said_once_per_job(host, bad, said, tmp_path, job_env):
    """(2026-12-06: the example's own checks of its command line, and argparse's errors,
    were said by every rank.) Both ranks refuse; the first counted in torchrun's store says
    it, in two lines (no usage); both exit 2; no traceback from a worker."""
    job = run_job(
        torchrun_command(2, EXAMPLE.with_name(host), *bad),
        log_dir=tmp_path / "two",
        timeout_s=180,
        env=job_env,
    )
    output = job.output()
    assert job.rc != 0 and not job.leftovers, job.tail()
    assert output.count(said) == 1, job.tail()
    assert output.count(f"{host} --help lists the flags") == 1, job.tail()
    assert "usage:" not in output, job.tail()
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.tail()
    assert "exitcode  : 2" in output, job.tail()


@pytest.mark.slow
def test_a_hosts_refusal_on_one_rank_alone_is_said_by_it(tmp_path, job_env):
    """Rank 1 alone refuses its command line (its environment says 3 ranks, so
    ``--tensor-model-parallel-size 2`` does not divide them); rank 0 goes on into its
    process-group set-up. Rank 1, the first (and only) to refuse, says it, naming itself."""
    job = _rank_1_job(
        tmp_path,
        job_env,
        "world1",
        "    os.environ['WORLD_SIZE'] = '3'\n",
        "--tensor-model-parallel-size", "2", "--train-iters", "3",
    )  # fmt: skip
    output = job.output()
    assert job.rc != 0 and not job.leftovers, job.tail()
    said = [line for line in output.splitlines() if "train_gpt.py: error:" in line]
    assert len(said) == 1 and said[0].startswith("[rank 1] train_gpt.py: error: "), job.tail()
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, job.tail()
