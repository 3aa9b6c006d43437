"""``benchmarks/handwritten.py``: the example's loop written by hand, no plugin.

The benchmark's comparison means something only if both loops do the same work: on the CPU
the hand-written loop must give the plugin's eager losses step for step, learning-rate
schedule included, and time every step with the same clock.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from cpu_only import needs_mcore_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import handwritten

import train_gpt

pytestmark = needs_mcore_on_cpu

STEPS = 6


def _handwritten(**fields: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = {"train_iters": STEPS, "log_interval": 0, "cpu": True}
    config = handwritten.BaselineConfig(**{**defaults, **fields})
    return handwritten.run(config)


def _plugin(*argv: str) -> dict[str, Any]:
    return train_gpt.run(["--cpu", "--train-iters", str(STEPS), "--log-interval", "0", *argv])


LINEAR = "--lr-decay-style linear --lr-warmup-iters 2 --min-lr 1e-4 --log-interval 4"


@pytest.mark.parametrize(
    ("fields", "argv"),
    [
        ({}, ()),  # train_gpt's defaults: cosine decay, no warm-up
        (
            {"lr_decay_style": "linear", "lr_warmup_iters": 2, "min_lr": 1e-4, "log_interval": 4},
            tuple(LINEAR.split()),
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ("full_iteration",)},
            ("--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"),
        ),
    ],
    ids=["cosine", "linear-warmup-logged", "full_iteration"],
)
def test_losses_equal_the_plugin_eager_run_step_for_step(
    fields: dict[str, Any], argv: tuple[str, ...]
) -> None:
    hand = _handwritten(**fields)
    plugin = _plugin(*argv)
    assert hand["losses"] == plugin["losses"]
    # The same clock: one time per step, read at the log interval and at the end.
    assert len(hand["step_ms"]) == len(plugin["step_ms"]) == STEPS
    assert all(ms > 0 for ms in hand["step_ms"])


def test_the_schedule_drives_the_learning_rate() -> None:
    """A loop that forgot ``scheduler.step()`` (or set it up otherwise) would train at a
    constant rate: the losses part from the scheduled run's after the first update."""
    cosine = _handwritten()["losses"]
    constant = _handwritten(lr_decay_style="constant")["losses"]
    assert cosine[:2] == constant[:2] and cosine[2:] != constant[2:]


def test_the_optimizer_graph_is_refused_where_it_cannot_be_captured() -> None:
    reason = handwritten.optimizer_graph_unavailable(use_cuda=False)
    assert reason is not None and ("0.17" in reason or "CUDA device" in reason)
    with pytest.raises(RuntimeError, match="optimizer_cuda_graph refused"):
        _handwritten(optimizer_cuda_graph=True)


@pytest.mark.parametrize("shared_stream", [False, True], ids=["0.16", "0.18+"])
@pytest.mark.parametrize("full_iteration", [False, True], ids=["te-or-none", "full-iteration"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_ddp_is_built_on_the_stream_the_plugin_builds_it_on(
    monkeypatch: pytest.MonkeyPatch, graphs: bool, full_iteration: bool, shared_stream: bool
) -> None:
    """The stream DDP is built on decides where every AccumulateGrad node (and DDP's grad
    hook) runs in each backward: both loops must build it on the same one. The plugin gives
    the host a build context only while graphs are on (``state.active``), and its
    ``DDPBuildContext`` picks the stream."""
    from cudagraph_plugin.compat import ddp

    monkeypatch.setattr(ddp, "_has_shared_capture_stream", lambda: shared_stream)
    expected = None
    context = ddp.DDPBuildContext(full_iteration)
    if graphs and context.needs_stream:
        expected = "shared" if full_iteration else "side"
    assert handwritten.ddp_build_stream(graphs, full_iteration, shared_stream) == expected
