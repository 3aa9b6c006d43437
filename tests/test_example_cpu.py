"""The example host (``examples/train_gpt.py``) on real megatron-core 0.16.1, on the CPU.

This module owns the tests of the example training loop and of the CUDA-to-CPU redirect it
runs under (``examples/cpu_redirect.py``): the loop trains, fires the hooks of
:mod:`hookspecs.spec` in the documented order through a real plugin manager, toggles the
forward pre-hooks the Megatron-LM way, ends with the right shutdown reason on every path,
and leaves nothing behind for the next run in the same process. Every run passes ``--cpu``
so the tests check the CPU path on a CUDA machine too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_only import needs_mcore_on_cpu

import cpu_redirect
import train_gpt
from hookspecs import PeerFailed, get_plugin_manager, hookimpl, spec

pytestmark = needs_mcore_on_cpu

EXAMPLE = Path(train_gpt.__file__)

# Hooks the CUDA graph plugin fires itself (never on the CPU, except the report at shutdown);
# the order tests below are about the hooks the host fires.
PLUGIN_EVENTS = {"before_capture", "after_capture", "report"}


class Recorder:
    """A plugin implementing every hook: records ``(hook, details...)`` in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.step_metrics: dict[int, dict[str, Any]] = {}
        self.eval_metrics: list[dict[str, Any]] = []
        self.pre_hook_handles: dict[int, int] = {}
        self.model: list[Any] | None = None

    def host_calls(self) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] not in PLUGIN_EVENTS]

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    @hookimpl
    def mcgraph_add_arguments(self, parser: Any) -> None:
        self.calls.append(("add_arguments",))

    @hookimpl
    def mcgraph_configure(self, config: Any, pluginmanager: Any) -> None:
        self.calls.append(("configure",))

    @hookimpl
    def mcgraph_model_config_kwargs(self, config: Any) -> None:
        self.calls.append(("model_config_kwargs",))

    @hookimpl
    def mcgraph_rng_options(self, config: Any) -> None:
        self.calls.append(("rng_options",))

    @hookimpl
    def mcgraph_rng_initialized(self, config: Any) -> None:
        self.calls.append(("rng_initialized",))

    @hookimpl
    def mcgraph_model_build_context(self, config: Any) -> Any:
        self.calls.append(("model_build_context",))

        @contextlib.contextmanager
        def recording() -> Iterator[None]:
            self.calls.append(("model_build_context.enter",))
            yield
            self.calls.append(("model_build_context.exit",))

        return recording()

    @hookimpl
    def mcgraph_model_built(
        self,
        model: list[Any],
        optimizer: Any,
        model_config: Any,
        seq_length: int,
        micro_batch_size: int,
    ) -> None:
        self.model = model
        self.calls.append(("model_built", len(model), seq_length, micro_batch_size))

    @hookimpl
    def mcgraph_forward_backward_func(self, forward_backward_func: Any) -> None:
        self.calls.append(("forward_backward_func",))

    # A query the CUDA graph plugin answers (in every run mode): observed, not answered.
    @hookimpl(wrapper=True)
    def mcgraph_warmup_steps(self, config: Any) -> Iterator[None]:
        answer = yield
        self.calls.append(("warmup_steps", answer))
        return answer

    @hookimpl
    def mcgraph_train_start(self, start_step: int, train_iters: int) -> None:
        self.calls.append(("train_start", start_step, train_iters))

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        self.calls.append(("train_step_start", step))
        if self.model is not None and hasattr(self.model[0], "remove_forward_pre_hook_handles"):
            self.pre_hook_handles[step] = len(self.model[0].remove_forward_pre_hook_handles)

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        self.calls.append(("post_warmup_step", step, start_step))

    @hookimpl
    def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("train_step_end", step))
        self.step_metrics[step] = dict(metrics)

    @hookimpl
    def mcgraph_step_padded(
        self, step: int, seq_length: int, real_tokens: int, padded_tokens: int
    ) -> None:
        self.calls.append(("step_padded", step, seq_length))

    @hookimpl
    def mcgraph_invalidate_graphs(self, reason: str) -> None:
        self.calls.append(("invalidate_graphs", reason))

    @hookimpl
    def mcgraph_disable_forward_pre_hook(self, model: list[Any], param_sync: bool) -> None:
        self.calls.append(("disable_forward_pre_hook", param_sync))

    @hookimpl
    def mcgraph_enable_forward_pre_hook(self, model: list[Any]) -> None:
        self.calls.append(("enable_forward_pre_hook",))

    @hookimpl
    def mcgraph_evaluation_start(self, step: int) -> None:
        self.calls.append(("evaluation_start", step))

    @hookimpl
    def mcgraph_evaluation_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("evaluation_end", step))
        self.eval_metrics.append(dict(metrics))

    @hookimpl
    def mcgraph_before_capture(self, step: int, impl: str, scope: list[str]) -> None:
        self.calls.append(("before_capture", step, impl))

    @hookimpl
    def mcgraph_after_capture(
        self, step: int, impl: str, scope: list[str], seconds: float, graph_count: int
    ) -> None:
        self.calls.append(("after_capture", step, impl))

    @hookimpl
    def mcgraph_report(self, report: Any) -> None:
        self.calls.append(("report",))

    @hookimpl
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> None:
        self.calls.append(("shutdown", str(reason)))


def train(*argv: str, plugins: tuple[Any, ...] = ()) -> dict[str, Any]:
    return train_gpt.run(["--cpu", "--log-interval", "0", *argv], plugins=plugins)


def assert_finite(losses: list[float]) -> None:
    assert losses
    assert all(math.isfinite(loss) for loss in losses), losses


# -------------------------------------------------------------------------------------------
# The training loop.
# -------------------------------------------------------------------------------------------


def test_recorder_implements_every_hook() -> None:
    specs = {name for name, _ in inspect.getmembers(spec, inspect.isfunction)}
    specs = {name for name in specs if name.startswith("mcgraph_")}
    implemented = {name for name in dir(Recorder) if name.startswith("mcgraph_")}
    assert implemented == specs
    get_plugin_manager(load_entrypoints=False).register(Recorder())  # signatures validate


def test_loss_is_finite_and_falls_over_ten_steps() -> None:
    summary = train("--train-iters", "10")

    assert summary["steps"] == 10
    assert summary["device"] == "cpu"
    assert summary["shutdown_reason"] == "completed"
    losses = summary["losses"]
    assert_finite(losses)
    assert len(losses) == 10
    assert summary["first_loss"] == losses[0] and summary["last_loss"] == losses[-1]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    assert summary["median_step_ms"] > 0
    assert summary["eval_losses"] == []


def test_hook_order_of_a_short_run_with_evaluation() -> None:
    recorder = Recorder()
    argv = ["--train-iters", "3", "--eval-interval", "2", "--eval-iters", "2"]
    summary = train(*argv, "--cuda-graph-warmup-steps", "1", plugins=(recorder,))

    assert recorder.host_calls() == [
        ("add_arguments",),
        ("configure",),
        ("rng_options",),
        ("rng_initialized",),
        ("model_config_kwargs",),
        ("model_build_context",),
        ("model_build_context.enter",),
        ("model_build_context.exit",),
        ("model_built", 1, 32, 2),
        ("forward_backward_func",),
        ("warmup_steps", 1),
        ("train_start", 0, 3),
        ("train_step_start", 0),
        ("train_step_end", 0),
        ("train_step_start", 1),
        ("post_warmup_step", 1, 0),
        ("train_step_end", 1),
        ("evaluation_start", 1),
        ("evaluation_end", 1),
        ("train_step_start", 2),
        ("train_step_end", 2),
        ("shutdown", "completed"),
    ]
    assert summary["shutdown_reason"] == "completed"
    # Step metrics are handed over as the loop has them (the loss is still a tensor).
    assert set(recorder.step_metrics) == {0, 1, 2}
    for metrics in recorder.step_metrics.values():
        assert isinstance(metrics["loss"], torch.Tensor)
        assert math.isfinite(float(metrics["loss"]))
        assert metrics["step_time_ms"] > 0
    assert len(summary["eval_losses"]) == 1
    assert recorder.eval_metrics == [{"loss": summary["eval_losses"][0]}]
    assert_finite(summary["eval_losses"])


def test_exit_interval_ends_with_early_exit() -> None:
    recorder = Recorder()
    summary = train("--train-iters", "10", "--exit-interval", "3", plugins=(recorder,))

    assert summary["steps"] == 3
    assert summary["shutdown_reason"] == "early_exit"
    assert recorder.host_calls()[-1] == ("shutdown", "early_exit")
    assert ("train_step_start", 3) not in recorder.calls


def test_distributed_optimizer_with_overlap_toggles_pre_hooks_around_first_step() -> None:
    recorder = Recorder()
    summary = train(
        "--train-iters",
        "3",
        "--use-distributed-optimizer",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
        plugins=(recorder,),
    )

    assert_finite(summary["losses"])
    calls = recorder.host_calls()
    disable = calls.index(("disable_forward_pre_hook", False))
    enable = calls.index(("enable_forward_pre_hook",))
    assert disable < calls.index(("train_step_start", 0))
    assert calls.index(("train_step_end", 0)) < enable < calls.index(("train_step_start", 1))
    assert [call[0] for call in calls].count("disable_forward_pre_hook") == 1
    assert [call[0] for call in calls].count("enable_forward_pre_hook") == 1
    # The host's default implementations really removed and restored the DDP hooks.
    assert recorder.pre_hook_handles[0] == 0
    assert recorder.pre_hook_handles[1] > 0


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--bf16"], id="bf16"),
        pytest.param(
            [
                "--num-experts",
                "4",
                "--moe-router-topk",
                "2",
                "--moe-expert-capacity-factor",
                "1.0",
                "--moe-pad-expert-input-to-capacity",
            ],
            id="moe-drop-and-pad",
        ),
        pytest.param(["--recompute-granularity", "full"], id="full-recompute"),
        pytest.param(["--num-microbatches", "2", "--overlap-grad-reduce"], id="microbatches"),
    ],
)
def test_configurations_train_on_cpu(extra: list[str]) -> None:
    summary = train("--train-iters", "3", *extra)

    assert summary["steps"] == 3
    assert summary["shutdown_reason"] == "completed"
    assert_finite(summary["losses"])


def test_two_runs_in_one_process_start_fresh() -> None:
    first = train("--train-iters", "3", "--eval-interval", "3")
    second = train("--train-iters", "3", "--eval-interval", "3")

    assert second["losses"] == pytest.approx(first["losses"], rel=1e-6)
    assert second["eval_losses"] == pytest.approx(first["eval_losses"], rel=1e-6)
    assert second["shutdown_reason"] == "completed"


def test_exception_in_a_plugin_ends_the_run_and_cleans_up() -> None:
    from megatron.core import parallel_state

    class Failing(Recorder):
        @hookimpl
        def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
            if step == 1:
                raise RuntimeError("plugin failed at step 1")

    failing = Failing()
    with pytest.raises(RuntimeError, match="plugin failed at step 1"):
        train("--train-iters", "5", plugins=(failing,))

    assert failing.host_calls()[-1] == ("shutdown", "exception")
    assert not torch.distributed.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    assert not cpu_redirect.is_active()
    assert train("--train-iters", "2")["steps"] == 2


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine is installed",
)
def test_transformer_engine_impl_without_te_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        train("--transformer-impl", "transformer_engine")

    assert excinfo.value.code == 2
    assert "needs Transformer Engine, which is not installed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [
        (("--train-iters", "-5"), "--train-iters -5: give a number >= 0"),
        (("--log-interval", "-1"), "--log-interval -1: give a number >= 0"),
        (("--seq-length", "0"), "--seq-length 0: give a number >= 1"),
        (("--train-iters", "3", "--start-step", "4"), "--start-step 4 must not exceed --train-"
         "iters 3"),
    ],
)  # fmt: skip
def test_a_count_out_of_range_is_a_usage_error_naming_the_flag_given(capsys, argv, said) -> None:
    """(review of 2026-12-04: ``--train-iters -5`` was blamed on --start-step, and
    ``--log-interval -1`` ran.)"""
    with pytest.raises(SystemExit) as excinfo:
        train(*argv)
    assert excinfo.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [
        (("--tensor-model-parallel-size", "2"), "--tensor-model-parallel-size 2 x "
         "--pipeline-model-parallel-size 1 = 2 ranks per model replica must divide the job's 1 "
         "process(es)"),
        (("--pipeline-model-parallel-size", "2"), "torchrun --nproc-per-node 2"),
        (("--sequence-parallel",), "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (("--num-experts", "2", "--moe-router-topk", "3"), "--moe-router-topk 3 must not exceed "
         "--num-experts 2"),
        (("--eval-interval", "2", "--eval-iters", "0"), "--eval-interval 2 needs --eval-iters "
         ">= 1"),
        (("--lr", "-1"), "--lr -1.0: give a number >= 0"),
    ],
)  # fmt: skip
def test_a_layout_megatron_core_would_refuse_later_is_a_usage_error(capsys, argv, said) -> None:
    """A user review (2026-12-05): each ran into megatron-core's own error, or an
    ``IndexError`` of the example, with a traceback after the run had started."""
    with pytest.raises(SystemExit) as excinfo:
        train("--train-iters", "2", *argv)
    assert excinfo.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.skipif(
    "optimizer_cuda_graph" in train_gpt._optimizer_config_fields(),
    reason="this megatron-core has the capturable optimizer (0.17+)",
)
def test_the_capturable_optimizer_on_an_older_megatron_core_is_a_usage_error(capsys) -> None:
    """It failed in OptimizerConfig with a TypeError (unexpected keyword argument)."""
    with pytest.raises(SystemExit) as excinfo:
        train("--train-iters", "2", "--capturable-optimizer")
    assert excinfo.value.code == 2
    assert "--capturable-optimizer needs megatron-core 0.17+" in capsys.readouterr().err


def test_every_problem_of_the_host_flags_is_said_at_once(capsys) -> None:
    """One at a time, each after a 50-line usage dump (a user review, 2026-12-05)."""
    with pytest.raises(SystemExit) as excinfo:
        train(
            "--loss-scale", "5", "--overlap-param-gather", "--pipeline-model-parallel-size",
            "2", "--num-virtual-stages-per-pipeline-rank", "2", "--num-microbatches", "3",
        )  # fmt: skip
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "train_gpt.py: error: 4 problems:\n  1. --tensor-model-parallel-size 1 x " in err
    assert "\n  2. --overlap-param-gather needs --use-distributed-optimizer\n" in err
    assert "\n  3. --loss-scale needs --fp16" in err
    assert "\n  4. the interleaved schedule needs --num-microbatches (3)" in err
    assert "usage:" not in err and "(train_gpt.py --help lists the flags)" in err


def test_the_help_says_each_default_once() -> None:
    """(review of 2026-12-04: "(default: megatron-core's 3) (default: None)", and flags
    without help showed no default.)"""
    text = train_gpt.build_parser(get_plugin_manager()).format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "default: 32" in " ".join(text.split("--seq-length SEQ_LENGTH", 2)[2].split()[:2])


# -------------------------------------------------------------------------------------------
# The example as a program.
# -------------------------------------------------------------------------------------------


def _parser_has_cuda_graph_impl() -> bool:
    parser = train_gpt.build_parser(get_plugin_manager())
    return "--cuda-graph-impl" in parser._option_string_actions


@pytest.fixture(scope="module")
def script_run(subprocess_env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], bool]:
    """``python examples/train_gpt.py --cpu --train-iters 3``, asking for graphs if it can."""
    asks_for_graphs = _parser_has_cuda_graph_impl()
    argv = [sys.executable, str(EXAMPLE), "--cpu", "--train-iters", "3"]
    if asks_for_graphs:
        argv += ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    result = subprocess.run(
        argv, capture_output=True, text=True, env=subprocess_env, timeout=120, check=False
    )
    return result, asks_for_graphs


# The tests of one module-scoped run share a pytest-xdist worker (make test runs --dist
# loadgroup), so the script runs once, not once on each worker.
@pytest.mark.slow
@pytest.mark.xdist_group("example_script_run")
def test_script_exits_zero_and_prints_the_summary(
    script_run: tuple[subprocess.CompletedProcess[str], bool],
) -> None:
    result, _ = script_run

    assert result.returncode == 0, result.stderr[-4000:]
    assert "trained 3 step(s) on cpu: loss " in result.stdout
    assert "shutdown: completed" in result.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("example_script_run")
def test_script_says_once_that_cuda_graphs_need_a_cuda_device(
    script_run: tuple[subprocess.CompletedProcess[str], bool],
) -> None:
    result, asks_for_graphs = script_run
    if not asks_for_graphs:
        pytest.skip(
            "no installed plugin adds --cuda-graph-impl (the cudagraph entry point is missing "
            "or blocked), so there is no graph request to turn down"
        )

    output = result.stdout + result.stderr
    assert output.count("CUDA graphs need a CUDA device") == 1, output[-4000:]


# -------------------------------------------------------------------------------------------
# The CUDA-to-CPU redirect.
# -------------------------------------------------------------------------------------------


def test_redirect_maps_cuda_to_cpu_and_restores_everything() -> None:
    originals = {name: getattr(torch.cuda, name) for name in ("current_device", "Stream")}

    with cpu_redirect.cpu_redirect():
        assert cpu_redirect.is_active()
        assert not torch.cuda.is_available()
        for device in ("cuda", "cuda:0", torch.device("cuda"), 0):
            assert torch.zeros(2, device=device).device.type == "cpu"
        tensor = torch.ones(2)
        assert tensor.cuda() is tensor
        assert tensor.to("cuda").device.type == "cpu"
        assert tensor.to(torch.device("cuda", 0), torch.float64).dtype == torch.float64
        assert tensor.type() == "torch.cuda.FloatTensor"
        assert tensor.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert torch.cuda.current_device() == "cpu"
        stream = torch.cuda.Stream(device=torch.cuda.current_device())
        with torch.cuda.stream(stream):
            assert torch.cuda.current_stream() is stream
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with cpu_redirect.cpu_redirect():
                pass

    assert not cpu_redirect.is_active()
    for name, original in originals.items():
        assert getattr(torch.cuda, name) is original
    assert torch.ones(2).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(2, device="cuda")


def test_redirect_is_undone_when_the_block_raises() -> None:
    original = torch.cuda.synchronize
    with pytest.raises(ValueError, match="boom"):
        with cpu_redirect.cpu_redirect():
            raise ValueError("boom")
    assert torch.cuda.synchronize is original
    assert not cpu_redirect.is_active()


def test_a_ctrl_c_inside_torchs_mode_bookkeeping_stays_a_ctrl_c() -> None:
    """An interrupt that lands while torch has the redirect's mode popped off its stack (a
    review: a 2-rank rl_loop stopped by Ctrl-C, one rank's interrupt inside
    ``torch.overrides._pop_mode_temporarily``) left the stack without the mode: leaving the
    redirect then failed ("empty mode stack"), and that error replaced the interrupt (a
    traceback and status 1 instead of the Ctrl-C's line)."""
    original = torch.cuda.synchronize
    with pytest.raises(KeyboardInterrupt) as info:
        with cpu_redirect.cpu_redirect():
            torch.overrides._pop_mode()  # (where the interrupt left torch's stack)
            raise KeyboardInterrupt
    assert info.value.__context__ is None  # (raised as it was: its own context, none)
    failed = KeyboardInterrupt()  # (one held during a failed run's shutdown keeps its own)
    with pytest.raises(KeyboardInterrupt) as info:
        with cpu_redirect.cpu_redirect():
            torch.overrides._pop_mode()
            try:
                raise ValueError("the real bug")
            except ValueError:
                raise failed  # noqa: B904 (as TrainingRun's __exit__ raises it)
    assert info.value is failed and isinstance(failed.__context__, ValueError)
    assert not failed.__suppress_context__
    assert torch.cuda.synchronize is original
    assert not cpu_redirect.is_active()
    with pytest.raises(PeerFailed):  # (the watch's interrupt, the same way)
        with cpu_redirect.cpu_redirect():
            torch.overrides._pop_mode()
            raise PeerFailed(1, "interrupted")
    with pytest.raises(RuntimeError, match="boom"):  # (any other error is left as it is)
        with cpu_redirect.cpu_redirect():
            raise RuntimeError("boom")
    assert not cpu_redirect.is_active()


def test_redirect_runs_backward_under_the_mode() -> None:
    seen: list[str] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            # Like activation recomputation: code in the backward pass asks for CUDA memory.
            seen.append(torch.ones(1, device="cuda").device.type)
            return grad * 2

    with cpu_redirect.cpu_redirect():
        x = torch.ones(3, requires_grad=True)
        torch.autograd.backward(Probe.apply(x).sum())
        Probe.apply(x).sum().backward()

    assert seen == ["cpu", "cpu"]
    assert x.grad is not None and x.grad.tolist() == [4.0, 4.0, 4.0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-virtual-stages-per-pipeline-rank", "2"], "need --pipeline-model-parallel-size"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
             "--num-layers-per-virtual-pipeline-stage", "3"],
            "must be divisible by --num-layers-per-virtual-pipeline-stage 3",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
             "--num-microbatches", "3"],
            "--num-microbatches (3) divisible by --pipeline-model-parallel-size (2)",
        ),
        (["--fp8-format", "hybrid"], "--fp8-format needs --transformer-impl transformer_engine"),
    ],
)  # fmt: skip
def test_pipeline_and_fp8_flags_are_checked_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        train(*argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_virtual_stages_from_layers_per_stage_as_megatron_lm_derives_them() -> None:
    parser = train_gpt.build_parser(get_plugin_manager())
    args = parser.parse_args(
        ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
         "--num-layers-per-virtual-pipeline-stage", "2", "--num-microbatches", "4"]
    )  # fmt: skip
    problems: list[str] = []
    assert train_gpt._virtual_stages(args, problems) == 2
    args = parser.parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                              "--num-layers-per-virtual-pipeline-stage", "4"])  # fmt: skip
    assert train_gpt._virtual_stages(args, problems) is None  # one chunk per rank: no interleaving
    assert problems == []
    # a layout that does not divide says so, and nothing that follows from its floored
    # numbers (8 layers per stage by 3: "2 chunks" would ask for divisible micro-batches)
    args = parser.parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "16",
                              "--num-layers-per-virtual-pipeline-stage", "3",
                              "--num-microbatches", "3"])  # fmt: skip
    assert train_gpt._virtual_stages(args, problems) is None
    assert problems == [
        "the 8 layers per pipeline stage must be divisible by "
        "--num-layers-per-virtual-pipeline-stage 3"
    ]


TWO_RANK_ARGV = [
    "--cpu", "--train-iters", "5", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
    "--vocab-size", "128", "--log-interval", "0",
]  # fmt: skip


def two_rank_failure(tmp_path, name: str, fault: dict[str, str]) -> tuple[Any, dict, dict]:
    """A torchrun job of 2 ranks over gloo with the probe's ``fault``: it must end non-zero
    in time; the job, rank 1's record and rank 0's."""
    from train_jobs import launch

    # torchrun checks its workers every 0.1 s and then SIGTERMs the others: a rank still in
    # its teardown when the other exited dies by that signal, writing no ``at_exit`` record
    # (seen once in a loaded `make test`, 2026-12-06); every 5 s leaves each rank its own end
    monitor = {"PET_MONITOR_INTERVAL": "5"}
    job = launch(
        name, TWO_RANK_ARGV, job_dir=tmp_path, timeout_s=180, nproc=2, env={**fault, **monitor}
    )
    assert job.result.rc != 0 and not job.result.timed_out, job.context()
    failed, told = job.record(1), job.record(0)
    assert failed["shutdown_reason"] == "exception", job.context()
    assert told["shutdown_reason"] == "peer_failed", job.context()
    return job, failed, told


def test_a_rank_failing_ends_a_two_rank_job_with_every_process_group_aborted(tmp_path) -> None:
    """torchrun, 2 ranks over gloo: rank 1 raising at step 2 ends the job non-zero; rank 1
    ends by its exception and aborts its process groups instead of a graceful teardown
    (``cudagraph_plugin.abort_process_groups``); rank 0, told through the job's store,
    ends by ``peer_failed`` naming rank 1; neither is left with a process group."""
    job, failed, told = two_rank_failure(
        tmp_path, "cpu-raise-rank1", {"MCGRAPH_PROBE_RAISE": "2:1"}
    )
    assert "rank 1" in told["exception"]
    assert "rank 1: the run ended abnormally (exception); aborting the process groups" in (
        job.result.output()
    )
    for record in (failed, told):
        assert record.get("at_exit") == {"process_group_initialized": False}, job.context()
    # torchrun's summary of the failed job says it too (each entry was "To enable traceback
    # see ..."): rank 1's traceback (the example's @record), rank 0's reason naming rank 1
    summary = job.result.output().split("ChildFailedError:", 1)[-1]
    assert "RuntimeError: mcgraph probe: injected failure at step 2 on rank 1" in summary, (
        job.context()
    )
    assert "this rank's run ended because of another rank: rank 1 (" in summary, job.context()
    assert "To enable traceback" not in summary, job.context()


def test_a_rank_failing_before_any_hook_started_the_watch_still_tells_the_others(
    tmp_path,
) -> None:
    """torchrun, 2 ranks over gloo: rank 1 fails in its seeding (``mcgraph_rng_options``),
    after the process group exists and before any hook started the peer watch on it; rank 0
    goes on into the model build. Rank 1's shutdown starts the watch to mark its failure,
    so rank 0 ends by ``peer_failed`` naming it (review of 2026-12-04: nothing was marked;
    over gloo rank 0 then failed on the closed connection, over NCCL it waited in the
    collective until torchrun killed it, with no shutdown)."""
    _, _, told = two_rank_failure(
        tmp_path, "cpu-raise-seeding-rank1", {"MCGRAPH_PROBE_RAISE_SEEDING": "1"}
    )
    assert "rank 1" in told["exception"] and "injected failure in seeding" in told["exception"]


def test_a_teardown_whose_abort_does_not_end_skips_the_rest(monkeypatch, caplog) -> None:
    """After an abnormal end of a multi-rank run, an abort whose teardown still waits at its
    timeout leaves the process groups registered: a graceful destroy would then wait for
    good, so the example skips it (and says so)."""
    from megatron.core import parallel_state

    from cudagraph_plugin.compat import device
    from hookspecs import ShutdownReason

    waited: list[float | None] = []
    destroyed: list[str] = []

    def abort_left_behind(timeout_s: float | None = None) -> bool:
        waited.append(timeout_s)
        return False

    monkeypatch.setattr(device, "abort_process_groups", abort_left_behind)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(
        torch.distributed, "destroy_process_group", lambda *a, **k: destroyed.append("pg")
    )
    monkeypatch.setattr(
        parallel_state, "destroy_model_parallel", lambda: destroyed.append("model parallel")
    )
    with caplog.at_level("WARNING", logger="train_gpt"):
        train_gpt._end_distributed(ShutdownReason.EXCEPTION)
    assert waited == [train_gpt.ABORT_TIMEOUT_S]
    assert destroyed == []
    assert "did not end within" in caplog.text


@pytest.mark.parametrize("fail", [False, True], ids=["completed", "exception"])
def test_the_example_tears_its_process_groups_down_inside_the_runs_shutdown(
    monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    """After the shutdown hook (the graphs hold NCCL buffers) and before the run gives the
    signals back: a launcher's SIGTERM during the teardown then waits until the run said
    its ending (``TrainingRun(teardown=...)``), where after the run it cut that off."""
    import signal

    seen: list[tuple[str, bool]] = []
    end_distributed = train_gpt._end_distributed

    def recorded(reason: Any) -> None:
        handler = signal.getsignal(signal.SIGTERM)
        seen.append((str(reason), getattr(handler, "__name__", "") == "_on_signal"))
        end_distributed(reason)

    class Fails:
        @hookimpl
        def mcgraph_train_step_end(self, step: int, metrics: Any) -> None:
            if fail and step == 1:
                raise RuntimeError("step failed")

    recorder = Recorder()
    monkeypatch.setattr(train_gpt, "_end_distributed", recorded)
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        train("--train-iters", "3", plugins=(recorder, Fails()))
    reason = "exception" if fail else "completed"
    assert seen == [(reason, True)]  # (once, with the run's SIGTERM handler still in place)
    assert recorder.calls[-1] == ("shutdown", reason)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "extra, refused",
    [
        ([], True),  # megatron-core's attention dropout (0.1) with core_attn recomputed
        (["--attention-dropout", "0"], False),
        (["--recompute-modules", "mlp", "--hidden-dropout", "0"], False),
        (["--recompute-modules", "mlp"], True),  # the hidden dropout (0.1) this time
    ],
    ids=["defaults", "no-attention-dropout", "mlp-no-hidden-dropout", "mlp"],
)
def test_the_plugin_judges_the_example_s_recompute_as_megatron_core_does(extra, refused) -> None:
    """The example builds its TransformerConfig from the fields the plugin checks, so the
    plugin refuses exactly what megatron-core would refuse at build time, and its fix names
    flags the example has."""
    from megatron.core.transformer import TransformerConfig

    from cudagraph_plugin import check_config
    from cudagraph_plugin.compat import model_config_kwargs

    parser = train_gpt.build_parser(get_plugin_manager())
    argv = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    args = parser.parse_args([*argv, "--recompute-granularity", "selective", *extra])
    args.virtual_pipeline_model_parallel_size = train_gpt._virtual_stages(args, [])
    result = check_config(args, te_version=None)
    assert result.ok is not refused
    s = result.settings
    fields = train_gpt._transformer_config_fields(args, False)
    fields.update(model_config_kwargs(s.impl, s.scope, s.warmup_steps))  # as the plugin's hook
    try:
        TransformerConfig(**fields)
    except AssertionError as error:
        mcore_refused = "dropout is not supported with graphed" in str(error)
    else:
        mcore_refused = False
    assert mcore_refused is refused
    if refused:
        (problem,) = result.problems
        assert "fix: set --attention-dropout=0.0" in problem.format() or (
            "fix: set --hidden-dropout=0.0" in problem.format()
        )
        assert "--recompute-modules" in problem.format()


@pytest.mark.parametrize(
    "precision, said",
    [
        ([], "layers whose parameters are fp32 fail at the capture step"),
        (["--fp16", "--loss-scale", "4096"], "layers whose parameters are fp16 fail"),
        (["--bf16"], None),
    ],
    ids=["fp32", "fp16", "bf16"],
)
def test_te_graphs_on_layers_not_in_bf16_are_refused_at_the_start(precision, said) -> None:
    """An fp32 or fp16 run of the example with TE graphs failed at the capture step on the
    GPU (an H100, 2026-12-05, both megatron-core versions: megatron-core's sample inputs
    are bfloat16); the plugin now refuses it at the start, naming the example's flag."""
    from cudagraph_plugin import check_config

    parser = train_gpt.build_parser(get_plugin_manager())
    args = parser.parse_args(
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp", *precision]
    )
    result = check_config(args, te_version=None)
    assert result.ok is (said is None)
    if said is not None:
        (problem,) = result.problems
        assert said in problem.format()
        assert "fix: train in bf16 (pass --bf16" in problem.format()
