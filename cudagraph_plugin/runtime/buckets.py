"""Full-iteration CUDA graphs per sequence-length bucket, recaptured when memory moves.

megatron-core's ``FullCudaGraphWrapper`` holds one graph per stage on its class: a shape
change after capture would replay stale buffers (the plugin's guard raises instead).
:class:`BucketGraphs` serves hosts whose sequence length changes per batch (RL trainers):
the host pads each step's micro-batches to a bucket length (``cudagraph_plugin.runtime.padding``)
and passes it as ``seq_length``; every (bucket, micro-batch size, micro-batch count) gets
its own graph, following megatron-core's rules for each:

* its own warm-up: a key runs eagerly (on its static buffers) ``warmup_steps`` times, is
  captured on its next call, which then replays (megatron-core's sequence); the warm-up
  makes every lazy, shape-dependent allocation (rotary caches, scratch buffers) outside
  the capture pool;
* its own static input buffers, filled by megatron-core's ``StaticBufferLoader`` through
  ``FullCudaGraphWrapper.data_read`` (``bucket_compat.read_static_inputs``), the copy
  ordered after the previous replay;
* the capture as megatron-core does it: barrier, a new ``CUDAGraph`` registering every
  generator state of the RNG tracker, synchronise, ``torch.cuda.graph(...,
  capture_error_mode="thread_local")`` on megatron-core's shared capture stream where it
  has one (0.18+; else one stream of this object), stale capture streams overridden,
  synchronise, barrier;
* one graph memory pool shared by every bucket graph of this object (and no other graph),
  so their memory is about that of the largest, not the sum. A graph's outputs (the losses
  it returns) are valid until the next forward/backward call: a later graph may reuse
  their memory, as a later replay of the same graph overwrites them;
* the graphs keep megatron-core's global scratch buffers they were captured with: a
  longer sequence makes megatron-core replace a buffer with a larger one (its local
  attention takes the ``"mpu"`` buffer for every step, sized by the sequence length
  squared), which would free the memory the earlier graphs use as scratch;
* and what megatron-core's cached forwards gave them: the rotary embeddings' tables
  (``RotaryEmbedding.forward`` is an ``lru_cache(maxsize=32)``: once 32 other lengths ran
  eagerly, an RL host's rollouts, a bucket's table is evicted and would be freed, since
  replays never touch the cache); and a table the capture itself had to compute (evicted
  between the warm-up and the capture) lies in the shared pool, so its cache is emptied
  after the capture: no eager call or later capture reads pool memory another graph's
  replays may overwrite.

A step outside every bucket runs eagerly with one log line per new shape (never a crash,
never a stale replay); forward-only (validation) calls run eagerly (see :meth:`route`).
Each call of a bucket is first compared with the micro-batches its static buffers were made
from (a short or unpadded micro-batch would be broadcast into them): unlike ones run
eagerly, said once. The shape guard (``guard.ShapeGuard``) checks each replayed call
against its graph's capture call too.

Memory that moves: before every training call while graphs are held, an
:class:`AddressFingerprint` (``data_ptr()`` of DDP's parameter and gradient buffers, of
every parameter, the loss scale) is compared with the one taken at capture; if anything
moved (offload and reload, ``param.data = ...``) every graph is freed and each bucket is
captured again after its warm-up, with a log line saying why;
:meth:`BucketGraphs.invalidate` does the same on the host's word. Graphs of other
mechanisms that read the same memory (the optimizer graph, whose captured step reads the
gradient buffers, the main parameters and Adam's state) are tied to these
(:meth:`BucketGraphs.tie`): they are freed with them and captured again after their own
warm-up; the fingerprint then also samples the optimizer's state, and any call of
megatron-core's optimizer offload API counts as a move (it gives every state tensor new
memory one by one: a sample can come back unchanged). In a multi-rank job every rank must
take the same action in a step (a capture holds barriers, the graphs hold collectives):
each training call agrees on the key and on "memory moved" with one small all-reduce; on
disagreement the step runs eagerly on every rank.

What the fingerprint cannot see (the host then calls :meth:`BucketGraphs.invalidate`, or a
debugging run captures with ``check_input_liveness``): optimizer state moved by the host's
own code where the sampled tensors came back at their old addresses; other cached tensors
freed behind the graphs' back, or cuBLAS workspaces cleared while graphs live.

None of this fires hooks: the plugin brackets :meth:`BucketGraphs.run` of a
``Action.CAPTURE`` route with its capture hooks, timing and memory snapshots.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from cudagraph_plugin.compat import buckets as bucket_compat
from cudagraph_plugin.config.buckets import check_buckets
from cudagraph_plugin.runtime.bucket_keys import (
    BUCKET_FIX,
    Action,
    BucketKey,
    BucketStats,
    PaddingLedger,
    Route,
    differs_from_buffers,
    draw_micro_batches,
    iterators_over,
    key_of,
    summary_rows,
    unmatched,
)
from cudagraph_plugin.runtime.fingerprint import AddressFingerprint, MoveWatch
from cudagraph_plugin.runtime.guard import (
    ShapeGuard,
    StaticShapeError,
    fingerprint,
    signature,
)
from cudagraph_plugin.runtime.release import DURING_TRAINING, ReleaseStep, release_each, settle

logger = logging.getLogger("cudagraph_plugin")


@dataclasses.dataclass
class _Captured:
    graph: Any
    result: Any  # the capture's outputs, which every replay refills; kept with the graph
    step: int | None
    scratch: list[tuple[str, Any]]  # megatron-core's scratch buffers at capture, kept alive
    cached: list[Any]  # what megatron-core's cached forwards gave the capture, kept alive


class TiedGraphs(Protocol):
    """Graphs of another mechanism that read what the fingerprint covers (the optimizer
    graph): freed and captured again with the bucket graphs."""

    def graph_count(self) -> int: ...

    def invalidate(self) -> int:
        """Free the graphs so that they are captured again after their warm-up; returns
        how many were freed."""
        ...


class BucketGraphs:
    """Full-iteration graphs of the training stage, one per bucket key.

    :param buckets: the bucket sequence lengths.
    :param warmup_steps: eager calls of a key before its capture (at least 1).
    :param model: the model chunks (for the address fingerprint and megatron-core's reader).
    :param optimizer: the host's optimizer (its loss scale is in the fingerprint).
    :param max_graphs: at most this many graphs at once (``None``: no limit); a further key
        runs eagerly with one log line.
    :param fingerprint: what to check for moved memory (default: :class:`AddressFingerprint`
        of ``model`` and ``optimizer``).
    :param agree: element-wise maximum of a list of ints over all ranks (default: one
        all-reduce, nothing in a single-rank job).
    :param check_input_liveness: capture with torch's input-liveness check (torch 2.13+),
        which makes a replay raise if a tensor the graph reads was freed: a debugging aid.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        warmup_steps: int,
        *,
        model: Sequence[Any],
        optimizer: Any = None,
        max_graphs: int | None = None,
        fingerprint: AddressFingerprint | None = None,
        agree: Callable[[list[int]], list[int]] | None = None,
        check_input_liveness: bool = False,
    ) -> None:
        self.buckets = check_buckets(buckets, "cuda_graph_buckets")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"cuda_graph_warmup_steps={warmup_steps!r}: bucketed full-iteration graphs "
                "need at least 1 eager step per bucket before its capture (lazy, "
                "shape-dependent allocations must happen outside the graph pool). Fix: "
                "--cuda-graph-warmup-steps 1 or more"
            )
        if max_graphs is not None and (isinstance(max_graphs, bool) or max_graphs < 1):
            raise ValueError(
                f"max_graphs={max_graphs!r}: give a positive number of graphs, or None for no limit"
            )
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self.fingerprint = fingerprint or AddressFingerprint(model, optimizer)
        self._agree = agree or bucket_compat.max_across_ranks
        self._liveness = bucket_compat.liveness_kwargs(check_input_liveness)
        self.guard = ShapeGuard()
        self.stats: dict[BucketKey, BucketStats] = {}
        self.invalidations: list[tuple[int | None, str, int]] = []
        self.padding = PaddingLedger()
        self._graphs: dict[BucketKey, _Captured] = {}
        self._calls: collections.Counter[BucketKey] = collections.Counter()
        self._buffers: dict[tuple[int, int | None], list[Any]] = {}
        # per buffer list: (fingerprint, signature) of each micro-batch they were made from
        self._shapes: dict[tuple[int, int | None], list[tuple[Any, Any]]] = {}
        # the fingerprint's reference at the capture, and the optimizer's offload calls
        self.moves = MoveWatch(self.fingerprint, "optimizer state and main parameters")
        self._reader: Any = None
        self._pool: Any = None
        self._stream: Any = None
        self._logged: set[Any] = set()
        self._tied: list[TiedGraphs] = []
        self._told = False  # the host invalidated the graphs since the last training call
        # told of every invalidation, the host's and the address check's: (step, reason, freed)
        self.on_invalidate: list[Callable[[int | None, str, int], None]] = []

    def tie(self, graphs: TiedGraphs) -> None:
        """Free ``graphs`` whenever these are invalidated (memory moved, the host's word)."""
        self._tied.append(graphs)

    def tied_captured(self) -> None:
        """A tied mechanism captured: if no bucket graph holds the fingerprint's reference,
        its addresses are the ones to check from now on."""
        if self.moves.reference is None:
            self.moves.mark()

    def watch_optimizer_offload(self, optimizer: Any) -> None:
        """megatron-core's offload API moves every main parameter and state tensor one by
        one (the fingerprint samples a few): the optimizer graph reads them all, and without
        a separate main copy (an fp32 model, no distributed optimizer) the main parameters
        are the model's own, which every bucket graph reads. Each call of it frees the
        graphs at the next training call, whatever the sample says."""
        self.moves.watch_offload(optimizer)

    def _holds_graphs(self) -> bool:
        return bool(self._graphs) or any(t.graph_count() for t in self._tied)

    # -- routing ----------------------------------------------------------------------------

    def route(self, kwargs: Mapping[str, Any], step: int | None = None) -> Route:
        """Decide what one ``forward_backward_func`` call does.

        Forward-only calls run eagerly: megatron-core's wrapper keeps one validation graph,
        which a second shape would replay stale, and they are cheap next to the training
        step. A training call first checks the address fingerprint (freeing every graph if
        memory moved), agrees with the other ranks, then: outside every bucket, eager; a
        captured key, replay; else warm-up until the key's ``warmup_steps``-th call, which
        captures.
        """
        if kwargs.get("forward_only"):
            self._log_once(
                "forward_only",
                "forward-only (validation) calls run eagerly with CUDA graph buckets: only "
                "the training step is captured per bucket",
            )
            return Route(Action.EAGER, None, "forward-only")
        key = key_of(kwargs)
        # (drawn first: a data iterator that raises must not take the offload record along)
        drawn, listed, unlike = self._draw(key, kwargs.get("data_iterator"))
        moved = self.moves.moved(self._holds_graphs())
        mbs = key.micro_batch_size if key.micro_batch_size is not None else -1
        shape = [key.seq_length, mbs, key.num_microbatches]
        # (a rank whose host invalidated its graphs since the last call counts as moved: the
        # other ranks free theirs too, or the ranks would warm up, capture and replay out of
        # step; that rank's own are freed already)
        told, self._told = self._told, False
        agreed = self._agree(
            [*shape, *(-v for v in shape), int(bool(moved) or told), int(bool(unlike))]
        )
        if agreed[6] and not moved and not told:
            moved = ["another rank found memory moved or was told its graphs are invalid"]
        if moved:
            self.invalidate(
                "memory the graphs point at moved: " + "; ".join(moved), step=step, tell_peers=False
            )
        route = self._decide(key, agreed, step)
        self._say_padding(self.padding.routed(step, key.seq_length))
        if agreed[7] and route.action is not Action.EAGER:
            self._log_once(
                ("unlike", key),  # (once per key: a value that differs every step, too)
                f"a training step with {key} has micro-batches unlike those its bucket's "
                f"static buffers were made from ({unlike or 'on another rank'}): it runs "
                f"eagerly on every rank. Fix: {BUCKET_FIX}",
                logging.WARNING,
            )
            route = Route(Action.EAGER, key, "micro-batches unlike the bucket's")
        if agreed[7]:  # (every rank alike, whichever saw it: their warm-ups stay in step)
            self._remake_unused_buffers(key)
        return dataclasses.replace(route, drawn=drawn, listed=listed)

    def _remake_unused_buffers(self, key: BucketKey) -> None:
        """After an unlike call: static buffers no graph reads yet are made again from the
        bucket's next call. The first call may have been the odd one (a host's partial
        batch): kept, it would have made every later call unlike, the bucket eager for the
        rest of the run. Each key of the bucket then warms up once more on the new buffers."""
        buffers = (key.seq_length, key.micro_batch_size)
        if any((k.seq_length, k.micro_batch_size) == buffers for k in self._graphs):
            return  # a graph reads them: an unlike call stays eager
        self._shapes.pop(buffers, None)
        self._buffers.pop(buffers, None)
        for other in self._calls:
            if (other.seq_length, other.micro_batch_size) == buffers:
                self._calls[other] = min(self._calls[other], self.warmup_steps - 1)

    def _draw(self, key: BucketKey, data_iterator: Any) -> tuple[list[Any] | None, bool, str]:
        """Draw the micro-batches of a call in a bucket and say how they differ from those
        its static buffers were made from (megatron-core's loader would broadcast a short
        micro-batch into them, or convert a dtype, without a word)."""
        if key.seq_length not in self.buckets:
            return None, False, ""
        drawn, listed = draw_micro_batches(data_iterator, key.num_microbatches)
        seen = self._shapes.get((key.seq_length, key.micro_batch_size))
        return drawn, listed, differs_from_buffers(seen or [], drawn or [])

    def _decide(self, key: BucketKey, agreed: list[int], step: int | None) -> Route:
        if agreed[:3] != [-v for v in agreed[3:6]]:
            self._log_once(
                ("ranks", key),
                f"ranks called forward_backward_func with different shapes at step {step} "
                f"(this rank: {key}); such steps run eagerly on every rank. Fix: pad every "
                "rank's micro-batches to the same bucket (pad_step(..., length=<the longest "
                "over all ranks>))",
            )
            return Route(Action.EAGER, key, "ranks disagree")
        if key.seq_length not in self.buckets:
            above = [b for b in self.buckets if b > key.seq_length]
            fix = (
                f"pad such steps to the bucket {min(above)} "
                "(cudagraph_plugin.runtime.padding.pad_step) and pass it as seq_length"
                if above
                else f"add a bucket of at least {key.seq_length} to cuda_graph_buckets, or "
                "shorten such steps"
            )
            self._log_once(
                ("outside", key),
                f"a training step with {key} is outside every CUDA graph bucket "
                f"({', '.join(map(str, self.buckets))}): steps of this shape run eagerly. "
                f"Fix: {fix}",
                logging.WARNING if above else logging.INFO,  # (not padded: a mistake)
            )
            return Route(Action.EAGER, key, "outside every bucket")
        if key in self._graphs:
            return Route(Action.REPLAY, key)
        if self.max_graphs is not None and len(self._graphs) >= self.max_graphs:
            self._log_once(
                ("limit", key),
                f"a training step with {key} would need a CUDA graph beyond the limit of "
                f"{self.max_graphs}: steps of this shape run eagerly. Fix: raise max_graphs, "
                "or use fewer buckets",
            )
            return Route(Action.EAGER, key, "graph limit")
        if self._calls[key] >= self.warmup_steps:
            return Route(Action.CAPTURE, key)
        return Route(Action.WARMUP, key)

    def run(self, route: Route, eager: Any, kwargs: dict[str, Any], step: int | None = None) -> Any:
        """Carry out ``route`` for a call of ``eager`` (megatron-core's forward_backward_func)
        with ``kwargs``; returns what the call returns (after a capture or replay, the
        graph's outputs, valid until the next call)."""
        key = route.key
        if key is not None:
            stats = self.stats.setdefault(key, BucketStats(key, key.seq_length in self.buckets))
            stats.calls.append((step, route.action))
        kwargs = dict(kwargs)
        if route.drawn is not None:
            kwargs["data_iterator"] = iterators_over(route.drawn, route.listed)
        if route.action is Action.EAGER:
            return eager(**kwargs)
        assert key is not None
        self._made_from(key, route.drawn)
        label = f"training (bucket {key})"
        capturing = route.action is Action.CAPTURE
        data_iterator = self.guard.check_call(label, step, kwargs, record=capturing, copied=True)
        if self._reader is None:
            self._reader = bucket_compat.static_input_reader(eager)
        buffers = self._buffers.setdefault((key.seq_length, key.micro_batch_size), [])
        try:
            kwargs["data_iterator"] = bucket_compat.read_static_inputs(
                self._reader, buffers, data_iterator, kwargs["model"], key.num_microbatches
            )
        except StaticShapeError as error:
            error.add_note(f"Fix: {BUCKET_FIX}")
            raise
        if route.action is Action.WARMUP:
            self._calls[key] += 1
            return eager(**kwargs)
        if capturing:
            result = self._capture(key, eager, kwargs, step)
            self.guard.commit(label)
            return result
        captured = self._graphs[key]
        captured.graph.replay()
        stats.replays += 1
        return captured.result

    def _made_from(self, key: BucketKey, drawn: list[Any] | None) -> None:
        """Remember what the bucket's static buffers are made from: each micro-batch index's
        buffer from the first call that reached that index."""
        seen = self._shapes.setdefault((key.seq_length, key.micro_batch_size), [])
        seen += [(fingerprint(b), signature(b)) for b in (drawn or [])[len(seen) :]]

    # -- capture ----------------------------------------------------------------------------

    def _capture(self, key: BucketKey, eager: Any, kwargs: dict[str, Any], step: int | None) -> Any:
        import torch

        pool = self._pool if self._pool is not None else torch.cuda.graph_pool_handle()
        stream = bucket_compat.shared_capture_stream()
        if stream is None:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
        logger.info("capturing the full-iteration CUDA graph for %s at step %s", key, step)
        start = time.perf_counter()
        graph = None
        cached: list[Any] = []
        missed: list[Any] = []
        try:
            with bucket_compat.stale_capture_streams_overridden():
                bucket_compat.barrier()
                graph = torch.cuda.CUDAGraph()
                for state in bucket_compat.rng_generator_states():
                    graph.register_generator_state(state)
                torch.cuda.synchronize()
                with (
                    torch.cuda.graph(
                        graph,
                        pool=pool,
                        stream=stream,
                        capture_error_mode="thread_local",
                        **self._liveness,
                    ),
                    bucket_compat.cached_forward_outputs(kwargs["model"], cached, missed),
                ):
                    result = eager(**kwargs)
                torch.cuda.synchronize()
                bucket_compat.barrier()
        except BaseException as error:
            # Not held yet, so no release step frees it; at DP > 1 the teardown of the
            # communicators it captured (a peer failed in the barrier) waits for it.
            if graph is not None:
                self._discard(graph, key, error)
            raise
        finally:
            bucket_compat.forget_cached_outputs(missed)  # (tables made in the pool)
        seconds = time.perf_counter() - start
        self._pool = pool
        self._graphs[key] = _Captured(graph, result, step, self._scratch(), cached)
        self._calls[key] += 1
        self.moves.mark()
        stats = self.stats[key]
        stats.capture_seconds.append(seconds)
        logger.info(
            "captured the full-iteration CUDA graph for %s in %.3f s (%d bucket graph(s) held)",
            key,
            seconds,
            len(self._graphs),
        )
        # (not counted in stats.replays: the report's replays are those after the capture)
        graph.replay()
        return result

    @staticmethod
    def _discard(graph: Any, key: BucketKey, error: BaseException) -> None:
        cause = error.__context__  # what a failed capture_end replaced (a PeerFailed, say)
        what = f"{type(error).__name__}: {error}" + (f", after {cause!r}" if cause else "")
        try:
            graph.reset()
        except Exception as exc:
            logger.warning("could not reset the interrupted capture of %s (%s): %s", key, what, exc)
            return
        logger.warning("the capture of %s did not complete (%s): its graph was reset", key, what)

    # -- moved memory and invalidation ------------------------------------------------------

    def invalidate(self, reason: str, step: int | None = None, *, tell_peers: bool = True) -> int:
        """Free every graph (their memory, outputs and shape references); each key is
        captured again after ``warmup_steps`` eager calls. Returns the graphs freed.
        ``tell_peers``: the other ranks free theirs at the next training call (the host's
        word may come on one rank only); the route's own invalidation is agreed already."""
        self._told = self._told or tell_peers
        unreplayed = sum(1 for k in self._graphs if not self.stats[k].replayed_since_capture())
        if self._holds_graphs():
            import torch

            # The last replay may still run on the device: its memory goes back only after.
            torch.cuda.synchronize()
        result = release_each(
            [
                *self.graph_release_steps(),
                *(
                    ReleaseStep(f"tied graphs ({type(t).__name__})", t.invalidate, True)
                    for t in self._tied
                ),
            ]
        )
        self._calls.clear()
        self.guard.disarm()
        self.moves.reference = None
        self.invalidations.append((step, reason, result.graphs_freed))
        logger.warning(
            "CUDA graph buckets: %s: freed %d graph(s) %s%s; each bucket%s is captured "
            "again after %d warm-up step(s)",
            reason,
            result.graphs_freed,
            "before the first step" if step is None else f"at step {step}",
            (
                f", {unreplayed} of them never replayed since its capture (a capture that "
                "bought nothing: invalidate less often, or use fewer buckets or a shorter "
                "warm-up)"
                if unreplayed
                else ""
            ),
            " and the optimizer step" if self._tied else "",
            self.warmup_steps,
        )
        for callback in self.on_invalidate:
            callback(step, reason, result.graphs_freed)
        settle(result.failures, None, DURING_TRAINING)
        return result.graphs_freed

    # -- bookkeeping and release ------------------------------------------------------------

    def graph_count(self) -> int:
        return len(self._graphs)

    @staticmethod
    def _scratch() -> list[tuple[str, Any]]:
        return [(name, t) for _, name, t in bucket_compat.global_memory_buffer_tensors()]

    def kept_scratch_buffers(self) -> list[tuple[str, int, int]]:
        """(name, address, bytes) of the scratch buffers the held graphs keep alive that
        megatron-core has since replaced: memory that exists only for the graphs."""
        current = {t.data_ptr() for _, t in self._scratch()}
        kept: dict[int, tuple[str, int, int]] = {}
        for captured in self._graphs.values():
            for name, tensor in captured.scratch:
                address = tensor.data_ptr()
                if address not in current:
                    kept[address] = (name, address, tensor.numel() * tensor.element_size())
        return list(kept.values())

    def record_padding(
        self, seq_length: int, real_tokens: int, padded_tokens: int, *, step: int | None
    ) -> None:
        """Count a step's real and padded token positions (from ``padding.pad_step``)."""
        self._say_padding(self.padding.record(step, seq_length, real_tokens, padded_tokens))

    def _say_padding(self, unmatched_lengths: list[tuple[int | None, int, int]]) -> None:
        for step, padded_to, called in unmatched_lengths:  # (once per pair of lengths)
            said = unmatched(step, padded_to, called)
            self._log_once(("padding", padded_to, called), said, logging.WARNING)

    def summary(
        self,
        durations_ms: Mapping[int, float] | None = None,
        holding_captures: Collection[int] = (),
    ) -> list[dict[str, Any]]:
        """Per key: its steps by action, capture seconds, replays, padding waste, medians
        (:func:`~cudagraph_plugin.runtime.bucket_keys.summary_rows`)."""
        self._say_padding(self.padding.finish())  # (the last step's)
        return summary_rows(
            self.stats, self._graphs, self.padding, durations_ms or {}, holding_captures
        )

    def graph_release_steps(self) -> list[ReleaseStep]:
        """The graphs alone, then the pool handle (invalidation, the fallback policy)."""
        return [
            *(
                ReleaseStep(f"bucket graph ({key})", functools.partial(self._free, key), True)
                for key in list(self._graphs)
            ),
            ReleaseStep("bucket graph pool handle", self._forget_pool),
        ]

    def release_steps(self) -> list[ReleaseStep]:
        return [
            *self.graph_release_steps(),
            ReleaseStep("bucket warm-up counters", self._calls.clear),
            ReleaseStep("bucket static input buffers", self._buffers.clear),
            ReleaseStep("what they were made from", self._shapes.clear),
            ReleaseStep("bucket static-shape guard", self.guard.disarm),
            ReleaseStep("the optimizer's offload methods", self.moves.unwatch),
            ReleaseStep("bucket model and optimizer references", self._drop_references),
        ]

    def _free(self, key: BucketKey) -> int:
        captured = self._graphs.pop(key)
        captured.result = None  # its tensors live in the pool
        captured.scratch = captured.cached = []
        captured.graph.reset()
        return 1

    def _forget_pool(self) -> None:
        # A pool whose last graph is gone is released; capturing into its stale handle trips
        # the caching allocator ("use_count > 0"): the next capture asks for a new one.
        if not self._graphs:
            self._pool = None

    def _drop_references(self) -> None:
        self._tied = []
        self.on_invalidate = []
        self.moves.forget()
        self._reader = None
        self._stream = None

    def _log_once(self, what: Any, message: str, level: int = logging.INFO) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.log(level, "%s", message)
