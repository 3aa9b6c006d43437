"""Full-iteration CUDA graphs per sequence-length bucket (``cudagraph_plugin.runtime.buckets``), on
real megatron-core 0.16.1 on the CPU.

A tiny megatron-core GPT with DDP and megatron-core's optimizer trains on micro-batches
whose length changes from step to step, padded to buckets by ``padding.pad_step``; each
call goes through :class:`BucketGraphs` (route, then run), as the plugin's interceptor will.
Only graph capture is faked (``tests/fakes.py``): a fake graph replays the recorded tensor
work on the captured tensors and refuses a replay once memory it reads has moved, as a
real one would read freed memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cpu_only import needs_mcore_on_cpu

import cpu_redirect
import train_gpt
from cudagraph_plugin.compat import buckets as bucket_compat
from cudagraph_plugin.runtime import buckets
from cudagraph_plugin.runtime.buckets import Action, BucketGraphs, BucketKey
from cudagraph_plugin.runtime.fingerprint import AddressFingerprint
from cudagraph_plugin.runtime.guard import StaticShapeError
from cudagraph_plugin.runtime.padding import pad_step
from cudagraph_plugin.runtime.release import release_each
from hookspecs import get_plugin_manager

pytestmark = needs_mcore_on_cpu

BUCKETS = (16, 32)
MBS = 2
VOCAB = 128
MAX_LENGTH = 64  # the model's position embeddings: room for lengths above every bucket


@pytest.fixture
def graphs(bucket_fakes):
    return bucket_fakes


# -- the host: a real megatron-core GPT whose sequence length changes per step ---------------


class _NoBuildStream:
    """What ``train_gpt._build_model`` asks of the run: 0.16 full-iteration graphs need no
    build stream (``compat.DDPBuildContext``)."""

    @staticmethod
    def model_build_context() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclasses.dataclass
class Host:
    model: list[Any]
    optimizer: Any
    config: Any


@contextlib.contextmanager
def megatron_gpt(*argv: str, seed: int = 1234) -> Iterator[Host]:
    """A tiny GPT, DDP and optimizer in a fresh single-rank world; torn down on exit."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parser = train_gpt.build_parser(get_plugin_manager())
    args = parser.parse_args(
        ["--seq-length", str(MAX_LENGTH), "--vocab-size", str(VOCAB), "--hidden-size", "32", *argv]
    )
    train_gpt._check_args(parser, args, use_cuda=False)
    with cpu_redirect.cpu_redirect():
        train_gpt._init_distributed(False)
        try:
            parallel_state.initialize_model_parallel()
            random.seed(seed)
            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
            config = TransformerConfig(**train_gpt._transformer_config_fields(args, False))
            model = train_gpt._build_model(_NoBuildStream(), args, config)
            optimizer = train_gpt._build_optimizer(args, model)
            train_gpt._wire_grad_sync(args, config, model, optimizer)
            yield Host(model, optimizer, config)
        finally:
            train_gpt._end_distributed(None)


def micro_batches(step: int, lengths: list[int]) -> list[dict[str, Any]]:
    """Deterministic micro-batches of the given real lengths (counting tokens, as the
    example's data: learnable)."""
    generator = torch.Generator().manual_seed(step)
    found = []
    for length in lengths:
        starts = torch.randint(0, VOCAB, (MBS, 1), generator=generator)
        sequence = (starts + torch.arange(length + 1)) % VOCAB
        found.append(
            {
                "tokens": sequence[:, :-1],
                "labels": sequence[:, 1:],
                "loss_mask": torch.ones(MBS, length),
                "position_ids": torch.arange(length).repeat(MBS, 1),
                "attention_mask": None,
            }
        )
    return found


def step_kwargs(host: Host, step: int, lengths: list[int], *, pad: bool = True) -> dict:
    batches = micro_batches(step, lengths)
    if pad:
        padded = pad_step(batches, BUCKETS, pad_token_id=0, overflow="keep")
        batches, seq_length = padded.batches, padded.seq_length
    else:
        seq_length = max(lengths)
    return {
        "forward_step_func": train_gpt.forward_step,
        "data_iterator": iter(batches),
        "model": host.model,
        "num_microbatches": len(batches),
        "seq_length": seq_length,
        "micro_batch_size": MBS,
        "forward_only": False,
    }


def train_step(host: Host, kwargs: dict, graphs: BucketGraphs | None, step: int) -> float:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in host.model:
        chunk.zero_grad_buffer()
    host.optimizer.zero_grad()
    eager = get_forward_backward_func()
    if graphs is None:
        loss_dicts = eager(**kwargs)
    else:
        loss_dicts = graphs.run(graphs.route(kwargs, step), eager, kwargs, step)
    host.optimizer.step()
    return float(train_gpt._mean_loss(loss_dicts))


def train(
    schedule: list[list[int]],
    *,
    bucketed: bool,
    warmup: int = 2,
    between: dict[int, Any] | None = None,
    **options: Any,
) -> tuple[list[float], BucketGraphs | None]:
    """Train one step per entry of ``schedule`` (the real lengths of its micro-batches);
    ``between[step](host, graphs)`` runs before that step. The graphs are released at the
    end (their fake graphs stay in the ``graphs`` fixture's log)."""
    losses = []
    with megatron_gpt() as host:
        graphs = (
            BucketGraphs(BUCKETS, warmup, model=host.model, optimizer=host.optimizer, **options)
            if bucketed
            else None
        )
        try:
            for step, lengths in enumerate(schedule):
                if between and step in between:
                    between[step](host, graphs)
                losses.append(train_step(host, step_kwargs(host, step, lengths), graphs, step))
        finally:
            if graphs is not None:
                assert not release_each(graphs.release_steps()).failures
    return losses, graphs


def actions(graphs: BucketGraphs, seq_length: int, count: int = 1) -> list[tuple[int, Action]]:
    return graphs.stats[BucketKey(seq_length, MBS, count)].calls


# 16: steps 0, 2, 3 (capture), 5, 9; 32: steps 1, 4, 6 (capture), 7; 48: outside.
SCHEDULE = [[10], [20], [12], [16], [30], [5], [32], [25], [48], [14]]


# -- routing, warm-up, capture, replay ------------------------------------------------------


def test_each_bucket_is_captured_after_its_own_warmup_and_replayed_for_its_steps(graphs):
    _, bucketed = train(SCHEDULE, bucketed=True, warmup=2)
    W, C, R, E = Action.WARMUP, Action.CAPTURE, Action.REPLAY, Action.EAGER
    assert actions(bucketed, 16) == [(0, W), (2, W), (3, C), (5, R), (9, R)]
    assert actions(bucketed, 32) == [(1, W), (4, W), (6, C), (7, R)]
    assert actions(bucketed, 48) == [(8, E)]
    short, long = graphs.graphs
    assert short.replays == 3 and long.replays == 2  # each capture call replays once too
    # one graph memory pool for every bucket graph, and megatron-core's capture mode
    assert short.capture_pool == long.capture_pool and short.capture_pool is not None
    assert short.capture_error_mode == long.capture_error_mode == "thread_local"
    [row16, row32, row48] = bucketed.summary()
    # the row's replays are those after the capture, as the report's: not the capture call's
    assert (row16["capture_steps"], row16["replay_steps"], row16["replays"]) == ([3], [5, 9], 2)
    assert (row32["capture_steps"], row32["replay_steps"]) == ([6], [7])
    assert row48["in_bucket"] is False and row48["eager_steps"] == [8]
    assert all(seconds > 0 for seconds in row16["capture_seconds"] + row32["capture_seconds"])


def test_summary_gives_each_bucket_its_step_times_and_padding_waste(graphs):
    _, bucketed = train(SCHEDULE, bucketed=True, warmup=2)
    bucketed.record_padding(16, real_tokens=30, padded_tokens=10, step=5)
    bucketed.record_padding(16, real_tokens=30, padded_tokens=10, step=9)
    durations = {step: 10.0 + step for step in range(len(SCHEDULE))}
    row16, row32, row48 = bucketed.summary(durations)
    # eager: the warm-up steps but a key's first (its buffers, lazy allocations); no capture
    assert (row16["eager_step_ms"], row16["replay_step_ms"]) == (12.0, 17.0)  # [2], [5, 9]
    assert (row32["eager_step_ms"], row32["replay_step_ms"]) == (14.0, 17.0)  # [4], [7]
    assert row48["eager_step_ms"] is None  # one step: its first
    assert row16["padding_waste_percent"] == 25.0 and row32["padding_waste_percent"] is None
    assert row16["graph_held"] is False  # released at the end of train()


def test_padding_reported_at_another_length_than_the_step_s_call_is_said_once(graphs, caplog):
    """(review of 2026-12-05: a step_padded length that matched no training call, the
    unpadded longest say, was dropped without a word: the row's padding read null.)"""
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")

    schedule = [[10], [10], [10]]  # padded to 16 each

    def before(step):
        def report(host, graphs_):
            graphs_.record_padding(10, real_tokens=10, padded_tokens=6, step=step)

        return report

    _, bucketed = train(schedule, bucketed=True, warmup=1, between={0: before(0), 1: before(1)})
    bucketed.record_padding(12, real_tokens=10, padded_tokens=6, step=2)  # after its call
    bucketed.summary()  # (the last step's is said with the report)
    said = [r.getMessage() for r in caplog.records if "run.step_padded said" in r.getMessage()]
    assert said == [
        "run.step_padded said step 0 was padded to seq_length 10, but its training call came "
        "at seq_length 16: that padding counts for no bucket of the report (said once for "
        "these lengths). Fix: pass step_padded the length the micro-batches were padded to, "
        "the seq_length forward_backward_func gets (pad_step's seq_length)",
        "run.step_padded said step 2 was padded to seq_length 12, but its training call came "
        "at seq_length 16: that padding counts for no bucket of the report (said once for "
        "these lengths). Fix: pass step_padded the length the micro-batches were padded to, "
        "the seq_length forward_backward_func gets (pad_step's seq_length)",
    ]
    bucketed.record_padding(16, real_tokens=10, padded_tokens=6, step=2)  # the right length
    bucketed.summary()
    assert len([r for r in caplog.records if "run.step_padded said" in r.getMessage()]) == 2


def test_a_step_with_training_calls_at_two_lengths_may_report_both():
    """(review of this session's diff: with the last call's length alone, a step of two
    calls at 16 and 32 was told its padding to 16 matched no call.) Each step is compared
    once it is over, without a scan of the run's history."""
    from cudagraph_plugin.runtime.bucket_keys import PaddingLedger

    ledger = PaddingLedger()
    assert ledger.record(5, 16, 10, 6) == [] and ledger.record(5, 32, 20, 12) == []
    assert ledger.routed(5, 16) == [] and ledger.routed(5, 32) == []
    assert ledger.record(6, 16, 10, 6) == [] and ledger.routed(6, 32) == []
    assert ledger.routed(7, 16) == [(6, 16, 32)]  # step 6 padded to 16, called at 32
    assert ledger.finish() == []  # step 7: called, nothing reported


def test_the_micro_batch_count_is_part_of_the_graph_key(graphs):
    # three steps of one micro-batch, then three of two, all in bucket 16, warm-up 1
    schedule = [[10], [10], [10], [9, 12], [9, 12], [9, 12]]
    _, bucketed = train(schedule, bucketed=True, warmup=1)
    W, C, R = Action.WARMUP, Action.CAPTURE, Action.REPLAY
    assert actions(bucketed, 16, 1) == [(0, W), (1, C), (2, R)]
    assert actions(bucketed, 16, 2) == [(3, W), (4, C), (5, R)]
    assert [g.replays for g in graphs.graphs] == [2, 2]


def test_padding_waste_is_counted_per_key_from_the_steps_it_ran(graphs):
    # two keys of one length (1 and 2 micro-batches): each row counts its own steps' padding
    schedule = [[16], [16], [9, 12], [9, 12]]
    _, bucketed = train(schedule, bucketed=True, warmup=1)
    for step in (0, 1):
        bucketed.record_padding(16, real_tokens=32, padded_tokens=0, step=step)
    for step in (2, 3):
        bucketed.record_padding(16, real_tokens=8, padded_tokens=24, step=step)
    one, two = bucketed.summary()
    assert (one["num_microbatches"], one["padding_waste_percent"]) == (1, 0.0)
    assert (two["num_microbatches"], two["padding_waste_percent"]) == (2, 75.0)


def test_a_micro_batch_with_its_keys_in_another_order_is_the_bucket_s_own(graphs):
    # megatron-core copies a micro-batch into the static buffers by key: the same tensors
    # under the same keys, in another order, replay the bucket's graph (not eager)
    def reordered(kwargs: dict) -> dict:
        batches = [dict(reversed(list(batch.items()))) for batch in kwargs["data_iterator"]]
        return {**kwargs, "data_iterator": iter(batches)}

    with megatron_gpt() as host:
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        try:
            for step in range(3):
                kwargs = step_kwargs(host, step, [10])
                train_step(host, reordered(kwargs) if step else kwargs, bucketed, step)
        finally:
            assert not release_each(bucketed.release_steps()).failures
    W, C, R = Action.WARMUP, Action.CAPTURE, Action.REPLAY
    assert actions(bucketed, 16) == [(0, W), (1, C), (2, R)]


def test_bucket_graphs_train_exactly_as_eager_with_the_same_padding(graphs):
    """The fake graphs replay the captured work on the static buffers: a replay that used
    another bucket's buffers, missed an input copy or a gradient would change the losses."""
    eager, _ = train(SCHEDULE, bucketed=False)
    bucketed, _ = train(SCHEDULE, bucketed=True, warmup=2)
    assert sum(g.replays for g in graphs.graphs) == 5
    assert bucketed == eager
    assert bucketed[-1] < bucketed[0]


def test_a_shape_outside_every_bucket_runs_eagerly_with_one_log_line_per_new_shape(graphs, caplog):
    schedule = [[10], [48], [10], [48], [40], [10], [48]]
    eager, _ = train(schedule, bucketed=False)
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        bucketed, result = train(schedule, bucketed=True, warmup=1)
    lines = [
        r.getMessage() for r in caplog.records if "outside every CUDA graph bucket" in r.message
    ]
    assert len(lines) == 2
    assert "seq_length 48" in lines[0] and "seq_length 40" in lines[1]
    assert "Fix: add a bucket of at least 48 to cuda_graph_buckets" in lines[0]
    assert actions(result, 48) == [(1, Action.EAGER), (3, Action.EAGER), (6, Action.EAGER)]
    assert len(graphs.graphs) == 1  # bucket 16 only
    assert bucketed == eager


def test_an_unpadded_step_is_told_which_bucket_to_pad_to(graphs, caplog):
    """(review of 2026-12-04: a host that forgot to pad was told at INFO that its steps were
    "outside every bucket", with no fix, and ran eagerly throughout.)"""
    with megatron_gpt() as host, caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model)
        try:
            for step in range(2):
                train_step(host, step_kwargs(host, step, [10], pad=False), bucketed, step)
        finally:
            assert not release_each(bucketed.release_steps()).failures
    [said] = [r for r in caplog.records if "outside every CUDA graph bucket" in r.getMessage()]
    assert said.levelno == logging.WARNING
    assert "Fix: pad such steps to the bucket 16 (" in said.getMessage()


def test_forward_only_calls_run_eagerly(graphs, caplog):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with megatron_gpt() as host, caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model)
        outputs = []
        for step in range(3):
            kwargs = {**step_kwargs(host, step, [10]), "forward_only": True}
            route = bucketed.route(kwargs, step)
            assert route == buckets.Route(Action.EAGER, None, "forward-only")
            with torch.no_grad():
                result = bucketed.run(route, get_forward_backward_func(), kwargs, step)
            outputs.append(float(train_gpt._mean_loss(result)))
        assert bucketed.graph_count() == 0 and graphs.graphs == []
    assert [r.message for r in caplog.records].count(
        "forward-only (validation) calls run eagerly with CUDA graph buckets: only the "
        "training step is captured per bucket"
    ) == 1
    assert len(set(outputs)) == 3


def test_a_call_is_checked_against_its_buckets_micro_batches_before_any_replay(graphs, caplog):
    """A micro-batch left unpadded (20 tokens) in a call that says seq_length 32: the
    bucket's graph would replay on a copy broadcast or refused into its 32-token buffers.
    The call runs eagerly, said once with what differs and the fix."""
    with megatron_gpt() as host:
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        try:
            for step in range(2):
                train_step(host, step_kwargs(host, step, [20]), bucketed, step)
            unpadded = {**step_kwargs(host, 2, [20], pad=False), "seq_length": 32}
            with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
                train_step(host, unpadded, bucketed, 2)
        finally:
            release_each(bucketed.release_steps())
        [graph] = graphs.graphs
        assert graph.replays == 1  # the capture call's; the unlike call did not replay
    assert [a for _, a in actions(bucketed, 32)][-1] is Action.EAGER
    [said] = [r.getMessage() for r in caplog.records if "unlike those" in r.getMessage()]
    assert "shape (2, 32)" in said and "now shape (2, 20)" in said and "pad every" in said


# -- capture details -----------------------------------------------------------------------


def test_capture_registers_every_tracker_generator_state_in_each_graph(graphs):
    from megatron.core.tensor_parallel import random as mrandom

    def add_state(host, bucketed):
        # megatron-core's get_all_rng_states() returns the tracker's states (the
        # inference tracker used on the CPU has none of its own)
        mrandom.get_cuda_rng_tracker().states_["model-parallel-rng"] = generator

    generator = torch.Generator()
    train([[10], [10], [20], [20]], bucketed=True, warmup=1, between={0: add_state})
    assert [g.generator_states for g in graphs.graphs] == [[generator], [generator]]


def test_capture_runs_on_one_stream_with_stale_streams_overridden_only_meanwhile(
    graphs, monkeypatch
):
    getter = torch._C._override_stale_capture_stream
    seen = []
    forward_step = train_gpt.forward_step

    def recording_forward_step(data_iterator, model):
        capturing = bool(graphs.graphs) and graphs.graphs[-1].capturing
        seen.append((capturing, getter()))
        return forward_step(data_iterator, model)

    monkeypatch.setattr(train_gpt, "forward_step", recording_forward_step)
    before = getter()
    train([[10], [10], [20], [20]], bucketed=True, warmup=1)
    assert getter() == before is False
    assert sorted(set(seen)) == [(False, False), (True, True)]
    short, long = graphs.graphs
    # 0.16 has no shared capture stream: one stream of the BucketGraphs for every capture
    assert short.capture_stream is long.capture_stream
    assert isinstance(short.capture_stream, cpu_redirect.Stream)


def test_on_018_and_later_capture_uses_megatron_cores_shared_capture_stream(graphs, monkeypatch):
    from megatron.core import full_cuda_graph

    shared = cpu_redirect.Stream()
    monkeypatch.setattr(full_cuda_graph, "get_shared_capture_stream", lambda: shared, raising=False)
    train([[10], [10], [20], [20]], bucketed=True, warmup=1)
    assert [g.capture_stream for g in graphs.graphs] == [shared, shared]


def test_input_liveness_checking_is_passed_to_the_capture_where_torch_has_it(graphs, monkeypatch):
    train([[10], [10]], bucketed=True, warmup=1, check_input_liveness=True)
    [graph] = graphs.graphs
    assert graph.check_input_liveness is True

    @contextlib.contextmanager
    def graph_of_older_torch(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph_of_older_torch)
    with pytest.raises(ValueError, match=r"check_input_liveness=True needs .* Fix"):
        BucketGraphs(BUCKETS, 1, model=[], check_input_liveness=True)
    assert BucketGraphs(BUCKETS, 1, model=[]).graph_count() == 0


def test_megatron_cores_static_buffer_lists_stay_untouched(graphs):
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    lists = StaticBufferLoader.static_buffers
    training, validation = lists["training"], lists["validation"]
    train(SCHEDULE[:5], bucketed=True, warmup=1)
    assert lists["training"] is training and training == [] and validation == []
    assert FullCudaGraphWrapper.curr_iteration == {"training": 0, "validation": 0}
    assert FullCudaGraphWrapper.cuda_graph == {"training": None, "validation": None}


# -- memory that moves -----------------------------------------------------------------------


def offload_and_reload_grad_buffers(host: Host, graphs: BucketGraphs | None) -> None:
    """megatron-core's own RL offloading of the DDP gradient buffers
    (``storage().resize_(0)``, then a new allocation); something else takes the freed
    memory meanwhile, so the buffers come back elsewhere."""
    [chunk] = host.model

    def addresses() -> list[int]:
        return [buffer.grad_data.data_ptr() for buffer in chunk.buffers]

    before = addresses()
    squatters = []
    # The squatter usually takes the freed block, but the allocator may have handed the
    # block back to the system and map it again for the reload: offload once more, with
    # one more squatter held, until the buffers land elsewhere.
    for _ in range(8):
        chunk.offload_grad_buffers()
        squatters += [torch.empty(buffer.grad_data_size) for buffer in chunk.buffers]
        chunk.restore_grad_buffers()
        if addresses() != before:
            break
    assert addresses() != before
    del squatters


def reallocate_a_parameter(host: Host, graphs: BucketGraphs | None) -> None:
    [chunk] = host.model
    param = next(chunk.parameters())
    before = param.data_ptr()
    param.data = param.data.clone()  # offloading to a CPU copy and back does the same
    assert param.data_ptr() != before


def replace_the_loss_scale(host: Host, graphs: BucketGraphs | None) -> None:
    """What megatron-core's DynamicGradScaler does on every growth or back-off
    (``self._scale = self._scale * factor``): the captured backward multiplies by the old
    tensor."""
    [inner] = host.optimizer.chained_optimizers
    inner._scale = inner._scale * 1.0


# 16: warm-up 0, capture 1; 32: warm-up 2, capture 3; memory moves before step 5: every
# graph is freed, 16 warms up at 5 and is captured again at 7, 32 at 6 and 8.
MOVE_SCHEDULE = [[10], [10], [20], [20], [12], [12], [25], [12], [30], [5]]


# megatron-core's offloading calls the deprecated Tensor.storage(); under the CPU redirect
# torch attributes the warning to the redirect, not to megatron-core.
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize(
    "move,moved",
    [
        (offload_and_reload_grad_buffers, "gradient buffers (model chunk 0 grad buffer 0"),
        (reallocate_a_parameter, "parameters (model chunk 0 module.embedding"),
        (replace_the_loss_scale, "loss scale (optimizer loss scale: 0x"),
    ],
    ids=["grad-buffers-offloaded", "parameter-reallocated", "loss-scale-replaced"],
)
def test_graphs_are_freed_and_recaptured_after_warmup_when_memory_moves(
    graphs, caplog, move, moved
):
    eager, _ = train(MOVE_SCHEDULE, bucketed=False, between={5: move})
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        bucketed, result = train(MOVE_SCHEDULE, bucketed=True, warmup=1, between={5: move})
    assert bucketed == eager  # a replay onto the old memory raises in the fake
    W, C, R = Action.WARMUP, Action.CAPTURE, Action.REPLAY
    assert actions(result, 16) == [(0, W), (1, C), (4, R), (5, W), (7, C), (9, R)]
    assert actions(result, 32) == [(2, W), (3, C), (6, W), (8, C)]
    first16, first32, second16, second32 = graphs.graphs
    assert (first16.resets, first32.resets) == (1, 1)
    assert first16.capture_pool == first32.capture_pool
    # the pool of freed graphs is gone: the new generation gets a new handle
    assert second16.capture_pool == second32.capture_pool != first16.capture_pool
    [(step, reason, freed)] = result.invalidations
    assert (step, freed) == (5, 2) and moved in reason
    warnings = [r.message for r in caplog.records if "freed 2 graph(s) at step 5" in r.message]
    assert len(warnings) == 1 and moved in warnings[0]


class TiedGraphs:
    """What :meth:`BucketGraphs.tie` asks of another mechanism (the plugin ties the
    optimizer graph, ``mechanisms.OptimizerGraphs``): its graph count and ``invalidate``."""

    def __init__(self) -> None:
        self.held = 0
        self.invalidated = 0

    def graph_count(self) -> int:
        return self.held

    def invalidate(self) -> int:
        self.invalidated += 1
        freed, self.held = self.held, 0
        return freed


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_a_tied_graph_is_freed_when_memory_moves_though_no_bucket_graph_is_held(graphs):
    """Every step is outside the buckets, so no bucket graph exists; the tied mechanism
    captured at step 1 (taking the addresses then), memory moves before step 3: it is
    freed there, once."""
    tied = TiedGraphs()

    def tie(host, bucketed):
        bucketed.tie(tied)

    def capture_tied(host, bucketed):
        tied.held = 1
        bucketed.tied_captured()

    _, result = train(
        [[48]] * 5,
        bucketed=True,
        warmup=1,
        between={0: tie, 1: capture_tied, 3: offload_and_reload_grad_buffers},
    )
    assert tied.invalidated == 1 and tied.held == 0
    [(step, reason, freed)] = result.invalidations
    assert (step, freed) == (3, 1) and "gradient buffers" in reason


def test_graphs_keep_the_scratch_buffers_megatron_core_replaces(graphs):
    """megatron-core's local attention takes its scratch from the global "mpu" buffer,
    which a longer sequence replaces by a larger one: the graph captured before keeps the
    old one (its memory would otherwise be free for anything) and goes on replaying."""
    from megatron.core import parallel_state

    seen = {}

    def look(host, bucketed):
        buffers = parallel_state.get_global_memory_buffer().buffer
        seen[len(seen)] = ({name: t.data_ptr() for name, t in buffers.items()}, bucketed)
        seen[f"kept{len(seen)}"] = bucketed.kept_scratch_buffers()

    schedule = [[10], [10], [48], [10]]
    _, result = train(schedule, bucketed=True, warmup=1, between={2: look, 3: look})
    (before, _), (after, _) = seen[0], seen[2]
    key = ("mpu", torch.float32)
    assert after[key] != before[key]  # the 48-token step grew it
    assert seen["kept1"] == []
    [(name, address, size)] = seen["kept3"]
    assert (name, address) == ("mpu (torch.float32)", before[key]) and size > 0
    assert [a for _, a in actions(result, 16)][-1] is Action.REPLAY
    assert result.invalidations == [] and result.kept_scratch_buffers() == []


def test_graphs_keep_the_rotary_tables_megatron_cores_cache_drops(graphs):
    """RoPE: megatron-core caches each length's rotary table (``RotaryEmbedding.forward``,
    ``lru_cache(maxsize=32)``) and a graph reads its bucket's table from there. An RL host's
    eager rollouts at 32 other lengths evict it, and its memory would be free for anything
    while the graph still reads it: the graph keeps it (review finding)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    with megatron_gpt("--position-embedding-type", "rope") as host:
        [rotary] = [m for c in host.model for m in c.modules() if isinstance(m, RotaryEmbedding)]
        tables: dict[int, Any] = {}
        hook = rotary.register_forward_hook(lambda m, a, out: tables.setdefault(len(tables), out))
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        try:
            for step in range(2):  # warm-up, then the capture of bucket 16
                train_step(host, step_kwargs(host, step, [10]), bucketed, step)
            hook.remove()
            assert tables[0] is tables[1]  # the capture read the warm-up's cached table
            [captured] = bucketed._graphs.values()
            assert len(captured.cached) == 1 and captured.cached[0] is tables[1]
            for length in range(33, 33 + 32):  # rollouts at 32 other lengths evict it
                rotary(length)
            train_step(host, step_kwargs(host, 2, [12]), bucketed, 2)
            assert [a for _, a in actions(bucketed, 16)] == [
                Action.WARMUP, Action.CAPTURE, Action.REPLAY
            ]  # fmt: skip
            assert captured.cached[0] is tables[1]  # still held by the graph
        finally:
            assert not release_each(bucketed.release_steps()).failures
        assert captured.cached == []  # let go with the graph


def short(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The micro-batches with one row fewer (a host's last, partial batch)."""
    return [{k: v[:-1] if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]


def with_and_without_buckets(
    schedule: list[list[int]], alter: Any
) -> tuple[dict[bool, list[float]], BucketGraphs]:
    """The losses of ``schedule`` (warm-up 2) eagerly and through bucket graphs, each step's
    micro-batches passed through ``alter(step, batches)``; and the bucket graphs."""
    losses: dict[bool, list[float]] = {}
    for bucketed in (False, True):
        with megatron_gpt() as host:
            bucket_graphs = (
                BucketGraphs(BUCKETS, 2, model=host.model, optimizer=host.optimizer)
                if bucketed
                else None
            )
            try:
                for step, lengths in enumerate(schedule):
                    kwargs = step_kwargs(host, step, lengths)
                    kwargs["data_iterator"] = iter(alter(step, list(kwargs["data_iterator"])))
                    losses.setdefault(bucketed, []).append(
                        train_step(host, kwargs, bucket_graphs, step)
                    )
            finally:
                if bucket_graphs is not None:
                    assert not release_each(bucket_graphs.release_steps()).failures
    assert bucket_graphs is not None
    return losses, bucket_graphs


@pytest.mark.parametrize("when", ["warm-up", "replay"])
def test_a_micro_batch_unlike_its_buckets_first_runs_eagerly(graphs, caplog, when):
    """Review finding: routing looked only at the call's arguments, so a micro-batch with a
    row fewer than micro_batch_size, at a bucket length, was broadcast into the bucket's
    static buffers during the warm-up (training on a duplicated row) and stopped the run
    after the capture (StaticShapeError). It now runs eagerly, said once; the bucket goes
    on as before."""
    odd = 1 if when == "warm-up" else 3

    def shortened(step: int, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return short(batches) if step == odd else batches

    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        losses, bucket_graphs = with_and_without_buckets([[10]] * 6, shortened)
    assert losses[True] == losses[False]  # the short step trained on its own rows
    W, C, R, E = Action.WARMUP, Action.CAPTURE, Action.REPLAY, Action.EAGER
    expected = [W, E, W, C, R, R] if when == "warm-up" else [W, W, C, E, R, R]
    assert [a for _, a in bucket_graphs.stats[BucketKey(16, MBS, 1)].calls] == expected
    said = [r.getMessage() for r in caplog.records if "unlike those its bucket" in r.getMessage()]
    assert len(said) == 1 and "shape (2, 16)" in said[0] and "shape (1, 16)" in said[0], said


def test_an_odd_first_micro_batch_does_not_keep_its_bucket_eager(graphs, caplog):
    """(review of 2026-12-04: the bucket's static buffers were made from its first call, a
    host's partial batch here; every later, correct call was unlike them, and the bucket ran
    eagerly for the rest of the run, said once at INFO.) Buffers no graph reads yet are made
    again from the next call, which warms up on them; the unlike step is a warning."""

    def first_short(step: int, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return short(batches) if step == 0 else batches

    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        losses, bucket_graphs = with_and_without_buckets([[10]] * 6, first_short)
    assert losses[True] == losses[False]
    W, C, R, E = Action.WARMUP, Action.CAPTURE, Action.REPLAY, Action.EAGER
    assert [a for _, a in bucket_graphs.stats[BucketKey(16, MBS, 1)].calls] == [W, E, W, C, R, R]
    [said] = [r for r in caplog.records if "unlike those its bucket" in r.getMessage()]
    assert said.levelno == logging.WARNING


def test_micro_batches_beyond_the_buckets_first_call_are_compared_too(graphs):
    """Second review: a later call of the bucket with more micro-batches was compared only
    on those its first call had; the extra ones made their buffers unchecked (a short one
    broadcast into them)."""

    def second_short(step: int, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [batches[0], *short(batches[1:])] if step == 1 else batches

    schedule = [[10], [10, 12], [10, 12], [10, 12]]
    losses, bucket_graphs = with_and_without_buckets(schedule, second_short)
    assert losses[True] == losses[False]
    W, C, E = Action.WARMUP, Action.CAPTURE, Action.EAGER
    assert [a for _, a in bucket_graphs.stats[BucketKey(16, MBS, 2)].calls] == [E, W, W]
    assert [a for _, a in bucket_graphs.stats[BucketKey(16, MBS, 1)].calls] == [W]
    assert C not in [a for _, a in bucket_graphs.stats[BucketKey(16, MBS, 2)].calls]


def test_an_offload_seen_before_a_call_whose_data_iterator_raises_is_not_forgotten(graphs):
    """Second review: the routing took the offload API's record before drawing the call's
    micro-batches; a data iterator that raised (and a host that went on) lost it, and the
    next call replayed onto the moved state."""
    with megatron_gpt() as host:
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        try:
            for step in range(2):  # warm-up, capture
                train_step(host, step_kwargs(host, step, [10]), bucketed, step)
            bucketed.moves._offloaded("MegatronOptimizer.restore_from_cpu()")  # the watch's call
            with pytest.raises(StopIteration):
                bucketed.route({**step_kwargs(host, 2, [10]), "data_iterator": iter([])}, 2)
            train_step(host, step_kwargs(host, 3, [10]), bucketed, 3)
        finally:
            release_each(bucketed.release_steps())
    [(step, reason, freed)] = bucketed.invalidations
    assert (step, freed) == (3, 1) and "restore_from_cpu() ran" in reason
    assert [a for _, a in actions(bucketed, 16)][-1] is Action.WARMUP


def test_the_host_can_invalidate_the_graphs_explicitly(graphs, caplog):
    def invalidate(host, bucketed):
        assert bucketed.invalidate("weights reloaded after the rollout", step=5) == 2

    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        _, result = train(MOVE_SCHEDULE, bucketed=True, warmup=1, between={5: invalidate})
    assert actions(result, 16)[3:] == [(5, Action.WARMUP), (7, Action.CAPTURE), (9, Action.REPLAY)]
    assert [g.resets for g in graphs.graphs] == [1, 1, 1, 1]  # the last two at the end
    # bucket 32, captured at step 3, never replayed before step 5 (review of 2026-12-04: an RL
    # run that captured again and again and never replayed was told nothing until its end)
    assert any(
        "weights reloaded after the rollout: freed 2 graph(s) at step 5, 1 of them never "
        "replayed since its capture (a capture that bought nothing"
        in r.message
        and "captured again after 1 warm-up step(s)" in r.message
        for r in caplog.records
    )


def _scaled_forward_step(coef, data_iterator, model):
    output, loss_func = train_gpt.forward_step(data_iterator, model)
    return output, lambda out: (lambda loss, n, d: (loss * coef, n, d))(*loss_func(out))


def test_a_replayed_bucket_refuses_a_forward_step_func_with_another_coefficient(graphs):
    """(review of 2026-12-04: the bucket's graph replayed the first coefficient: the
    losses and gradients of a coefficient of 5, then 0, were those of 1)"""

    def with_coef(coefs):
        schedule = {}
        for step, coef in enumerate(coefs):
            schedule[step] = functools.partial(_scaled_forward_step, coef)
        return schedule

    made = with_coef([1.0, 1.0, 1.0, 5.0])
    with megatron_gpt() as host:
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        try:
            for step in range(3):  # warm-up, capture, replay: each a partial made anew
                kwargs = dict(step_kwargs(host, step, [12]), forward_step_func=made[step])
                train_step(host, kwargs, bucketed, step)
            assert [a for _, a in actions(bucketed, 16)][-1] is Action.REPLAY
            kwargs = dict(step_kwargs(host, 3, [12]), forward_step_func=made[3])
            with pytest.raises(StaticShapeError, match="another forward_step_func"):
                train_step(host, kwargs, bucketed, 3)
        finally:
            assert not release_each(bucketed.release_steps()).failures


def test_a_graph_limit_runs_further_shapes_eagerly(graphs, caplog):
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        _, result = train([[10], [10], [20], [20], [20]], bucketed=True, warmup=1, max_graphs=1)
    assert [a for _, a in actions(result, 32)] == [Action.EAGER] * 3
    assert len(graphs.graphs) == 1
    assert sum("beyond the limit of 1" in r.message for r in caplog.records) == 1


# -- several ranks ----------------------------------------------------------------------------


class OtherRank:
    """The element-wise maximum with what another rank sends, as the all-reduce returns."""

    def __init__(
        self,
        seq_length: int | None = None,
        moved_at: int | None = None,
        unlike_at: int | None = None,
    ) -> None:
        self.seq_length = seq_length
        self.moved_at = moved_at
        self.unlike_at = unlike_at
        self.calls = 0

    def __call__(self, values: list[int]) -> list[int]:
        self.calls += 1
        s, m, c = values[:3]
        other_s = self.seq_length if self.seq_length is not None else s
        other = [other_s, m, c, -other_s, -m, -c]
        other += [int(self.calls == self.moved_at), int(self.calls == self.unlike_at)]
        return [max(a, b) for a, b in zip(values, other, strict=True)]


def test_ranks_that_disagree_on_the_shape_run_the_step_eagerly(graphs, caplog):
    schedule = [[10], [10], [10], [10]]
    eager, _ = train(schedule, bucketed=False)
    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        bucketed, result = train(schedule, bucketed=True, warmup=1, agree=OtherRank(32))
    assert [a for _, a in actions(result, 16)] == [Action.EAGER] * 4
    assert graphs.graphs == [] and bucketed == eager
    assert sum("different shapes" in r.message for r in caplog.records) == 1


def test_memory_moved_on_another_rank_frees_the_graphs_here_too(graphs):
    _, result = train([[10]] * 5, bucketed=True, warmup=1, agree=OtherRank(moved_at=4))
    assert [a for _, a in actions(result, 16)] == [
        Action.WARMUP,
        Action.CAPTURE,
        Action.REPLAY,
        Action.WARMUP,  # call 4: another rank's memory moved
        Action.CAPTURE,
    ]
    assert [(s, f) for s, _, f in result.invalidations] == [(3, 1)]
    assert "another rank found memory moved" in result.invalidations[0][1]


def test_a_hosts_invalidation_on_one_rank_frees_the_graphs_on_every_rank(graphs):
    """(review of 2026-12-04: a host that invalidates where its own reload moved memory, on
    one rank, left the others replaying while it warmed up and captured: its capture
    barriers met their gradient all-reduces.) Its next training call tells the others,
    which free theirs as for moved memory (``OtherRank(moved_at=...)``, above); it does not
    free its own twice."""
    sent: list[list[int]] = []

    def agree(values):
        sent.append(list(values))
        return values

    def invalidate(host, bucketed):
        assert bucketed.invalidate("this rank's reload moved its buffers", step=3) == 1

    _, result = train([[10]] * 5, bucketed=True, warmup=1, agree=agree, between={3: invalidate})
    assert [flags[6] for flags in sent] == [0, 0, 0, 1, 0]  # said once, at the next call
    assert [a for _, a in actions(result, 16)] == [
        Action.WARMUP, Action.CAPTURE, Action.REPLAY, Action.WARMUP, Action.CAPTURE
    ]  # fmt: skip
    assert [(s, f) for s, _, f in result.invalidations] == [(3, 1)]


def test_micro_batches_unlike_on_another_rank_run_the_step_eagerly_here_too(graphs):
    _, result = train([[10]] * 4, bucketed=True, warmup=1, agree=OtherRank(unlike_at=3))
    assert [a for _, a in actions(result, 16)] == [
        Action.WARMUP, Action.CAPTURE, Action.EAGER, Action.REPLAY
    ]  # fmt: skip


def test_single_rank_agreement_is_the_values_themselves():
    assert bucket_compat.max_across_ranks([3, -1, 7]) == [3, -1, 7]


# -- release, settings, fingerprint ------------------------------------------------------------


def test_release_frees_every_graph_once_and_forgets_the_pool(graphs):
    with megatron_gpt() as host:
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        for step, lengths in enumerate([[10], [10], [20], [20]]):
            train_step(host, step_kwargs(host, step, lengths), bucketed, step)
        assert bucketed.graph_count() == 2
        steps = bucketed.release_steps()
        result = release_each(steps)
    assert result.graphs_freed == 2 and not result.failures
    assert [g.resets for g in graphs.graphs] == [1, 1]
    assert bucketed.graph_count() == 0
    assert bucketed.fingerprint.model is None
    # the graph steps name their bucket; the fallback policy frees the graphs alone
    assert steps[0].resource == f"bucket graph ({BucketKey(16, MBS, 1)})"


class _Interrupted(BaseException):
    """What a peer's failure raises into the main thread (``PeerFailed``), or a Ctrl-C."""


@pytest.mark.parametrize("where", ["in the capture", "in the barrier after it"])
def test_a_capture_interrupted_frees_its_graph_before_the_error_goes_on(
    graphs, monkeypatch, caplog, where
):
    """The graph is held (and so freed by the release) only once its capture completed: an
    interruption inside the capture, or in the barrier after it where a peer that failed
    leaves this rank (at DP > 1 the aborted communicators' teardown waits for that
    graph), must free it there."""
    barrier = bucket_compat.barrier

    def interrupting_barrier() -> None:
        if where == "in the barrier after it" and graphs.graphs and graphs.graphs[-1].captured:
            raise _Interrupted("peer failed")
        barrier()

    monkeypatch.setattr(bucket_compat, "barrier", interrupting_barrier)
    with megatron_gpt() as host:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fbf = get_forward_backward_func()

        def eager(**kwargs: Any) -> Any:
            if where == "in the capture" and any(g.capturing for g in graphs.graphs):
                raise _Interrupted("Ctrl-C")
            return fbf(**kwargs)

        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        kwargs = step_kwargs(host, 0, [10])
        bucketed.run(bucketed.route(kwargs, 0), eager, kwargs, 0)  # warm-up
        kwargs = step_kwargs(host, 1, [10])
        with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
            with pytest.raises(_Interrupted):
                bucketed.run(bucketed.route(kwargs, 1), eager, kwargs, 1)
        [graph] = graphs.graphs
        assert graph.resets == 1 and not graph.captured and not graph.capturing
        assert bucketed.graph_count() == 0
        assert (
            "did not complete (_Interrupted: " in caplog.text and "graph was reset" in caplog.text
        )
        assert not release_each(bucketed.release_steps()).failures
    assert graph.resets == 1  # freed once: the release did not hold it


@pytest.mark.parametrize(
    "options,match",
    [
        ({"warmup_steps": 0}, "cuda_graph_warmup_steps=0.*at least 1"),
        ({"buckets": ()}, "cuda_graph_buckets is empty"),
        ({"buckets": (16, -2)}, "cuda_graph_buckets must be positive integers"),
        ({"max_graphs": 0}, "max_graphs=0"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(options, match):
    arguments = {"buckets": BUCKETS, "warmup_steps": 1, **options}
    with pytest.raises(ValueError, match=match):
        BucketGraphs(arguments.pop("buckets"), arguments.pop("warmup_steps"), model=[], **arguments)


def test_routing_needs_integer_shapes():
    bucketed = BucketGraphs(BUCKETS, 1, model=[])
    with pytest.raises(ValueError, match=r"seq_length=None.*pass seq_length as an int"):
        bucketed.route({"num_microbatches": 1, "forward_only": False})
    # a bool is an int to Python, not a length or a count
    with pytest.raises(ValueError, match=r"num_microbatches=True"):
        bucketed.route({"seq_length": 16, "num_microbatches": True, "forward_only": False})


def test_fingerprint_samples_parameters_from_first_to_last_and_names_what_moved(graphs):
    with megatron_gpt() as host:
        names = [name for name, _ in host.model[0].named_parameters()]
        sampled = AddressFingerprint(host.model, params_per_chunk=3)
        taken = [name for group, name, _ in sampled.take() if group == "parameters"]
        middle = round((len(names) - 1) / 2)
        assert taken == [f"model chunk 0 {names[i]}" for i in (0, middle, len(names) - 1)]
        every = AddressFingerprint(host.model, params_per_chunk=None).take()
        assert sum(group == "parameters" for group, _, _ in every) == len(names)
        with_state = AddressFingerprint(host.model, host.optimizer, optimizer_state=True)
        train_step(host, step_kwargs(host, 0, [10]), None, 0)  # Adam's state exists now
        groups = {group for group, _, _ in with_state.take()}
        assert groups == {"parameters", "gradient buffers", "loss scale", "optimizer state"}
        before = with_state.take()
        last = list(host.model[0].parameters())[-1]
        last.data = last.data.clone()
        # (without a main copy, the optimizer's last main parameter is that one too)
        change, *also = AddressFingerprint.changes(before, with_state.take())
        assert change.startswith(f"parameters (model chunk 0 {names[-1]}: 0x")
        assert [c.split(" (")[0] for c in also] in ([], ["optimizer state"])


def test_a_move_the_allocator_hides_from_a_sample_is_seen(graphs):
    """(review of 2026-12-04: the fingerprint read 16 parameters per chunk and the first
    main parameter's optimizer state; a reload that gave those their old addresses while
    others moved went unseen, and the graphs replayed onto freed memory)"""
    with megatron_gpt() as host:
        names = [name for name, _ in host.model[0].named_parameters()]
        assert len(names) > 16  # (more than the old sample)
        fingerprint = AddressFingerprint(host.model, host.optimizer, optimizer_state=True)
        train_step(host, step_kwargs(host, 0, [10]), None, 0)  # Adam's state exists now
        before = fingerprint.take()
        params = list(host.model[0].parameters())
        for param in params[1:-1:2]:  # neither the first nor the last
            param.data = param.data.clone()
        assert any(
            c.startswith("parameters (")
            for c in AddressFingerprint.changes(before, fingerprint.take())
        )
        before = fingerprint.take()
        [inner] = (
            [o for o in host.optimizer.chain_optimizers]
            if hasattr(host.optimizer, "chain_optimizers")
            else [host.optimizer]
        )
        torch_optimizer = inner.optimizer
        main = [p for group in torch_optimizer.param_groups for p in group["params"]]
        middle = main[len(main) // 2]
        for key, value in torch_optimizer.state[middle].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch_optimizer.state[middle][key] = value.clone()
        assert any(
            c.startswith("optimizer state (")
            for c in AddressFingerprint.changes(before, fingerprint.take())
        )


def test_a_rotary_table_made_inside_a_capture_is_not_left_in_megatron_cores_cache(graphs):
    """Rollouts at many lengths evict a bucket's rotary table from megatron-core's
    ``lru_cache`` (32 entries) between its warm-up and its capture: the capture computes it
    in the shared graph pool. Left in the cache, later eager calls and later captures would
    read pool memory an earlier graph's replays may overwrite (review of 2026-12-04)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from fakes import _storage

    with megatron_gpt("--position-embedding-type", "rope") as host:
        [rotary] = [m for c in host.model for m in c.modules() if isinstance(m, RotaryEmbedding)]
        seen: list[Any] = []
        rotary.register_forward_hook(lambda module, args, output: seen.append(output))
        bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer)
        try:
            train_step(host, step_kwargs(host, 0, [10]), bucketed, 0)  # warm-up of (16, 2, 1)
            for length in range(33, 65):  # the rollouts: 32 other lengths
                rotary(length)
            made = len(seen)
            train_step(host, step_kwargs(host, 1, [10]), bucketed, 1)  # its capture
            in_pool = seen[made]
            assert _storage(in_pool) in graphs.graphs[-1]._recording._made  # (the premise)
            after = len(seen)
            train_step(host, step_kwargs(host, 2, [10, 9]), bucketed, 2)  # eager: (16, 2, 2)
            assert seen[after] is not in_pool
            assert bucketed._graphs[BucketKey(16, MBS, 1)].cached.count(in_pool) >= 1  # kept
        finally:
            assert not release_each(bucketed.release_steps()).failures


def test_the_fake_graph_refuses_a_replay_onto_moved_memory(graphs):
    """What the invalidation tests rely on: a real graph would read freed memory."""
    weight = torch.ones(4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = weight * 2
    graph.replay()
    assert out.tolist() == [2.0] * 4
    weight.data = torch.full((4,), 3.0)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        graph.replay()


def test_right_padding_leaves_the_real_tokens_losses_unchanged(graphs):
    """Why padding to a bucket is harmless with causal attention: a real token never
    attends to a later (padded) one."""
    [batch] = micro_batches(0, [11])
    padded = pad_step([batch], BUCKETS, pad_token_id=0).batches[0]
    with megatron_gpt() as host, torch.no_grad():
        host.model[0].eval()
        module = host.model[0].module

        def losses(b):
            return module(b["tokens"], b["position_ids"], None, labels=b["labels"])

        assert torch.allclose(losses(padded)[:, :11], losses(batch), atol=1e-6)


def test_a_value_that_changes_every_step_is_said_once(graphs, caplog):
    """(review of 2026-12-04: the "unlike" line held the difference, so a per-step Python value
    in the micro-batch, a token count, was said on every step.)"""

    def counted(step: int, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**b, "num_real_tokens": 100 + step} for b in batches]

    with caplog.at_level(logging.INFO, logger="cudagraph_plugin"):
        with_and_without_buckets([[10]] * 5, counted)
    said = [r.getMessage() for r in caplog.records if "unlike those its bucket" in r.getMessage()]
    assert len(said) == 1 and "non-tensor values fixed" in said[0]


def test_the_buffers_are_made_again_on_every_rank_alike(graphs):
    """(review of 2026-12-04: only the rank that saw the odd micro-batch made its buffers again
    and went back to warming up; the others captured at that step, a capture's barrier
    against a warm-up's gradient all-reduce.) Two ranks, one after the other: A's step 1 is
    short, B hears of it through the agreement."""

    def rank(odd_step, agree):
        with megatron_gpt() as host:
            bucketed = BucketGraphs(BUCKETS, 1, model=host.model, optimizer=host.optimizer,
                                    agree=agree)  # fmt: skip
            try:
                for step in range(4):
                    kwargs = step_kwargs(host, step, [10])
                    batches = list(kwargs["data_iterator"])
                    kwargs["data_iterator"] = iter(short(batches) if step == odd_step else batches)
                    train_step(host, kwargs, bucketed, step)
            finally:
                assert not release_each(bucketed.release_steps()).failures
        return [action for _, action in bucketed.stats[BucketKey(16, MBS, 1)].calls]

    W, C, E = Action.WARMUP, Action.CAPTURE, Action.EAGER
    assert rank(1, OtherRank()) == rank(None, OtherRank(unlike_at=2)) == [W, E, W, C]
