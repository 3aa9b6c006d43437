"""The device-side gradient-norm kernels and their installer (``compat.grad_norm``).

The kernels are checked against megatron-core's own local fallback
(``megatron.core.utils.local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``) and an
exact float64 reference, and through megatron-core's real ``get_grad_norm_fp32`` and
``clip_grad_by_total_norm_fp32`` (0.16.1 on the CPU, under ``examples/cpu_redirect``), with the
kernels installed and without. That they never read a tensor on the host is checked twice: under
a torch-function mode that fails on every host read of a tensor, and on the ``meta`` device,
where any read of a value fails. The installer's decision is checked on megatron-core's real
module and on module objects that mirror the globals of the other installations (0.19's, and
Transformer Engine's or Apex's kernels, which cannot exist here).
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cpu_only import needs_mcore_on_cpu
from torch.overrides import TorchFunctionMode

from cudagraph_plugin.compat import grad_norm as gnd

CHUNK = 2048 * 32  # what megatron-core's multi_tensor_applier passes


def _local() -> types.ModuleType:
    from megatron.core import utils

    return utils


def _local_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """megatron-core's fallback norm; it allocates on ``device="cuda"``, hence the redirect."""
    import cpu_redirect

    with cpu_redirect.cpu_redirect():
        norm, _ = _local().local_multi_tensor_l2_norm(CHUNK, _flag(), [grads], False)
    return norm


def _exact_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int)


GRAD_SETS = {
    "fp32": lambda g: [torch.randn(17, 5, generator=g), torch.randn(3, generator=g)],
    "bf16": lambda g: [
        torch.randn(64, generator=g).bfloat16(),
        torch.randn(4, 4, generator=g).bfloat16(),
    ],
    "mixed": lambda g: [torch.randn(9, generator=g), torch.randn(8, generator=g).bfloat16()],
    "one scalar": lambda g: [torch.tensor(-3.0)],
    "many, with an empty tensor": lambda g: (
        [torch.randn(i + 1, generator=g) for i in range(40)] + [torch.zeros(0)]
    ),
    "large values": lambda g: [1e6 * torch.randn(1000, generator=g)],
}


def _grads(name: str) -> list[torch.Tensor]:
    return GRAD_SETS[name](torch.Generator().manual_seed(7))


# -- the norm ---------------------------------------------------------------------------------


@needs_mcore_on_cpu
@pytest.mark.parametrize("name", sorted(GRAD_SETS))
def test_norm_equals_megatron_local_fallback_and_the_exact_norm(name):
    grads = _grads(name)
    expected = _local_norm(grads)
    flag = _flag()
    norm, per_tensor = gnd.multi_tensor_l2norm(CHUNK, flag, [grads], False)

    assert norm.shape == (1,) and norm.dtype == torch.float32
    # megatron-core's fallback rounds each bf16 tensor's norm to bf16 before summing; the
    # device-side norm (like TE's and Apex's kernels) accumulates in float32.
    tolerance = 1e-2 if any(g.dtype == torch.bfloat16 for g in grads) else 1e-6
    assert norm.item() == pytest.approx(expected.item(), rel=tolerance)
    assert norm.item() == pytest.approx(_exact_norm(grads), rel=1e-6)
    assert per_tensor.shape == (0,)
    assert flag.item() == 0


def test_per_tensor_norms_when_asked():
    grads = _grads("mixed")
    norm, per_tensor = gnd.multi_tensor_l2norm(CHUNK, _flag(), [grads], True)

    assert per_tensor.dtype == torch.float32
    assert per_tensor.tolist() == pytest.approx([_exact_norm([g]) for g in grads], rel=1e-6)
    assert norm.item() == pytest.approx(_exact_norm(grads), rel=1e-6)


@needs_mcore_on_cpu
@pytest.mark.parametrize("grads", [[], [torch.zeros(3), torch.zeros(2, 2)]], ids=["empty", "zeros"])
def test_norm_zero(grads):
    expected = _local_norm(grads)
    norm, per_tensor = gnd.multi_tensor_l2norm(CHUNK, _flag(), [grads], True)

    assert expected.item() == 0.0
    assert norm.tolist() == [0.0]
    assert per_tensor.tolist() == [0.0] * len(grads)


@needs_mcore_on_cpu
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_norm_as_megatron_computes_it_and_flagged(bad):
    grads = [torch.ones(4), torch.tensor([1.0, bad])]
    expected = _local_norm(grads)
    flag = _flag()
    norm, _ = gnd.multi_tensor_l2norm(CHUNK, flag, [grads], False)

    if math.isnan(bad):
        assert math.isnan(expected.item()) and math.isnan(norm.item())
    else:
        assert expected.item() == norm.item() == math.inf
    # As Transformer Engine's and Apex's kernels do: set for a non-finite norm.
    assert flag.item() == 1


def test_a_set_flag_is_never_cleared():
    flag = torch.ones(1, dtype=torch.int)
    gnd.multi_tensor_l2norm(CHUNK, flag, [[torch.ones(3)]], False)
    assert flag.item() == 1


def test_norm_takes_exactly_one_list():
    with pytest.raises(ValueError, match="exactly one list"):
        gnd.multi_tensor_l2norm(CHUNK, _flag(), [[torch.ones(2)], [torch.ones(2)]], False)


def test_norm_through_megatron_applier_signature():
    """megatron-core calls ``multi_tensor_applier(l2_norm_impl, buf, [grads], False)``."""
    grads = _grads("fp32")
    norm, _ = _local().local_multi_tensor_applier(gnd.multi_tensor_l2norm, _flag(), [grads], False)
    assert norm.item() == pytest.approx(_exact_norm(grads), rel=1e-6)


# -- the scale --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.25, 1.0, 0.0])
def test_scale_in_place_equals_megatron_local(dtype, scale):
    ours = [t.to(dtype) for t in _grads("fp32")]
    theirs = [t.clone() for t in ours]
    gnd.multi_tensor_scale(CHUNK, _flag(), [ours, ours], scale)
    _local().local_multi_tensor_scale(CHUNK, _flag(), [theirs, theirs], scale)

    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, b)


def test_scale_into_other_tensors_converts_and_keeps_the_sources():
    sources = _grads("fp32")
    kept = [s.clone() for s in sources]
    ours = [torch.empty_like(s, dtype=torch.bfloat16) for s in sources]
    theirs = [torch.empty_like(s, dtype=torch.bfloat16) for s in sources]
    gnd.multi_tensor_scale(CHUNK, _flag(), [sources, ours], 0.5)
    _local().local_multi_tensor_scale(CHUNK, _flag(), [sources, theirs], 0.5)

    for a, b, s, k in zip(ours, theirs, sources, kept, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(s, k)


@pytest.mark.parametrize("shape", [(1,), ()])
def test_tensor_scale_equals_the_float_scale(shape):
    coefficient = 0.3125
    ours = _grads("fp32")
    theirs = [t.clone() for t in ours]
    gnd.multi_tensor_scale_tensor(
        CHUNK, _flag(), [ours, ours], torch.full(shape, coefficient, dtype=torch.float32)
    )
    _local().local_multi_tensor_scale(CHUNK, _flag(), [theirs, theirs], coefficient)

    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_scale_of_empty_lists_does_nothing():
    gnd.multi_tensor_scale(CHUNK, _flag(), [[], []], 0.5)
    gnd.multi_tensor_scale_tensor(CHUNK, _flag(), [[], []], torch.ones(1))


def test_scale_refuses_lists_of_different_length():
    with pytest.raises(ValueError, match=r"list lengths \[2, 1\]"):
        gnd.multi_tensor_scale(CHUNK, _flag(), [[torch.ones(1)] * 2, [torch.ones(1)]], 0.5)


def test_tensor_scale_refuses_more_than_one_element():
    with pytest.raises(ValueError, match=r"scale has shape \(2,\)"):
        gnd.multi_tensor_scale_tensor(CHUNK, _flag(), [[torch.ones(1)]] * 2, torch.ones(2))


# -- no host reads ----------------------------------------------------------------------------


class HostReadError(AssertionError):
    pass


_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__complex__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}


class _NoHostReads(TorchFunctionMode):
    """Fails on every way Python code reads a tensor's value on the host (what a CUDA graph
    capture rejects with "operation not permitted when stream is capturing")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            raise HostReadError(f"host read: {func.__name__}")
        return func(*args, **(kwargs or {}))


def _run_all_kernels(device: str) -> None:
    grads = [torch.randn(5, device=device), torch.randn(3, device=device).bfloat16()]
    flag = torch.zeros(1, dtype=torch.int, device=device)
    norm, _ = gnd.multi_tensor_l2norm(CHUNK, flag, [grads], True)
    gnd.multi_tensor_l2norm(CHUNK, flag, [[]], False)
    coefficient = (1.0 / (norm + 1e-6)).clamp_max_(1.0)
    gnd.multi_tensor_scale_tensor(CHUNK, flag, [grads, grads], coefficient)
    gnd.multi_tensor_scale(CHUNK, flag, [grads, [torch.empty_like(g) for g in grads]], 0.5)


def test_the_host_read_guard_catches_megatron_local_fallback():
    grads = [torch.ones(3)]
    with pytest.raises(HostReadError), _NoHostReads():
        _local().local_multi_tensor_l2_norm(CHUNK, _flag(), [grads], False)
    with pytest.raises(HostReadError), _NoHostReads():
        bool(torch.ones(1))


def test_kernels_do_not_read_the_host():
    with _NoHostReads():
        _run_all_kernels("cpu")


def test_kernels_run_on_meta_tensors_which_have_no_values_to_read():
    _run_all_kernels("meta")
    # The control: megatron-core's fallback needs the values.
    with pytest.raises(RuntimeError, match="meta"):
        _local().local_multi_tensor_l2_norm(
            CHUNK, torch.zeros(1, device="meta"), [[torch.ones(2, device="meta")]], False
        )


# -- megatron-core's real clip-grad path (0.16.1 on the CPU) ----------------------------------


@contextlib.contextmanager
def _world() -> Iterator[None]:
    import cpu_redirect

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        with cpu_redirect.cpu_redirect():
            yield
    finally:
        torch.distributed.destroy_process_group()


def _clip_grads_module() -> types.ModuleType:
    from megatron.core.optimizer import clip_grads

    return clip_grads


def _params(grad_values: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for value in grad_values:
        param = torch.nn.Parameter(torch.zeros_like(value))
        param.grad = value.clone()
        params.append(param)
    return params


def _clip(grad_values: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    clip_grads = _clip_grads_module()
    params = _params(grad_values)
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
    return norm, [p.grad for p in params]


@needs_mcore_on_cpu
@pytest.mark.parametrize("name", sorted(GRAD_SETS))
def test_get_grad_norm_fp32_is_the_same_with_the_kernels_installed(name):
    clip_grads = _clip_grads_module()
    grads = _grads(name)
    with _world():
        without = clip_grads.get_grad_norm_fp32(grads)
        handle = gnd.install(clip_grads)
        try:
            with_kernels = clip_grads.get_grad_norm_fp32(grads)
        finally:
            handle.restore()

    assert handle.replaced, "megatron-core 0.16.1 on the CPU uses its local fallback"
    tolerance = 1e-2 if any(g.dtype == torch.bfloat16 for g in grads) else 1e-6
    assert with_kernels == pytest.approx(without, rel=tolerance)
    assert with_kernels == pytest.approx(_exact_norm(grads), rel=1e-6)


@needs_mcore_on_cpu
def test_get_grad_norm_fp32_of_no_grads_and_of_non_finite_grads():
    clip_grads = _clip_grads_module()
    with _world():
        handle = gnd.install(clip_grads)
        try:
            empty = clip_grads.get_grad_norm_fp32([])
            infinite = clip_grads.get_grad_norm_fp32([torch.tensor([1.0, math.inf])])
            not_a_number = clip_grads.get_grad_norm_fp32([torch.tensor([math.nan])])
        finally:
            handle.restore()

    assert empty == 0.0
    assert infinite == math.inf
    assert math.isnan(not_a_number)


@needs_mcore_on_cpu
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "not clipped"])
def test_clip_grad_by_total_norm_fp32_is_the_same_with_the_kernels_installed(max_norm):
    clip_grads = _clip_grads_module()
    values = _grads("fp32")
    with _world():
        norm_without, clipped_without = _clip(values, max_norm)
        handle = gnd.install(clip_grads)
        try:
            norm_with, clipped_with = _clip(values, max_norm)
        finally:
            handle.restore()

    assert norm_with == pytest.approx(norm_without, rel=1e-6)
    for a, b, original in zip(clipped_with, clipped_without, values, strict=True):
        torch.testing.assert_close(a, b)
        if max_norm < norm_without:
            torch.testing.assert_close(a, original * (max_norm / (norm_without + 1e-6)))
        else:
            assert torch.equal(a, original)
    if max_norm < norm_without:
        assert _exact_norm(clipped_with) == pytest.approx(max_norm, rel=1e-5)


# -- install / restore ------------------------------------------------------------------------


def _snapshot(module: types.ModuleType) -> dict[str, Any]:
    return dict(vars(module))


def _assert_same_objects(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    changed = [name for name in before if before[name] is not after[name]]
    assert changed == []


@needs_mcore_on_cpu
def test_install_replaces_the_local_fallback_and_restore_puts_megatron_objects_back(caplog):
    clip_grads = _clip_grads_module()
    before = _snapshot(clip_grads)

    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        handle = gnd.install(clip_grads)
    try:
        assert clip_grads.l2_norm_impl is gnd.multi_tensor_l2norm
        assert clip_grads.multi_tensor_scale_impl is gnd.multi_tensor_scale
        assert handle.replaced == {
            "l2_norm_impl": before["l2_norm_impl"],
            "multi_tensor_scale_impl": before["multi_tensor_scale_impl"],
        }
        # 0.16.1 has no tensor-scale global: get_grad_norm_fp32 still calls .item().
        assert not hasattr(clip_grads, gnd.SCALE_TENSOR)
        assert handle.reads_host_after is True
        assert "local_multi_tensor_l2_norm" in handle.description
        assert ".item()" in handle.description
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1
        assert "l2_norm_impl (local_multi_tensor_l2_norm)" in lines[0]
        assert "local fallback" in lines[0]
    finally:
        handle.restore()
    _assert_same_objects(before, _snapshot(clip_grads))

    handle.restore()  # a second restore does nothing
    _assert_same_objects(before, _snapshot(clip_grads))


@needs_mcore_on_cpu
def test_a_second_run_in_the_process_installs_again_from_megatron_state():
    clip_grads = _clip_grads_module()
    before = _snapshot(clip_grads)
    for _ in range(2):
        handle = gnd.install(clip_grads)
        assert clip_grads.l2_norm_impl is gnd.multi_tensor_l2norm
        handle.restore()
        _assert_same_objects(before, _snapshot(clip_grads))


@needs_mcore_on_cpu
def test_an_install_while_installed_changes_nothing_and_its_restore_keeps_the_first():
    clip_grads = _clip_grads_module()
    before = _snapshot(clip_grads)
    first = gnd.install(clip_grads)
    try:
        assert gnd.plan(clip_grads).already_installed
        second = gnd.install(clip_grads)
        assert second.replaced == {}
        assert "already installed" in second.description
        second.restore()
        assert clip_grads.l2_norm_impl is gnd.multi_tensor_l2norm
    finally:
        first.restore()
    _assert_same_objects(before, _snapshot(clip_grads))


@needs_mcore_on_cpu
def test_install_defaults_to_megatron_clip_grads_module():
    clip_grads = _clip_grads_module()
    handle = gnd.install()
    try:
        assert handle.module is clip_grads
        assert clip_grads.l2_norm_impl is gnd.multi_tensor_l2norm
    finally:
        handle.restore()


# -- the decision, on the globals of each installation ----------------------------------------


def _fused(module: str, name: str) -> Any:
    """A stand-in for a compiled kernel (``amp_C.multi_tensor_l2norm``,
    ``transformer_engine_torch.multi_tensor_scale_tensor``): named and placed as the real one."""

    def kernel(chunk_size, noop_flag, tensor_lists, *args):
        raise AssertionError("a fused kernel cannot run on the CPU")

    kernel.__module__ = module
    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def _clip_grads_like(**globals_: Any) -> types.ModuleType:
    module = types.ModuleType("megatron.core.optimizer.clip_grads")
    for name, value in globals_.items():
        setattr(module, name, value)
    return module


def _mcore19_local() -> types.ModuleType:
    """0.19's globals after its local-fallback branch (clip_grads.py:44-47)."""
    utils = _local()
    return _clip_grads_like(
        multi_tensor_applier=utils.local_multi_tensor_applier,
        l2_norm_impl=utils.local_multi_tensor_l2_norm,
        multi_tensor_scale_impl=utils.local_multi_tensor_scale,
        multi_tensor_scale_tensor_impl=None,
    )


def _mcore19_apex() -> types.ModuleType:
    """0.19's globals after its Apex branch (clip_grads.py:22-28)."""
    return _clip_grads_like(
        multi_tensor_applier=_fused("apex.multi_tensor_apply.multi_tensor_apply", "applier"),
        l2_norm_impl=_fused("amp_C", "multi_tensor_l2norm"),
        multi_tensor_scale_impl=_fused("amp_C", "multi_tensor_scale"),
        multi_tensor_scale_tensor_impl=None,
    )


def _mcore19_te214() -> types.ModuleType:
    """0.19's globals with Transformer Engine >= 2.14 (clip_grads.py:10-20)."""
    te = "transformer_engine_torch"
    return _clip_grads_like(
        multi_tensor_applier=_fused("transformer_engine.pytorch.optimizers", "applier"),
        l2_norm_impl=_fused(te, "multi_tensor_l2norm"),
        multi_tensor_scale_impl=_fused(te, "multi_tensor_scale"),
        multi_tensor_scale_tensor_impl=_fused(te, "multi_tensor_scale_tensor"),
    )


def _mcore16_te() -> types.ModuleType:
    """0.16's globals with Transformer Engine (no tensor-scale global at all)."""
    te = "transformer_engine_torch"
    return _clip_grads_like(
        multi_tensor_applier=_fused("transformer_engine.pytorch.optimizers", "applier"),
        l2_norm_impl=_fused(te, "multi_tensor_l2norm"),
        multi_tensor_scale_impl=_fused(te, "multi_tensor_scale"),
    )


def test_decision_for_megatron_019_local_fallback_replaces_all_three():
    module = _mcore19_local()
    decision = gnd.plan(module)
    assert decision.reads_host is True
    assert decision.reads_host_after is False
    assert decision.replacements == {
        "l2_norm_impl": gnd.multi_tensor_l2norm,
        "multi_tensor_scale_impl": gnd.multi_tensor_scale,
        "multi_tensor_scale_tensor_impl": gnd.multi_tensor_scale_tensor,
    }

    before = _snapshot(module)
    handle = gnd.install(module)
    assert module.multi_tensor_scale_tensor_impl is gnd.multi_tensor_scale_tensor
    assert module.multi_tensor_applier is before["multi_tensor_applier"]  # pure Python: kept
    assert "the norm stays on the device" in handle.description
    handle.restore()
    _assert_same_objects(before, _snapshot(module))


@needs_mcore_on_cpu
def test_decision_for_the_real_megatron_016_local_fallback():
    decision = gnd.plan(_clip_grads_module())
    assert decision.reads_host is True
    assert decision.reads_host_after is True  # the unconditional .item() (clip_grads.py:133)
    assert set(decision.replacements) == {"l2_norm_impl", "multi_tensor_scale_impl"}


def test_decision_for_apex_without_a_tensor_scale_replaces_only_the_tensor_scale():
    module = _mcore19_apex()
    decision = gnd.plan(module)
    assert decision.reads_host is True
    assert decision.reads_host_after is False
    assert decision.replacements == {
        "multi_tensor_scale_tensor_impl": gnd.multi_tensor_scale_tensor
    }


@pytest.mark.parametrize(
    ("module", "reads_host"),
    [(_mcore19_te214, False), (_mcore16_te, True)],
    ids=["0.19 with TE 2.14", "0.16 with TE"],
)
def test_decision_leaves_fused_kernels_alone(module, reads_host):
    module = module()
    decision = gnd.plan(module)
    assert decision.replacements == {}
    assert decision.reads_host is reads_host
    assert decision.reads_host_after is reads_host

    before = _snapshot(module)
    handle = gnd.install(module)
    _assert_same_objects(before, _snapshot(module))
    assert handle.replaced == {}
    assert handle.reads_host_after is reads_host
    assert "megatron-core's own kernels" in handle.description
    handle.restore()
    _assert_same_objects(before, _snapshot(module))


def test_decision_for_an_unknown_layout_is_unknown_and_changes_nothing():
    module = _clip_grads_like(some_other_global=1)
    decision = gnd.plan(module)
    assert decision.reads_host is None and decision.reads_host_after is None
    assert decision.replacements == {}
    assert "does not know" in decision.reason


def test_the_package_module_imports_no_torch(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; import cudagraph_plugin.compat.grad_norm; "
        "print('torch' in sys.modules, 'megatron' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.split() == ["False", "False"]
