"""The compat module against real megatron-core 0.16.1 and fakes of 0.19's API."""

from __future__ import annotations

import logging

import pytest
import torch
from cpu_only import needs_mcore_on_cpu
from megatron.core import full_cuda_graph
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

from cpu_redirect import cpu_redirect
from cudagraph_plugin import compat
from fakes import (
    FakeCUDAGraph,
    FakeTECudaGraphHelper,
    FakeTECudaGraphHelper019,
    _fake_full_cuda_graph_019,
    fake_graph,
)


@pytest.fixture(autouse=True)
def clean_full_iteration_state():
    compat.free_full_iteration_graphs(None)
    yield
    compat.free_full_iteration_graphs(None)


def _dirty(stage: str = "training") -> FakeCUDAGraph:
    graph = FakeCUDAGraph()
    graph.capture_begin()
    graph.capture_end()
    FullCudaGraphWrapper.cuda_graph[stage] = graph
    FullCudaGraphWrapper.result[stage] = [{"loss": torch.ones(1)}]
    FullCudaGraphWrapper.curr_iteration[stage] = 5
    StaticBufferLoader.static_buffers[stage].append({"tokens": torch.zeros(2, 4)})
    return graph


def test_installed_generation_is_016():
    assert str(compat.mcore_version()) == "0.16.1"
    assert compat.new_generation() is False
    versions = compat.versions()
    assert versions["megatron-core"] == "0.16.1"
    assert versions["torch"].startswith("2.")


def test_free_full_iteration_graphs_resets_016_class_state_by_hand():
    training = _dirty("training")
    validation = _dirty("validation")
    assert compat.full_iteration_state_dirty()
    freed = compat.free_full_iteration_graphs(None)
    assert freed == 2
    assert training.resets == 1 and validation.resets == 1
    for stage in ("training", "validation"):
        assert FullCudaGraphWrapper.cuda_graph[stage] is None
        assert FullCudaGraphWrapper.result[stage] is None
        assert FullCudaGraphWrapper.curr_iteration[stage] == 0
        assert StaticBufferLoader.static_buffers[stage] == []
    assert not compat.full_iteration_state_dirty()
    assert compat.free_full_iteration_graphs(None) == 0


def test_free_keeps_the_static_buffer_dict_object():
    """megatron-core's loaders hold the class dict; it must be cleared, not replaced."""
    buffers = StaticBufferLoader.static_buffers
    _dirty()
    compat.free_full_iteration_graphs(None)
    assert StaticBufferLoader.static_buffers is buffers


@needs_mcore_on_cpu
def test_wrapper_over_dirty_state_warns_and_resets(caplog):
    _dirty()
    with cpu_redirect(), caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        wrapper = compat.make_full_iteration_wrapper(lambda **kw: None, warmup_steps=2)
    assert isinstance(wrapper, FullCudaGraphWrapper)
    assert wrapper.cuda_graph_warmup_steps == 2
    assert compat.full_iteration_calls("training") == 0
    assert not compat.full_iteration_captured("training")
    assert "state from an earlier run" in caplog.text


@needs_mcore_on_cpu
def test_wrapper_over_clean_state_is_silent(caplog):
    with cpu_redirect(), caplog.at_level(logging.WARNING):
        compat.make_full_iteration_wrapper(lambda **kw: None, warmup_steps=0)
    assert caplog.text == ""


@needs_mcore_on_cpu
def test_019_wrapper_gets_single_mempool_and_reset_api(monkeypatch):
    fake_class = _fake_full_cuda_graph_019()
    monkeypatch.setattr(compat, "new_generation", lambda: True)
    monkeypatch.setattr(full_cuda_graph, "FullCudaGraphWrapper", fake_class)
    with cpu_redirect():
        wrapper = compat.make_full_iteration_wrapper(lambda **kw: None, warmup_steps=3)
    assert isinstance(wrapper, fake_class)
    assert wrapper.use_single_mempool is True
    graph = _dirty()
    calls = []
    monkeypatch.setattr(
        wrapper,
        "reset_cuda_graph",
        lambda stage=None: calls.append(stage) or fake_class.reset_cuda_graph(wrapper, stage),
    )
    assert compat.free_full_iteration_graphs(wrapper) == 1
    assert calls == [None]
    assert graph.resets == 1
    # 0.19's reset_cuda_graph leaves the static buffers behind; compat clears them.
    assert StaticBufferLoader.static_buffers["training"] == []


@needs_mcore_on_cpu
def test_ddp_build_context_per_generation(monkeypatch):
    assert compat.ddp_build_context(full_iteration=True) is None  # 0.16: any stream works
    monkeypatch.setattr(compat, "new_generation", lambda: True)
    with cpu_redirect():
        shared = torch.cuda.Stream()
        monkeypatch.setattr(
            full_cuda_graph, "get_shared_capture_stream", lambda: shared, raising=False
        )
        before = torch.cuda.current_stream()
        with compat.ddp_build_context(full_iteration=True):
            assert torch.cuda.current_stream() is shared
        assert torch.cuda.current_stream() is before
        # other implementations: a dedicated side stream, never the default one
        with compat.ddp_build_context(full_iteration=False):
            side = torch.cuda.current_stream()
            assert side is not before and side is not shared
        assert torch.cuda.current_stream() is before


def test_019_free_drops_the_shared_graph_pool_handle(monkeypatch):
    monkeypatch.setattr(compat, "new_generation", lambda: True)
    monkeypatch.setattr(full_cuda_graph, "_shared_graph_pool", (0, 7), raising=False)
    _dirty()
    compat.free_full_iteration_graphs(None)
    assert full_cuda_graph._shared_graph_pool is None


def test_model_config_kwargs_are_accepted_by_real_016_config():
    from megatron.core.transformer import TransformerConfig

    kwargs = compat.model_config_kwargs("local", ("full_iteration",), 2)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        **kwargs,
    )
    assert config.cuda_graph_impl == "local"
    assert [s.name for s in config.cuda_graph_scope] == ["full_iteration"]
    assert config.cuda_graph_warmup_steps == 2
    assert config.use_te_rng_tracker is True


class _Layer:
    def __init__(self, graphs: int) -> None:
        self.cuda_graphs = [object()] * graphs


class _Helper:
    """The attributes compat reads from a TECudaGraphHelper."""

    def __init__(self, created: bool, finished: bool) -> None:
        self.callables_per_chunk = [[_Layer(2), _Layer(2)], [_Layer(2)]]
        self.flattened_callables = [layer for c in self.callables_per_chunk for layer in c]
        self._created, self._finished = created, finished
        self.deleted = 0

    def graphs_created(self) -> bool:
        return self._created

    def capture_finished(self) -> bool:
        return self._finished

    def delete_cuda_graphs(self) -> None:
        assert self._created
        self.deleted += 1
        self._created = False


def test_te_capture_done_per_generation(monkeypatch):
    helper = _Helper(created=False, finished=True)  # 0.19: capture ran, no graphable layer
    assert compat.te_capture_done(helper) is False
    monkeypatch.setattr(compat, "new_generation", lambda: True)
    assert compat.te_capture_done(helper) is True


def test_free_te_graphs_only_when_created():
    helper = _Helper(created=True, finished=True)
    assert compat.te_graph_count(helper) == 6
    assert compat.te_layer_count(helper) == 3
    assert compat.free_te_graphs(helper) == 6
    assert helper.deleted == 1
    assert compat.free_te_graphs(helper) == 0
    assert helper.deleted == 1


def test_fake_helpers_mirror_the_real_signatures():
    """The fakes must take exactly the real constructors' parameters."""
    import inspect

    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    real = inspect.signature(TECudaGraphHelper.__init__)
    assert (
        inspect.signature(FakeTECudaGraphHelper.__init__).parameters.keys()
        == real.parameters.keys()
    )
    extra = set(inspect.signature(FakeTECudaGraphHelper019.__init__).parameters) - set(
        real.parameters
    )
    assert extra == {"pg_collection"}
    for name in (
        "graphs_created",
        "create_cudagraphs",
        "cuda_graph_set_manual_hooks",
        "delete_cuda_graphs",
    ):
        assert hasattr(TECudaGraphHelper, name)
    fake_graph_api = {n for n in dir(FakeCUDAGraph) if not n.startswith("_")}
    real_graph_api = {n for n in dir(torch.cuda.CUDAGraph) if not n.startswith("_")}
    # register_generator_state lives in the C extension of CUDA builds only.
    used = {"capture_begin", "capture_end", "replay", "reset", "pool"}
    assert used <= real_graph_api
    assert used | {"register_generator_state"} <= fake_graph_api
    assert inspect.signature(fake_graph).parameters.keys() == inspect.signature(
        torch.cuda.graph.__init__
    ).parameters.keys() - {"self"}


def _seed(**options):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(
        1234, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True, **options
    )


@needs_mcore_on_cpu
def test_rng_tracker_state_reads_the_active_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    with cpu_redirect():
        _seed(inference_rng_tracker=True)
        assert compat.rng_tracker_state() == (True, compat.rng_tracker_state()[1])
        assert "inference" in compat.rng_tracker_state()[1]
        _seed(te_rng_tracker=True)  # no TE here: megatron-core silently falls back
        safe, description = compat.rng_tracker_state()
        assert safe is False
        assert "use_cudagraphable_rng=False" in description
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    assert compat.rng_tracker_state()[0] is False
    assert "was not called" in compat.rng_tracker_state()[1]
