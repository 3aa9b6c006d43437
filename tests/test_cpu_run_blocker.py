"""CPU runs refuse to start, with the reason, where megatron-core picked fused GPU kernels.

megatron-core takes Transformer Engine's (or Apex's) fused Adam and norms whenever they are
installed; on CPU tensors they die with "an illegal memory access" (seen on the H200 machine
with CUDA hidden). These tests swap ``megatron.core.optimizer.Adam`` for classes named like
the real ones, so they run (and mean the same) with or without TE installed.
"""

from __future__ import annotations

import pytest
import torch

import cpu_redirect
import train_gpt


def _adam_from(module: str, name: str = "FusedAdam") -> type:
    adam = type(name, (), {})
    adam.__module__ = module
    return adam


@pytest.fixture
def te_adam(monkeypatch: pytest.MonkeyPatch) -> type:
    from megatron.core import optimizer

    adam = _adam_from("transformer_engine.pytorch.optimizers.fused_adam")
    monkeypatch.setattr(optimizer, "Adam", adam)
    return adam


def test_torch_adam_allows_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import optimizer

    monkeypatch.setattr(optimizer, "Adam", torch.optim.AdamW)
    assert cpu_redirect.cpu_run_blocker() is None


@pytest.mark.parametrize(
    "module",
    ["transformer_engine.pytorch.optimizers.fused_adam", "apex.optimizers.fused_adam"],
)
def test_fused_adam_blocks_cpu_runs_and_says_which(
    monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    from megatron.core import optimizer

    monkeypatch.setattr(optimizer, "Adam", _adam_from(module))
    reason = cpu_redirect.cpu_run_blocker()
    assert reason is not None
    assert f"{module}.FusedAdam" in reason
    assert "cannot train on the CPU here" in reason
    assert "without Transformer Engine and Apex" in reason


def test_the_redirect_refuses_to_start_and_changes_nothing(te_adam: type) -> None:
    available = torch.cuda.is_available
    with pytest.raises(RuntimeError, match="cannot train on the CPU here"):
        with cpu_redirect.cpu_redirect():
            pytest.fail("the block must not run")
    assert not cpu_redirect.is_active()
    assert torch.cuda.is_available is available


def test_the_example_exits_with_the_reason(
    te_adam: type, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.run(["--cpu", "--train-iters", "1"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu: megatron-core uses transformer_engine.pytorch.optimizers" in err
