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
        (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp"], [False]),
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


def _warm_up_draw(batch, *, record: bool = False, static_buffers: bool = True, index: int = 0):
    """Micro-batch ``index`` of a full-iteration call before the capture (``record``: the
    capture call itself), ``batch`` drawn at that index."""
    guard = ShapeGuard()
    kwargs = {"num_microbatches": index + 1, "seq_length": 8, "micro_batch_size": 2}
    drawn = iter([batch] * (index + 1))
    iterator = guard.check_call(
        "training",
        1,
        {**kwargs, "data_iterator": drawn},
        record=record,
        copied=True,
        static_buffers=static_buffers,
    )
    return [next(iterator) for _ in range(index + 1)]


@pytest.fixture
def made_buffer(monkeypatch):
    """megatron-core's training static buffer of micro-batch 0, as its first call made it."""
    from megatron.core.full_cuda_graph import StaticBufferLoader

    buffer = {
        "tokens": torch.zeros(2, 8, dtype=torch.int64),
        "mask": torch.ones(2, 8, dtype=torch.bool),
        "nested": {"pos": torch.zeros(2, 8, dtype=torch.int64)},
        "max_seqlen": 8,
    }
    monkeypatch.setitem(StaticBufferLoader.static_buffers, "training", [buffer])
    return buffer


def _fitting() -> dict:
    return {
        "tokens": torch.ones(2, 8, dtype=torch.int64),  # other values: copied in
        "mask": torch.zeros(2, 8, dtype=torch.bool),
        "nested": {"pos": torch.ones(2, 8, dtype=torch.int64)},
        "max_seqlen": 6,  # a value megatron-core sets, not copies: the capture's counts
    }


@needs_mcore_on_cpu
@pytest.mark.parametrize(
    "change, said",
    [
        ({"tokens": torch.zeros(2, 4, dtype=torch.int64)}, r"shape \(2, 8\) dtype torch.int64 in"),
        # broadcast by the copy without an error: the silent case
        ({"mask": torch.ones(2, 1, dtype=torch.bool)}, r"now shape \(2, 1\)"),
        ({"tokens": torch.zeros(2, 8, dtype=torch.int32)}, "now shape .* torch.int32"),
        ({"nested": {"pos": torch.zeros(1, 8, dtype=torch.int64)}}, r"batch\['nested'\]\['pos'\]"),
        ({"nested": {}}, r"batch\['nested'\]\['pos'\]: .* in the buffer, now absent"),
        ({"tokens": None}, r"batch\['tokens'\]: .* in the buffer, now absent"),
    ],
    ids=["shape", "broadcast", "dtype", "nested", "nested-key-gone", "tensor-gone"],
)
def test_a_warm_up_call_that_does_not_fit_the_static_buffer_is_refused(made_buffer, change, said):
    batch = {**_fitting(), **change}
    with pytest.raises(StaticShapeError, match=said) as info:
        _warm_up_draw(batch)
    assert "micro-batch 0 (model chunk 0) at step 1 (warm-up)" in str(info.value)
    assert "Fix: keep seq_length" in str(info.value)


@needs_mcore_on_cpu
def test_a_key_the_buffer_holds_and_the_micro_batch_lacks_is_refused(made_buffer):
    """megatron-core leaves such a key in the buffer: the model would get its old value."""
    batch = _fitting()
    del batch["max_seqlen"]
    with pytest.raises(StaticShapeError, match=r"batch\['max_seqlen'\]: a key in the buffer"):
        _warm_up_draw(batch)


@needs_mcore_on_cpu
def test_a_warm_up_call_that_fits_or_adds_a_key_or_finds_no_buffer_passes(made_buffer):
    assert len(_warm_up_draw(_fitting())) == 1
    # a top-level key the buffer lacks: megatron-core makes room for it
    assert len(_warm_up_draw({**_fitting(), "labels": torch.zeros(2, 3)})) == 1
    # what megatron-core copies of a (dict, ...) tuple is the dict
    assert len(_warm_up_draw((_fitting(), "extra"))) == 1
    with pytest.raises(StaticShapeError, match="tokens"):
        _warm_up_draw(({**_fitting(), "tokens": torch.zeros(2, 4)}, "extra"))
    # micro-batch 1 has no buffer yet: this call makes it (micro-batch 0 fits)
    assert len(_warm_up_draw({**_fitting()}, index=1)) == 2


@needs_mcore_on_cpu
def test_the_capture_call_must_fit_the_static_buffer_too(made_buffer):
    batch = {**_fitting(), "tokens": torch.zeros(2, 4, dtype=torch.int64)}
    with pytest.raises(StaticShapeError, match=r"at step 1 \(the capture\)"):
        _warm_up_draw(batch, record=True)


@needs_mcore_on_cpu
def test_calls_that_copy_into_their_own_buffers_are_not_checked_against_megatron_cores(
    made_buffer,
):
    """A bucket (its own static buffers) or an unwrapped call: no static-buffer check."""
    batch = {**_fitting(), "tokens": torch.zeros(2, 4, dtype=torch.int64)}
    assert len(_warm_up_draw(batch, static_buffers=False)) == 1
    assert len(_warm_up_draw(batch, record=True, static_buffers=False)) == 1
