"""The environment preflight: NCCL_GRAPH_REGISTER with expandable segments, TE presence."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace as NS

import pytest

from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.config.fixes import preflight
from cudagraph_plugin.config.settings import read_settings

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def settings(impl="local", scope="full_iteration"):
    return read_settings(NS(model=NS(cuda_graph_impl=impl, cuda_graph_scope=scope)))


def run(s, environ, *, nccl=False, te=True, dry_run=False):
    return preflight(
        s,
        environ=environ,
        nccl_initialized=lambda: nccl,
        te_available=lambda: te,
        dry_run=dry_run,
    )


def _records(caplog):
    return [r for r in caplog.records if r.name == "cudagraph_plugin"]


@pytest.mark.parametrize(
    "impl, scope", [("local", "full_iteration"), ("transformer_engine", "attn,mlp")]
)
def test_expandable_segments_without_nccl_sets_register_and_logs(caplog, impl, scope):
    env = dict(EXPANDABLE)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = run(settings(impl, scope), env)
    assert env == {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}
    assert len(changes) == 1 and changes[0].startswith("set NCCL_GRAPH_REGISTER=0: ")
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == f"preflight: {changes[0]}"


def test_expandable_segments_among_other_alloc_options():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    run(settings(), env)
    assert env["NCCL_GRAPH_REGISTER"] == "0"


def test_expandable_segments_with_nccl_initialised_is_an_error_with_the_fix():
    env = dict(EXPANDABLE)
    with pytest.raises(CudaGraphConfigError) as info:
        run(settings(), env, nccl=True)
    assert env == EXPANDABLE  # too late to set it: nothing changed
    (violation,) = info.value.violations
    assert violation.fields == ("NCCL_GRAPH_REGISTER",)
    message = str(info.value)
    assert "NCCL_GRAPH_REGISTER = unset: " in message
    assert "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access" in message
    assert "NCCL is already initialised" in message
    assert "fix: export NCCL_GRAPH_REGISTER=0 before the process starts" in message


def test_nccl_initialised_query_is_only_made_when_needed():
    calls = []

    def nccl():
        calls.append(1)
        return True

    preflight(settings(), environ={}, nccl_initialized=nccl, te_available=lambda: True)
    preflight(
        settings(),
        environ={**EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"},
        nccl_initialized=nccl,
        te_available=lambda: True,
    )
    assert calls == []


@pytest.mark.parametrize("value", ["1", "2", ""])
def test_register_other_than_zero_is_an_error(value):
    env = {**EXPANDABLE, "NCCL_GRAPH_REGISTER": value}
    with pytest.raises(CudaGraphConfigError) as info:
        run(settings(), env)
    assert env["NCCL_GRAPH_REGISTER"] == value
    (violation,) = info.value.violations
    assert violation.fields == ("NCCL_GRAPH_REGISTER", "PYTORCH_CUDA_ALLOC_CONF")
    assert repr(value) in violation.value and "expandable_segments:True" in violation.value
    message = str(info.value)
    assert "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access" in message
    assert "fix: export NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True" in message


@pytest.mark.parametrize("nccl", [False, True])
def test_register_zero_is_fine(caplog, nccl):
    env = {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}
    with caplog.at_level(logging.DEBUG, logger="cudagraph_plugin"):
        assert run(settings(), env, nccl=nccl) == []
    assert env == {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}
    assert _records(caplog) == []


@pytest.mark.parametrize(
    "env",
    [{}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, {"NCCL_GRAPH_REGISTER": "1"}],
)
def test_no_expandable_segments_nothing_to_do(caplog, env):
    before = dict(env)
    with caplog.at_level(logging.DEBUG, logger="cudagraph_plugin"):
        assert run(settings(), env, nccl=True) == []
    assert env == before
    assert _records(caplog) == []


@pytest.mark.parametrize("register", [None, "1"])
def test_graphs_off_nothing_to_do(register):
    env = dict(EXPANDABLE)
    if register is not None:
        env["NCCL_GRAPH_REGISTER"] = register
    before = dict(env)
    assert run(settings("none", []), env, nccl=True, te=False) == []
    assert env == before


def test_te_impl_without_te_is_an_error():
    with pytest.raises(CudaGraphConfigError) as info:
        run(settings("transformer_engine", "attn"), {}, te=False)
    (violation,) = info.value.violations
    assert violation.fields == ("model.cuda_graph_impl",)
    message = str(info.value)
    assert "model.cuda_graph_impl = 'transformer_engine': " in message
    assert "CUDA Graphs are not supported without TE" in message
    assert "fix: pip install 'megatron-cudagraph-plugin[te]'" in message


def test_te_impl_with_te_is_fine_and_local_does_not_need_te():
    assert run(settings("transformer_engine", "attn"), {}, te=True) == []
    assert run(settings("local", "full_iteration"), {}, te=False) == []


def test_all_environment_problems_reported_together():
    env = {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "1"}
    with pytest.raises(CudaGraphConfigError) as info:
        run(settings("transformer_engine", "attn"), env, te=False)
    assert len(info.value.violations) == 2
    assert str(info.value).startswith("2 problem(s)")


def test_dry_run_reports_but_does_not_modify_environ(caplog):
    env = dict(EXPANDABLE)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = run(settings(), env, dry_run=True)
    assert env == EXPANDABLE
    assert len(changes) == 1 and "NCCL_GRAPH_REGISTER=0" in changes[0]
    (record,) = _records(caplog)
    assert record.getMessage() == f"preflight: (dry run) would {changes[0]}"


def test_dry_run_still_raises():
    with pytest.raises(CudaGraphConfigError):
        run(settings(), dict(EXPANDABLE), nccl=True, dry_run=True)


def test_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # setenv first so that monkeypatch restores the original state (the preflight writes
    # os.environ itself).
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "placeholder")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")
    preflight(settings(), nccl_initialized=lambda: False, te_available=lambda: True)
    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"


# -- the real NCCL query --------------------------------------------------------------------------


def test_nccl_initialized_false_without_a_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert compat.nccl_initialized() is False


def test_nccl_initialized_false_with_a_gloo_process_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        assert compat.nccl_initialized() is False
        # The real query plugs straight into the preflight: the variable gets set.
        env = dict(EXPANDABLE)
        preflight(
            settings(),
            environ=env,
            nccl_initialized=compat.nccl_initialized,
            te_available=lambda: True,
        )
        assert env["NCCL_GRAPH_REGISTER"] == "0"
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
