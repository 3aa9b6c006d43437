"""The static-shape guard: changed inputs after capture raise instead of replaying."""

from __future__ import annotations

import pytest
import torch
from cpu_only import needs_mcore_on_cpu

from cudagraph_plugin.runtime.guard import ShapeGuard, StaticShapeError, signature


def batches(n: int, seq: int = 8, mbs: int = 2, dtype=torch.int64):
    return iter([{"tokens": torch.zeros(mbs, seq, dtype=dtype), "mask": None} for _ in range(n)])


def call(guard: ShapeGuard, n: int = 2, record: bool = False, **overrides):
    kwargs = {
        "num_microbatches": n,
        "seq_length": 8,
        "micro_batch_size": 2,
        "data_iterator": batches(n),
    }
    kwargs.update(overrides)
    iterator = guard.check_call("training", 3, kwargs, record=record)
    return [next(iterator) for _ in range(kwargs["num_microbatches"])]


def armed() -> ShapeGuard:
    guard = ShapeGuard()
    call(guard, record=True)
    guard.commit("training")
    assert guard.is_armed("training")
    return guard


def test_signature_covers_nested_tensors_and_leaves():
    sig = signature({"b": (torch.zeros(2, 3), 4), "a": torch.ones(1, dtype=torch.bfloat16)})
    assert sig == (
        ("batch['a']", "shape (1,) dtype torch.bfloat16"),
        ("batch['b'][0]", "shape (2, 3) dtype torch.float32"),
        ("batch['b'][1]", "int 4"),
    )


def test_python_scalars_and_objects_are_compared_by_value():
    """A graph keeps the capture-time values of non-tensor inputs (e.g. the max_seqlen of
    packed-sequence parameters): a changed value must be caught, not only a changed type."""
    from megatron.core.packed_seq_params import PackedSeqParams

    def packed(max_seqlen: int) -> dict:
        cu = torch.tensor([0, 4, 8], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
        )
        return {"tokens": torch.zeros(1, 8, dtype=torch.int64), "packed_seq_params": params}

    guard = ShapeGuard()
    recorded = guard.check_call(
        "training", 3, {"num_microbatches": 1, "data_iterator": iter([packed(4)])}, record=True
    )
    next(recorded)
    guard.commit("training")
    same = guard.check_call(
        "training", 4, {"num_microbatches": 1, "data_iterator": iter([packed(4)])}, record=False
    )
    next(same)
    changed = guard.check_call(
        "training", 5, {"num_microbatches": 1, "data_iterator": iter([packed(6)])}, record=False
    )
    with pytest.raises(StaticShapeError, match=r"max_seqlen_kv: int 4 at capture, now int 6"):
        next(changed)


def test_a_changed_scalar_in_a_plain_dict_is_caught():
    guard = ShapeGuard()
    first = guard.check_call("training", 0, {"data_iterator": iter([{"scale": 1.0}])}, record=True)
    next(first)
    guard.commit("training")
    later = guard.check_call("training", 1, {"data_iterator": iter([{"scale": 2.0}])}, record=False)
    with pytest.raises(StaticShapeError, match="scale"):
        next(later)


def test_unarmed_guard_passes_the_iterator_through():
    guard = ShapeGuard()
    it = batches(1)
    assert guard.check_call("training", 0, {"data_iterator": it}, record=False) is it


def test_same_inputs_replay_fine():
    guard = armed()
    for _ in range(3):
        assert len(call(guard)) == 2


def test_shape_change_raises_naming_the_tensor_and_fix():
    guard = armed()
    with pytest.raises(StaticShapeError) as info:
        call(
            guard,
            data_iterator=iter(
                [{"tokens": torch.zeros(2, 16, dtype=torch.int64), "mask": None}] * 2
            ),
        )
    message = str(info.value)
    assert "micro-batch 0" in message and "batch['tokens']" in message
    assert "(2, 8)" in message and "(2, 16)" in message
    assert "stale buffers" in message and "Fix:" in message and "step 3" in message


def test_dtype_change_raises():
    guard = armed()
    with pytest.raises(StaticShapeError, match=r"dtype torch\.int32"):
        call(guard, data_iterator=batches(2, dtype=torch.int32))


def test_leaf_type_change_raises():
    guard = armed()
    changed = iter([{"tokens": torch.zeros(2, 8, dtype=torch.int64), "mask": torch.ones(1)}] * 2)
    with pytest.raises(StaticShapeError, match="mask"):
        call(guard, data_iterator=changed)


@pytest.mark.parametrize(
    "key,value", [("num_microbatches", 3), ("seq_length", 16), ("micro_batch_size", 4)]
)
def test_call_argument_change_raises_before_any_batch_is_drawn(key, value):
    guard = armed()
    drawn = []

    def counting():
        while True:
            drawn.append(1)
            yield {"tokens": torch.zeros(2, 8, dtype=torch.int64), "mask": None}

    with pytest.raises(StaticShapeError, match=f"{key}={value}"):
        guard.check_call(
            "training",
            4,
            {
                "num_microbatches": 2,
                "seq_length": 8,
                "micro_batch_size": 2,
                key: value,
                "data_iterator": counting(),
            },
            record=False,
        )
    assert drawn == []


def test_more_microbatches_drawn_than_captured_raises():
    guard = armed()
    iterator = guard.check_call(
        "training",
        5,
        {
            "num_microbatches": 2,
            "seq_length": 8,
            "micro_batch_size": 2,
            "data_iterator": batches(3),
        },
        record=False,
    )
    next(iterator), next(iterator)
    with pytest.raises(StaticShapeError, match="saw 2 micro-batch"):
        next(iterator)


def test_stages_and_model_chunks_are_separate():
    guard = armed()
    # validation was never recorded: anything goes there
    it = guard.check_call("validation", 5, {"data_iterator": batches(1, seq=99)}, record=False)
    assert next(it)["tokens"].shape == (2, 99)
    chunked = ShapeGuard()
    its = chunked.check_call(
        "training",
        0,
        {"num_microbatches": 1, "data_iterator": [batches(1), None, batches(1, seq=4)]},
        record=True,
    )
    assert its[1] is None
    next(its[0]), next(its[2])
    chunked.commit("training")
    its = chunked.check_call(
        "training",
        1,
        {"num_microbatches": 1, "data_iterator": [batches(1), None, batches(1, seq=8)]},
        record=False,
    )
    next(its[0])
    with pytest.raises(StaticShapeError, match="model chunk 2"):
        next(its[2])


def test_disarm_forgets_the_reference():
    guard = armed()
    guard.disarm()
    assert not guard.is_armed("training")
    call(guard, seq_length=16, data_iterator=batches(2, seq=16))


def test_nested_values_are_described_by_shape_down_to_the_depth_limit():
    """Four dicts deep a tensor is still described by shape and dtype, not by its values."""

    def nested(tensor):
        return {"a": {"b": {"c": {"d": tensor}}}}

    assert signature(nested(torch.zeros(2))) == signature(nested(torch.ones(2)))
    assert signature(nested(torch.zeros(2))) != signature(nested(torch.zeros(3)))


def test_plain_objects_are_described_by_their_public_fields():
    class Params:
        def __init__(self, max_seqlen, cache):
            self.max_seqlen = max_seqlen
            self._cache = cache  # private: not part of what the graph baked in

    assert signature(Params(32, cache=1)) == signature(Params(32, cache=2))
    assert signature(Params(32, cache=1)) != signature(Params(16, cache=1))


def test_a_batch_that_contains_itself_is_checked_without_endless_recursion():
    """The depth limit holds on the dict fast path too."""
    guard = ShapeGuard()
    batch: dict = {"tokens": torch.zeros(2, 8, dtype=torch.int64)}
    batch["self"] = batch
    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2}
    next(guard.check_call("training", 3, {**kwargs, "data_iterator": iter([batch])}, record=True))
    guard.commit("training")
    next(guard.check_call("training", 4, {**kwargs, "data_iterator": iter([batch])}, record=False))


def test_a_changed_tensor_in_a_nested_dict_or_an_array_like_value_is_caught():
    """Values other than torch tensors in a dict batch (a nested dict, an object with shape
    and dtype) go through the general description: changes there still raise."""

    class ArrayLike:
        def __init__(self, shape):
            self.shape = shape
            self.dtype = "float32"

    def batch(inner_len, array_len):
        return {
            "tokens": torch.zeros(2, 8, dtype=torch.int64),
            "extra": {"cu_seqlens": torch.zeros(inner_len, dtype=torch.int32)},
            "array": ArrayLike((array_len,)),
        }

    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2}

    def check(b, record=False):
        next(guard.check_call("training", 3, {**kwargs, "data_iterator": iter([b])}, record=record))

    guard = ShapeGuard()
    check(batch(3, 4), record=True)
    guard.commit("training")
    check(batch(3, 4))
    with pytest.raises(StaticShapeError, match="cu_seqlens"):
        check(batch(5, 4))
    with pytest.raises(StaticShapeError, match="array"):
        check(batch(3, 6))


@pytest.mark.parametrize("first,later", [("dict", "OrderedDict"), ("OrderedDict", "dict")])
def test_a_dict_subclass_and_a_plain_dict_with_the_same_values_are_the_same_batch(first, later):
    # signature() describes a dict subclass as a dict; the fingerprint must agree, for tensor
    # and None values alike (each has its own fast path)
    import collections

    kinds = {"dict": dict, "OrderedDict": collections.OrderedDict}
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.int64), "mask": None, "scale": 1.0}
    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2}
    guard = ShapeGuard()
    drawn = guard.check_call(
        "training", 3, {**kwargs, "data_iterator": iter([kinds[first](batch)])}, record=True
    )
    next(drawn)
    guard.commit("training")
    replayed = guard.check_call(
        "training", 4, {**kwargs, "data_iterator": iter([kinds[later](batch)] * 2)}, record=False
    )
    assert next(replayed)["scale"] == 1.0
    changed = kinds[later]({**batch, "mask": torch.ones(2, 8)})
    replayed = guard.check_call(
        "training", 5, {**kwargs, "data_iterator": iter([changed])}, record=False
    )
    with pytest.raises(StaticShapeError, match="mask"):
        next(replayed)


# -- check_replay: check_call's shortcut for the interceptor's remembered training replay ------


def _plain_step(data_iterator, model):  # a step function the replay's shortcut trusts
    raise AssertionError("never called by the guard")


_MODEL = [torch.nn.Linear(1, 1)]
# (the model and a plain step function: without them every replay check takes check_call's
# path, and the replay's own shortcut, which these tests are about, is never reached)
CALLEE = {"forward_step_func": _plain_step, "model": _MODEL}


def _replay_kwargs(**overrides):
    kwargs = {"num_microbatches": 2, "seq_length": 8, "micro_batch_size": 2, **CALLEE}
    kwargs["data_iterator"] = batches(kwargs["num_microbatches"])
    kwargs.update(overrides)
    return kwargs


def armed_for_replays() -> ShapeGuard:
    """A guard armed by a call with the model and a plain step function, whose replays take
    the shortcut (``check_call`` is then never reached for an unchanged call)."""
    guard = ShapeGuard()
    # (copied: the interceptor's full-iteration path, which snapshots the step function)
    iterator = guard.check_call("training", 3, _replay_kwargs(), record=True, copied=True)
    next(iterator), next(iterator)
    guard.commit("training")

    def unexpected(*args, **kwargs):
        raise AssertionError("the replay's shortcut fell back to check_call")

    shortcut = guard.check_replay(_replay_kwargs())
    guard.check_call, real = unexpected, guard.check_call
    try:
        next(guard.check_replay(_replay_kwargs()))
    finally:
        guard.check_call = real
    del shortcut
    return guard


@pytest.mark.parametrize(
    "key,value", [("num_microbatches", 3), ("seq_length", 16), ("micro_batch_size", 4)]
)
def test_check_replay_refuses_a_changed_call_as_check_call_does(key, value):
    guard = armed_for_replays()
    with pytest.raises(StaticShapeError) as by_call:
        guard.check_call("training", None, _replay_kwargs(**{key: value}), record=False)
    with pytest.raises(StaticShapeError) as by_replay:
        guard.check_replay(_replay_kwargs(**{key: value}))
    assert str(by_replay.value) == str(by_call.value)
    assert f"{key}={value}" in str(by_replay.value)


def test_check_replay_checks_every_micro_batch_as_it_is_drawn():
    guard = armed()
    same = guard.check_replay(_replay_kwargs())
    assert [next(same)["tokens"].shape for _ in range(2)] == [(2, 8), (2, 8)]
    changed = guard.check_replay(_replay_kwargs(data_iterator=batches(2, seq=4)))
    with pytest.raises(StaticShapeError, match="tokens"):
        next(changed)
    extra = guard.check_replay(_replay_kwargs(data_iterator=batches(3)))
    next(extra), next(extra)
    with pytest.raises(StaticShapeError, match="saw 2 micro-batch"):
        next(extra)


def test_check_replay_wraps_chunk_lists_and_passes_none():
    guard = ShapeGuard()
    kwargs = {"num_microbatches": 1, "data_iterator": [batches(1), None, batches(1, seq=4)]}
    its = guard.check_call("training", 0, kwargs, record=True)
    next(its[0]), next(its[2])
    guard.commit("training")
    its = guard.check_replay(
        {"num_microbatches": 1, "data_iterator": [batches(1), None, batches(1, seq=8)]}
    )
    assert its[1] is None
    next(its[0])
    with pytest.raises(StaticShapeError, match="model chunk 2"):
        next(its[2])
    assert guard.check_replay({"num_microbatches": 1, "data_iterator": None}) is None


def test_check_replay_after_disarm_checks_nothing():
    guard = armed()
    guard.disarm()
    iterator = batches(1, seq=99)
    assert guard.check_replay(_replay_kwargs(data_iterator=iterator)) is iterator


def test_check_replay_wraps_a_list_subclass_per_chunk_as_check_call_does():
    class Chunks(list):
        pass

    guard = ShapeGuard()
    its = guard.check_call(
        "training", 0, {"data_iterator": Chunks([batches(1)]), **CALLEE}, record=True, copied=True
    )
    next(its[0])
    guard.commit("training")
    its = guard.check_replay({"data_iterator": Chunks([batches(1, seq=4)]), **CALLEE})
    with pytest.raises(StaticShapeError, match="model chunk 0"):
        next(its[0])


def _packed_batch() -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, 4, 8], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=8
    )
    return {"tokens": torch.zeros(1, 8, dtype=torch.int64), "packed_seq_params": params}


def _record_packed(copied: bool) -> list:
    guard = ShapeGuard()
    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 1}
    kwargs["data_iterator"] = iter([_packed_batch()])
    iterator = guard.check_call("training", 3, kwargs, record=True, copied=copied)
    return [next(iterator)]


def test_a_full_iteration_capture_refuses_a_tensor_megatron_core_would_not_copy():
    """megatron-core's full-iteration graph copies a micro-batch into its static buffers
    through dicts, lists and tuples only: PackedSeqParams' cu_seqlens would be read where
    they were at the capture on every replay (new packing boundaries silently ignored)."""
    pytest.importorskip("megatron.core.packed_seq_params")
    with pytest.raises(StaticShapeError) as info:
        _record_packed(copied=True)
    message = str(info.value)
    assert "holds batch['packed_seq_params'].cu_seqlens_q, batch['packed_seq_params']." in message
    assert "does not copy into its static buffers" in message
    assert "Fix: put the tensor itself in the batch dict" in message
    assert len(_record_packed(copied=False)) == 1  # per-layer TE graphs: the model reads it


def test_tensors_inside_objects_are_found_at_any_depth_and_containers_alone_are_fine():
    from types import SimpleNamespace as NS

    from cudagraph_plugin.runtime.guard import tensors_inside_objects

    t = torch.zeros(2)
    assert tensors_inside_objects({"a": t, "b": [t, (t, {"c": t})], "n": 3, "m": None}) == []
    assert tensors_inside_objects({"a": [NS(x=t, y=1, _z=t)], "b": NS(o=NS(v=(t,)))}) == [
        "batch['a'][0].x",
        "batch['b'].o.v[0]",
    ]


@needs_mcore_on_cpu
@pytest.mark.parametrize(
    "argv, copied",
    [
        (["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"], [True]),
        (
            ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp", "--bf16"],
            [False],
        ),
    ],
    ids=["full_iteration", "te"],
)
def test_the_loop_records_a_full_iteration_capture_as_copied(
    fake_graphs, monkeypatch, argv, copied
):
    """What :func:`test_a_full_iteration_capture_refuses_a_tensor_megatron_core_would_not_copy`
    relies on: the full-iteration capture call is recorded as copied, a TE reference not."""
    from recording import run_recorded

    recorded = []
    check_call = ShapeGuard.check_call

    def spy(self, stage, step, kwargs, *, record, copied=False, **more):
        if record:
            recorded.append(copied)
        return check_call(self, stage, step, kwargs, record=record, copied=copied, **more)

    monkeypatch.setattr(ShapeGuard, "check_call", spy)
    run_recorded(*argv, "--cuda-graph-warmup-steps", "2", steps=5)
    assert recorded == copied


@needs_mcore_on_cpu
def test_the_rl_loop_records_each_bucket_capture_as_copied(fake_graphs, bucket_fakes, monkeypatch):
    import rl_loop

    recorded = []
    check_call = ShapeGuard.check_call

    def spy(self, stage, step, kwargs, *, record, copied=False, **more):
        if record:
            recorded.append((stage, copied))
        return check_call(self, stage, step, kwargs, record=record, copied=copied, **more)

    monkeypatch.setattr(ShapeGuard, "check_call", spy)
    rl_loop.run(
        ["--seq-length", "48", "--min-length", "4", "--max-length", "48", "--train-iters", "12",
         "--steps-per-round", "4", "--rollout-batches", "2", "--log-interval", "0",
         "--cuda-graph-warmup-steps", "2", "--cuda-graph-impl", "local", "--cuda-graph-scope",
         "full_iteration", "--cuda-graph-buckets", "16,32,48"]
    )  # fmt: skip
    assert recorded and all(copied for _, copied in recorded), recorded
    assert all(stage.startswith("training (bucket") for stage, _ in recorded), recorded


def _armed_with(batch: dict) -> ShapeGuard:
    guard = ShapeGuard()
    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2}
    next(guard.check_call("training", 3, {**kwargs, "data_iterator": iter([batch])}, record=True))
    guard.commit("training")
    return guard


def _draw(guard: ShapeGuard, batch: dict) -> None:
    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2}
    next(guard.check_call("training", 4, {**kwargs, "data_iterator": iter([batch])}, record=False))


def test_a_numpy_scalar_is_compared_by_value_as_a_python_number_is():
    """megatron-core does not copy a NumPy scalar (a ``max_seqlen`` from ``np.max``) into
    the graph's buffers: its capture value is baked in."""
    np = pytest.importorskip("numpy")
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    guard = _armed_with({"tokens": tokens, "max_seqlen": np.int64(4)})
    _draw(guard, {"tokens": tokens, "max_seqlen": np.int64(4)})
    with pytest.raises(
        StaticShapeError, match=r"batch\['max_seqlen'\]: int64 np.int64\(4\) at capture"
    ):
        _draw(guard, {"tokens": tokens, "max_seqlen": np.int64(6)})
    guard = _armed_with({"tokens": tokens, "scale": torch.tensor(2.0)})  # a 0-d torch tensor
    _draw(guard, {"tokens": tokens, "scale": torch.tensor(3.0)})  # copied: its shape counts


def test_the_same_keys_in_another_order_are_the_same_batch():
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    guard = _armed_with({"tokens": tokens, "labels": tokens})
    _draw(guard, {"labels": tokens, "tokens": tokens})  # megatron-core copies by key
    with pytest.raises(StaticShapeError, match="labels"):
        _draw(guard, {"labels": tokens[:, :4], "tokens": tokens})


# -- warm-up calls against megatron-core's static buffers -----------------------------------------


def _through_megatron(
    *steps, chunks: int = 1, capture_at: int | None = None, forward_step=None
) -> list:
    """Full-iteration calls before the capture (``capture_at``: that step is the capture
    call), each step a list of micro-batches (or, with ``chunks``, a list of such lists, one
    per model chunk), drawn through the guard by megatron-core's own ``data_read`` into its
    real ``StaticBufferLoader`` buffers; ``forward_step`` is given each micro-batch the
    model gets (megatron-core's buffer itself); returns what the model got at the last step."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from cpu_redirect import cpu_redirect

    guard = ShapeGuard()
    seen: list = []
    with cpu_redirect():
        wrapper = FullCudaGraphWrapper(lambda **kwargs: None, cuda_graph_warmup_steps=99)
        for step, drawn in enumerate(steps, 1):
            lists = drawn if chunks > 1 else [drawn]
            iterators = [iter(chunk) for chunk in lists]
            kwargs = {
                "data_iterator": iterators if chunks > 1 else iterators[0],
                "num_microbatches": len(lists[0]),
                "seq_length": 8,
                "micro_batch_size": 2,
            }
            iterator = guard.check_call(
                "training", step, kwargs, record=step == capture_at, copied=True,
                static_buffers=True,
            )  # fmt: skip
            data = wrapper.data_read(iterator, [object()] * chunks, True, len(lists[0]))
            seen = [next(chunk_data) for chunk_data in data]
            for batch in seen if forward_step else ():
                forward_step(batch)
    return seen


@pytest.fixture
def static_buffers(monkeypatch):
    """megatron-core's static buffers, empty, for this test alone."""
    from megatron.core.full_cuda_graph import StaticBufferLoader

    buffers = {"training": [], "validation": []}
    monkeypatch.setattr(StaticBufferLoader, "static_buffers", buffers)
    return buffers


def _tokens(value: int = 0, width: int = 8, dtype=torch.int64):
    return torch.full((2, width), value, dtype=dtype)


@needs_mcore_on_cpu
@pytest.mark.parametrize(
    "first, then, said, what",
    [
        ({"tokens": _tokens()}, {"tokens": _tokens(width=4)},
         "batch['tokens']: shape (2, 8) dtype torch.int64 in the buffer, now shape (2, 4)",
         "would fail (the shapes do not match)"),
        # the silent one: broadcast by megatron-core's copy_
        ({"tokens": _tokens()}, {"tokens": _tokens(width=1)}, "now shape (2, 1)",
         "broadcast it into the buffer without an error"),
        ({"tokens": _tokens()}, {"tokens": _tokens(dtype=torch.int32)},
         "now shape (2, 8) dtype torch.int32", "convert it to the buffer's dtype"),
        ({"t": _tokens(), "cu": [_tokens(), _tokens()]}, {"t": _tokens(), "cu": [_tokens()]},
         "batch['cu']: a list of 2 in the buffer, now a list of 1", "leave the old value"),
        ({"t": _tokens(), "cu": [_tokens()]}, {"t": _tokens(), "cu": [_tokens(), _tokens()]},
         "batch['cu']: a list of 1 in the buffer, now a list of 2", "would fail"),
        ({"t": _tokens(), "m": {"a": 8, "pad": 3}}, {"t": _tokens(), "m": {"a": 8}},
         "batch['m']: a dict with keys ['a', 'pad'] in the buffer, now a dict with keys ['a']",
         "leave the old value"),
        ({"t": _tokens(), "m": {"a": _tokens()}}, {"t": _tokens(), "m": {"a": _tokens(width=2)}},
         "batch['m']['a']: shape (2, 8)", "would fail"),
        ({"t": _tokens(), "max_seqlen": 8}, {"t": _tokens()},
         "batch['max_seqlen']: a key in the buffer, now absent", "leave the old value"),
        ({"t": _tokens(), "shape": (2, 8)}, {"t": _tokens(), "shape": (2, 8)},
         "batch['shape']: a tuple of 2 in the buffer, now a tuple of 2",
         "Unsupported copy for tuple yet"),
        ({"t": _tokens(), "mask": None}, {"t": _tokens(), "mask": _tokens()},
         "batch['mask']: NoneType None in the buffer, now shape (2, 8)",
         "no tensor in the buffer"),
        ({"t": _tokens()}, {"t": _tokens(), "extra": [_tokens()]},
         "batch['extra']: absent in the buffer, now a list of 1", "without copying it"),
    ],
    ids=["shape", "broadcast", "dtype", "list-shrinks", "list-grows", "nested-key-gone",
         "nested-shape", "key-gone", "tuple", "tensor-after-none", "late-list-of-tensors"],
)  # fmt: skip
def test_a_warm_up_call_megatron_core_would_copy_wrongly_is_refused(
    static_buffers, first, then, said, what
):
    with pytest.raises(StaticShapeError) as info:
        _through_megatron([first], [then])
    message = str(info.value)
    assert said in message and what in message
    assert "training micro-batch 0 (model chunk 0) at step 2 (a warm-up call)" in message
    assert "Fix: keep seq_length" in message and "--cuda-graph-buckets" in message


@needs_mcore_on_cpu
@pytest.mark.parametrize(
    "first, then, model_got",
    [
        # other values: copied in; a non-tensor value is put in place
        ([{"t": _tokens(1), "n": 8}], [{"t": _tokens(2), "n": 6}], {"t": _tokens(2), "n": 6}),
        # a top-level key the buffer lacks: megatron-core makes room for it
        ([{"t": _tokens(1)}], [{"t": _tokens(2), "l": _tokens(3)}],
         {"t": _tokens(2), "l": _tokens(3)}),
        # a tensor followed by None: put in place as None
        ([{"t": _tokens(1), "m": _tokens()}], [{"t": _tokens(2), "m": None}],
         {"t": _tokens(2), "m": None}),
        # what megatron-core copies of a (dict, ...) tuple is the dict
        ([({"t": _tokens(1)}, "x")], [({"t": _tokens(2)}, "x")], {"t": _tokens(2)}),
    ],
    ids=["values", "key-added", "none-after-tensor", "tuple-of-dict"],
)  # fmt: skip
def test_a_warm_up_call_megatron_core_copies_rightly_passes(static_buffers, first, then, model_got):
    [got] = _through_megatron(first, then)
    assert got.keys() == model_got.keys()
    for key, value in model_got.items():
        assert torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value


@needs_mcore_on_cpu
def test_objects_and_arrays_megatron_core_puts_in_place_may_change(static_buffers):
    np = pytest.importorskip("numpy")
    [got] = _through_megatron(
        [{"t": _tokens(), "a": np.zeros(3)}], [{"t": _tokens(), "a": np.zeros(5)}]
    )
    assert got["a"].shape == (5,)


@needs_mcore_on_cpu
def test_a_forward_step_that_converts_the_buffer_in_place_is_no_dtype_change(static_buffers):
    """megatron-core hands forward_step its buffer: one that converts a value in place
    changes the buffer's dtype, and each later copy converts to it, as each eager call's
    forward_step would. The micro-batches passed keep their dtype: nothing to refuse."""

    def forward_step(batch):
        batch["mask"] = batch["mask"].double()

    mask = torch.ones(2, 8)
    steps = [[{"t": _tokens(), "mask": mask}] for _ in range(3)]
    [got] = _through_megatron(*steps, forward_step=forward_step)
    assert got["mask"].dtype == torch.float64
    changed = [{"t": _tokens(), "mask": mask.half()}]  # what the host passes: refused
    with pytest.raises(StaticShapeError, match=r"\(passed as torch.float32\).*torch.float16"):
        _through_megatron(*steps, changed, forward_step=forward_step)


@needs_mcore_on_cpu
def test_model_chunks_share_a_buffer_each_with_its_own_keys(static_buffers):
    """Virtual pipeline stages: megatron-core copies every chunk's micro-batch ``b`` into one
    buffer; a key one chunk passes and another lacks is no stale key of the other's."""
    first = [[{"tokens": _tokens(1)}], [{"labels": _tokens(-1)}]]
    then = [[{"tokens": _tokens(2)}], [{"labels": _tokens(-2)}]]
    got = _through_megatron(first, then, chunks=2)
    assert torch.equal(got[0]["tokens"], _tokens(2)) and torch.equal(got[1]["labels"], _tokens(-2))
    gone = [[{"tokens": _tokens(3)}], [{"other": 1}]]  # chunk 1 no longer passes labels
    with pytest.raises(StaticShapeError, match=r"model chunk 1\) at step 3 .*batch\['labels'\]"):
        _through_megatron(first, then, gone, chunks=2)


@needs_mcore_on_cpu
def test_the_capture_call_must_fit_the_static_buffer_too(static_buffers):
    with pytest.raises(StaticShapeError, match=r"at step 2 \(the capture call\)"):
        _through_megatron([{"t": _tokens()}], [{"t": _tokens(width=4)}], capture_at=2)


@needs_mcore_on_cpu
def test_calls_that_copy_into_their_own_buffers_are_not_checked_against_megatron_cores(
    static_buffers,
):
    """A bucket (its own static buffers) or an unwrapped call: no static-buffer check."""
    static_buffers["training"].append({"t": _tokens()})
    guard = ShapeGuard()
    for record in (False, True):
        kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2,
                  "data_iterator": iter([{"t": _tokens(width=4)}])}  # fmt: skip
        iterator = guard.check_call("training", 1, kwargs, record=record, copied=True)
        assert next(iterator)["t"].shape == (2, 4)


@needs_mcore_on_cpu
def test_a_validation_call_before_the_first_training_step_says_so(static_buffers):
    static_buffers["validation"].append({"t": _tokens()})
    guard = ShapeGuard()
    kwargs = {"num_microbatches": 1, "seq_length": 8, "micro_batch_size": 2,
              "data_iterator": iter([{"t": _tokens(width=4)}])}  # fmt: skip
    iterator = guard.check_call(
        "validation", None, kwargs, record=False, copied=True, static_buffers=True
    )
    with pytest.raises(StaticShapeError, match=r"validation micro-batch 0 .* before the first"):
        next(iterator)
