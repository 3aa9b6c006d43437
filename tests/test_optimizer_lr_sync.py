"""Host writes into the param groups reach the captured optimizer step
(``cudagraph_plugin.runtime.optimizer_sync``).

Real parts: torch's ``Adam(capturable=True)`` (its CUDA-only device gate lifted for the CPU;
the algorithm is torch's), megatron-core 0.16.1's ``OptimizerParamScheduler`` (which writes a
Python float into ``param_group["lr"]`` every step, as custom loops do) and its
``ChainedOptimizer``/``FP32Optimizer`` wrappers. The stand-in: :class:`CapturedStep` for the
CUDA graph of ``optimizer.step()``; a replay runs the real step with every param group holding
what it held at capture (the same tensor objects, read by address; the same Python values,
baked into kernels), whatever the host has written since. Every run is compared with the
eager run of the same loop, which reads each step's values.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from cpu_only import needs_mcore_on_cpu

from cudagraph_plugin.runtime import optimizer_sync as lrs

CAPTURE_AT = 3  # optimizer.step() call number of the capture (after 3 warm-up steps)
STEPS = 12


class CapturedStep:
    """Stands in for ``torch.cuda.CUDAGraph`` of ``optimizer.step()`` (see the module doc)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.bound = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]

    def replay(self) -> None:
        groups = list(self.optimizer.param_groups)
        host = [dict(group) for group in groups]
        for group, bound in zip(groups, self.bound, strict=True):
            group.update(bound)
        try:
            self.optimizer.step()
        finally:
            for group, values in zip(groups, host, strict=True):
                group.clear()
                group.update(values)


@pytest.fixture(autouse=True)
def capturable_adam_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's capturable Adam refuses CPU tensors only by a device-type list; lift it."""
    import torch.optim.adam as adam

    real = adam._get_capturable_supported_devices
    monkeypatch.setattr(
        adam,
        "_get_capturable_supported_devices",
        lambda supports_xla=True: [*real(supports_xla), "cpu"],
    )


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(6, 4, generator=generator)),
        torch.nn.Parameter(torch.randn(5, generator=generator)),
    ]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _adam(params: list[torch.nn.Parameter], lr: Any, weight_decay: float = 0.1) -> Any:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, capturable=True)


def _scheduler(optimizer: Any, wd_incr_style: str = "constant", end_wd: float = 0.1) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=STEPS,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=end_wd,
        wd_incr_steps=STEPS,
        wd_incr_style=wd_incr_style,
    )


Loop = Callable[[Any, list[torch.nn.Parameter], int], None]


def _megatron_scheduler_loop(
    wd_incr_style: str = "constant", end_wd: float = 0.1
) -> Callable[[Any, list[torch.nn.Parameter]], Loop]:
    """A loop whose host writes are megatron-core's scheduler's (a float lr each step)."""

    def make(optimizer: Any, params: list[torch.nn.Parameter]) -> Loop:
        scheduler = _scheduler(optimizer, wd_incr_style, end_wd)
        return lambda optimizer, params, step: scheduler.step(1)

    return make


def _run(
    make_loop: Callable[[Any, list[torch.nn.Parameter]], Loop],
    mode: str,
    lr: Any = 1e-2,
    promote: bool = False,
) -> list[torch.Tensor]:
    """Train STEPS steps: ``eager``; ``graph`` (captured at CAPTURE_AT, no sync);
    ``synced`` (captured, with HyperparameterSync); returns the final parameters."""
    params = _params()
    optimizer = _adam(params, lr)
    after_step = make_loop(optimizer, params)
    graph = sync = None
    for step in range(STEPS):
        _set_grads(params, step)
        if mode == "eager" or step < CAPTURE_AT:
            optimizer.step()
        else:
            if graph is None:
                if promote:
                    lrs.promote_lr_to_tensor(optimizer)
                if mode == "synced":
                    sync = lrs.HyperparameterSync.watch(optimizer)
                graph = CapturedStep(optimizer)
            elif sync is not None:
                sync.before_replay()
            graph.replay()
        after_step(optimizer, params, step)
    return [p.detach().clone() for p in params]


def _assert_equal_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def _differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return any(not torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b, strict=True))


# -- megatron-core's scheduler writing a float lr ----------------------------------------------


def test_the_stand_in_graph_freezes_the_lr_without_the_sync():
    """The control: replays read the lr of the capture, so the run leaves the eager one."""
    loop = _megatron_scheduler_loop()
    eager = _run(loop, "eager")
    frozen = _run(loop, "graph", promote=True)
    assert _differ(frozen, eager)


def test_a_scheduled_lr_reaches_the_captured_step(caplog):
    loop = _megatron_scheduler_loop()
    eager = _run(loop, "eager")
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        synced = _run(loop, "synced", promote=True)

    _assert_equal_params(synced, eager)
    lines = [r.getMessage() for r in caplog.records if "replaced param_groups" in r.getMessage()]
    assert len(lines) == 1, "logged once, not once per step"
    assert "param_groups[0]['lr']" in lines[0]


def test_a_float_lr_baked_at_capture_is_refused_before_the_replay_that_would_ignore_it():
    params = _params()
    optimizer = _adam(params, 1e-2)
    scheduler = _scheduler(optimizer)
    for step in range(CAPTURE_AT):
        _set_grads(params, step)
        optimizer.step()
        scheduler.step(1)
    sync = lrs.HyperparameterSync.watch(optimizer)
    graph = CapturedStep(optimizer)
    graph.replay()
    scheduler.step(1)
    before = [p.detach().clone() for p in params]

    with pytest.raises(lrs.HyperparameterChangedError) as raised:
        sync.before_replay()

    message = str(raised.value)
    assert "param_groups[0]['lr']" in message
    assert f"float {graph.bound[0]['lr']!r} at capture" in message
    assert "promote_lr_to_tensor" in message
    _assert_equal_params([p.detach() for p in params], before)


def test_promote_gives_a_capturable_torch_adam_a_device_tensor_lr_of_the_same_value():
    params = _params()
    optimizer = _adam(params, 3e-4)
    optimizer.add_param_group({"params": [], "lr": 1.0})
    not_capturable = torch.optim.Adam(_params(1), lr=5e-4)

    assert lrs.promote_lr_to_tensor(optimizer) == 1
    lr = optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    assert lr.dtype == torch.float32 and lr.device == params[0].device and lr.dim() == 0
    assert lr.item() == pytest.approx(3e-4)
    assert optimizer.param_groups[1]["lr"] == 1.0  # no parameters: not read by the step
    assert lrs.promote_lr_to_tensor(not_capturable) == 0
    assert not_capturable.param_groups[0]["lr"] == 5e-4
    assert lrs.promote_lr_to_tensor(optimizer) == 0  # already a tensor


# -- a tensor lr, as Transformer Engine's capturable FusedAdam holds ---------------------------


def _host_writes(write: Callable[[dict[str, Any], int], None]) -> Callable[..., Loop]:
    def make(optimizer: Any, params: list[torch.nn.Parameter]) -> Loop:
        def after_step(optimizer: Any, params: list[torch.nn.Parameter], step: int) -> None:
            for group in optimizer.param_groups:
                write(group, step)

        return after_step

    return make


def _tenth_at_step_10(group: dict[str, Any], step: int) -> None:
    """The measured failure's host: ``g['lr'] = 0.1 * g['lr']`` once, at step 10."""
    if step == 10:
        group["lr"] = 0.1 * group["lr"]


def _float_every_step(group: dict[str, Any], step: int) -> None:
    """A float from the capture on (before it, the tensor would be gone at capture: a baked
    float, refused with the promote fix, see above)."""
    if step >= CAPTURE_AT:
        group["lr"] = 1e-2 / (1 + step)


def _fill_in_place(group: dict[str, Any], step: int) -> None:
    """megatron-core 0.19's scheduler (optimizer_param_scheduler.py:296-297)."""
    group["lr"].fill_(1e-2 / (1 + step))


@pytest.mark.parametrize(
    "write",
    [_tenth_at_step_10, _float_every_step, _fill_in_place],
    ids=["new tensor at step 10", "float every step", "fill in place"],
)
def test_host_writes_into_a_tensor_lr_reach_the_captured_step(write):
    lr = torch.tensor(1e-2)
    eager = _run(_host_writes(write), "eager", lr=lr.clone())
    synced = _run(_host_writes(write), "synced", lr=lr.clone())
    _assert_equal_params(synced, eager)
    if write is not _fill_in_place:
        assert _differ(_run(_host_writes(write), "graph", lr=lr.clone()), eager)


def test_a_written_number_is_filled_in_and_the_captured_tensor_put_back():
    params = _params()
    optimizer = _adam(params, torch.tensor(1e-2))
    captured = optimizer.param_groups[0]["lr"]
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[0]["lr"] = 1e-3

    sync.before_replay()

    assert optimizer.param_groups[0]["lr"] is captured
    assert captured.item() == pytest.approx(1e-3)
    assert sync.copies == 1
    assert "host writes copied before replays: 1" in sync.description
    sync.before_replay()  # nothing new written: nothing copied
    assert sync.copies == 1


def test_a_host_tensor_stays_in_the_group_and_its_later_in_place_writes_are_copied(caplog):
    """A host that puts its own tensor in the group once and then fills it in place (a
    scheduler holding its tensor): every replay reads the host's latest value."""
    optimizer = _adam(_params(), torch.tensor(1e-2))
    captured = optimizer.param_groups[0]["lr"]
    sync = lrs.HyperparameterSync.watch(optimizer)
    mine = torch.tensor(5e-4)
    optimizer.param_groups[0]["lr"] = mine

    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        sync.before_replay()
    assert optimizer.param_groups[0]["lr"] is mine
    assert captured.item() == pytest.approx(5e-4)
    assert "the host's tensor stays in the group" in caplog.text

    mine.fill_(1e-5)
    sync.before_replay()
    assert captured.item() == pytest.approx(1e-5)
    assert sync.copies == 2


def test_a_loaded_step_counter_is_copied_once_and_the_captured_one_keeps_counting():
    """Transformer Engine's capturable FusedAdam keeps ``group["step"]`` in a device tensor
    that the captured step increments in place; a ``load_state_dict`` while the graph lives
    puts a new one in the group. Kept there, it would be copied over the captured counter
    before every replay and the step would stand still (a wrong bias correction)."""
    optimizer = _adam(_params(), torch.tensor(1e-2))
    optimizer.param_groups[0]["step"] = torch.tensor([3], dtype=torch.int)
    counter = optimizer.param_groups[0]["step"]
    sync = lrs.HyperparameterSync.watch(optimizer)
    loaded = counter.clone() + 1  # the checkpoint's step
    optimizer.param_groups[0]["step"] = loaded

    seen = []
    for _ in range(3):
        sync.before_replay()
        counter.add_(1)  # what the captured kernel does
        seen.append(int(counter))
    assert optimizer.param_groups[0]["step"] is counter
    assert seen == [5, 6, 7]
    assert sync.copies == 1


def test_a_fill_in_place_needs_no_copy_and_logs_nothing(caplog):
    optimizer = _adam(_params(), torch.tensor(1e-2))
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[0]["lr"].fill_(5e-3)
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        sync.before_replay()
    assert sync.copies == 0
    assert caplog.records == []


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        (None, "NoneType None"),
        ("1e-3", "str '1e-3'"),
        (True, "bool True"),
        (torch.ones(2), "a tensor of shape (2,)"),
    ],
    ids=["None", "str", "bool", "two elements"],
)
def test_a_value_that_cannot_be_copied_is_refused_and_nothing_changes(value, phrase):
    optimizer = _adam(_params(), torch.tensor(1e-2))
    captured = optimizer.param_groups[0]["lr"]
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[0]["lr"] = value

    with pytest.raises(lrs.HyperparameterChangedError, match="param_groups\\[0\\]\\['lr'\\]") as e:
        sync.before_replay()
    assert phrase in str(e.value)
    assert "fix:" in str(e.value)
    assert captured.item() == pytest.approx(1e-2)
    assert optimizer.param_groups[0]["lr"] is value


def test_a_removed_lr_is_refused():
    optimizer = _adam(_params(), torch.tensor(1e-2))
    sync = lrs.HyperparameterSync.watch(optimizer)
    del optimizer.param_groups[0]["lr"]
    with pytest.raises(lrs.HyperparameterChangedError, match="the key was removed"):
        sync.before_replay()


# -- Python values baked into the captured step ------------------------------------------------


def test_a_constant_weight_decay_rewritten_every_step_is_fine():
    loop = _megatron_scheduler_loop(wd_incr_style="constant")
    _assert_equal_params(_run(loop, "synced", promote=True), _run(loop, "eager"))


def test_a_scheduled_weight_decay_is_refused_with_the_fix():
    loop = _megatron_scheduler_loop(wd_incr_style="linear", end_wd=0.2)
    with pytest.raises(lrs.HyperparameterChangedError) as raised:
        _run(loop, "synced", promote=True)
    message = str(raised.value)
    assert "param_groups[0]['weight_decay']" in message
    assert "baked into the captured kernels" in message
    assert "weight_decay_incr_style='constant'" in message


@pytest.mark.parametrize(
    ("captured", "written", "accepted"),
    [
        (0, 0.0, True),
        (0.1, 0.1, True),
        (float("nan"), float("nan"), True),
        (0.1, 0.2, False),
        (0, False, False),
    ],
)
def test_baked_numbers_compare_by_value(captured, written, accepted):
    optimizer = _adam(_params(), torch.tensor(1e-2))
    optimizer.param_groups[0]["weight_decay"] = captured  # torch's check refuses NaN; TE's not
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[0]["weight_decay"] = written
    if accepted:
        sync.before_replay()
    else:
        with pytest.raises(lrs.HyperparameterChangedError, match="weight_decay"):
            sync.before_replay()


def test_every_problem_is_reported_at_once():
    optimizer = _adam(_params(), torch.tensor(1e-2))
    sync = lrs.HyperparameterSync.watch(optimizer)
    group = optimizer.param_groups[0]
    group["lr"] = None
    group["weight_decay"] = 0.5
    group["betas"] = (0.8, 0.999)
    with pytest.raises(lrs.HyperparameterChangedError) as raised:
        sync.before_replay()
    assert len(raised.value.problems) == 3


def test_added_param_groups_are_refused():
    optimizer = _adam(_params(), torch.tensor(1e-2))
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.add_param_group({"params": _params(2)})
    with pytest.raises(lrs.HyperparameterChangedError, match="2 group\\(s\\), 1 at capture"):
        sync.before_replay()


@pytest.mark.parametrize("where", ["a watched group", "a group empty at capture"])
def test_parameters_added_to_a_group_are_refused(where):
    """The captured step never updates a parameter it was not captured with."""
    optimizer = _adam(_params(), torch.tensor(1e-2))
    optimizer.add_param_group({"params": [], "lr": torch.tensor(1e-2)})
    sync = lrs.HyperparameterSync.watch(optimizer)
    index = 0 if where == "a watched group" else 1
    optimizer.param_groups[index]["params"].append(_params(3)[0])
    before = len(optimizer.param_groups[index]["params"]) - 1
    with pytest.raises(
        lrs.HyperparameterChangedError,
        match=rf"param_groups\[{index}\] has {before + 1} parameter\(s\), {before} at capture",
    ):
        sync.before_replay()


def _two_groups(lr: Any) -> Any:
    params = _params()
    return torch.optim.AdamW(
        [{"params": [params[0]]}, {"params": [params[1]]}], lr=lr, capturable=True
    )


def test_groups_sharing_one_lr_tensor_given_different_values_are_refused():
    """torch puts the optimizer's lr tensor in every group that names none: a replay can
    give those groups one value only, not the two a per-group schedule writes."""
    optimizer = _two_groups(torch.tensor(1e-2))
    shared = optimizer.param_groups[0]["lr"]
    assert optimizer.param_groups[1]["lr"] is shared
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[0]["lr"] = 1e-3
    optimizer.param_groups[1]["lr"] = 1e-4
    with pytest.raises(lrs.HyperparameterChangedError, match="read one captured tensor") as err:
        sync.before_replay()
    assert "[0] float 0.001; [1] float 0.0001" in str(err.value)
    assert "give each param group its own lr tensor" in str(err.value)
    assert shared.item() == pytest.approx(1e-2)  # nothing changed

    optimizer.param_groups[0]["lr"] = 1e-3  # one group written, the other still the tensor
    optimizer.param_groups[1]["lr"] = shared
    with pytest.raises(lrs.HyperparameterChangedError, match="the captured tensor, unchanged"):
        sync.before_replay()


@pytest.mark.parametrize("same", ["number", "tensor"])
def test_groups_sharing_one_lr_tensor_given_one_value_are_fine(same):
    optimizer = _two_groups(torch.tensor(1e-2))
    shared = optimizer.param_groups[0]["lr"]
    sync = lrs.HyperparameterSync.watch(optimizer)
    value = 1e-3 if same == "number" else torch.tensor(1e-3)
    for group in optimizer.param_groups:
        group["lr"] = value
    sync.before_replay()
    assert shared.item() == pytest.approx(1e-3)


def test_two_groups_swapping_their_captured_tensors_get_each_others_values():
    params = _params()
    optimizer = torch.optim.AdamW(
        [
            {"params": [params[0]], "lr": torch.tensor(1e-3)},
            {"params": [params[1]], "lr": torch.tensor(1e-4)},
        ],
        capturable=True,
    )
    first, second = (group["lr"] for group in optimizer.param_groups)
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"] = second, first
    sync.before_replay()
    assert (first.item(), second.item()) == pytest.approx((1e-4, 1e-3))
    assert optimizer.param_groups[0]["lr"] is first  # each captured tensor is back in place
    sync.before_replay()  # and stays swapped, not swapped back
    assert (first.item(), second.item()) == pytest.approx((1e-4, 1e-3))


def test_groups_without_parameters_are_not_watched():
    optimizer = _adam(_params(), torch.tensor(1e-2))
    optimizer.add_param_group({"params": [], "lr": 1.0})
    sync = lrs.HyperparameterSync.watch(optimizer)
    optimizer.param_groups[1]["lr"] = 2.0  # megatron-core's empty stub groups get an lr too
    sync.before_replay()


def test_a_replaced_group_dict_is_followed_by_position():
    """torch's ``load_state_dict`` builds new group dicts (with deep-copied values)."""
    params = _params()
    optimizer = _adam(params, torch.tensor(1e-2))
    captured = optimizer.param_groups[0]["lr"]
    sync = lrs.HyperparameterSync.watch(optimizer)
    state = optimizer.state_dict()
    state["param_groups"][0]["lr"] = torch.tensor(4e-3)
    optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] is not captured

    sync.before_replay()

    assert optimizer.param_groups[0]["lr"] is not captured  # the loaded tensor stays
    assert captured.item() == pytest.approx(4e-3)
    optimizer.param_groups[0]["lr"].fill_(2e-3)  # megatron-core 0.19's scheduler, next step
    sync.before_replay()
    assert captured.item() == pytest.approx(2e-3)


def test_the_sync_keeps_the_captured_tensor_alive_until_release():
    """A graph holds no reference to what it reads: the sync must, or a replaced lr tensor's
    memory goes back to the allocator while the graph still reads it."""
    import gc
    import weakref

    # The group's own tensor, as Transformer Engine's FusedAdam makes it (``.to(device)`` of
    # the defaults' tensor, fused_adam.py:177): nothing else references it.
    optimizer = torch.optim.AdamW(
        [{"params": _params(), "lr": torch.tensor(1e-2)}], lr=1e-3, capturable=True
    )
    sync = lrs.HyperparameterSync.watch(optimizer)
    captured = weakref.ref(optimizer.param_groups[0]["lr"])
    optimizer.param_groups[0]["lr"] = 1e-3  # the host's write drops the group's reference
    gc.collect()
    assert captured() is not None

    sync.release()
    gc.collect()
    assert captured() is None


def test_release_drops_the_tensors_and_refuses_later_use():
    optimizer = _adam(_params(), torch.tensor(1e-2))
    sync = lrs.HyperparameterSync.watch(optimizer)
    sync.release()
    assert sync.optimizer is None
    with pytest.raises(RuntimeError, match="after release"):
        sync.before_replay()


# -- megatron-core's optimizer wrappers ----------------------------------------------------------


@contextlib.contextmanager
def _model_parallel_world() -> Iterator[None]:
    from megatron.core import parallel_state

    import cpu_redirect

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        parallel_state.initialize_model_parallel()
        with cpu_redirect.cpu_redirect():
            yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _chained(params: list[torch.nn.Parameter], lr: float) -> Any:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    config = OptimizerConfig(lr=lr, clip_grad=0.0)
    parts = [FP32Optimizer(_adam([p], lr), config, None) for p in params]
    return ChainedOptimizer(parts)


def _run_chained(mode: str) -> list[torch.Tensor]:
    params = _params()
    optimizer = _chained(params, 1e-2)
    scheduler = _scheduler(optimizer)
    graph = sync = None
    for step in range(STEPS):
        _set_grads(params, step)
        if mode == "eager" or step < CAPTURE_AT:
            optimizer.step()
        else:
            if graph is None:
                assert lrs.promote_lr_to_tensor(optimizer) == 2
                sync = lrs.HyperparameterSync.watch(optimizer)
                graph = CapturedStep(optimizer)
            else:
                sync.before_replay()
            graph.replay()
        scheduler.step(1)
    return [p.detach().clone() for p in params]


@needs_mcore_on_cpu
def test_megatron_chained_optimizer_follows_the_scheduler():
    with _model_parallel_world():
        eager = _run_chained("eager")
        synced = _run_chained("synced")
    _assert_equal_params(synced, eager)


def test_the_module_imports_no_torch(tmp_path):
    code = (
        "import sys; import cudagraph_plugin.runtime.optimizer_sync; "
        "print('torch' in sys.modules, 'megatron' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.split() == ["False", "False"]


@needs_mcore_on_cpu
def test_a_chained_optimizers_reloaded_inner_groups_are_followed():
    """A ``load_state_dict`` of the torch optimizer inside megatron-core's wrappers gives it
    a new ``param_groups`` list of new dicts, which the next replay must still see (a sync
    that kept the inner lists it saw at capture would not)."""
    with _model_parallel_world():
        params = _params()
        optimizer = _chained(params, 1e-2)
        lrs.promote_lr_to_tensor(optimizer)
        captured = [group["lr"] for group in optimizer.param_groups]
        sync = lrs.HyperparameterSync.watch(optimizer)
        inner = optimizer.chained_optimizers[1].optimizer
        state = inner.state_dict()
        state["param_groups"][0]["lr"] = 4e-3
        inner.load_state_dict(state)

        sync.before_replay()

        assert all(g["lr"] is c for g, c in zip(optimizer.param_groups, captured, strict=True))
        assert captured[1].item() == pytest.approx(4e-3)
        assert captured[0].item() == pytest.approx(1e-2)


class _FirstGroupOnly:
    """A wrapper whose ``param_groups`` is not its inner optimizer's list: it exposes one of
    two groups (the sync must read what the wrapper gives, not the inner optimizer)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups[:1]


def test_a_wrapper_that_shows_other_groups_than_its_inner_optimizer_is_read_through_itself():
    params = _params()
    inner = torch.optim.AdamW(
        [{"params": params[:1]}, {"params": params[1:]}],
        lr=torch.tensor(1e-2),
        weight_decay=0.1,
        capturable=True,
    )
    wrapper = _FirstGroupOnly(inner)
    captured = wrapper.param_groups[0]["lr"]
    sync = lrs.HyperparameterSync.watch(wrapper)
    wrapper.param_groups[0]["lr"] = 2e-3  # the host's write, through the wrapper

    sync.before_replay()  # one group, as at capture (the inner optimizer has two)

    assert wrapper.param_groups[0]["lr"] is captured
    assert captured.item() == pytest.approx(2e-3)


@needs_mcore_on_cpu
def test_a_chained_optimizer_added_after_the_capture_is_refused():
    """The captured step never steps a chained optimizer added after it: its groups are new
    groups (refused), however the sync reads the param groups."""
    with _model_parallel_world():
        params = _params()
        optimizer = _chained(params, 1e-2)
        lrs.promote_lr_to_tensor(optimizer)
        sync = lrs.HyperparameterSync.watch(optimizer)
        extra = _chained([torch.nn.Parameter(torch.zeros(3))], 1e-2).chained_optimizers[0]
        optimizer.chained_optimizers.append(extra)

        with pytest.raises(lrs.HyperparameterChangedError, match="3 group"):
            sync.before_replay()


@needs_mcore_on_cpu
def test_an_inner_optimizer_swapped_after_the_capture_is_read_again():
    """A host that swaps the torch optimizer inside a megatron-core wrapper: the sync reads
    the new one's groups (here a weight decay the captured kernels do not have: refused)."""
    with _model_parallel_world():
        params = _params()
        optimizer = _chained(params, 1e-2)
        lrs.promote_lr_to_tensor(optimizer)
        sync = lrs.HyperparameterSync.watch(optimizer)
        part = optimizer.chained_optimizers[0]
        part.optimizer = torch.optim.AdamW(
            [params[0]], lr=torch.tensor(5e-3), weight_decay=0.5, capturable=True
        )

        with pytest.raises(lrs.HyperparameterChangedError, match="weight_decay"):
            sync.before_replay()


class _Reversed(_FirstGroupOnly):
    """A wrapper that shows its inner optimizer's groups in the other order."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups[::-1]


def test_a_wrapper_that_orders_its_inner_groups_otherwise_is_read_through_itself():
    params = _params()
    inner = torch.optim.AdamW(
        [{"params": params[:1], "lr": torch.tensor(1e-2)}, {"params": params[1:]}],
        lr=torch.tensor(3e-2),
        weight_decay=0.1,
        capturable=True,
    )
    wrapper = _Reversed(inner)
    first, second = (group["lr"] for group in wrapper.param_groups)
    sync = lrs.HyperparameterSync.watch(wrapper)
    wrapper.param_groups[0]["lr"] = 2e-3  # the host's write into the wrapper's first group

    sync.before_replay()

    assert wrapper.param_groups[0]["lr"] is first and wrapper.param_groups[1]["lr"] is second
    assert first.item() == pytest.approx(2e-3) and second.item() == pytest.approx(1e-2)
