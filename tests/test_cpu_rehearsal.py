"""Without a CUDA device a run that asked for graphs captures nothing, but the checks of the
loop that need no device still run, so that a loop wired on a laptop learns there what its
first GPU run would refuse (user trials of 2026-12-05: every wiring mistake ran with rc 0 on
the CPU): training before ``run.model_built()``, the TE-graphed layers' precision, buckets
longer than the model's learned position embeddings. No fake device here: the real CPU."""

from __future__ import annotations

import argparse

import minimal_loop
import pytest
from cpu_only import needs_mcore_on_cpu

import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.runtime.wiring import CudaGraphWiringError
from hookspecs import TrainingRun, get_plugin_manager
from recording import FULL

pytestmark = needs_mcore_on_cpu


@pytest.fixture(autouse=True)
def no_device(monkeypatch):
    monkeypatch.setattr(compat, "cuda_available", lambda: False)


@pytest.mark.parametrize(
    "argv",
    [FULL, ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp"]],
    ids=["full_iteration", "te"],
)
def test_training_before_model_built_is_refused_on_the_cpu_too(argv):
    pm = get_plugin_manager()
    parser = argparse.ArgumentParser()
    pm.hook.mcgraph_add_arguments(parser=parser)
    args = parser.parse_args([*argv, "--cuda-graph-warmup-steps", "1"])
    with pytest.raises(CudaGraphWiringError, match=r"before run\.model_built\(\)"):
        with TrainingRun(pm, config=args, train_iters=3) as run:
            with run.train_step(0):
                pass


def test_te_scopes_on_fp32_layers_are_refused_at_the_build_on_the_cpu_too(capsys):
    """examples/minimal_loop.py builds fp32 layers and its config says no precision: the
    configuration passes, the built model's parameters are refused, as on a GPU."""
    argv = ["--train-iters", "3", "--cuda-graph-impl", "transformer_engine"]
    assert minimal_loop.main([*argv, "--cuda-graph-scope", "attn,mlp"]) == 2
    err = capsys.readouterr().err
    assert "run.model_built(model=...)" in err and "with parameters in float32" in err
    assert "Traceback" not in err
    # full-iteration graphs take any precision: the same loop runs
    assert minimal_loop.main(["--train-iters", "3", *FULL]) == 0


def test_buckets_beyond_the_learned_positions_are_refused_at_the_build_on_the_cpu_too(
    monkeypatch,
):
    """A config that does not say its position embeddings passes the configuration (seen
    here by hiding the example's field from the reader); the built model says them."""
    from cudagraph_plugin.config.fields import FIELD_PATHS

    monkeypatch.setitem(FIELD_PATHS, "position_embedding_type", ("model.nowhere",))
    argv = [*FULL, "--seq-length", "32", "--cuda-graph-buckets", "16,32,48"]
    with pytest.raises(CudaGraphConfigError, match="longer than model chunk 0's learned"):
        train_gpt.run(["--train-iters", "2", "--log-interval", "0", *argv])
    train_gpt.run(
        [
            "--train-iters",
            "2",
            "--log-interval",
            "0",
            *FULL,
            "--seq-length",
            "32",
            "--cuda-graph-buckets",
            "16,32",
        ]
    )
