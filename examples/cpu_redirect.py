"""Run real megatron-core 0.16.1 without CUDA: a CUDA-to-CPU redirect.

This module owns the redirect that the CPU example run (``train_gpt.py --cpu``, or any run
on a machine without CUDA) and the CPU tests use. It lives with the examples and is never
imported by the library packages (``hookspecs``, ``cudagraph_plugin``).

megatron-core hard-codes ``device="cuda"``, ``torch.cuda.current_device()``, CUDA streams
and ``tensor.type() == "torch.cuda.FloatTensor"`` checks. Inside :func:`cpu_redirect`:

* a :class:`torch.overrides.TorchFunctionMode` rewrites every CUDA device argument
  (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an int index) to the CPU, makes
  ``Tensor.cuda()`` and ``Tensor.to("cuda")`` stay on the CPU, reports a CPU tensor's
  ``type()`` as the ``torch.cuda.*`` type megatron-core's optimizer checks for, and keeps
  itself active during ``backward`` (activation recomputation runs there);
* ``torch.cuda`` answers as a process without a usable GPU would, but with "cuda" meaning
  the CPU: ``is_available()`` and ``is_initialized()`` are ``False`` (also on a machine
  with CUDA: the block runs on the CPU, so nothing in it may reach for the GPU),
  ``current_device()`` is ``"cpu"``, and the stream, event, device-query and RNG-state
  calls megatron-core makes are CPU stand-ins with torch's signatures (an event records
  ``time.perf_counter()``, so ``elapsed_time`` is a real host duration);
* it refuses to start (:func:`cpu_run_blocker`) where megatron-core picked fused GPU
  kernels at import time (Transformer Engine's or Apex's Adam and norms, whenever they are
  installed), which no redirect can run on CPU tensors;
* megatron-core 0.16's ``moe_utils`` gets the ``te_general_gemm = None`` it forgets to
  define without Transformer Engine (:func:`mcore_without_te_fixes`).

CUDA graph capture is deliberately not faked (``torch.cuda.CUDAGraph`` and
``torch.cuda.graph`` are untouched), and ``is_available()`` is never made ``True``.
Everything is restored on exit, also when the block raises, so tests in one process stay
independent. The mode is thread-local: it covers the thread that entered it, which is where
a CPU run does all its work (the autograd engine runs CPU backward passes on the caller's
thread).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_redirect", "cpu_run_blocker", "is_active", "mcore_without_te_fixes"]

_active = False


def is_active() -> bool:
    """Whether a :func:`cpu_redirect` is in force."""
    return _active


# -------------------------------------------------------------------------------------------
# Device arguments.
# -------------------------------------------------------------------------------------------


def _to_cpu_device(device: Any) -> Any:
    """The CPU for any CUDA device spelling; anything else unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _is_device_like(value: Any) -> bool:
    return (isinstance(value, (str, torch.device, int))) and not isinstance(value, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward:
            return self._backward(*args, **kwargs)
        if func is torch.Tensor.backward:
            return self._tensor_backward(*args, **kwargs)
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False, memory_format=...) -> stays put.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0], func(*args))
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_device_like(args[1]):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)

    def _backward(
        self,
        tensors: Any,
        grad_tensors: Any = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """``torch.autograd.backward`` with this mode active while the engine runs.

        A mode is off inside its own handler, and torch >= 2.13 routes ``backward`` through
        the handler, so the backward pass (gradient hooks, activation recomputation, which
        builds causal masks with ``device="cuda"``) would otherwise run unredirected. The
        body mirrors ``torch.autograd.backward`` after its ``__torch_function__`` check.
        """
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if inputs is None:
            inputs = ()
        elif isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        elif isinstance(inputs, dict):
            inputs = tuple(inputs.values())
        else:
            inputs = tuple(inputs)
        grads = _make_grads(
            tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False
        )
        with self:
            _engine_run_backward(
                tensors,
                grads,
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                inputs,
                allow_unreachable=True,
                accumulate_grad=True,
            )

    def _tensor_backward(
        self,
        tensor: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """``Tensor.backward`` (it calls ``torch.autograd.backward``) under this mode."""
        self._backward(tensor, gradient, retain_graph, create_graph, inputs)


def _cuda_type_name(tensor: torch.Tensor, name: str) -> str:
    # megatron-core's optimizer accepts only 'torch.cuda.{Float,Half,BFloat16}Tensor'.
    if tensor.device.type == "cpu" and name.startswith("torch.") and "." not in name[6:]:
        return "torch.cuda." + name[6:]
    return name


# -------------------------------------------------------------------------------------------
# torch.cuda stand-ins (same signatures as torch's).
# -------------------------------------------------------------------------------------------


class Stream:
    """CPU stand-in for :class:`torch.cuda.Stream`: work runs in order, so waits are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_event(self, event: Event) -> None:
        pass

    def wait_stream(self, stream: Stream) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Event:
    """CPU stand-in for :class:`torch.cuda.Event`; ``elapsed_time`` is host time in ms."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


_DEFAULT_STREAM = Stream()
_current_stream: Stream = _DEFAULT_STREAM


class _StreamContext:
    """CPU stand-in for ``torch.cuda.StreamContext`` (what ``torch.cuda.stream`` returns)."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self) -> None:
        global _current_stream
        self._previous = _current_stream
        if self.stream is not None:
            _current_stream = self.stream

    def __exit__(self, *exc: object) -> None:
        global _current_stream
        if self._previous is not None:
            _current_stream = self._previous


def _stream(stream: Stream | None) -> _StreamContext:
    return _StreamContext(stream)


def _set_stream(stream: Stream) -> None:
    global _current_stream
    if stream is not None:
        _current_stream = stream


def _current_stream_fn(device: Any = None) -> Stream:
    return _current_stream


def _default_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


def _synchronize(device: Any = None) -> None:
    pass


def _is_available() -> bool:
    # Also on a machine with CUDA (``--cpu``): the block runs on the CPU, so code that asks
    # (timers, memory probes) must not reach for the GPU.
    return False


def _is_initialized() -> bool:
    # torch.cuda._lazy_call then queues megatron-core's CUDA RNG-state callbacks (dropped on
    # exit) instead of running them against the real device's generators.
    return False


def _current_device() -> str:
    # MCore passes it on as a device argument, which the mode maps to the CPU anyway.
    return "cpu"


def _get_device_capability(device: Any = None) -> tuple[int, int]:
    # (0, 0): no architecture feature may be assumed on the CPU.
    return (0, 0)


def _graph_pool_handle() -> tuple[int, int]:
    return (0, 0)


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    # There is no CUDA generator: dropout draws from the CPU one, so its state is the one
    # activation recomputation must save and replay.
    return torch.get_rng_state()


_CUDA_STAND_INS: dict[str, Any] = {
    "is_available": _is_available,
    "is_initialized": _is_initialized,
    "Stream": Stream,
    "Event": Event,
    "stream": _stream,
    "set_stream": _set_stream,
    "current_stream": _current_stream_fn,
    "default_stream": _default_stream,
    "synchronize": _synchronize,
    "current_device": _current_device,
    "get_device_capability": _get_device_capability,
    "graph_pool_handle": _graph_pool_handle,
    "get_rng_state": _get_rng_state,
}
_CUDA_RANDOM_STAND_INS: dict[str, Any] = {"get_rng_state": _get_rng_state}


# -------------------------------------------------------------------------------------------
# megatron-core without Transformer Engine.
# -------------------------------------------------------------------------------------------


def cpu_run_blocker() -> str | None:
    """Why megatron-core cannot train on the CPU in this environment, or ``None``.

    megatron-core chooses its Adam when ``megatron.core.optimizer`` is imported: Transformer
    Engine's fused Adam if TE imports, else Apex's, else ``torch.optim.AdamW``; the fused
    ones (and TE's norms, chosen the same way) run CUDA kernels only, so on CPU tensors they
    fail with an illegal memory access. Asking the module which one it took covers a TE that
    is installed but broken (megatron-core then falls back to torch's).
    """
    from megatron.core import optimizer

    adam = getattr(optimizer, "Adam", None)
    module = getattr(adam, "__module__", None) or ""
    if adam is None or module.split(".")[0] == "torch":
        return None
    return (
        f"megatron-core uses {module}.{adam.__name__} in this environment (it takes "
        "Transformer Engine's or Apex's fused kernels whenever they are installed), and those "
        "run on CUDA tensors only: megatron-core cannot train on the CPU here. Run on the GPU, "
        "or use an environment without Transformer Engine and Apex for CPU runs (as CI does)"
    )


@contextlib.contextmanager
def mcore_without_te_fixes() -> Iterator[None]:
    """Define ``te_general_gemm = None`` in megatron-core 0.16's ``moe_utils`` without TE.

    0.16's router GEMM tests ``te_general_gemm is not None``, but the name is only bound when
    Transformer Engine imports, so MoE without TE fails with ``NameError``. 0.19 binds it to
    ``None``. Useful on a CUDA machine without TE as well; does nothing where the name exists.
    """
    from megatron.core.transformer.moe import moe_utils

    added = not hasattr(moe_utils, "te_general_gemm")
    if added:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        if added:
            del moe_utils.te_general_gemm


# -------------------------------------------------------------------------------------------
# The context manager.
# -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_redirect() -> Iterator[None]:
    """Redirect megatron-core's CUDA calls to the CPU for the duration of the block.

    Not re-entrant; everything is restored on exit, also when the block raises.

    :raises RuntimeError: if a redirect is already active, or megatron-core cannot run on
        the CPU here (:func:`cpu_run_blocker`).
    """
    global _active, _current_stream
    if _active:
        raise RuntimeError("cpu_redirect() is already active; it is not re-entrant")
    blocker = cpu_run_blocker()
    if blocker is not None:
        raise RuntimeError(blocker)
    patches = [(torch.cuda, name, value) for name, value in _CUDA_STAND_INS.items()]
    patches += [(torch.cuda.random, name, value) for name, value in _CUDA_RANDOM_STAND_INS.items()]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    queued_before = len(torch.cuda._queued_calls)
    _active = True
    _current_stream = _DEFAULT_STREAM
    try:
        for module, name, stand_in in patches:
            setattr(module, name, stand_in)
        with mcore_without_te_fixes(), _CudaToCpuMode():
            yield
    except RuntimeError as error:
        # An interrupt (a Ctrl-C, a peer's failure told by the plugin's watch) that lands
        # inside torch's own mode-stack bookkeeping leaves the stack without this mode, and
        # leaving the mode then fails ("trying to pop from empty mode stack"): that error
        # would replace the interrupt, which is what happened
        interrupt = error.__context__
        if interrupt is None or "mode stack" not in str(error):
            raise
        # (raised as it was: its own context, e.g. the failure a held Ctrl-C came after)
        context, suppressed = interrupt.__context__, interrupt.__suppress_context__
        try:
            raise interrupt from None
        finally:
            interrupt.__context__, interrupt.__suppress_context__ = context, suppressed
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        # megatron-core sets the "CUDA" RNG state through torch.cuda._lazy_call, which queued
        # the calls for when CUDA initialises; they hold CPU generator states.
        del torch.cuda._queued_calls[queued_before:]
        _current_stream = _DEFAULT_STREAM
        _active = False
