"""The plugin's own host time per training step, measured in-process.

The end-to-end ratio "loop with the plugin / hand-written loop" cannot resolve a few
microseconds on a host whose CPU speed moves by tens of percent between runs (BENCHMARKS.md
section 2). This measures the plugin's share directly instead, inside one run of the
example loop (``examples/train_gpt.py``), by timing exactly the code the plugin adds to a
step:

* ``hooks``: ``TrainingRun.train_step`` entering and leaving (every ``mcgraph_*`` step hook:
  dispatch by pluggy, the plugin's step timer, post-warmup);
* ``plugin_hooks``: of which the CUDA graph plugin's own step-hook implementations (their
  bodies: the step timer, the capture-step and fallback checks), without the dispatch;
* ``forward_backward``: the plugin's forward/backward wrapper minus the megatron-core call it
  wraps (the capture decision, the input-copy ordering, the guard's set-up), guard included;
* ``guard``: of which checking each micro-batch against the captured one (the static-shape
  guard), which runs while megatron-core draws the micro-batches;
* ``optimizer`` (mode ``full_iteration_optimizer``): the plugin's ``optimizer.step`` in
  place of the host's minus megatron-core's ``OptimizerCudaGraphWrapper`` call it wraps (the
  capture decision, the hyperparameter check before each replay).

Timed with ``time.perf_counter_ns`` around each piece on the steady-state steps (after the
capture step); medians over those steps, in microseconds. The target is <= 30 µs per step
(issue 21).

GPU (after ../shared/gpu/README.md's install)::

    PYTHONPATH=$PWD:$PWD/examples:$PYTHONPATH python3 benchmarks/plugin_host_time.py \\
        --mode full_iteration --out $OUT/host_time_full.json

CPU (the plugin is inactive without CUDA graphs, so only ``hooks`` is measured)::

    python benchmarks/plugin_host_time.py --cpu --steps 20
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
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
MODES = ("full_iteration", "full_iteration_optimizer", "te_attn_mlp", "eager")


class StepClock:
    """Nanoseconds spent in each instrumented piece, per training step."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.ns: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def add(self, piece: str, ns: int) -> None:
        if self.step is not None:
            self.ns[self.step][piece] += ns


def instrument(clock: StepClock, stack: contextlib.ExitStack) -> None:
    """Wrap the pieces the plugin adds to a step (undone when ``stack`` closes)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from cudagraph_plugin.runtime import guard, interceptor
    from hookspecs import run

    def patch(owner: Any, name: str, replacement: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        stack.callback(setattr, owner, name, original)

    train_step = run.TrainingRun.train_step

    @contextlib.contextmanager
    def timed_train_step(self: Any, step: int) -> Any:
        clock.step = step
        start = time.perf_counter_ns()
        manager = train_step(self, step)
        metrics = manager.__enter__()
        clock.add("hooks", time.perf_counter_ns() - start)
        try:
            yield metrics
        except BaseException:
            if not manager.__exit__(*sys.exc_info()):
                raise
        else:
            start = time.perf_counter_ns()
            manager.__exit__(None, None, None)
            clock.add("hooks", time.perf_counter_ns() - start)

    patch(run.TrainingRun, "train_step", timed_train_step)

    # The plugin's own step hooks, timed inside the dispatch (patched on the class before
    # the run registers its instance; functools.wraps keeps pluggy's hookimpl marker).
    from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

    for name in ("mcgraph_train_step_start", "mcgraph_train_step_end"):
        implementation = getattr(CudaGraphPlugin, name)

        @functools.wraps(implementation)
        def timed_implementation(
            self: Any, *args: Any, _implementation: Any = implementation, **kwargs: Any
        ) -> Any:
            start = time.perf_counter_ns()
            try:
                return _implementation(self, *args, **kwargs)
            finally:
                clock.add("plugin_hooks", time.perf_counter_ns() - start)

        patch(CudaGraphPlugin, name, timed_implementation)

    forward_backward = interceptor.ForwardBackwardInterceptor.call
    inner_ns = [0]
    inner_depth = [0]

    def timed_inner(call: Any, *args: Any, **kwargs: Any) -> Any:
        # megatron-core's time (its wrapper, the host's function): the outermost one counts.
        # A plain function, not a context manager: what the harness itself costs around the
        # call lands in the plugin's share.
        inner_depth[0] += 1
        start = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            inner_depth[0] -= 1
            if not inner_depth[0]:
                inner_ns[0] += time.perf_counter_ns() - start

    # One timed stand-in per host function, made once: the plugin keys its megatron-core
    # wrapper by the function it is given, so a new stand-in per call would make it build a
    # new FullCudaGraphWrapper (and CUDA stream) on every step, which the plugin never does.
    timed_eagers: dict[int, tuple[Any, Any]] = {}

    def timed_eager_for(eager: Any) -> Any:
        known = timed_eagers.get(id(eager))
        if known is None:

            def timed_eager(**inner_kwargs: Any) -> Any:
                return timed_inner(eager, **inner_kwargs)

            known = timed_eagers[id(eager)] = (eager, timed_eager)
        return known[1]

    def timed_forward_backward(self: Any, eager: Any, kwargs: dict[str, Any]) -> Any:
        inner_ns[0] = 0
        start = time.perf_counter_ns()
        result = forward_backward(self, timed_eager_for(eager), kwargs)
        clock.add("forward_backward", time.perf_counter_ns() - start - inner_ns[0])
        return result

    patch(interceptor.ForwardBackwardInterceptor, "call", timed_forward_backward)

    mcore_call = FullCudaGraphWrapper.__call__

    def timed_mcore_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return timed_inner(mcore_call, self, *args, **kwargs)

    patch(FullCudaGraphWrapper, "__call__", timed_mcore_call)

    see = guard.ShapeGuard._see

    def timed_see(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return see(self, *args, **kwargs)
        finally:
            spent = time.perf_counter_ns() - start
            clock.add("guard", spent)
            inner_ns[0] -= spent  # it ran inside megatron-core's call: count it as the guard

    patch(guard.ShapeGuard, "_see", timed_see)

    optimizer_step = interceptor.OptimizerStep.__call__
    optimizer_inner_ns = [0]

    def timed_optimizer_step(self: Any) -> Any:
        optimizer_inner_ns[0] = 0
        start = time.perf_counter_ns()
        result = optimizer_step(self)
        clock.add("optimizer", time.perf_counter_ns() - start - optimizer_inner_ns[0])
        return result

    patch(interceptor.OptimizerStep, "__call__", timed_optimizer_step)
    try:  # megatron-core 0.17+
        from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper
    except ImportError:
        return
    mcore_optimizer_call = OptimizerCudaGraphWrapper.__call__

    def timed_mcore_optimizer_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return mcore_optimizer_call(self, *args, **kwargs)
        finally:
            optimizer_inner_ns[0] += time.perf_counter_ns() - start

    patch(OptimizerCudaGraphWrapper, "__call__", timed_mcore_optimizer_call)


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import train_gpt
    from hookspecs import hookimpl

    class Capture:
        step: int | None = None

        @hookimpl
        def mcgraph_report(self, report: Any) -> None:
            self.step = report.capture_step

    capture = Capture()
    clock = StepClock()
    settings = gpu_modes.Settings(
        steps=args.steps,
        warmup=args.warmup,
        repeats=1,
        seq_length=32 if args.cpu else 512,
        micro_batch_size=2,
        vocab_size=128,
        bf16=not args.cpu,
        cpu=args.cpu,
        smoke=False,
    )
    argv = gpu_modes.plugin_argv(SIZE, gpu_limit.MODES[mode], settings, use_cuda=not args.cpu)
    with contextlib.ExitStack() as stack:
        instrument(clock, stack)
        train_gpt.run(argv, plugins=[capture])
    first = (capture.step if capture.step is not None else args.warmup) + 1
    steady = {step: pieces for step, pieces in clock.ns.items() if step >= first}
    pieces = ("hooks", "plugin_hooks", "forward_backward", "guard", "optimizer")
    per_piece = {
        piece: statistics.median(p[piece] for p in steady.values()) / 1000.0 if steady else None
        for piece in pieces
    }
    # the guard runs inside megatron-core's call and is already part of forward_backward
    totals = [
        (p["hooks"] + p["forward_backward"] + p["optimizer"]) / 1000.0 for p in steady.values()
    ]
    total = statistics.median(totals) if totals else None
    # what the plugin's own code costs per step, the hook dispatch left out
    own = [
        (p["plugin_hooks"] + p["forward_backward"] + p["optimizer"]) / 1000.0
        for p in steady.values()
    ]
    return {
        "mode": mode,
        "capture_step": capture.step,
        "steady_steps": len(steady),
        "us_per_step": per_piece,
        "total_us_per_step": total,
        "total_us_p90": sorted(totals)[int(0.9 * (len(totals) - 1))] if totals else None,
        "plugin_code_us_per_step": statistics.median(own) if own else None,
        "target_us": TARGET_US,
        "within_target": total is not None and total <= TARGET_US,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="full_iteration")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    import torch

    from cudagraph_plugin import compat

    result = measure(args.mode, args)
    use_cuda = torch.cuda.is_available() and not args.cpu
    result.update(
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if use_cuda else "cpu",
        versions=compat.versions(),
        command=" ".join([sys.executable, *sys.argv]),
    )
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
