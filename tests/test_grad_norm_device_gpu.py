"""megatron-core's real clip-grad path captured in a CUDA graph with the device-side kernels.

On a CUDA device, with whatever megatron-core and kernels are installed: where
``compat.grad_norm.install`` says the path no longer reads the host (megatron-core 0.19+:
its local fallback or Apex, with the kernels installed; or Transformer Engine >= 2.14 as it
is), ``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32`` must capture, and replays on
new gradients must give what the eager path gives. Where it says a host read remains
(megatron-core 0.16), the path must indeed read the host. The all-reduce runs over a
one-rank NCCL group, as in a real run. Skipped without CUDA (marker ``gpu``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from cudagraph_plugin.compat import grad_norm as gnd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def nccl_world(tmp_path) -> Iterator[None]:
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.zeros(shape, device="cuda"))
        param.grad = torch.zeros(shape, device="cuda")
        params.append(param)
    return params


def _fill(params: list[torch.nn.Parameter], seed: int, scale: float) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    values = [scale * torch.randn(p.shape, device="cuda", generator=generator) for p in params]
    for param, value in zip(params, values, strict=True):
        param.grad.copy_(value)
    return values


def _eager(values: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """megatron-core's own eager result (its kernels, whatever reads the host)."""
    from megatron.core.optimizer import clip_grads

    params = _params([tuple(v.shape) for v in values])
    for param, value in zip(params, values, strict=True):
        param.grad.copy_(value)
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
    return float(norm if not isinstance(norm, torch.Tensor) else norm.item()), [
        p.grad.clone() for p in params
    ]


@contextlib.contextmanager
def _installed() -> Iterator[gnd.GradNormInstall]:
    handle = gnd.install()
    try:
        yield handle
    finally:
        handle.restore()


def test_the_clip_grad_path_captures_exactly_where_install_says_it_stays_on_the_device(
    nccl_world,
):
    from megatron.core.optimizer import clip_grads

    max_norm = 1.0
    shapes = [(1024, 64), (4096,), (3, 5, 7)]
    with _installed() as handle:
        params = _params(shapes)
        grads = [p.grad for p in params]

        def step() -> torch.Tensor:
            norm = clip_grads.get_grad_norm_fp32(grads)
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
            return norm

        if handle.reads_host_after is not False:
            from test_grad_norm_device import HostReadError, _NoHostReads

            _fill(params, seed=0, scale=1.0)
            with pytest.raises(HostReadError), _NoHostReads():
                step()
            return

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _fill(params, seed=0, scale=1.0)
            step()  # warm-up off the default stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured_norm = step()

        for seed, scale in [(1, 1.0), (2, 1e-4), (3, 30.0)]:
            values = _fill(params, seed, scale)
            graph.replay()
            torch.cuda.synchronize()
            replayed = [g.clone() for g in grads]
            replayed_norm = captured_norm.item()
            with _restored(handle):
                expected_norm, expected = _eager(values, max_norm)
            assert replayed_norm == pytest.approx(expected_norm, rel=1e-5)
            for got, want in zip(replayed, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@contextlib.contextmanager
def _restored(handle: gnd.GradNormInstall) -> Iterator[None]:
    """megatron-core's own kernels for the block, the device-side ones again after it."""
    from megatron.core.optimizer import clip_grads

    installed = {name: getattr(clip_grads, name) for name in handle.replaced}
    for name, original in handle.replaced.items():
        setattr(clip_grads, name, original)
    try:
        yield
    finally:
        for name, kernel in installed.items():
            setattr(clip_grads, name, kernel)
