"""Fakes for what cannot exist on a CPU: CUDA graph capture and Transformer Engine graphs.

Each fake mirrors the real API it replaces, signature for signature:

* :class:`FakeCUDAGraph` / :func:`fake_graph` — ``torch.cuda.CUDAGraph`` and
  ``torch.cuda.graph``. The body of a capture runs once (as a real capture followed by its
  first replay computes once); ``replay()`` cannot re-run Python on a CPU, so it only counts.
* :class:`FakeGraphedCallable` — what TE's ``make_graphed_callables`` returns per layer and
  micro-batch: a callable with ``reset()``. It computes the function TE captured (the
  layer's ``_te_cuda_graph_capture``) eagerly, so a run on "captured" TE graphs trains on,
  and megatron-core's own replay path (``_te_cuda_graph_replay``) runs around it, manual
  hooks included.
* :class:`FakeTECudaGraphHelper` (megatron-core 0.16) and :class:`FakeTECudaGraphHelper019`
  (0.19: ``pg_collection``, ``capture_finished()``, one capture per helper) —
  ``megatron.core.transformer.cuda_graphs.TECudaGraphHelper``, discovering the graphable
  layers with megatron-core's own ``_layer_is_graphable``.
* :meth:`FakeDevice.event_class` — ``torch.cuda.Event``'s timing API, on a fake device
  that the test tells when it has passed an event (``query()``), as a real one decides.
* :class:`FakeFullCudaGraphWrapper019` — 0.19's ``FullCudaGraphWrapper`` API on top of the
  installed 0.16 class (``use_single_mempool``, ``reset_cuda_graph``), for the compat tests.

:func:`install_fake_cuda_graphs` puts them in place with ``monkeypatch`` and makes the plugin
believe a CUDA device exists (``compat.cuda_available``); the host still runs on the CPU
through ``examples/cpu_redirect``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import types
from typing import Any

import torch

import cpu_redirect
from cudagraph_plugin import compat


class FakeCUDAGraph:
    """Mirrors ``torch.cuda.CUDAGraph``."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self.capturing = False
        self.captured = False
        self.replays = 0
        self.resets = 0
        self.generator_states: list[Any] = []
        self.capture_pool: Any = None
        self.capture_error_mode: str | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert not self.capturing and not self.captured, "capture_begin on a used graph"
        self.capturing = True
        self.capture_pool = pool
        self.capture_error_mode = capture_error_mode

    def capture_end(self) -> None:
        assert self.capturing, "capture_end without capture_begin"
        self.capturing = False
        self.captured = True

    def replay(self) -> None:
        assert self.captured, "replay of a graph that was not captured (or was reset)"
        self.replays += 1

    def reset(self) -> None:
        self.captured = False
        self.resets += 1

    def pool(self) -> tuple[int, int]:
        return (0, id(self))

    def register_generator_state(self, state: Any) -> None:
        self.generator_states.append(state)


@contextlib.contextmanager
def fake_graph(
    cuda_graph: FakeCUDAGraph,
    pool: Any = None,
    stream: Any = None,
    capture_error_mode: str = "global",
    enable_annotations: bool = False,
    check_input_liveness: bool = False,
) -> Any:
    """Mirrors ``torch.cuda.graph`` (the context manager that captures into a graph)."""
    cuda_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
    try:
        yield
    finally:
        cuda_graph.capture_end()


class FakeGraphedCallable:
    """What TE's ``make_graphed_callables`` returns for one layer and micro-batch."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.calls = 0
        self.was_reset = False

    def __call__(self, *args: Any, is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        assert not self.was_reset, "replay of a graph that was reset"
        self.calls += 1
        # The function TE captured: megatron-core's layer routes calls made while capturing
        # to _te_cuda_graph_capture, which returns the flat tuple of graph outputs.
        return self.layer._te_cuda_graph_capture(*args, **kwargs)

    def reset(self) -> None:
        self.was_reset = True


@dataclasses.dataclass
class HelperLog:
    """What every fake helper of a test did, in order (shared across helpers)."""

    events: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    helpers: list[Any] = dataclasses.field(default_factory=list)
    on_capture: Any = None


class FakeTECudaGraphHelper:
    """Mirrors megatron-core 0.16's ``TECudaGraphHelper``."""

    log = HelperLog()

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=[]):  # noqa: B006
        from megatron.core.transformer.cuda_graphs import _layer_is_graphable
        from megatron.core.utils import get_attr_wrapped_model

        assert config.cuda_graph_impl == "transformer_engine", (
            "Option cuda_graph_impl=transformer_engine not enabled."
        )
        self.model = model
        self.config = config
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.optimizers = optimizers
        self.num_model_chunks = len(model)
        self.num_microbatches = None
        self.callables_per_chunk: list[list[Any]] = []
        self.flattened_callables: list[Any] = []
        for chunk in model:
            decoder = get_attr_wrapped_model(chunk, "decoder", return_model_obj=True).decoder
            layers = [layer for layer in decoder.layers if _layer_is_graphable(layer, config)]
            self.callables_per_chunk.append(layers)
            self.flattened_callables.extend(layers)
        self._graphs_created = False
        self.log.helpers.append(self)
        self.log.events.append(("init", len(self.flattened_callables)))

    def graphs_created(self) -> bool:
        return self._graphs_created

    def create_cudagraphs(self) -> None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        assert not self._graphs_created, "CUDA Graphs have already been created."
        get_num_microbatches()  # the real helper reads it while building the capture kwargs
        self.log.events.append(("create_cudagraphs", compat.forward_pre_hooks_enabled(self.model)))
        if self.log.on_capture is not None:
            self.log.on_capture()
        self.num_microbatches = 1
        for layers in self.callables_per_chunk:
            for layer in layers:
                layer.cuda_graphs = [FakeGraphedCallable(layer)]
        for chunk in self.model:
            chunk.zero_grad_buffer()
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        self._graphs_created = True

    def cuda_graph_set_manual_hooks(self) -> None:
        self.log.events.append(("set_manual_hooks", compat.forward_pre_hooks_enabled(self.model)))
        for chunk_number, layers in enumerate(self.callables_per_chunk):
            for layer in layers:
                layer.setup_manual_hooks(self.model[chunk_number]._make_forward_pre_hook)

    def delete_cuda_graphs(self) -> None:
        assert self._graphs_created, "CUDA Graphs have not been created."
        self.log.events.append(("delete_cuda_graphs", None))
        for layers in self.callables_per_chunk:
            for layer in layers:
                for graph in layer.cuda_graphs:
                    graph.reset()
                layer.cuda_graphs = []
                layer.cuda_graph_manual_hooks = []
        self._graphs_created = False


class FakeTECudaGraphHelper019(FakeTECudaGraphHelper):
    """Mirrors megatron-core 0.19's ``TECudaGraphHelper``: ``pg_collection``,
    ``capture_finished()`` and a helper that can capture only once."""

    def __init__(
        self,
        model,
        config,
        seq_length,
        micro_batch_size,
        optimizers=[],  # noqa: B006
        pg_collection=None,
    ):
        super().__init__(model, config, seq_length, micro_batch_size, optimizers)
        self.pg_collection = pg_collection
        self._capture_finished = False

    def capture_finished(self) -> bool:
        return self._capture_finished

    def create_cudagraphs(self) -> None:
        assert not self._capture_finished, "CUDA Graph capture has already been finished."
        if self.flattened_callables:
            super().create_cudagraphs()
        self._capture_finished = True

    def delete_cuda_graphs(self) -> None:
        assert self._graphs_created, "No CUDA Graphs were created to delete."
        super().delete_cuda_graphs()


def _fake_full_cuda_graph_019() -> type:
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    class FakeFullCudaGraphWrapper019(FullCudaGraphWrapper):
        """0.19's constructor and ``reset_cuda_graph`` over the installed class state."""

        def __init__(
            self, forward_backward_func, cuda_graph_warmup_steps=1, use_single_mempool=False
        ):
            super().__init__(forward_backward_func, cuda_graph_warmup_steps)
            self.use_single_mempool = use_single_mempool

        def reset_cuda_graph(self, stage=None):
            for name in ("training", "validation"):
                if stage is None or stage == name:
                    FullCudaGraphWrapper.cuda_graph[name] = None
                    FullCudaGraphWrapper.result[name] = None
                    FullCudaGraphWrapper.curr_iteration[name] = 0
            gc.collect()

    return FakeFullCudaGraphWrapper019


class FakeDevice:
    """The device clock and progress behind :class:`FakeCudaEvent`s."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.events: list[Any] = []
        self.synchronize_calls = 0

    def advance(self, ms: float) -> None:
        self.now_ms += ms

    def pass_all(self) -> None:
        """The device catches up with everything recorded so far."""
        for event in self.events:
            event.done = True

    def synchronize(self, device: Any = None) -> None:
        self.synchronize_calls += 1
        self.pass_all()

    def event_class(self) -> type:
        device = self

        class FakeCudaEvent(cpu_redirect.Event):
            """Mirrors ``torch.cuda.Event`` (timing part; the constructor is the CPU
            stand-in's, which has torch's signature). An event never recorded counts as
            passed, as torch's ``query()`` says."""

            at_ms = 0.0
            done = True

            def record(self, stream: Any = None) -> None:
                self.at_ms = device.now_ms
                self.done = False
                device.events.append(self)

            def query(self) -> bool:
                return self.done

            def elapsed_time(self, end_event: Any) -> float:
                # torch raises "device not ready" for events the device has not passed.
                if not (self.done and end_event.done):
                    raise RuntimeError("CUDA error: device not ready")
                return end_event.at_ms - self.at_ms

        return FakeCudaEvent


def _fake_device_name(device: Any = None) -> str:
    return "fake CUDA device (CPU)"


def _install_fake_transformer_engine_import(monkeypatch: Any) -> None:
    """megatron-core's TE replay path (``TransformerLayer._get_te_cuda_graph_replay_args``)
    imports ``transformer_engine.pytorch`` and asks for its version before it builds the
    replay arguments; give it an importable, empty TE of the version the GPU machine has.
    Only that lazy import sees it: megatron-core decided ``HAVE_TE`` when it was imported."""
    from megatron.core import utils

    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.11.0"
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(utils, "_te_version", None)  # megatron-core caches the version


def install_fake_cuda_graphs(
    monkeypatch: Any, te_helper: type = FakeTECudaGraphHelper
) -> HelperLog:
    """Make the plugin see a CUDA device whose graphs are the fakes above."""
    from megatron.core import full_cuda_graph

    # TE graphs exist only after a capture: only then does the fake TE become importable
    # (megatron-core's module constructors would otherwise take it for the real one).
    log = HelperLog(on_capture=lambda: _install_fake_transformer_engine_import(monkeypatch))
    monkeypatch.setattr(FakeTECudaGraphHelper, "log", log)
    monkeypatch.setattr(compat, "cuda_available", lambda: True)
    # CPU builds of torch have no cuBLAS workspaces to clear; count the calls instead.
    monkeypatch.setattr(
        compat,
        "clear_cublas_workspaces",
        lambda: log.events.append(("clear_cublas_workspaces", None)),
    )
    monkeypatch.setattr(compat, "te_available", lambda: True)
    monkeypatch.setattr(compat, "make_te_helper", _fake_make_te_helper(te_helper))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "get_device_name", _fake_device_name)
    monkeypatch.setattr(full_cuda_graph.torch.cuda, "CUDAGraph", FakeCUDAGraph)
    return log


def _fake_make_te_helper(helper_class: type) -> Any:
    def make(model, model_config, seq_length, micro_batch_size, optimizers):
        return helper_class(
            model=model,
            config=model_config,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            optimizers=optimizers,
        )

    return make
