"""A full-iteration graph replays the computation of the call it captured: the guard refuses
a later call with another model or another forward_step_func (review of 2026-12-04: an RL
host's ``functools.partial(loss, kl_coef=...)`` made per step replayed the first step's
coefficient, its losses and gradients silently wrong), and lets through one made again
alike. Per-layer (TE) graphs capture layers only: there the guard does not compare them."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from cudagraph_plugin.runtime.callee import same_callable
from cudagraph_plugin.runtime.guard import ShapeGuard, StaticShapeError


def loss_step(coef, data_iterator, model):
    return coef


def make_closure(coef):
    def forward_step(data_iterator, model):
        return coef

    return forward_step


class Host:
    def forward_step(self, data_iterator, model):
        return None


MODEL = [torch.nn.Linear(2, 2)]


def call(guard, *, record=False, copied=True, model=MODEL, step_func=None):
    kwargs = {
        "num_microbatches": 1,
        "seq_length": 8,
        "micro_batch_size": 2,
        "data_iterator": iter([{"tokens": torch.zeros(2, 8, dtype=torch.int64)}]),
        "model": model,
        "forward_step_func": step_func or functools.partial(loss_step, 1.0),
    }
    iterator = guard.check_call("training", 3, kwargs, record=record, copied=copied)
    next(iterator)
    if record:
        guard.commit("training")
    return kwargs


def test_callables_made_again_alike_are_the_same_and_changed_ones_are_not():
    host = Host()
    tensor = torch.ones(1)
    alike = [
        (functools.partial(loss_step, 0.5), functools.partial(loss_step, 0.5)),
        (functools.partial(loss_step, coef=[1, "a"]), functools.partial(loss_step, coef=[1, "a"])),
        (functools.partial(loss_step, tensor), functools.partial(loss_step, tensor)),
        (make_closure(0.5), make_closure(0.5)),
        (host.forward_step, host.forward_step),
    ]
    for a, b in alike:
        assert a is not b and same_callable(a, b), (a, b)
    changed = [
        (functools.partial(loss_step, 0.5), functools.partial(loss_step, 5.0)),
        (functools.partial(loss_step, 1), functools.partial(loss_step, 1.0)),  # int vs float
        (functools.partial(loss_step, tensor), functools.partial(loss_step, torch.ones(1))),
        (make_closure(0.5), make_closure(0.0)),
        (host.forward_step, Host().forward_step),
        (loss_step, make_closure(1.0)),
        (make_closure(0.5), functools.partial(loss_step, 0.5)),
    ]
    for a, b in changed:
        assert not same_callable(a, b), (a, b)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    kl_coef: float


class ForwardStep:
    def __init__(self, coef):
        self.coef = coef

    def __call__(self, data_iterator, model):
        return self.coef


def recursive(coef):
    def forward_step(data_iterator, model, depth=0):
        return coef if depth else forward_step(data_iterator, model, 1)

    return forward_step


def test_equal_values_in_other_objects_are_the_same():
    """(second review of 2026-12-04: these were refused, stopping correct runs)"""
    import numpy as np

    alike = [
        (
            functools.partial(loss_step, LossConfig(0.1)),
            functools.partial(loss_step, LossConfig(0.1)),
        ),
        (ForwardStep(0.1), ForwardStep(0.1)),
        (
            functools.partial(loss_step, np.float32(0.1)),
            functools.partial(loss_step, np.float32(0.1)),
        ),
        (
            functools.partial(loss_step, torch.device("cpu")),
            functools.partial(loss_step, torch.device("cpu")),
        ),
        (functools.partial(loss_step, float("nan")), functools.partial(loss_step, float("nan"))),
        (recursive(0.1), recursive(0.1)),
    ]
    for a, b in alike:
        assert same_callable(a, b), (a, b)
    for a, b in [
        (
            functools.partial(loss_step, LossConfig(0.1)),
            functools.partial(loss_step, LossConfig(0.2)),
        ),
        (ForwardStep(0.1), ForwardStep(0.2)),
        (recursive(0.1), recursive(0.2)),
    ]:
        assert not same_callable(a, b), (a, b)


def test_a_value_changed_in_the_closure_cell_the_capture_saw_is_seen():
    """A lambda made in the loop shares one cell with the captured one: by the next step
    the captured lambda's cell holds the new value too (second review of 2026-12-04: they
    compared equal, and the graph replayed the first coefficient)."""
    guard = ShapeGuard()
    for step, kl_coef in enumerate((0.1, 0.2)):
        forward_step = lambda data_iterator, model: kl_coef  # noqa: B023, E731 (the point)
        if step == 0:
            call(guard, record=True, step_func=forward_step)  # the capture, at 0.1
            continue
        with pytest.raises(StaticShapeError, match="a value it uses changed"):
            call(guard, step_func=forward_step)
    # the same function object, its variable changed in place (nonlocal): also seen
    guard = ShapeGuard()

    def make():
        value = 0.1

        def forward_step(data_iterator, model):
            return value

        def change(new):
            nonlocal value
            value = new

        return forward_step, change

    forward_step, change = make()
    captured = call(guard, record=True, step_func=forward_step)
    guard.check_replay(dict(captured, data_iterator=iter([])))
    change(0.5)
    with pytest.raises(StaticShapeError, match="a value it uses changed"):
        guard.check_replay(dict(captured, data_iterator=iter([])))


def test_a_forward_step_func_with_another_coefficient_is_refused_one_made_alike_passes():
    guard = ShapeGuard()
    call(guard, record=True, step_func=functools.partial(loss_step, 1.0))
    call(guard, step_func=functools.partial(loss_step, 1.0))  # made again, alike
    call(guard, model=list(MODEL), step_func=functools.partial(loss_step, 1.0))  # a new list
    with pytest.raises(StaticShapeError) as refused:
        call(guard, step_func=functools.partial(loss_step, 5.0))
    message = str(refused.value)
    assert "another forward_step_func (partial(loss_step, ...), captured with" in message
    assert "would be silently ignored" in message and "as a tensor in the micro-batch" in message
    with pytest.raises(StaticShapeError, match="called with another model after CUDA graph"):
        call(guard, model=[torch.nn.Linear(2, 2)], step_func=functools.partial(loss_step, 1.0))


def test_the_replay_fast_path_compares_them_too():
    guard = ShapeGuard()
    captured = call(guard, record=True)
    guard.check_replay(dict(captured, data_iterator=iter([])))  # the same objects: passes
    with pytest.raises(StaticShapeError, match="another forward_step_func"):
        guard.check_replay(
            dict(captured, data_iterator=iter([]), forward_step_func=make_closure(1.0))
        )


def test_per_layer_graphs_do_not_compare_the_model_or_the_step_function():
    guard = ShapeGuard()
    call(guard, record=True, copied=False)
    call(guard, copied=False, model=[torch.nn.Linear(2, 2)], step_func=make_closure(3.0))


@pytest.mark.parametrize("replay", ["check_call", "check_replay"])
def test_a_full_iteration_call_in_another_train_eval_mode_than_its_capture_is_refused(replay):
    """The graph replays the mode it was captured in: a validation graph captured by
    forward-only calls in training mode (an RL host's log-probs) ran dropout in every later
    eval-mode evaluation, silently (review of 2026-12-05)."""
    model = [torch.nn.Dropout(0.5), torch.nn.Linear(2, 2)]
    step_func = Host().forward_step  # (a bound method: the replay's shortcut trusts it)
    guard = ShapeGuard()
    call(guard, record=True, model=model, step_func=step_func)  # captured in train mode
    check = (
        (lambda: call(guard, model=model, step_func=step_func))
        if replay == "check_call"
        else (lambda: next(guard.check_replay(_kwargs(model, step_func))))
    )
    check()  # the same mode: replays
    model[0].eval()
    with pytest.raises(StaticShapeError, match=r"mixed train/eval mode \(captured in train mode"):
        check()
    model[1].eval()
    with pytest.raises(StaticShapeError, match=r"model in eval mode .*Fix: call with the model"):
        check()
    for chunk in model:
        chunk.train()
    check()  # back in the captured mode


def test_per_layer_references_do_not_compare_the_mode():
    model = [torch.nn.Linear(2, 2)]
    guard = ShapeGuard()
    call(guard, record=True, copied=False, model=model)
    model[0].eval()
    call(guard, copied=False, model=model)


def _kwargs(model, step_func):
    return {
        "num_microbatches": 1,
        "seq_length": 8,
        "micro_batch_size": 2,
        "data_iterator": iter([{"tokens": torch.zeros(2, 8, dtype=torch.int64)}]),
        "model": model,
        "forward_step_func": step_func,
    }
