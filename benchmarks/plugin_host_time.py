"""The plugin's own host time per training step, measured in-process.

The end-to-end ratio "loop with the plugin / hand-written loop" cannot resolve a few
microseconds on a host whose CPU speed moves by tens of percent between runs (BENCHMARKS.md
section 2). This measures the plugin's share directly instead, inside one run of the
example loop (``examples/train_gpt.py``), by timing exactly the code the plugin adds to a
step:

* ``hooks``: ``TrainingRun.train_step`` entering and leaving (every ``mcgraph_*`` step hook:
  dispatch by pluggy, the plugin's step timer, post-warmup);
* ``plugin_hooks`` (``--breakdown``): of which the CUDA graph plugin's own step-hook
  implementations (their bodies: the step timer, the capture-step and fallback checks),
  without the dispatch;
* ``timer`` (``--breakdown``): of which the plugin's step timer (two CUDA event records and a
  query on the steps it times; ``timed_steps`` / ``untimed_steps`` give the step total apart
  for the steps it times and the others);
* ``forward_backward``: the plugin's forward/backward wrapper minus the megatron-core call it
  wraps (the capture decision, the input-copy ordering, the guard's set-up), guard included;
* ``guard``: of which checking each micro-batch against the captured one (the static-shape
  guard), which runs while megatron-core draws the micro-batches: the guard's iterator
  (its frame, its check), the host's own draw inside it left out;
* ``optimizer`` (mode ``full_iteration_optimizer``): the plugin's ``optimizer.step`` in
  place of the host's minus megatron-core's ``OptimizerCudaGraphWrapper`` call it wraps (the
  capture decision, the hyperparameter check before each replay).

Timed with ``time.perf_counter_ns`` around each piece on the steady-state steps (after the
capture step); medians over those steps, in microseconds. Every timer costs host time
too, and a timed piece inside another adds its timers' cost to the outer one: by default
only the pieces the total is made of are timed; ``--breakdown`` adds the nested pieces and
the main thread's CPU time (``time.thread_time_ns``) beside each (a piece whose CPU time is
far below its wall-clock time waited: slept in the driver, was descheduled), at the price
of larger totals. Two ways to take the device
out of the figures: ``--sync-between-steps`` (the device idle at each step's start) and
``--size host-bound`` (a model whose GPU work is far below the host's). The target is
<= 30 µs per step (issue 21).

``step_period_us`` is the median time from one step's start to the next: where the host
waits for the device (the real model), the device's step; where it does not (``--size
host-bound``), the host's own work per step, which is what the plugin's share can lengthen
(with ``--speed-meter``, the meter's few microseconds included).

``host_probe_before`` / ``_after`` (GPU runs): a dependent-load chase from Python through
256 entries (the CPU's speed) and through 128 MiB (the memory's latency), before and after
the run: whether a slow process has a slow CPU or slow memory.

``--speed-meter`` runs a short L1-resident chase (256 loads) before each step, outside every
timed piece: ``speed_meter`` gives the steady total apart for the steps that ran at full
speed (the meter within 1.2x of the run's fastest) and the others; ``per_step`` holds every
step's meter and total, to pool runs.

``threads`` in the JSON is where the process's threads stood when the run report was made
(Linux ``/proc``; empty elsewhere): each thread's name, the CPU it last ran on and that CPU's
hyperthread siblings, its CPU time and its voluntary and involuntary context switches. The
same code measures up to 2x apart between processes on one machine (BENCHMARKS.md 2h, 2i):
this says whether a slow process's main thread slept (voluntary switches: a blocking wait in
the driver), was preempted (involuntary ones), or shared its core with a busy thread.

GPU (after ../shared/gpu/README.md's install)::

    PYTHONPATH=$PWD:$PWD/examples:$PYTHONPATH python3 benchmarks/plugin_host_time.py \\
        --mode full_iteration --out $OUT/host_time_full.json

CPU (the plugin is inactive without CUDA graphs, so only ``hooks`` is measured)::

    python benchmarks/plugin_host_time.py --cpu --steps 20
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpu_limit  # noqa: E402
import gpu_modes  # noqa: E402  (sets up sys.path for the project and the example)

TARGET_US = 30.0
# The model of the other GPU benchmarks (gpu_modes, gpu_limit), so the numbers line up.
SIZE = gpu_modes.SIZES["4L-512H"]
# ``--size host-bound``: a model whose GPU work per step is far below the host's, so the
# host never waits for the device and every piece is the host's own work.
SIZES = {**gpu_modes.SIZES, "host-bound": gpu_modes.Size("host-bound-1L-64H", 1, 64, 4)}
MODES = ("full_iteration", "full_iteration_optimizer", "te_attn_mlp", "eager")


class StepClock:
    """Nanoseconds spent in each instrumented piece, per training step: wall-clock time
    (``ns``) and the main thread's CPU time (``cpu_ns``; far below the wall-clock time where
    a piece waited, e.g. slept in the driver); ``timed``: the steps the plugin's own step
    timer timed (it samples after its dense window, see runtime/measurement.py)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.ns: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.cpu_ns: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.timed: set[int] = set()
        # perf_counter_ns when each step's train_step was entered: the loop's period
        self.starts: dict[int, int] = {}
        # --speed-meter: ns per iteration of a short L1-resident chase run before each step
        self.meter: dict[int, float] = {}

    def add(self, piece: str, ns: int, cpu_ns: int = 0) -> None:
        if self.step is not None:
            self.ns[self.step][piece] += ns
            self.cpu_ns[self.step][piece] += cpu_ns


def _no_cpu_clock() -> int:
    return 0


class _Span:
    """Wall-clock (and, with ``--breakdown``, thread CPU) time of one piece, added to
    ``clock`` by :meth:`end`. The wall clock is read last on the way in and first on the
    way out, so the span's own bookkeeping stays outside it."""

    __slots__ = ("clock", "cpu", "piece", "wall")
    cpu_clock: Any = None  # time.thread_time_ns with --breakdown

    def __init__(self, clock: StepClock, piece: str) -> None:
        self.clock, self.piece = clock, piece
        self.cpu = 0 if self.cpu_clock is None else self.cpu_clock()
        self.wall = time.perf_counter_ns()

    def end(self) -> None:
        wall = time.perf_counter_ns() - self.wall
        cpu = 0 if self.cpu_clock is None else self.cpu_clock() - self.cpu
        self.clock.add(self.piece, wall, cpu)


def instrument(
    clock: StepClock,
    stack: contextlib.ExitStack,
    sync_between_steps: bool = False,
    breakdown: bool = False,
    speed_meter: bool = False,
) -> None:
    """Wrap the pieces the plugin adds to a step (undone when ``stack`` closes).

    The timers themselves cost the host time, and each timed piece nested inside another
    adds its own cost to the outer one. By default only the pieces the total is made of are
    timed (``hooks``, ``forward_backward`` with the ``guard`` inside megatron-core's call,
    ``optimizer``), wall-clock only; ``breakdown`` adds the plugin's step hooks and its step
    timer inside ``hooks``, and the CPU time of every piece, which makes the totals larger
    by what those timers cost.
    """
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from cudagraph_plugin.runtime import guard, interceptor, timing
    from hookspecs import run

    def patch(owner: Any, name: str, replacement: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        stack.callback(setattr, owner, name, original)

    train_step = run.TrainingRun.train_step
    synchronize = None
    if sync_between_steps:
        import torch

        synchronize = torch.cuda.synchronize

    meter = chase_cycle(METER_ENTRIES) if speed_meter else None

    @contextlib.contextmanager
    def timed_train_step(self: Any, step: int) -> Any:
        if synchronize is not None:
            # the device idle before the step's first piece: no piece can wait for it
            synchronize()
        if meter is not None:
            # the CPU's speed at this step, outside every timed piece
            clock.meter[step] = _chase_ns(meter, METER_STEPS)
        clock.step = step
        clock.starts[step] = time.perf_counter_ns()
        span = _Span(clock, "hooks")
        manager = train_step(self, step)
        metrics = manager.__enter__()
        span.end()
        try:
            yield metrics
        except BaseException:
            if not manager.__exit__(*sys.exc_info()):
                raise
        else:
            span = _Span(clock, "hooks")
            manager.__exit__(None, None, None)
            span.end()

    patch(run.TrainingRun, "train_step", timed_train_step)

    # The plugin's own step hooks, timed inside the dispatch (patched on the class before
    # the run registers its instance; functools.wraps keeps pluggy's hookimpl marker). They
    # are on the plugin itself before the step listener (a baseline, tools/host_baseline.sh).
    try:
        from cudagraph_plugin.runtime.steps import StepListener as step_hooks
    except ImportError:
        from cudagraph_plugin.runtime.plugin import CudaGraphPlugin as step_hooks

    def timed_method(owner: Any, name: str, piece: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            span = _Span(clock, piece)
            try:
                return method(self, *args, **kwargs)
            finally:
                span.end()

        patch(owner, name, timed)

    if breakdown:
        stack.callback(setattr, _Span, "cpu_clock", None)
        _Span.cpu_clock = staticmethod(time.thread_time_ns)
        for name in ("mcgraph_train_step_start", "mcgraph_train_step_end"):
            timed_method(step_hooks, name, "plugin_hooks")
        # of which the plugin's step timer (two CUDA event records and a query per timed step)
        timed_method(timing.StepTimer, "start", "timer")
        timed_method(timing.StepTimer, "stop", "timer")
    cpu_clock = _Span.cpu_clock or _no_cpu_clock

    inner = {"depth": 0, "ns": 0, "cpu_ns": 0}

    def timed_inner(call: Any) -> Any:
        """``call`` timed as megatron-core's time (its wrapper, the host's function; the
        outermost one counts), in one frame. Its clock is read first and last, so that what
        the harness costs around the call lands in megatron-core's share, not the plugin's;
        only the frame itself is left in the plugin's (without ``--breakdown``, not even a
        call of the CPU clock)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            start_cpu = cpu_clock() if breakdown else 0
            inner["depth"] += 1
            try:
                return call(*args, **kwargs)
            finally:
                inner["depth"] -= 1
                outermost = not inner["depth"]
                if breakdown and outermost:
                    inner["cpu_ns"] += cpu_clock() - start_cpu
                end = time.perf_counter_ns()
                if outermost:
                    inner["ns"] += end - start

        return timed

    def around_inner(piece: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        # ``call``'s time minus megatron-core's inside it
        inner["ns"] = inner["cpu_ns"] = 0
        start_cpu = cpu_clock()
        start = time.perf_counter_ns()
        result = call(*args, **kwargs)
        wall = time.perf_counter_ns() - start - inner["ns"]
        clock.add(piece, wall, cpu_clock() - start_cpu - inner["cpu_ns"])
        return result

    # The guard: its checked iterator's __next__ (the frame included: that is the plugin's
    # cost too), minus the host's own draw inside it (its data iterator's next, which may
    # build the batch). The host's data iterator is wrapped in a timed draw on each call,
    # before the forward/backward call is timed: the wrapper's making is never booked as the
    # plugin's.
    drawn = {"ns": 0, "cpu_ns": 0}

    class TimedDraw:
        __slots__ = ("iterator",)

        def __init__(self, iterator: Any) -> None:
            self.iterator = iterator

        def __iter__(self) -> Any:
            return self

        def __next__(self) -> Any:
            start = time.perf_counter_ns()
            start_cpu = cpu_clock() if breakdown else 0
            try:
                return next(self.iterator)
            finally:
                if breakdown:
                    drawn["cpu_ns"] += cpu_clock() - start_cpu
                drawn["ns"] += time.perf_counter_ns() - start

    def timed_draw(iterator: Any) -> Any:
        if isinstance(iterator, list):  # one per model chunk (virtual pipeline stages)
            return [timed_draw(each) for each in iterator]
        return None if iterator is None else TimedDraw(iterator)

    # The forward/backward callable the host gets (the remembered replay's shortcut is in
    # it), timed whole; the host function it is made for is swapped for a timed stand-in
    # once, when it is made (the plugin keys megatron-core's wrapper by that function, so
    # a new stand-in per call would make it build a new FullCudaGraphWrapper, and CUDA
    # stream, on every step, which the plugin never does).
    forward_backward_init = interceptor.ForwardBackward.__init__
    forward_backward_call = interceptor.ForwardBackward.__call__

    def timed_forward_backward_init(self: Any, owner: Any, eager: Any) -> None:
        forward_backward_init(self, owner, timed_inner(eager))

    def timed_forward_backward(self: Any, **kwargs: Any) -> Any:
        if "data_iterator" in kwargs:
            kwargs["data_iterator"] = timed_draw(kwargs["data_iterator"])
        return around_inner("forward_backward", forward_backward_call, self, **kwargs)

    patch(interceptor.ForwardBackward, "__init__", timed_forward_backward_init)
    patch(interceptor.ForwardBackward, "__call__", timed_forward_backward)
    patch(FullCudaGraphWrapper, "__call__", timed_inner(FullCudaGraphWrapper.__call__))

    checked_next = guard._CheckedIterator.__next__

    def timed_next(self: Any) -> Any:
        drawn["ns"] = drawn["cpu_ns"] = 0
        start_cpu = cpu_clock() if breakdown else 0
        start = time.perf_counter_ns()
        try:
            return checked_next(self)
        finally:
            spent = time.perf_counter_ns() - start - drawn["ns"]
            cpu = cpu_clock() - start_cpu - drawn["cpu_ns"] if breakdown else 0
            clock.add("guard", spent, cpu)
            # it ran inside megatron-core's call: count it as the guard
            inner["ns"] -= spent
            inner["cpu_ns"] -= cpu

    patch(guard._CheckedIterator, "__next__", timed_next)

    optimizer_step = interceptor.OptimizerStep.__call__

    def timed_optimizer_step(self: Any) -> Any:
        return around_inner("optimizer", optimizer_step, self)

    patch(interceptor.OptimizerStep, "__call__", timed_optimizer_step)
    try:  # megatron-core 0.17+
        from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper
    except ImportError:
        return
    patch(OptimizerCudaGraphWrapper, "__call__", timed_inner(OptimizerCudaGraphWrapper.__call__))


def timed_by_the_plugin(steps: Any, capture_step: int | None) -> set[int]:
    """The steps the plugin's step timer times (its own rule for a run without buckets,
    ``measurement.timed_after_capture``), worked out here rather than watched: watching
    would cost a call per step inside the timed hooks."""
    from cudagraph_plugin.runtime import measurement

    if capture_step is None:
        return set(steps)
    return {step for step in steps if measurement.timed_after_capture(step, capture_step)}


PIECES = ("hooks", "plugin_hooks", "timer", "forward_backward", "guard", "optimizer")


def _median_us(values: list[int]) -> float | None:
    return statistics.median(values) / 1000.0 if values else None


def summarise(clock: StepClock, first: int, breakdown: bool = True) -> dict[str, Any]:
    """Medians per piece and per step over the steps from ``first`` on: wall-clock and CPU
    time, and the total apart for the steps the plugin's step timer timed and those it did
    not."""
    steps = sorted(step for step in clock.ns if step >= first)
    ns, cpu_ns = clock.ns, clock.cpu_ns

    def total(pieces: collections.Counter[str]) -> int:
        # the guard runs inside megatron-core's call and is already part of forward_backward
        return pieces["hooks"] + pieces["forward_backward"] + pieces["optimizer"]

    def own(pieces: collections.Counter[str]) -> int:
        # what the plugin's own code costs per step, the hook dispatch left out
        return pieces["plugin_hooks"] + pieces["forward_backward"] + pieces["optimizer"]

    totals = sorted(total(ns[step]) for step in steps)
    starts = clock.starts
    periods = [starts[s + 1] - starts[s] for s in steps if s in starts and s + 1 in starts]
    timed = [total(ns[step]) for step in steps if step in clock.timed]
    untimed_steps = [step for step in steps if step not in clock.timed]
    untimed = [total(ns[step]) for step in untimed_steps]
    return {
        "steady_steps": len(steps),
        "us_per_step": {piece: _median_us([ns[s][piece] for s in steps]) for piece in PIECES},
        "cpu_us_per_step": {
            piece: _median_us([cpu_ns[s][piece] for s in steps]) for piece in PIECES
        },
        "total_us_per_step": _median_us(totals),
        "total_us_p90": totals[int(0.9 * (len(totals) - 1))] / 1000.0 if totals else None,
        "total_cpu_us_per_step": _median_us([total(cpu_ns[s]) for s in steps]),
        # (the plugin's hook bodies are timed apart only with --breakdown)
        "plugin_code_us_per_step": _median_us([own(ns[s]) for s in steps]) if breakdown else None,
        "timed_steps": {"count": len(timed), "total_us_per_step": _median_us(timed)},
        "untimed_steps": {"count": len(untimed), "total_us_per_step": _median_us(untimed)},
        # from one step's start to the next: the device's step where the host waits for it
        # (a GPU-bound run), the host's own where it does not (--size host-bound)
        "step_period_us": _median_us(periods),
        **(by_speed(clock, untimed_steps, total) if clock.meter else {}),
    }


METER_ENTRIES, METER_STEPS = 256, 256
# a step whose meter is within this factor of the run's fastest ran at full speed
FULL_SPEED = 1.2


def by_speed(clock: StepClock, untimed_steps: list[int], total: Any) -> dict[str, Any]:
    """``--speed-meter``: the steady total (over ``untimed_steps``, the steps the plugin does
    not time) apart for the steps whose meter says the CPU ran at full speed (within
    :data:`FULL_SPEED` of the run's fastest meter) and the others, and every step's meter and
    total (to pool runs). The lent host's CPU runs the same L1-resident loop up to 2x slower
    at times, within one process (BENCHMARKS.md 2j)."""
    metered = [s for s in untimed_steps if s in clock.meter]
    if not metered:
        return {}
    totals = [total(clock.ns[s]) for s in metered]
    meters = [clock.meter[s] for s in metered]
    bound = FULL_SPEED * min(meters)
    full = [t for t, m in zip(totals, meters, strict=True) if m <= bound]
    slow = [t for t, m in zip(totals, meters, strict=True) if m > bound]
    return {
        "speed_meter": {
            "fastest_ns": min(meters),
            "median_ns": statistics.median(meters),
            "full_speed_steps": {"count": len(full), "total_us_per_step": _median_us(full)},
            "slower_steps": {"count": len(slow), "total_us_per_step": _median_us(slow)},
        },
        "per_step": {
            "step": metered,
            "meter_ns": [round(m, 2) for m in meters],
            "total_us": [t / 1000.0 for t in totals],
        },
    }


def _proc_fields(stat: str) -> list[str]:
    # /proc/<pid>/task/<tid>/stat: "tid (comm) state ..." (comm may hold spaces and ")")
    return stat[stat.rindex(")") + 2 :].split()


def thread_snapshot(proc: Path = Path("/proc/self/task")) -> list[dict[str, Any]]:
    """Each thread of this process: name, last CPU and its hyperthread siblings, CPU time
    (clock ticks of user + system time) and context switches; ``[]`` without ``/proc``."""
    threads = []
    try:
        tasks = sorted(proc.iterdir(), key=lambda t: int(t.name))
    except OSError:
        return []
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            fields = _proc_fields((task / "stat").read_text())
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
        except (OSError, ValueError):
            continue  # the thread ended while being read
        # stat fields 14/15 (utime, stime) and 39 (processor) are 12/13 and 37 after comm
        cpu = int(fields[36])
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        threads.append(
            {
                "tid": int(task.name),
                "name": name,
                "cpu": cpu,
                "cpu_siblings": siblings.read_text().strip() if siblings.exists() else None,
                "cpu_ticks": int(fields[11]) + int(fields[12]),
                "voluntary_switches": int(status.get("voluntary_ctxt_switches", "0")),
                "involuntary_switches": int(status.get("nonvoluntary_ctxt_switches", "0")),
            }
        )
    return threads


def chase_cycle(n: int, seed: int = 0) -> array.array:
    """An array of ``n`` next-indices forming one cycle through all of them, in random order: a
    chase from any index visits every entry before it comes back (so a chase longer than
    the cache's share of the entries cannot stay in the cache)."""
    import torch

    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    following = torch.empty(n, dtype=torch.int64)
    following[order] = order.roll(-1)
    cycle = array.array("q")
    cycle.frombytes(following.numpy().tobytes())
    return cycle


def _chase_ns(cycle: array.array, steps: int) -> float:
    index = 0
    start = time.perf_counter_ns()
    for _ in range(steps):
        index = cycle[index]
    return (time.perf_counter_ns() - start) / steps


def host_probe(large: int = 1 << 24, small: int = 256, steps: int = 1 << 19) -> dict[str, float]:
    """Nanoseconds per step of a dependent-load chase from Python, through ``small`` entries
    (in the L1 cache: the CPU's speed with the interpreter's own overhead) and through
    ``large`` ones (128 MiB by default, beyond a server's last-level cache: each step misses
    the caches, and the TLB without huge pages, so it adds the memory's latency as this
    process sees it). Taken before and after the run (``host_probe_before``/``_after``), it
    says whether a slow process has a slow CPU or slow memory: BENCHMARKS.md 2i found every
    piece of a process 1.5-2x slower together, with the code's hot-loop cost unchanged."""
    small_cycle, large_cycle = chase_cycle(small), chase_cycle(large)
    _chase_ns(large_cycle, steps // 8)  # page the entries in first
    return {
        "l1_chase_ns": min(_chase_ns(small_cycle, steps) for _ in range(3)),
        "memory_chase_ns": min(_chase_ns(large_cycle, steps) for _ in range(3)),
        "large_entries": large,
    }


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import train_gpt
    from hookspecs import hookimpl

    class Capture:
        def __init__(self) -> None:
            self.step: int | None = None
            self.threads: list[dict[str, Any]] = []

        @hookimpl
        def mcgraph_report(self, report: Any) -> None:
            self.step = report.capture_step
            self.threads = thread_snapshot()

    capture = Capture()
    clock = StepClock()
    size = SIZE if getattr(args, "size", None) is None else SIZES[args.size]
    seq_length = getattr(args, "seq_length", None) or (32 if args.cpu else 512)
    settings = gpu_modes.Settings(
        steps=args.steps,
        warmup=args.warmup,
        repeats=1,
        seq_length=seq_length,
        micro_batch_size=2,
        vocab_size=128,
        bf16=not args.cpu,
        cpu=args.cpu,
        smoke=False,
    )
    argv = gpu_modes.plugin_argv(size, gpu_limit.MODES[mode], settings, use_cuda=not args.cpu)
    sync = bool(getattr(args, "sync_between_steps", False)) and not args.cpu
    breakdown = bool(getattr(args, "breakdown", False))
    speed_meter = bool(getattr(args, "speed_meter", False))
    with contextlib.ExitStack() as stack:
        instrument(
            clock, stack, sync_between_steps=sync, breakdown=breakdown, speed_meter=speed_meter
        )
        train_gpt.run(argv, plugins=[capture])
    first = (capture.step if capture.step is not None else args.warmup) + 1
    clock.timed.update(timed_by_the_plugin(clock.ns, capture.step))
    total = summarise(clock, first, breakdown)
    return {
        "mode": mode,
        "size": size.name,
        "seq_length": seq_length,
        "sync_between_steps": sync,
        "breakdown": breakdown,
        "capture_step": capture.step,
        **total,
        "threads": capture.threads,
        "target_us": TARGET_US,
        "within_target": total["total_us_per_step"] is not None
        and total["total_us_per_step"] <= TARGET_US,
    }


ADDR_NO_RANDOMIZE = 0x0040000  # linux/personality.h


def process_facts(proc: Path = Path("/proc")) -> dict[str, Any]:
    """What the command line does not show about how this process was started: the hash
    seed, and whether its addresses are randomised (the kernel's setting, and the process's
    own personality: ``setarch -R`` turns it off). None where ``/proc`` does not say."""

    def read(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    setting, personality = (
        read(proc / "sys/kernel/randomize_va_space"),
        read(proc / "self/personality"),
    )
    randomised = None
    if setting is not None and personality is not None:
        randomised = setting != "0" and not int(personality, 16) & ADDR_NO_RANDOMIZE
    return {
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
        "randomize_va_space": setting,
        "personality": personality,
        "addresses_randomised": randomised,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="full_iteration")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--size", choices=SIZES, default=None, help="default: 4L-512H")
    parser.add_argument(
        "--seq-length", type=int, default=None, help="512 on the GPU, 32 on the CPU"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the plugin's step hooks and step timer, and CPU time (costs time)",
    )
    parser.add_argument(
        "--sync-between-steps",
        action="store_true",
        help="synchronise the device before each step (outside every timed piece)",
    )
    parser.add_argument(
        "--speed-meter",
        action="store_true",
        help="before each step (outside every timed piece) time a short L1-resident loop: "
        "the totals apart for the steps the CPU ran at full speed",
    )
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    import torch

    from cudagraph_plugin import compat

    before = None if args.cpu else host_probe()
    result = measure(args.mode, args)
    if before is not None:
        result.update(host_probe_before=before, host_probe_after=host_probe())
    use_cuda = torch.cuda.is_available() and not args.cpu
    result.update(
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if use_cuda else "cpu",
        versions=compat.versions(),
        command=" ".join([sys.executable, *sys.argv]),
        process=process_facts(),
    )
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
