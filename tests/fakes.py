"""Fakes for what cannot exist on a CPU: CUDA graph capture and Transformer Engine graphs.

Each fake mirrors one real API, signature for signature, and behaves like it where a test
can tell the difference. ``tests/real_apis.json`` holds the real signatures, taken from the
sources of megatron-core 0.16.1 and 0.19.2 and of torch; ``tests/test_fakes.py`` checks
every fake against both generations (and the snapshot against the installed sources).

* :class:`FakeCUDAGraph` / :func:`fake_graph` — ``torch.cuda.CUDAGraph`` and
  ``torch.cuda.graph``. A capture records the tensor operations of its body (the aten ops,
  below autograd) without leaving any effect on the tensors that existed before it, as a
  real capture launches no kernel; ``replay()`` runs the recorded operations again on the
  same tensors: new contents of the static inputs go in, the captured outputs are
  overwritten, and no Python runs (no module hook, no autograd hook, no host code). A graph
  that misses work therefore misses it here too, and the losses show it. A replay works on
  the captured addresses: if the memory of a tensor the capture used has moved since (the
  real graph would read freed memory), it raises CUDA's "illegal memory access".
* :class:`FakeGraphedCallable` — one callable of TE's ``make_graphed_callables`` (a layer
  and micro-batch). Replaying a TE graph runs no Python either, so calling it computes the
  layer's captured function with every forward hook of the layer's modules silenced: the
  DDP forward pre-hooks (the parameter all-gather) reach a graphed layer only through
  megatron-core's manual hooks, as on a GPU.
* :class:`FakeTECudaGraphHelper` (megatron-core 0.16) and :class:`FakeTECudaGraphHelper019`
  (0.19: ``pg_collection``, ``capture_finished()``, one capture per helper) —
  ``megatron.core.transformer.cuda_graphs.TECudaGraphHelper``, put in place of megatron-core's
  class so that the plugin builds it through the real ``compat.make_te_helper``; layers are
  found, capture flags set, grad buffers reset and graphs assigned as the real helper does.
* :meth:`FakeDevice.event_class` — ``torch.cuda.Event``'s timing API, on a fake device
  that the test tells when it has passed an event (``query()``), as a real one decides.
* :class:`FakeFullCudaGraphWrapper019` — 0.19's ``FullCudaGraphWrapper`` API on top of the
  installed 0.16 class (``use_single_mempool``, ``reset_cuda_graph``), for the compat tests.

:func:`install_fake_cuda_graphs` puts them in place with ``monkeypatch``: the torch and
megatron-core names the plugin reaches through ``compat`` are replaced, never ``compat``'s
own functions, except ``compat.cuda_available`` (the device itself: the host still runs on
the CPU through ``examples/cpu_redirect``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import os
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import cpu_redirect
from cudagraph_plugin import compat

# -- torch.cuda.CUDAGraph ----------------------------------------------------------------------

# Ops that read a tensor on the host: a real capture fails on them (the stream is capturing,
# nothing has run yet); megatron-core's captured code never does.
_HOST_READS = {torch.ops.aten._local_scalar_dense.default}
# Allocation without a kernel: a replay leaves such memory as the previous replay left it.
_NO_KERNEL = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    return (value for value in tree_flatten(tree)[0] if isinstance(value, torch.Tensor))


def _written(func: Any, args: tuple, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an op writes to (in-place and ``out=`` arguments), from its schema."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            value = kwargs[argument.name]
        elif index < len(args):
            value = args[index]
        else:
            continue
        yield from _tensors(value)


def _wait_for_collective(out: Any) -> None:
    """A collective in a graph completes in stream order, like any kernel: a replay waits
    for each one before the next op."""
    for value in tree_flatten(out)[0]:
        if not isinstance(value, torch.Tensor) and hasattr(value, "wait"):
            value.wait()


@contextlib.contextmanager
def _collective_waits_unrecorded() -> Iterator[None]:
    """gloo finishes some collectives (a coalesced reduce-scatter) inside ``Work.wait()``,
    copying from buffers of its own that no recorded op made: replayed, those copies would
    bring back the capture's values. They belong to the collective, which a replay waits
    for, so a capture does not record them."""
    from torch.utils._python_dispatch import _disable_current_modes

    work = torch.distributed.Work
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    work.wait = wait
    try:
        yield
    finally:
        work.wait = original


class _Recording(TorchDispatchMode):
    """What a capture records: each op with its (static) tensors and the outputs it made."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict[str, Any], list[tuple[int, torch.Tensor]]]] = []
        self._made: set[int] = set()
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._saved: set[int] = set()
        # The address of every tensor the graph found (made before the capture), when first
        # seen: a real graph reads and writes those addresses, whatever happens to the
        # tensor objects since.
        self.addresses: dict[int, tuple[torch.Tensor, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(
                "CUDA error: operation not permitted when stream is capturing (a tensor was "
                "read on the host inside a CUDA graph capture)"
            )
        for tensor in _tensors((args, kwargs)):
            if _storage(tensor) not in self._made and id(tensor) not in self.addresses:
                self.addresses[id(tensor)] = (tensor, tensor.data_ptr())
        for tensor in _written(func, args, kwargs):
            # A real capture changes nothing that exists: remember it to undo the write.
            if (
                tensor.numel()
                and _storage(tensor) not in self._made
                and id(tensor) not in self._saved
            ):
                self._saved.add(id(tensor))
                self._before.append((tensor, tensor.clone()))
        out = func(*args, **kwargs)
        _wait_for_collective(out)
        inputs = {_storage(tensor) for tensor in _tensors((args, kwargs))}
        made = []
        for index, value in enumerate(tree_flatten(out)[0]):
            if isinstance(value, torch.Tensor) and _storage(value) not in inputs:
                self._made.add(_storage(value))
                made.append((index, value))
        self.ops.append((func, args, kwargs, made))
        return out

    def undo_writes(self) -> None:
        """Give every tensor that existed before the capture its contents back (newest write
        first undone last, so overlapping views end with the oldest contents)."""
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for tensor, before in reversed(self._before):
                tensor.copy_(before)
        self._before.clear()
        self._saved.clear()

    def check_addresses(self) -> None:
        """A real replay works on the captured addresses: if a tensor's memory moved since
        (freed and reallocated, ``param.data = ...``, ``storage().resize_()``), it reads
        freed memory. The fake refuses, as the real one fails at best."""
        for tensor, address in self.addresses.values():
            if tensor.data_ptr() != address:
                raise RuntimeError(
                    "CUDA error: an illegal memory access was encountered (fake graph: a "
                    f"tensor of shape {tuple(tensor.shape)} the graph reads at {address:#x} "
                    f"moved to {tensor.data_ptr():#x} after the capture)"
                )

    def replay(self) -> None:
        self.check_addresses()
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for func, args, kwargs, made in self.ops:
                if func in _NO_KERNEL:
                    continue
                out = func(*args, **kwargs)
                flat = tree_flatten(out)[0]
                for index, target in made:
                    target.copy_(flat[index])
                _wait_for_collective(out)


class FakeCUDAGraph:
    """Mirrors ``torch.cuda.CUDAGraph`` (``capture_begin``/``capture_end``/``replay``/
    ``reset``/``pool``, and ``register_generator_state`` of CUDA builds)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self.capturing = False
        self.captured = False
        self.replays = 0
        self.resets = 0
        self.generator_states: list[Any] = []
        self.capture_pool: Any = None
        self.capture_error_mode: str | None = None
        self.capture_stream: Any = None  # the stream torch.cuda.graph captured on
        self.check_input_liveness = False
        self._recording: _Recording | None = None
        self._capture_context = contextlib.ExitStack()
        self._rng_before: torch.Tensor | None = None

    def capture_begin(
        self,
        pool: Any = None,
        capture_error_mode: str = "global",
        check_input_liveness: bool = False,
    ) -> None:
        assert not self.capturing and not self.captured, "capture_begin on a used graph"
        self.capturing = True
        self.capture_pool = pool
        self.capture_error_mode = capture_error_mode
        self.check_input_liveness = check_input_liveness
        # A capture draws no random numbers: the replays do, from where the generator is.
        self._rng_before = torch.get_rng_state()
        self._recording = _Recording()
        self._capture_context = contextlib.ExitStack()
        self._capture_context.enter_context(_collective_waits_unrecorded())
        self._capture_context.enter_context(self._recording)

    def capture_end(self) -> None:
        assert self.capturing, "capture_end without capture_begin"
        assert self._recording is not None
        self._capture_context.close()
        self._recording.undo_writes()
        torch.set_rng_state(self._rng_before)
        self.capturing = False
        self.captured = True

    @property
    def op_count(self) -> int:
        """How many tensor operations the capture recorded."""
        return 0 if self._recording is None else len(self._recording.ops)

    def replay(self) -> None:
        assert self.captured, "replay of a graph that was not captured (or was reset)"
        assert self._recording is not None
        self._recording.replay()
        self.replays += 1

    def reset(self) -> None:
        self.captured = False
        self._recording = None  # the graph's memory: every tensor it kept alive
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
) -> Iterator[None]:
    """Mirrors ``torch.cuda.graph`` (the context manager that captures into a graph)."""
    cuda_graph.capture_stream = stream
    cuda_graph.capture_begin(
        pool=pool, capture_error_mode=capture_error_mode, check_input_liveness=check_input_liveness
    )
    try:
        yield
    finally:
        cuda_graph.capture_end()


# -- Transformer Engine's graphed callables and megatron-core's TECudaGraphHelper ---------------


@contextlib.contextmanager
def _python_hooks_silenced(root: torch.nn.Module) -> Iterator[None]:
    """No forward (pre-)hook of ``root``'s modules, nor a global one, fires inside."""
    from torch.nn.modules import module as torch_module

    saved = []
    for module in root.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            saved.append((module.__dict__, name, module.__dict__[name]))
            module.__dict__[name] = collections.OrderedDict()
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        saved.append((vars(torch_module), name, getattr(torch_module, name)))
        setattr(torch_module, name, collections.OrderedDict())
    try:
        yield
    finally:
        for namespace, name, value in saved:
            namespace[name] = value


class FakeGraphedCallable:
    """What TE's ``make_graphed_callables`` returns for one layer and micro-batch."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.calls = 0
        self.was_reset = False

    def __call__(self, *args: Any, is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        assert not self.was_reset, "replay of a graph that was reset"
        self.calls += 1
        # The function TE captured (megatron-core routes calls made while capturing to
        # _te_cuda_graph_capture, which returns the flat tuple of graph outputs), with the
        # gradients flowing as through TE's graphed autograd function; no module hook runs.
        with _python_hooks_silenced(self.layer):
            return self.layer._te_cuda_graph_capture(*args, **kwargs)

    def reset(self) -> None:
        self.was_reset = True


@dataclasses.dataclass
class HelperLog:
    """What every fake helper of a test did, in order (shared across helpers)."""

    events: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    helpers: list[Any] = dataclasses.field(default_factory=list)
    on_capture: Any = None
    graphs: list[FakeCUDAGraph] = dataclasses.field(default_factory=list)


class FakeTECudaGraphHelper:
    """Mirrors megatron-core 0.16's ``TECudaGraphHelper``."""

    log = HelperLog()

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=[]):  # noqa: B006
        from megatron.core.transformer import cuda_graphs
        from megatron.core.transformer.enums import CudaGraphScope

        assert cuda_graphs.HAVE_TE_GRAPHS, "CUDA Graphs are not supported without TE."
        assert config.cuda_graph_impl == "transformer_engine", (
            "Option cuda_graph_impl=transformer_engine not enabled."
        )
        assert (
            "expandable_segments:True" not in os.getenv("PYTORCH_CUDA_ALLOC_CONF", "")
            or os.getenv("NCCL_GRAPH_REGISTER", "") == "0"
        ), "Setting NCCL_GRAPH_REGISTER=0 ..."
        if not hasattr(config, "cuda_graph_modules"):  # 0.16's config
            assert CudaGraphScope.full_iteration not in config.cuda_graph_scope
        self.model = model
        self.config = config
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.optimizers = optimizers
        self.num_model_chunks = len(model)
        self.num_microbatches = None
        self._discover_layers()
        self._graphs_created = False
        self.log.helpers.append(self)
        self.log.events.append(("init", len(self.flattened_callables)))

    def _discover_layers(self) -> None:
        from megatron.core.transformer.cuda_graphs import _layer_is_graphable
        from megatron.core.utils import get_attr_wrapped_model

        self.callables_per_chunk: list[list[Any]] = []
        self.flattened_callables: list[Any] = []
        for chunk in self.model:
            try:
                with_decoder = get_attr_wrapped_model(
                    chunk, "decoder", allow_none=False, return_model_obj=True
                )
            except RuntimeError:
                layers = []
            else:
                layers = [
                    layer
                    for layer in with_decoder.decoder.layers
                    if _layer_is_graphable(layer, self.config)
                ]
            self.callables_per_chunk.append(layers)
            self.flattened_callables.extend(layers)

    def graphs_created(self) -> bool:
        return self._graphs_created

    def _start_capturing(self) -> float:
        from megatron.core.transformer import cuda_graphs

        assert not self._graphs_created, "CUDA Graphs have already been created."
        torch.distributed.barrier()
        gc.collect()
        cuda_graphs._set_capture_start()
        return time.time()

    def _make_graphs(self) -> None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        # The real helper reads the calculator while it builds the capture's sample inputs:
        # one graph per layer and micro-batch.
        self.num_microbatches = get_num_microbatches()
        self.log.events.append(("create_cudagraphs", compat.forward_pre_hooks_enabled(self.model)))
        if self.log.on_capture is not None:
            self.log.on_capture()
        for layers in self.callables_per_chunk:
            for layer in layers:
                layer.cuda_graphs = [
                    FakeGraphedCallable(layer) for _ in range(self.num_microbatches)
                ]

    def _reset_after_capture(self) -> None:
        from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

        for chunk in self.model:
            chunk.zero_grad_buffer()
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        reset_model_temporary_tensors(self.config, self.model)

    def _finish_capturing(self, start_time: float) -> None:
        from megatron.core.transformer import cuda_graphs

        cuda_graphs._set_capture_end()
        torch.distributed.barrier()
        self._reset_after_capture()
        gc.collect()
        self._graphs_created = True

    def create_cudagraphs(self) -> None:
        start_time = self._start_capturing()
        self._make_graphs()
        self._finish_capturing(start_time)

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
                    graph.reset()  # TE >= 2.10 graphs can be reset
                layer.cuda_graphs = []
                layer.cuda_graph_manual_hooks = []
        self._graphs_created = False


class FakeTECudaGraphHelper019(FakeTECudaGraphHelper):
    """Mirrors megatron-core 0.19's ``TECudaGraphHelper``: ``pg_collection`` (the global
    parallel state's groups by default), ``capture_finished()``, a helper that can capture
    only once, and no graphs (but a finished capture) without graphable layers."""

    def __init__(
        self,
        model,
        config,
        seq_length,
        micro_batch_size,
        optimizers=[],  # noqa: B006
        pg_collection=None,
    ):
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.pg_collection = pg_collection
        if self.pg_collection is None:
            self.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._capture_finished = False
        super().__init__(model, config, seq_length, micro_batch_size, optimizers)

    def capture_finished(self) -> bool:
        return self._capture_finished

    def _start_capturing(self) -> float:
        from megatron.core.transformer import cuda_graphs

        assert not self._capture_finished, "CUDA Graph capture has already been finished."
        gc.collect()
        cuda_graphs._set_capture_start()
        return time.time()

    def create_cudagraphs(self) -> None:
        start_time = self._start_capturing()
        if self.flattened_callables:
            self._make_graphs()
            self._graphs_created = True
        self._finish_capturing(start_time)

    def _finish_capturing(self, start_time: float) -> None:
        from megatron.core.transformer import cuda_graphs

        cuda_graphs._set_capture_end()
        self._reset_after_capture()
        gc.collect()
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
        # what torch._C._cuda_getCurrentStream(device_index) answers: (stream_id,
        # device_index, device_type); the test switches streams by changing it
        self.current_stream = (0, 0, 1)
        self.streams_made: list[Any] = []
        self.recorded_on: list[Any] = []  # the stream given to each Event.record() call

    def install_stream_bindings(self, monkeypatch: Any) -> None:
        """The C bindings ``torch.cuda.current_stream()`` reads on a CUDA build of torch
        (``torch._C._cuda_getDevice``, ``torch._C._cuda_getCurrentStream``; CPU builds have
        neither) and a ``torch.cuda.Stream`` made from their answer, as torch makes it."""
        fake = self

        class FakeStream:
            def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
                self.stream_id = kwargs.get("stream_id", 0)
                self.device_index = kwargs.get("device_index", 0)
                self.device_type = kwargs.get("device_type", 1)
                fake.streams_made.append(self)

        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        monkeypatch.setattr(
            torch._C, "_cuda_getCurrentStream", lambda index: fake.current_stream, raising=False
        )
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)

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
            stream: Any = None

            def record(self, stream: Any = None) -> None:
                self.stream = stream
                device.recorded_on.append(stream)
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
    """Make the plugin see a CUDA device whose graphs are the fakes above.

    Returns the log of what the fakes did: the TE helpers and their events, and in
    ``graphs`` every :class:`FakeCUDAGraph` created.
    """
    from megatron.core.transformer import cuda_graphs

    # TE graphs exist only after a capture: only then does the fake TE become importable
    # (megatron-core's module constructors would otherwise take it for the real one).
    log = HelperLog(on_capture=lambda: _install_fake_transformer_engine_import(monkeypatch))

    class TrackedCUDAGraph(FakeCUDAGraph):
        def __init__(self, keep_graph: bool = False) -> None:
            super().__init__(keep_graph)
            log.graphs.append(self)

    monkeypatch.setattr(FakeTECudaGraphHelper, "log", log)
    monkeypatch.setattr(compat, "cuda_available", lambda: True)
    # What compat reads and calls, replaced where compat finds it (compat's own code runs):
    # megatron-core's TE support flag and helper class, and torch's cuBLAS workspace release
    # (CPU builds of torch have none; the call is counted).
    monkeypatch.setattr(cuda_graphs, "HAVE_TE_GRAPHS", True)
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", te_helper)
    monkeypatch.setattr(
        torch._C,
        "_cuda_clearCublasWorkspaces",
        lambda: log.events.append(("clear_cublas_workspaces", None)),
        raising=False,
    )
    monkeypatch.setattr(torch.cuda, "CUDAGraph", TrackedCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "get_device_name", _fake_device_name)
    return log
