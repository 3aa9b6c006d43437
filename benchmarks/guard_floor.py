"""How far the static-shape guard is from the cheapest sound check (issue 21, item 3).

The guard (``cudagraph_plugin/runtime/guard.py``) checks every micro-batch of every
replayed step: a changed shape or dtype must never reach a captured graph. No check can be
sound without reading each tensor's shape and dtype, so that read is the floor. This times,
in one process, per replayed step with one micro-batch (the example host's batch: tokens,
labels, loss mask, position ids as tensors, no attention mask):

* ``draw``: drawing the micro-batch from a bare iterator (what the host pays without the
  guard);
* ``floor``: the draw plus reading ``shape`` and ``dtype`` of every tensor and comparing them
  with the captured ones, inline, in C-level calls where Python has them;
* ``guard``: the draw through the guard, as the plugin's remembered replay does it
  (``ShapeGuard.check_replay`` and the checked iterator).

``guard - floor`` is what the guard's bookkeeping costs beyond the read itself. Hot-loop
figures (``timeit``, best of the repeats): a step of a real run is colder and costs more.

    python benchmarks/guard_floor.py [--json out.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import operator
import platform
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CALL = {"num_microbatches": 1, "seq_length": 512, "micro_batch_size": 2, "forward_only": False}


def micro_batch(device: str) -> dict[str, Any]:
    import torch

    tokens = torch.zeros(2, 512, dtype=torch.long, device=device)
    return {
        "tokens": tokens,
        "labels": torch.zeros_like(tokens),
        "loss_mask": torch.ones(2, 512, device=device),
        "attention_mask": None,
        "position_ids": torch.zeros_like(tokens),
    }


def armed_guard(batch: dict[str, Any]) -> Any:
    """A guard whose training reference is ``batch``, recorded as at a capture."""
    from cudagraph_plugin.runtime.guard import ShapeGuard

    guard = ShapeGuard()
    kwargs = {**CALL, "data_iterator": iter([batch])}
    next(guard.check_call("training", 3, kwargs, record=True))
    guard.commit("training")
    return guard


def measure(device: str = "cpu", number: int = 20000, repeats: int = 7) -> dict[str, Any]:
    """Microseconds per replayed step for ``draw``, ``floor`` and ``guard``."""
    batch = micro_batch(device)
    guard = armed_guard(batch)
    kwargs = {**CALL, "data_iterator": None}
    present = tuple(value is not None for value in batch.values())
    read = operator.attrgetter("shape", "dtype")
    keys = tuple(batch)
    captured = tuple(map(read, itertools.compress(batch.values(), present)))

    def draw() -> None:
        next(iter((batch,)))

    def floor() -> None:
        drawn = next(iter((batch,)))
        if tuple(drawn) != keys or (
            tuple(map(read, itertools.compress(drawn.values(), present))) != captured
        ):
            raise AssertionError("the floor's check failed on the captured batch")

    def guarded() -> None:
        kwargs["data_iterator"] = iter((batch,))
        next(guard.check_replay(kwargs))

    result: dict[str, Any] = {"device": device, "number": number, "repeats": repeats}
    for name, func in (("draw", draw), ("floor", floor), ("guard", guarded)):
        func()  # a failing check raises here, before anything is timed
        best = min(timeit.repeat(func, number=number, repeat=repeats))
        result[f"{name}_us"] = best / number * 1e6
    result["guard_minus_floor_us"] = result["guard_us"] - result["floor_us"]
    result["floor_minus_draw_us"] = result["floor_us"] - result["draw_us"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="where the tensors live (cpu, cuda)")
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    import torch

    result = measure(args.device, args.number, args.repeats)
    result.update(
        python=platform.python_version(),
        torch=torch.__version__,
        machine=platform.processor() or platform.machine(),
    )
    for name in ("draw", "floor", "guard"):
        print(f"{name:6s} {result[name + '_us']:7.3f} µs per replayed step")
    print(
        f"guard - floor {result['guard_minus_floor_us']:.3f} µs; "
        f"floor - draw {result['floor_minus_draw_us']:.3f} µs"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
