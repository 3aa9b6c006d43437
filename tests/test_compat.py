"""The compat module against real megatron-core 0.16.1 and fakes of 0.19's API."""

from __future__ import annotations

import contextlib
import functools
import logging

import pytest
import torch
from cpu_only import needs_mcore_on_cpu
from megatron.core import full_cuda_graph
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
from packaging.version import Version

from cpu_redirect import cpu_redirect
from cudagraph_plugin import compat
from cudagraph_plugin.config import environment
from fakes import (
    FakeCUDAGraph,
    FakeTECudaGraphHelper,
    FakeTECudaGraphHelper019,
    _fake_full_cuda_graph_019,
)


@pytest.fixture(autouse=True)
def clean_full_iteration_state():
    compat.free_full_iteration_graphs()
    yield
    compat.free_full_iteration_graphs()


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
    freed = compat.free_full_iteration_graphs()
    assert freed == 2
    assert training.resets == 1 and validation.resets == 1
    for stage in ("training", "validation"):
        assert FullCudaGraphWrapper.cuda_graph[stage] is None
        assert FullCudaGraphWrapper.result[stage] is None
        assert FullCudaGraphWrapper.curr_iteration[stage] == 0
        assert StaticBufferLoader.static_buffers[stage] == []
    assert not compat.full_iteration_state_dirty()
    assert compat.free_full_iteration_graphs() == 0


@pytest.mark.parametrize("left", ["graph", "counter", "result only", "static buffers"])
def test_any_single_leftover_counts_as_dirty_state(left):
    assert not compat.full_iteration_state_dirty()
    if left == "graph":
        FullCudaGraphWrapper.cuda_graph["validation"] = FakeCUDAGraph()
    elif left == "counter":
        FullCudaGraphWrapper.curr_iteration["training"] = 3
    elif left == "static buffers":
        StaticBufferLoader.static_buffers["validation"].append({"tokens": torch.zeros(1)})
    else:  # a result alone is overwritten by the next call: nothing to reset
        FullCudaGraphWrapper.result["training"] = [{"loss": torch.ones(1)}]
    assert compat.full_iteration_state_dirty() is (left != "result only")


def test_free_keeps_the_static_buffer_dict_object():
    """megatron-core's loaders hold the class dict; it must be cleared, not replaced."""
    buffers = StaticBufferLoader.static_buffers
    _dirty()
    compat.free_full_iteration_graphs()
    assert StaticBufferLoader.static_buffers is buffers


@needs_mcore_on_cpu
def test_full_iteration_graphs_over_dirty_state_warn_and_reset(caplog):
    from cudagraph_plugin.runtime.mechanisms import FullIterationGraphs

    _dirty()
    with cpu_redirect(), caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        graphs = FullIterationGraphs(warmup_steps=2, use_single_mempool=False)
        wrapper = graphs.wrapper_for(lambda **kw: None)
    assert isinstance(wrapper, FullCudaGraphWrapper)
    assert wrapper.cuda_graph_warmup_steps == 2
    assert compat.full_iteration_calls("training") == 0
    assert not compat.full_iteration_captured("training")
    assert "state from an earlier run" in caplog.text


@needs_mcore_on_cpu
def test_full_iteration_graphs_over_clean_state_are_silent_and_wrap_once(caplog):
    from cudagraph_plugin.runtime.mechanisms import FullIterationGraphs

    def func(**kwargs):
        return None

    with cpu_redirect(), caplog.at_level(logging.WARNING):
        graphs = FullIterationGraphs(warmup_steps=0, use_single_mempool=False)
        assert graphs.wrapper_for(func) is graphs.wrapper_for(func)
    assert caplog.text == ""


@needs_mcore_on_cpu
@pytest.mark.parametrize("single", [True, False])
def test_019_wrapper_gets_single_mempool_from_the_caller(monkeypatch, single):
    fake_class = _fake_full_cuda_graph_019()
    monkeypatch.setattr(full_cuda_graph, "FullCudaGraphWrapper", fake_class)
    with cpu_redirect():
        wrapper = compat.make_full_iteration_wrapper(
            lambda **kw: None, warmup_steps=3, use_single_mempool=single
        )
    assert isinstance(wrapper, fake_class)
    assert wrapper.use_single_mempool is single
    # whatever the generation, freeing resets the graph and the class state by hand
    graph = _dirty()
    assert compat.free_full_iteration_graphs() == 1
    assert graph.resets == 1
    assert StaticBufferLoader.static_buffers["training"] == []


def test_single_mempool_is_read_from_the_model_config():
    from types import SimpleNamespace

    assert compat.single_mempool(SimpleNamespace(cuda_graph_use_single_mempool=True)) is True
    assert compat.single_mempool(SimpleNamespace(cuda_graph_use_single_mempool=False)) is False
    assert compat.single_mempool(SimpleNamespace()) is False  # 0.16 has no such field
    assert compat.single_mempool(None) is False


@needs_mcore_on_cpu
def test_ddp_build_context_streams(monkeypatch):
    with cpu_redirect():
        before = torch.cuda.current_stream()
        # 0.16 full iteration: no stream of its own (its wrapper captures on a fresh one)
        context = compat.DDPBuildContext(full_iteration=True)
        assert context.needs_stream is False
        with context.enter():
            assert torch.cuda.current_stream() is before
        # TE graphs, every generation: a dedicated side stream, never the default one
        with compat.DDPBuildContext(full_iteration=False).enter():
            side = torch.cuda.current_stream()
            assert side is not before
        assert torch.cuda.current_stream() is before
        # 0.18+ full iteration: the shared capture stream
        shared = torch.cuda.Stream()
        monkeypatch.setattr(
            full_cuda_graph, "get_shared_capture_stream", lambda: shared, raising=False
        )
        with compat.DDPBuildContext(full_iteration=True).enter():
            assert torch.cuda.current_stream() is shared
        assert torch.cuda.current_stream() is before


@needs_mcore_on_cpu
def test_ddp_build_context_knows_which_ddp_chunks_were_built_inside():
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    with cpu_redirect(), _world():
        from megatron.core.transformer import TransformerConfig

        config = TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True
        )
        module = torch.nn.Linear(2, 2)
        ddp_config = DistributedDataParallelConfig()
        context = compat.DDPBuildContext(full_iteration=False)
        assert context.entered is False
        with context.enter():
            inside = DDP(config=config, ddp_config=ddp_config, module=module)
        assert context.entered is True  # what the violation says when a chunk is missing
        outside = DDP(config=config, ddp_config=ddp_config, module=torch.nn.Linear(2, 2))
        assert context.missing([inside]) == []
        assert context.missing([inside, outside]) == [1]
        assert compat.DDPBuildContext(full_iteration=False).missing([inside]) == [0]
        # not a DDP chunk: nothing to check
        assert context.missing([torch.nn.Linear(2, 2)]) == []


@contextlib.contextmanager
def _world():
    from megatron.core import parallel_state

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@needs_mcore_on_cpu
def test_input_copy_waits_for_the_previous_replay(monkeypatch):
    import cpu_redirect as redirect

    waits = []
    monkeypatch.setattr(redirect.Stream, "wait_stream", lambda self, other: waits.append(self))
    with cpu_redirect():
        wrapper = compat.make_full_iteration_wrapper(
            lambda **kw: None, warmup_steps=1, use_single_mempool=False
        )
        compat.order_input_copy_after_replay(wrapper)
    assert waits == [wrapper.static_loader.stream]


@pytest.mark.parametrize(
    "generation,orders", [("megatron-core 0.16", False), ("megatron-core 0.19", True)]
)
def test_whether_the_loader_orders_its_copy_is_read_from_its_code(generation, orders):
    import real_apis

    source = real_apis.load()[generation]["StaticBufferLoader.__call__"]
    assert compat.copy_waits_for_current_stream(source) is orders


def test_the_snapshot_holds_the_installed_loader_code():
    import inspect

    import real_apis

    [entry] = [e for e in real_apis.load().values() if e["version"] == full_cuda_graph_version()]
    assert inspect.getsource(StaticBufferLoader.__call__) == entry["StaticBufferLoader.__call__"]


def full_cuda_graph_version() -> str:
    import megatron.core

    return megatron.core.__version__


@needs_mcore_on_cpu
def test_no_extra_wait_where_the_loader_orders_its_copy(monkeypatch, tmp_path):
    """megatron-core 0.17+ waits before its copy: the plugin's wait on every step would be
    a second one (host time for nothing)."""
    import importlib.util

    import cpu_redirect as redirect
    import real_apis

    # megatron-core 0.19's own __call__, in a file (the plugin reads the loader's code)
    module_file = tmp_path / "loader019.py"
    module_file.write_text(
        "import torch\n"
        "from megatron.core.full_cuda_graph import *  # noqa\n"
        "from megatron.core.full_cuda_graph import StaticBufferLoader\n\n\n"
        "class Loader019:\n" + real_apis.load()["megatron-core 0.19"]["StaticBufferLoader.__call__"]
    )
    spec = importlib.util.spec_from_file_location("loader019", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(StaticBufferLoader, "__call__", module.Loader019.__call__)
    waits = []
    monkeypatch.setattr(redirect.Stream, "wait_stream", lambda self, other: waits.append(self))
    compat.loader_orders_its_copy.cache_clear()
    try:
        assert compat.loader_orders_its_copy()
        with cpu_redirect():
            wrapper = compat.make_full_iteration_wrapper(
                lambda **kw: None, warmup_steps=1, use_single_mempool=False
            )
            compat.order_input_copy_after_replay(wrapper)
    finally:
        compat.loader_orders_its_copy.cache_clear()
    assert waits == []


def test_019_free_drops_the_shared_graph_pool_handle(monkeypatch):
    monkeypatch.setattr(full_cuda_graph, "_shared_graph_pool", (0, 7), raising=False)
    _dirty()
    compat.free_full_iteration_graphs()
    assert full_cuda_graph._shared_graph_pool is None


def test_generation_is_detected_by_feature_not_by_version(monkeypatch):
    """A 0.18 release candidate sorts before 0.18.0; megatron on PYTHONPATH has no
    metadata. Neither may change which API is used."""
    import dataclasses

    from megatron.core import transformer

    @dataclasses.dataclass
    class NewConfig:
        cuda_graph_modules: list = dataclasses.field(default_factory=list)

    monkeypatch.setattr(environment, "dist_version", lambda *names: Version("0.18.0rc1"))
    compat.new_generation.cache_clear()
    try:
        assert compat.new_generation() is False  # the installed config: 0.16's fields
        monkeypatch.setattr(transformer, "TransformerConfig", NewConfig)
        compat.new_generation.cache_clear()
        assert compat.new_generation() is True
    finally:
        compat.new_generation.cache_clear()


def test_versions_without_package_metadata(monkeypatch):
    monkeypatch.setattr(environment, "dist_version", lambda *names: None)
    environment.mcore_version.cache_clear()
    try:
        versions = compat.versions()
    finally:
        environment.mcore_version.cache_clear()
    assert versions["megatron-core"] == "0.16.1"  # from megatron.core.package_info
    assert versions["torch"] == torch.__version__
    assert versions["transformer-engine"] is None


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
    """The attributes compat reads from a TECudaGraphHelper (its ``_graphs_created`` flag,
    set at the end of ``_finish_capturing``, and ``delete_cuda_graphs``, which asserts it
    and empties every layer's graphs)."""

    def __init__(self, created: bool, finished: bool) -> None:
        self.callables_per_chunk = [[_Layer(2), _Layer(2)], [_Layer(2)]]
        self.flattened_callables = [layer for c in self.callables_per_chunk for layer in c]
        self._graphs_created, self._finished = created, finished
        self.deleted = 0

    def graphs_created(self) -> bool:
        return self._graphs_created

    def capture_finished(self) -> bool:
        return self._finished

    def delete_cuda_graphs(self) -> None:
        assert self._graphs_created, "CUDA Graphs have not been created."
        for layers in self.callables_per_chunk:
            for layer in layers:
                layer.cuda_graphs = []
        self.deleted += 1
        self._graphs_created = False


class _Helper016(_Helper):
    capture_finished = None  # 0.16's helper has no such method

    def __getattribute__(self, name):
        if name == "capture_finished":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_te_capture_done_per_generation():
    # 0.19: the capture ran although no layer was graphable
    assert compat.te_capture_done(_Helper(created=False, finished=True)) is True
    # 0.16: only "graphs exist" is known
    assert compat.te_capture_done(_Helper016(created=False, finished=True)) is False
    assert compat.te_capture_done(_Helper016(created=True, finished=True)) is True


@needs_mcore_on_cpu
@pytest.mark.parametrize("with_groups", [True, False])
def test_make_te_helper_passes_the_models_process_groups_where_accepted(monkeypatch, with_groups):
    from types import SimpleNamespace

    from megatron.core.transformer import cuda_graphs

    made = []

    def recording(helper_class):
        """The helper class with its real signature, recording the keyword arguments."""

        @functools.wraps(helper_class.__init__)
        def init(self, *args, **kwargs):
            made.append(kwargs)

        return type(f"Recording{helper_class.__name__}", (helper_class,), {"__init__": init})

    groups = object()
    inner = SimpleNamespace(pg_collection=groups if with_groups else None)
    chunk = SimpleNamespace(module=SimpleNamespace(module=inner))  # DDP(Float16Module(model))
    config = SimpleNamespace(cuda_graph_impl="transformer_engine")
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", recording(FakeTECudaGraphHelper019))
    compat.make_te_helper([chunk], config, 16, 2, ["opt"])
    expected = {"pg_collection": groups} if with_groups else {}
    assert made == [
        {
            "model": [chunk],
            "config": config,
            "seq_length": 16,
            "micro_batch_size": 2,
            "optimizers": ["opt"],
            **expected,
        }
    ]
    # 0.16's helper takes no pg_collection: never passed
    made.clear()
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", recording(FakeTECudaGraphHelper))
    compat.make_te_helper([chunk], config, 16, 2, ["opt"])
    assert "pg_collection" not in made[0]


def test_free_te_graphs_frees_what_the_layers_hold():
    helper = _Helper(created=True, finished=True)
    assert compat.te_graph_count(helper) == 6
    assert compat.te_layer_count(helper) == 3
    assert compat.free_te_graphs(helper) == 6
    assert helper.deleted == 1
    assert compat.free_te_graphs(helper) == 0  # nothing held: nothing to delete
    assert helper.deleted == 1
    # megatron-core's _finish_capturing failed after the layers took their graphs
    assert compat.free_te_graphs(_Helper(created=False, finished=False)) == 6


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


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_ending_a_stuck_te_capture_unfreezes_only_what_megatron_core_froze(monkeypatch, freeze_gc):
    """megatron-core freezes the garbage collector for a TE capture only with its FREEZE_GC
    on (off with torch >= 2.9); ending a capture it left stuck must not unfreeze the host's
    own frozen objects otherwise."""
    import gc

    from megatron.core.transformer import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "FREEZE_GC", freeze_gc)
    unfrozen = []
    monkeypatch.setattr(gc, "unfreeze", lambda: unfrozen.append(True))
    cuda_graphs._set_capture_start()
    try:
        assert compat.end_stuck_te_capture() is True
    finally:
        cuda_graphs._set_capture_end()
    assert not cuda_graphs.is_graph_capturing()
    assert unfrozen == ([True] if freeze_gc else [])
    assert compat.end_stuck_te_capture() is False  # nothing stuck now


def test_a_graphs_off_config_does_not_trip_megatron_core_s_full_scope_warning():
    """(review of 2026-12-04: every graphs-off run on 0.16.1 printed megatron-core's "full
    scope is deprecated", from its own default, which users took for their flag.)"""
    import warnings

    from megatron.core.transformer import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            use_cpu_initialization=True,
            **compat.model_config_kwargs("none", (), 3),
        )
    assert config.cuda_graph_impl == "none" and config.cuda_graph_scope == []


class _Handle:
    """An all-gather's work handle, as ``torch.distributed`` returns it (``wait()``)."""

    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1


class _BucketGroup:
    """The two fields of megatron-core's ``_ParamAndGradBucketGroup`` the all-gather
    bookkeeping uses (checked against the real class below)."""

    def __init__(self, dispatched: bool, handle: _Handle | None = None) -> None:
        self.param_gather_dispatched = dispatched
        self.param_gather_handle = handle


def test_the_bucket_group_stand_in_has_megatron_cores_fields():
    import inspect

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    source = inspect.getsource(_ParamAndGradBucketGroup)
    assert "self.param_gather_dispatched = False" in source
    assert "self.param_gather_handle = None" in source
    assert "assert self.param_gather_handle is None" in source  # why an open one is waited


def test_an_all_gather_made_due_again_waits_for_one_still_in_flight():
    """A forward-only call dispatches the next group's all-gather early; if none of that
    group's modules ran, its handle is still open after a replay: waited for and cleared,
    else megatron-core's next dispatch trips its ``assert ... handle is None``."""
    handle = _Handle()
    groups = [_BucketGroup(True, handle), _BucketGroup(True), _BucketGroup(False)]
    compat.mark_param_gather_due(groups)
    assert [g.param_gather_dispatched for g in groups] == [False, False, False]
    assert groups[0].param_gather_handle is None and handle.waited == 1


def test_rearm_counts_the_groups_gathered_on_chunks_whose_pre_hooks_are_on():
    class Chunk:
        use_forward_hook = True

        def __init__(self, hooks_on, groups):
            self.remove_forward_pre_hook_handles = {object(): None} if hooks_on else {}
            self.bucket_groups = groups
            self.expert_parallel_bucket_groups = []

    on = Chunk(True, [_BucketGroup(True, _Handle()), _BucketGroup(False)])
    off = Chunk(False, [_BucketGroup(True)])  # (hooks off: a capture gathers nothing there)
    assert compat.rearm_param_gather([on, off]) == 1
    assert not on.bucket_groups[0].param_gather_dispatched
    assert on.bucket_groups[0].param_gather_handle is None
    assert off.bucket_groups[0].param_gather_dispatched
