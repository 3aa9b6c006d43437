"""The static-shape guard: a captured graph must never replay on changed inputs.

megatron-core's ``FullCudaGraphWrapper`` copies each new micro-batch into the static
buffers of the capture (broadcasting or silently converting when it can) and replays; TE's
per-layer graphs index their graphs by ``micro-batch % count``. Either way a change in
tensor shapes, dtypes or the number of micro-batches after capture gives wrong results
without an error. The guard records the inputs of the reference call (the capture call for
full-iteration graphs, the first training call after a per-layer capture) and checks every
later call before its micro-batches reach the model. Before a full-iteration capture,
megatron-core already copies each call into the static buffers its first call made: those
calls are checked against the buffers (:meth:`_check_static_buffer`). A full-iteration graph
also replays the model and ``forward_step_func`` of its capture call: a later call with
others is refused too (:mod:`~cudagraph_plugin.runtime.callee`).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Iterator
from typing import Any

from cudagraph_plugin import compat
from cudagraph_plugin.runtime import callee


class StaticShapeError(RuntimeError):
    """The inputs changed after CUDA graph capture; replaying would use stale buffers."""


FIX = (
    "keep seq_length, micro_batch_size, tensor dtypes, non-tensor batch values and the number "
    "of micro-batches fixed for the whole run (pad variable-length data to a fixed width), or "
    "run without CUDA graphs"
)


_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_DEPTH = 6


def signature(batch: Any, path: str = "batch", depth: int = 0) -> tuple[tuple[str, str], ...]:
    """A hashable description of a micro-batch: every tensor's path, shape and dtype, and
    every other leaf's path, type and value.

    Values matter for everything that is not a tensor: a captured graph copies new tensor
    contents into its static buffers, but Python scalars (e.g. the ``max_seqlen`` of
    packed-sequence parameters) were baked into the kernels at capture time. Objects
    (dataclasses, plain objects) are described field by field; a tensor inside one is not
    copied by a full-iteration graph at all (:func:`tensors_inside_objects`, refused at its
    capture).
    """
    shape = getattr(batch, "shape", None)
    dtype = getattr(batch, "dtype", None)
    if shape is not None and dtype is not None:
        if _host_scalar(batch, shape):
            return ((path, f"{type(batch).__name__} {batch!r}"),)
        return ((path, f"shape {tuple(shape)} dtype {dtype}"),)
    if isinstance(batch, _SCALARS) or isinstance(batch, enum.Enum):
        return ((path, f"{type(batch).__name__} {batch!r}"),)
    if depth >= _MAX_DEPTH:
        return ((path, f"{type(batch).__name__} {batch!r}"),)
    if isinstance(batch, dict):
        return tuple(
            item
            for key in sorted(batch, key=str)
            for item in signature(batch[key], f"{path}[{key!r}]", depth + 1)
        )
    if isinstance(batch, (list, tuple)):
        return tuple(
            item for i, v in enumerate(batch) for item in signature(v, f"{path}[{i}]", depth + 1)
        )
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    elif hasattr(batch, "__dict__") and not callable(batch):
        fields = {k: v for k, v in vars(batch).items() if not k.startswith("_")}
    else:
        return ((path, f"{type(batch).__name__} {batch!r}"),)
    described = (
        item
        for name in sorted(fields)
        for item in signature(fields[name], f"{path}.{name}", depth + 1)
    )
    return ((path, type(batch).__name__), *described)


def tensors_inside_objects(
    batch: Any, path: str = "batch", depth: int = 0, inside: bool = False
) -> list[str]:
    """The paths of the tensors of ``batch`` held by an object (a dataclass such as
    ``PackedSeqParams``, a plain object) rather than by dicts, lists and tuples alone.

    megatron-core's full-iteration graph copies a new micro-batch into its static buffers
    through dicts, lists and tuples only (``clone_tensors_in_struct``); an object is put in
    as it is, so its tensors are read where they were at the capture, whatever a later
    micro-batch holds."""
    if getattr(batch, "shape", None) is not None and getattr(batch, "dtype", None) is not None:
        return [path] if inside else []
    if isinstance(batch, _SCALARS) or isinstance(batch, enum.Enum) or depth >= _MAX_DEPTH:
        return []
    if isinstance(batch, dict):
        items = [(f"{path}[{key!r}]", value, inside) for key, value in batch.items()]
    elif isinstance(batch, (list, tuple)):
        items = [(f"{path}[{i}]", value, inside) for i, value in enumerate(batch)]
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [
            (f"{path}.{f.name}", getattr(batch, f.name), True) for f in dataclasses.fields(batch)
        ]
    elif hasattr(batch, "__dict__") and not callable(batch):
        items = [(f"{path}.{k}", v, True) for k, v in vars(batch).items() if not k.startswith("_")]
    else:
        return []
    return [
        found
        for where, value, held in items
        for found in tensors_inside_objects(value, where, depth + 1, held)
    ]


def _host_scalar(value: Any, shape: Any) -> bool:
    """A 0-d array that is no torch tensor (a NumPy scalar such as ``np.int64``):
    megatron-core does not copy it into a graph's buffers, its value was baked in at the
    capture like a Python number's, so it is compared by value."""
    return tuple(shape) == () and not isinstance(value, _TENSOR_TYPE or _tensor_type())


_TENSOR = object()


def fingerprint(batch: Any, depth: int = 0) -> Any:
    """What :func:`signature` describes, as a cheap comparable value (no strings): the
    guard compares every micro-batch of every replayed step with it, and builds the readable
    :func:`signature` only to say what changed."""
    if isinstance(batch, dict) and depth < _MAX_DEPTH:
        # dict subclasses too: signature() describes them as dicts, so must this
        return _dict_fingerprint(batch, depth)
    shape = getattr(batch, "shape", None)
    if shape is not None:
        dtype = getattr(batch, "dtype", None)
        if dtype is not None:
            if _host_scalar(batch, shape):
                return (type(batch), repr(batch))
            return (_TENSOR, tuple(shape), dtype)
    if isinstance(batch, float):
        return (float, repr(batch))  # NaN != NaN; its repr is stable
    if isinstance(batch, _SCALARS) or isinstance(batch, enum.Enum):
        return (type(batch), batch)
    if depth >= _MAX_DEPTH:
        return (type(batch), repr(batch))
    if isinstance(batch, (list, tuple)):
        return (type(batch), tuple(fingerprint(v, depth + 1) for v in batch))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = tuple(f.name for f in dataclasses.fields(batch))
        return (type(batch), tuple((n, fingerprint(getattr(batch, n), depth + 1)) for n in fields))
    return (type(batch), signature(batch, depth=depth))


def _dict_fingerprint(batch: dict[Any, Any], depth: int) -> Any:
    """:func:`fingerprint` of a dict (plain or a subclass), the usual micro-batch, in one
    comprehension (it runs for every micro-batch of every replayed step): torch tensors
    described in place (their ``torch.Size`` and dtype), ``None`` as itself, other values
    through :func:`fingerprint`."""
    tensor = _TENSOR_TYPE or _tensor_type()
    return (
        dict,
        tuple(
            [
                (key, _TENSOR, value.shape, value.dtype)
                if isinstance(value, tensor)
                else (key, None)
                if value is None
                else (key, fingerprint(value, depth + 1))
                for key, value in batch.items()
            ]
        ),
    )


def _tensor_type() -> Any:
    """``torch.Tensor``, or ``()`` (which nothing is an instance of) before torch is imported:
    the guard never imports torch itself."""
    global _TENSOR_TYPE
    if _TENSOR_TYPE is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return ()
        _TENSOR_TYPE = torch.Tensor
    return _TENSOR_TYPE


_TENSOR_TYPE: Any = None


def difference(expected: tuple, actual: tuple, then: str = "at capture") -> str:
    """The first item two :func:`signature` results differ in, as a phrase."""
    exp, act = dict(expected), dict(actual)
    for key in sorted(set(exp) | set(act)):
        if exp.get(key) != act.get(key):
            return f"{key}: {exp.get(key, 'absent')} {then}, now {act.get(key, 'absent')}"
    return "the structure changed"


@dataclasses.dataclass
class _Reference:
    step: int | None
    call: dict[str, Any]
    batches: dict[tuple[int, int], tuple] = dataclasses.field(default_factory=dict)
    # a full-iteration capture: megatron-core copies each micro-batch into static buffers
    copied: bool = False
    # (model, forward_step_func, its snapshot) of the call: a full-iteration graph replays
    # their work (callee.py)
    callee: tuple[Any, Any, Any] = (None, None, None)
    # copied into megatron-core's own class-level static buffers (not a bucket's)
    buffered: bool = False
    # each model chunk's training flag at the call (callee.modes; copied calls only)
    modes: tuple[Any, ...] = ()


class ShapeGuard:
    """Per stage (``training``/``validation``): record a reference call, check later calls."""

    CALL_KEYS = ("num_microbatches", "seq_length", "micro_batch_size")

    def __init__(self) -> None:
        self._reference: dict[str, _Reference] = {}
        self._recording: dict[str, _Reference] = {}
        # changes whenever a reference is made or dropped: a caller that remembered a
        # check's outcome (the interceptor's replay fast path) knows when to forget it
        self.generation = 0
        # the training reference's call values (check_replay); None matches no call
        self._replay_values: tuple[Any, ...] | None = None
        self._replay_callee: tuple[Any, Any] = (None, None)
        # the captured step function can change only by being another object (is_fixed)
        self._replay_fixed = False
        self._replay_modes: tuple[Any, ...] = ()
        # the step of each stage's warm-up call being checked against the static buffers
        self._warmup_step: dict[str, int | None] = {}
        # per (stage, model chunk, micro-batch index): the top-level keys that chunk's
        # micro-batches put in megatron-core's static buffer (the chunks share the buffer),
        # and the dtype each tensor path was first passed with
        self._passed_to_buffers: dict[tuple[str, int, int], tuple[set[Any], dict[str, Any]]] = {}

    def is_armed(self, stage: str) -> bool:
        return stage in self._reference

    def disarm(self) -> None:
        self._reference.clear()
        self._recording.clear()
        self._replay_values = None
        self._replay_callee = (None, None)
        self._replay_fixed = False
        self._replay_modes = ()
        self.generation += 1

    def check_call(
        self,
        stage: str,
        step: int | None,
        kwargs: dict[str, Any],
        *,
        record: bool,
        copied: bool = False,
        static_buffers: bool = False,
    ) -> Any:
        """Check (or, with ``record``, remember) one forward/backward call; returns the
        data iterator to pass on, wrapped so each micro-batch is checked as it is drawn.
        ``copied``: the call captures a full-iteration graph, which megatron-core feeds by
        copying each micro-batch into static buffers (a tensor it cannot copy is refused).
        ``static_buffers``: those are megatron-core's own class-level buffers of ``stage``,
        made by its first call: from the second call on, each micro-batch must fit the
        buffer it is copied into (:meth:`_check_static_buffer`)."""
        data_iterator = kwargs.get("data_iterator")
        if record:
            call = {key: kwargs.get(key) for key in self.CALL_KEYS}
            step_func = kwargs.get("forward_step_func")
            made = (kwargs.get("model"), step_func, callee.snapshot(step_func) if copied else None)
            self._recording[stage] = _Reference(
                step,
                call,
                copied=copied,
                callee=made,
                buffered=static_buffers,
                modes=callee.modes(kwargs.get("model")) if copied else (),
            )
            return self._wrap(stage, data_iterator, True)
        ref = self._reference.get(stage)
        if ref is None:
            if not static_buffers:
                return data_iterator
            # a warm-up call: checked against the buffers megatron-core already made
            self._warmup_step[stage] = step
            return self._wrap(stage, data_iterator, None)
        for key in self.CALL_KEYS:
            value = kwargs.get(key)
            if value != ref.call[key]:
                raise StaticShapeError(
                    f"{stage} forward_backward_func called with {key}={value!r} after "
                    f"CUDA graph capture (step {ref.step}) with {key}={ref.call[key]!r}; "
                    f"replaying the graph would use stale buffers. Fix: {FIX}"
                )
        if ref.copied:
            _check_callee(stage, ref, kwargs)
        return self._wrap(stage, data_iterator, False)

    def check_replay(self, kwargs: dict[str, Any]) -> Any:
        """:meth:`check_call` of a training call the interceptor replays directly (its
        reference exists): the same checks, in fewer calls, as it runs on every step."""
        model, step_func = self._replay_callee
        if (
            tuple(map(kwargs.get, self.CALL_KEYS)) != self._replay_values
            or kwargs.get("forward_step_func") is not step_func
            or not self._replay_fixed
            or kwargs.get("model") is not model
            or callee.modes(model) != self._replay_modes
        ):
            # (says what changed; a forward_step_func made again alike passes there, and
            # one with closure variables is looked at again: a value may change in place)
            return self.check_call("training", None, kwargs, record=False)
        data_iterator = kwargs.get("data_iterator")
        if data_iterator is None or isinstance(data_iterator, list):
            return self._wrap("training", data_iterator, False)
        return _CheckedIterator(self, "training", data_iterator, False, 0)

    def commit(self, stage: str) -> None:
        """Make the recorded call the reference for ``stage``."""
        ref = self._reference[stage] = self._recording.pop(stage)
        if stage == "training":
            self._replay_values = tuple(ref.call.values())  # in CALL_KEYS order
            model, step_func, recorded = ref.callee
            self._replay_callee = (model, step_func)
            self._replay_fixed = recorded is not None and callee.is_fixed(recorded)
            self._replay_modes = ref.modes
        self.generation += 1

    def _wrap(self, stage: str, data_iterator: Any, record: bool | None, chunk: int = 0) -> Any:
        """The data iterator, checked as it is drawn: one model chunk's (the usual case, on
        every replayed step: wrapped directly), or a list of them (virtual pipeline stages),
        each wrapped as its chunk; ``None`` (a stage that reads no data) stays ``None``.
        ``record``: True records, False checks against the reference, None (a warm-up
        call) checks against megatron-core's static buffers alone."""
        if isinstance(data_iterator, list):
            return [self._wrap(stage, it, record, c) for c, it in enumerate(data_iterator)]
        if data_iterator is None:
            return None
        return _CheckedIterator(self, stage, data_iterator, record, chunk)

    def _see(self, stage: str, index: int, chunk: int, batch: Any, record: bool | None) -> None:
        if record:
            recording = self._recording[stage]
            if recording.buffered:
                self._check_static_buffer(stage, index, chunk, batch, recording.step, True)
            hidden = tensors_inside_objects(batch) if recording.copied else []
            if hidden:
                raise StaticShapeError(
                    f"{stage} micro-batch {index} (model chunk {chunk}) holds "
                    f"{', '.join(hidden)}: a tensor inside an object, which megatron-core's "
                    "full-iteration graph does not copy into its static buffers (it copies "
                    "the tensors of dicts, lists and tuples), so every replay would read it "
                    "where it was at the capture. Fix: put the tensor itself in the batch "
                    "dict (e.g. cu_seqlens) and build the object (e.g. PackedSeqParams) in "
                    "forward_step, as Megatron-LM does; or use TE scopes such as attn,mlp "
                    "(bf16 layers)"
                )
            recording.batches[(chunk, index)] = (fingerprint(batch), signature(batch))
            return
        if record is None:
            self._check_static_buffer(stage, index, chunk, batch, self._warmup_step.get(stage))
            return
        ref = self._reference[stage]
        known = ref.batches.get((chunk, index))
        if known is None:
            raise StaticShapeError(
                f"{stage} micro-batch {index} (model chunk {chunk}) drawn after CUDA graph "
                f"capture (step {ref.step}), which saw {len(ref.batches)} micro-batch(es); "
                f"replaying the graph would use stale buffers. Fix: {FIX}"
            )
        # a plain dict, the usual micro-batch, straight to its fingerprint (one call less)
        seen = _dict_fingerprint(batch, 0) if type(batch) is dict else fingerprint(batch)
        if seen == known[0]:
            return
        # (a fingerprint follows the dict's key order; the signature sorts: the same keys
        # in another order are the same batch, megatron-core copies by key)
        described = signature(batch)
        if described != known[1]:
            raise StaticShapeError(
                f"{stage} micro-batch {index} (model chunk {chunk}) changed after CUDA graph "
                f"capture (step {ref.step}): {difference(known[1], described)}; "
                f"replaying the graph would use stale buffers. Fix: {FIX}"
            )

    def _check_static_buffer(
        self,
        stage: str,
        index: int,
        chunk: int,
        batch: Any,
        step: int | None,
        capture: bool = False,
    ) -> None:
        """Before the capture, megatron-core's ``FullCudaGraphWrapper`` copies every call's
        micro-batch ``index`` into the static buffer the first call that reached that index
        made (and the capture records into it). Where that copy would fail inside
        megatron-core, or go wrong without a word (a ``[b, 1]`` tensor broadcast into a
        ``[b, s]`` buffer, a converted dtype, a list that shrank leaving its old tail, a key
        no longer passed whose old value stays: :func:`compat.copy_problem`), the call is
        refused before the copy."""
        batch = compat.loader_input(batch)
        if not isinstance(batch, dict):
            return  # (megatron-core refuses a micro-batch that is no dict)
        keys, dtypes = self._passed_to_buffers.setdefault((stage, chunk, index), (set(), {}))
        buffer = compat.static_buffer(stage, index)
        found = compat.copy_problem(
            buffer if isinstance(buffer, dict) else None, batch, keys, dtypes
        )
        keys.update(batch)
        if found is None:
            return
        path, made, now, what = found
        when = "before the first training step" if step is None else f"at step {step}"
        raise StaticShapeError(
            f"{stage} micro-batch {index} (model chunk {chunk}) {when} ("
            f"{'the capture call' if capture else 'a warm-up call'}) does not fit the static "
            "buffer megatron-core's FullCudaGraphWrapper copies it into (made by the first "
            f"call that reached micro-batch {index}; every call before the capture is copied "
            f"into it): {path}: {made} in the buffer, now {now}: {what}. Fix: {FIX}; for "
            "shapes that must change, --cuda-graph-buckets"
        )


CALLEE_FIX = (
    "call with the model in the mode of the capture (chunk.train() before training steps; "
    "evaluations in eval mode from the first one on, the validation graph being captured in "
    "the mode of its capture call), and pass the same model and forward_step_func on every "
    "call (make forward_step_func once; "
    "give a value that changes per step, a loss coefficient say, to the loss as a tensor in "
    "the micro-batch, or as a device tensor filled in place); with --cuda-graph-buckets, "
    "run.invalidate_graphs() after a deliberate change captures the buckets again; or run "
    "without CUDA graphs"
)


def _check_callee(stage: str, ref: _Reference, kwargs: dict[str, Any]) -> None:
    """A full-iteration graph replays the computation of the model and forward_step_func it
    was captured with (:mod:`~cudagraph_plugin.runtime.callee`)."""
    model, step_func, recorded = ref.callee
    given = kwargs.get("forward_step_func")
    if not callee.same_models(kwargs.get("model"), model):
        what = "another model"
    elif callee.modes(model) != ref.modes:
        what = (
            f"the model in {_mode_name(callee.modes(model))} mode (captured in "
            f"{_mode_name(ref.modes)} mode: dropout and every other mode-dependent layer "
            "run as captured)"
        )
    elif recorded is not None and not callee.same_snapshot(callee.snapshot(given), recorded):
        what = (
            f"another forward_step_func ({callee.describe(given)}, captured with "
            f"{callee.describe(step_func)}: a value it uses changed)"
        )
    else:
        return
    raise StaticShapeError(
        f"{stage} forward_backward_func called with {what} after CUDA graph capture (step "
        f"{ref.step}): the graph replays the captured call's computation, so the change "
        f"would be silently ignored. Fix: {CALLEE_FIX}"
    )


def _mode_name(modes: tuple[Any, ...]) -> str:
    names = {"train" if flag else "eval" for flag in modes}
    return names.pop() if len(names) == 1 else "mixed train/eval"


class _CheckedIterator:
    """Checks (or records) each micro-batch as the schedule draws it. One is made per
    forward/backward call: slots, no instance dict (less memory touched per step)."""

    __slots__ = ("_chunk", "_guard", "_index", "_iterator", "_record", "_stage")

    def __init__(
        self, guard: ShapeGuard, stage: str, iterator: Any, record: bool | None, chunk: int
    ) -> None:
        self._guard = guard
        self._stage = stage
        self._iterator = iterator
        self._record = record
        self._chunk = chunk
        self._index = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._guard._see(self._stage, self._index, self._chunk, batch, self._record)
        self._index += 1
        return batch
