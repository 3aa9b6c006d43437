"""What the bucket graphs know of the optimizer's memory (``cudagraph_plugin.compat.buckets``):
the sample of its state the address check reads, whether its main parameters are the
model's, and the watch on megatron-core's offload API (``offload_to_cpu`` /
``restore_from_cpu``), which frees the graphs after a call that moved anything, and only
then."""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.optimizer.optimizer import ChainedOptimizer

from cudagraph_plugin.compat import buckets as bucket_compat
from cudagraph_plugin.runtime.fingerprint import AddressFingerprint

MODEL = torch.nn.Linear(4, 4)


def megatron_like(torch_optimizer: torch.optim.Optimizer) -> types.SimpleNamespace:
    """What the code reads of a ``MegatronOptimizer``: its torch optimizer in ``.optimizer``."""
    return types.SimpleNamespace(optimizer=torch_optimizer, config=None)


def stepped(torch_optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in torch_optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    torch_optimizer.step()
    return torch_optimizer


def move_every_state_tensor(torch_optimizer: torch.optim.Optimizer) -> None:
    for state in torch_optimizer.state.values():
        for key, value in list(state.items()):
            if value.dim() > 0:
                state[key] = value.clone()


@pytest.mark.parametrize("layout", ["first-group-empty", "plain-torch"])
def test_the_state_sample_finds_the_optimizer_s_memory_and_its_move(layout):
    # megatron-core keeps empty groups so that every rank has the same; the optimizer graph
    # wraps any optimizer's step, a plain torch one too
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    if layout == "first-group-empty":
        adam = stepped(torch.optim.Adam([{"params": []}, {"params": params}]))
        optimizer = megatron_like(adam)
    else:
        adam = optimizer = stepped(torch.optim.Adam(params))
    sample = bucket_compat.optimizer_state_tensors(optimizer)
    assert [name for _, name, _ in sample][:1] == ["optimizer 0 main parameter 0"]
    # each parameter (up to 16, spread), its exp_avg and exp_avg_sq
    assert [name for _, name, _ in sample] == [
        "optimizer 0 main parameter 0",
        "optimizer 0 parameter 0 state 'exp_avg'",
        "optimizer 0 parameter 0 state 'exp_avg_sq'",
        "optimizer 0 main parameter 1",
        "optimizer 0 parameter 1 state 'exp_avg'",
        "optimizer 0 parameter 1 state 'exp_avg_sq'",
    ]
    fingerprint = AddressFingerprint([MODEL], optimizer, optimizer_state=True)
    before = fingerprint.take()
    move_every_state_tensor(adam)
    assert fingerprint.take() != before


def test_a_chained_optimizer_nested_in_another_is_read_through():
    # megatron-core 0.19's layer-wise optimizer is a ChainedOptimizer inside the outer one;
    # its ``.optimizer`` property asserts when it chains more than one
    weight, bias = MODEL.weight, MODEL.bias
    layer_wise = ChainedOptimizer(
        [megatron_like(torch.optim.SGD([weight], lr=0.1)), megatron_like(torch.optim.SGD([bias]))]
    )
    outer = ChainedOptimizer([layer_wise])
    assert bucket_compat.optimizer_holds_model_params(outer, [MODEL]) is True
    names = [name for _, name, _ in bucket_compat.optimizer_state_tensors(outer)]
    assert names == ["optimizer 0 main parameter 0", "optimizer 1 main parameter 0"]
    other = torch.nn.Linear(2, 2)
    assert bucket_compat.optimizer_holds_model_params(outer, [other]) is False


class OffloadingOptimizer:
    """megatron-core's offload API on a torch Adam: ``restore_from_cpu`` gives each state
    tensor new memory one at a time, and moves nothing when the state is back already;
    ``fail_at`` makes it raise after that many tensors (an out-of-memory midway)."""

    def __init__(self) -> None:
        self.optimizer = stepped(
            torch.optim.Adam([torch.nn.Parameter(torch.zeros(4)) for _ in range(4)])
        )
        self.offloaded = False
        self.fail_at: int | None = None

    def offload_to_cpu(self) -> None:
        self.offloaded = True

    def restore_from_cpu(self) -> None:
        if not self.offloaded:
            return  # megatron-core moves only what is off the device
        for index, state in enumerate(self.optimizer.state.values()):
            if index == self.fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
            state["exp_avg"] = state["exp_avg"].clone()
        self.offloaded = False


def test_an_offload_call_that_moved_nothing_frees_no_graph():
    optimizer = OffloadingOptimizer()
    moves: list[str] = []
    restore = bucket_compat.watch_optimizer_offload(optimizer, moves.append)
    try:
        optimizer.restore_from_cpu()  # nothing off the device: a defensive call, every step
        assert moves == []
        optimizer.offload_to_cpu()  # (moves nothing in this stand-in)
        optimizer.restore_from_cpu()
        assert moves == ["MegatronOptimizer.restore_from_cpu()"]
    finally:
        restore()
    assert "restore_from_cpu" not in vars(optimizer)


def test_an_offload_call_that_raised_midway_counts_what_it_moved():
    optimizer = OffloadingOptimizer()
    optimizer.offloaded, optimizer.fail_at = True, 2
    moves: list[str] = []
    restore = bucket_compat.watch_optimizer_offload(optimizer, moves.append)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            optimizer.restore_from_cpu()
        assert moves == ["MegatronOptimizer.restore_from_cpu()"]
    finally:
        restore()
