"""The checks once the host has built its model (``cudagraph_plugin.runtime.build``): every
problem in one error, the RNG tracker again, the model as a list of chunks, TE chunks that
megatron-core's helper can finish a capture with."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.runtime import build
from cudagraph_plugin.runtime.state import RunState

FULL = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
TE = {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn,mlp"}


@pytest.fixture
def rng_tracker() -> Any:
    """Sets megatron-core's RNG tracker: graph-safe (its inference tracker, which CPU torch
    can make) or not (its default); megatron-core's own tracker state is put back after."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)

    def make(safe: bool) -> None:
        mrandom.initialize_rng_tracker(inference_rng_tracker=safe, force_reset=True)
        assert compat.rng_tracker_state()[0] is safe

    yield make
    mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


def state_for(settings: dict, model: Any, model_config: Any = None) -> RunState:
    state = RunState(read_settings(settings), pm=None, cuda=True)
    state.model = model
    state.model_config = model_config if model_config is not None else SimpleNamespace(**settings)
    state.seq_length, state.micro_batch_size = 8, 1
    return state


def test_every_build_problem_is_listed_at_once_with_the_rng_tracker_checked_again(rng_tracker):
    # a host that skipped run.rng_initialized(), built the config by hand and DDP outside
    # the build context: three problems, one error
    rng_tracker(False)
    state = state_for({**FULL, "seq_length": 16}, [], SimpleNamespace(cuda_graph_impl="none"))
    with pytest.raises(CudaGraphConfigError) as info:
        build.build_model_graphs(state, compat.DDPBuildContext(True), optimizer=None)
    listed = [" ".join(v.fields) for v in info.value.violations]
    assert any("RNG tracker" in fields for fields in listed)
    assert any("cuda_graph_impl" in fields for fields in listed)
    assert any("seq_length" in fields for fields in listed)
    assert len(listed) == 3


def test_a_graph_safe_tracker_and_a_matching_config_pass(rng_tracker):
    rng_tracker(True)
    state = state_for(FULL, [], SimpleNamespace(**FULL))
    build.build_model_graphs(state, compat.DDPBuildContext(True), optimizer=None)


def test_the_scope_s_order_in_the_built_config_is_no_difference():
    # megatron-core reads the scope as a set
    built = SimpleNamespace(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp", "attn"])
    assert build._built_config_problems(read_settings(TE), built, 8, 1) == []
    other = SimpleNamespace(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"])
    assert len(build._built_config_problems(read_settings(TE), other, 8, 1)) == 1


def test_a_model_that_is_not_a_list_of_chunks_is_refused_with_the_fix(rng_tracker):
    rng_tracker(True)
    state = state_for(FULL, SimpleNamespace(name="one DDP module"))
    with pytest.raises(CudaGraphConfigError, match=r"(?s)a list of model chunks.*model=\[model\]"):
        build.build_model_graphs(state, compat.DDPBuildContext(True), optimizer=None)


class _Helper:
    """Records what megatron-core's TECudaGraphHelper is given (its signature)."""

    made: ClassVar[list[Any]] = []

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=[]):  # noqa: B006
        self.optimizers = optimizers
        self.flattened_callables: list[Any] = []
        self.made.append(self)


@pytest.fixture
def te_helper(monkeypatch: pytest.MonkeyPatch) -> type[_Helper]:
    from megatron.core.transformer import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", _Helper)
    monkeypatch.setattr(compat, "num_microbatches_calculator_ready", lambda: True)
    monkeypatch.setattr(_Helper, "made", [])
    return _Helper


@pytest.mark.parametrize("bf16_samples", [True, False])
def test_te_chunks_without_a_ddp_wrapper_are_refused_before_the_capture(
    rng_tracker, te_helper, monkeypatch, bf16_samples
):
    # megatron-core's helper calls zero_grad_buffer() on each chunk after capturing, whatever
    # dtype its sample inputs take (the precision check had come to gate this one)
    from cudagraph_plugin.config import environment

    monkeypatch.setattr(environment, "mcore_te_samples_in_bf16", lambda: bf16_samples)
    rng_tracker(True)
    chunks = [SimpleNamespace(zero_grad_buffer=lambda: None), SimpleNamespace()]
    state = state_for(TE, chunks)
    with pytest.raises(CudaGraphConfigError, match=r"chunk\(s\) 1 have no zero_grad_buffer"):
        build.build_model_graphs(state, compat.DDPBuildContext(False), optimizer=None)
    assert te_helper.made == []


def test_te_without_an_optimizer_gives_the_helper_no_optimizer(rng_tracker, te_helper):
    # (the helper zeroes each optimizer's gradients after its capture: None.zero_grad())
    rng_tracker(True)
    state = state_for(TE, [SimpleNamespace(zero_grad_buffer=lambda: None)])
    build.build_model_graphs(state, compat.DDPBuildContext(False), optimizer=None)
    [helper] = te_helper.made
    assert helper.optimizers == []
    optimizer = SimpleNamespace(zero_grad=lambda: None)
    state = state_for(TE, [SimpleNamespace(zero_grad_buffer=lambda: None)])
    build.build_model_graphs(state, compat.DDPBuildContext(False), optimizer=optimizer)
    assert te_helper.made[-1].optimizers == [optimizer]


def test_scope_names_written_into_a_built_transformer_config_are_refused(rng_tracker):
    """(review of 2026-12-05: the harness overrides applied to a finalised TransformerConfig
    wrote ``['full_iteration']`` as names; the plugin's reading took them, megatron-core's
    ``CudaGraphScope.full_iteration in config.cuda_graph_scope`` did not, and the model was
    treated as a per-layer one.)"""
    from megatron.core.transformer import TransformerConfig

    from cudagraph_plugin.cli.overrides import apply_overrides

    rng_tracker(True)
    built = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    apply_overrides(built, cuda_graph_impl="local", cuda_graph_scope="full_iteration")
    state = state_for(FULL, [], built)
    with pytest.raises(CudaGraphConfigError) as refused:
        build.build_model_graphs(state, compat.DDPBuildContext(True), optimizer=None)
    [problem] = refused.value.violations
    assert (problem.fields, problem.value) == (
        ("TransformerConfig.cuda_graph_scope",),
        "['full_iteration']",
    )
    assert problem.fix.startswith("set the CUDA graph fields before the TransformerConfig is")
    # the same fields given before the build are megatron-core's members: no problem
    made = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, cuda_graph_impl="local",
        cuda_graph_scope="full_iteration", use_te_rng_tracker=True,
    )  # fmt: skip
    build.build_model_graphs(state_for(FULL, [], made), compat.DDPBuildContext(True), None)


class _Chunk(torch.nn.Module):
    """A DDP-wrapped chunk as the helper needs it, its parameters in ``dtype``."""

    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4, dtype=dtype)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def zero_grad_buffer(self) -> None:
        pass


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_te_layers_not_in_bf16_are_refused_where_the_config_did_not_say(
    rng_tracker, te_helper, dtype
):
    """megatron-core captures each layer with bfloat16 sample inputs: an fp32 or fp16 model
    fails at the capture step (measured on an H100, 2026-12-05, both megatron-core
    versions). A config without ``bf16`` passes the configure-time rule, so the built model's
    parameters say it, before anything is captured."""
    rng_tracker(True)
    state = state_for(TE, [_Chunk(getattr(torch, dtype))])
    assert state.settings.layer_dtype is None  # (the config does not say)
    with pytest.raises(CudaGraphConfigError) as info:
        build.build_model_graphs(state, compat.DDPBuildContext(False), optimizer=None)
    [problem] = info.value.violations
    assert problem.value == f"1 of 1 model chunk(s) with parameters in {dtype}"
    assert "bfloat16 sample inputs" in problem.problem
    assert "Float16Module" in problem.fix and "cuda_graph_impl=local" in problem.fix
    assert te_helper.made == []
    # the same chunks in bf16 (megatron-core's Float16Module): the helper is made
    state = state_for(TE, [_Chunk(getattr(torch, dtype)).to(torch.bfloat16)])
    build.build_model_graphs(state, compat.DDPBuildContext(False), optimizer=None)
    assert len(te_helper.made) == 1


def test_full_iteration_graphs_take_any_precision(rng_tracker):
    rng_tracker(True)
    state = state_for(FULL, [_Chunk(torch.float32)], SimpleNamespace(**FULL))
    build.build_model_graphs(state, compat.DDPBuildContext(True), optimizer=None)


def test_a_megatron_core_that_follows_the_config_s_dtype_takes_fp32_layers(
    rng_tracker, te_helper, monkeypatch
):
    """(megatron-core's development branch builds the sample inputs in the config's dtype
    since mid-2026: nothing to refuse there)"""
    from cudagraph_plugin.config import environment

    monkeypatch.setattr(environment, "mcore_te_samples_in_bf16", lambda: False)
    rng_tracker(True)
    state = state_for(TE, [_Chunk(torch.float32)])
    build.build_model_graphs(state, compat.DDPBuildContext(False), optimizer=None)
    assert len(te_helper.made) == 1


def test_the_layers_megatron_core_graphs_are_judged_not_the_whole_model(rng_tracker, te_helper):
    """A bf16 embedding does not make fp32 transformer layers capturable: the layers the
    helper graphs (megatron-core's GraphableMegatronModule) are judged one by one (review
    of 2026-12-05: any bf16 parameter of the model let it through)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from test_compat import _world

    with _world():
        config = TransformerConfig(
            num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
        )
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=32,
            max_sequence_length=8,
        )
        gpt.zero_grad_buffer = lambda: None  # (what DDP gives the helper)
        gpt.embedding.to(torch.bfloat16)
        rng_tracker(True)
        with pytest.raises(CudaGraphConfigError) as info:
            build.build_model_graphs(
                state_for(TE, [gpt]), compat.DDPBuildContext(False), optimizer=None
            )
        [problem] = info.value.violations
        assert problem.value == "2 of 2 graphable layer(s) with parameters in float32"
        gpt.decoder.layers[0].to(torch.bfloat16)  # (one layer in bf16: the other still fails)
        with pytest.raises(CudaGraphConfigError, match="1 of 2 graphable layer"):
            build.build_model_graphs(
                state_for(TE, [gpt]), compat.DDPBuildContext(False), optimizer=None
            )
        gpt.bfloat16()
        build.build_model_graphs(state_for(TE, [gpt]), compat.DDPBuildContext(False), None)
        assert len(te_helper.made) == 1
