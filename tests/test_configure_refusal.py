"""Which rank says a refusal made in configure (``runtime.configure_refusal``), against a
real ``TCPStore`` standing in for torchrun's agent store (the job tests in
``tests/test_talk_once.py`` run it under torchrun itself)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from cudagraph_plugin.runtime.configure_refusal import note_configure_speaker
from hookspecs import ConfigurationError


@pytest.fixture
def agent_env():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_RUN_ID": "run-a",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    del server


def said(env, run: int = 1) -> bool | None:
    error = ConfigurationError("1 problem(s)")
    note_configure_speaker(error, run, env)
    return error.said_here


def test_the_first_refusing_rank_says_it_and_no_other(agent_env):
    assert [said(agent_env) for _ in range(3)] == [True, False, False]
    # a restart of the job (torchrun's next attempt) counts afresh, and so does another run
    assert said({**agent_env, "TORCHELASTIC_RESTART_COUNT": "1"}) is True
    assert said({**agent_env, "TORCHELASTIC_RUN_ID": "run-b"}) is True
    # ... and the next run configured in the same process (a review: its refusal, counted
    # with the first run's, was said by no rank)
    assert [said(agent_env, run=2) for _ in range(2)] == [True, False]


def test_every_configured_run_of_the_process_is_counted_on_every_rank():
    from cudagraph_plugin.runtime.configure_refusal import configured

    first = configured()
    assert [configured(), configured()] == [first + 1, first + 2]


def test_a_speaker_already_chosen_is_kept(agent_env):
    error = ConfigurationError("x")
    error.said_here = False
    note_configure_speaker(error, 1, agent_env)
    assert error.said_here is False
    assert said(agent_env) is True  # (it did not count itself)


@pytest.mark.parametrize(
    "change",
    [
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},  # another launcher: rank 0 says it
        {"WORLD_SIZE": "1"},
        {"MASTER_PORT": "not-a-port"},
    ],
)
def test_outside_a_torchrun_job_of_several_ranks_nothing_is_decided(agent_env, change):
    assert said({**agent_env, **change}) is None
    assert said(agent_env) is True  # nothing was counted


def test_a_store_that_does_not_answer_leaves_this_rank_to_say_it(agent_env):
    """Said twice at worst rather than never: its count may land after the wait and
    silence every later rank (a review)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert said({**agent_env, "MASTER_PORT": str(port)}) is True


def test_a_hosts_refusal_is_counted_apart_and_said_by_every_rank_without_an_agent_store(
    agent_env,
):
    """``note_refusal_speaker`` (a host's own refusal of its arguments): counted under its
    own key (a configure refusal's count does not silence it). Under a launcher of several
    ranks without torchrun's store, every rank says it (a review: rank 1 alone refusing
    under such a launcher was said by nobody); one process leaves it as it was."""
    from cudagraph_plugin import note_refusal_speaker

    assert said(agent_env) is True  # (a configure refusal first)

    def host_said(env):
        return note_refusal_speaker(ConfigurationError("train_gpt.py: error: x"), env).said_here

    assert [host_said(agent_env), host_said(agent_env)] == [True, True]  # (one per refusal)
    assert host_said({"WORLD_SIZE": "2", "RANK": "1"}) is True
    assert host_said({}) is None and host_said({"WORLD_SIZE": "1"}) is None


@pytest.mark.parametrize(
    "kwargs, argv, where",
    [
        ({}, ["--x"], "(host --help lists the flags)\n"),
        # (review of 2026-12-06: the line named a --help the parser did not have)
        ({"add_help": False}, ["--x"], ""),
        ({"prefix_chars": "+"}, ["++x"], "(host ++help lists the flags)\n"),
    ],
    ids=["help", "no-help", "other-prefix"],
)
def test_a_job_parser_says_where_its_own_help_is(kwargs, argv, where, monkeypatch, capsys):
    from cudagraph_plugin import JobArgumentParser

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    parser = JobArgumentParser(prog="host", **kwargs)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"host: error: unrecognized arguments: {argv[0]}\n{where}"


def test_a_job_parser_refuses_a_list_of_problems_and_no_single_string(monkeypatch, capsys):
    from cudagraph_plugin import JobArgumentParser

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    parser = JobArgumentParser(prog="host")
    parser.refuse([])  # nothing to say: returns
    with pytest.raises(TypeError, match=r"refuse\(\['bad thing'\]\)"):
        parser.refuse("bad thing")  # (was: "9 problems", one per character)
    with pytest.raises(SystemExit) as exited:
        parser.refuse(("a is wrong", "b is wrong"))
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "host: error: 2 problems:\n  1. a is wrong\n  2. b is wrong\n"
        "(host --help lists the flags)\n"
    )
