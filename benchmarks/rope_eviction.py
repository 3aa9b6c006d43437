"""What the bucket graphs' hold on megatron-core's cached rotary tables is worth, on a GPU.

A RoPE model's bucket graph reads its length's rotary table from megatron-core's cache
(``RotaryEmbedding.forward``, ``lru_cache(maxsize=32)``); replays never touch the cache,
and rollouts at many lengths evict the table. This runs ``examples/rl_loop.py`` three
times, each in its own process: eager (``--pad-to-buckets``), graphed, and graphed with
the hold turned off (``--without-hold``: the plugin before it kept the tables). It prints
each run's largest relative loss difference from the eager run and whether any loss is
not finite; ``--json`` writes the same.

    python benchmarks/rope_eviction.py [--json FILE] [rl_loop.py arguments]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOP = [
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
    "--vocab-size", "1024", "--seq-length", "512", "--min-length", "32",
    "--micro-batch-size", "2", "--train-iters", "60", "--steps-per-round", "5",
    "--rollout-batches", "40", "--log-interval", "0", "--cuda-graph-warmup-steps", "2",
    "--pad-to-buckets", "128,256,512", "--bf16", "--position-embedding-type", "rope",
]  # fmt: skip
GRAPHS = [
    "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
    "--cuda-graph-buckets", "128,256,512",
]  # fmt: skip
RUNS = {"eager": [], "graphed": GRAPHS, "graphed-without-hold": [*GRAPHS, "--without-hold"]}


def one_run(argv: list[str]) -> None:
    """In this process: the loop's losses as one JSON line on stdout."""
    sys.path[:0] = [str(ROOT / "examples")]
    if "--without-hold" in argv:
        argv = [a for a in argv if a != "--without-hold"]
        from cudagraph_plugin.compat import buckets

        buckets.cached_forward_outputs = lambda model, into: contextlib.nullcontext()
    import rl_loop

    summary = rl_loop.run(argv)
    print("LOSSES " + json.dumps(summary["losses"]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.one:
        one_run(rest)
        return 0
    losses: dict[str, list[float] | None] = {}
    for name, extra in RUNS.items():
        command = [sys.executable, __file__, "--one", *LOOP, *rest, *extra]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("LOSSES ")]
        losses[name] = json.loads(lines[-1][7:]) if lines else None
        if losses[name] is None:
            print(f"{name}: rc {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
    eager = losses["eager"]
    results = {}
    for name, mine in losses.items():
        if mine is None or eager is None:
            results[name] = {"completed": False}
            continue
        worst = max(abs(a - b) / abs(b) for a, b in zip(mine, eager, strict=True))
        finite = all(math.isfinite(x) for x in mine)
        results[name] = {"completed": True, "max_rel_diff": worst, "all_finite": finite}
        print(f"{name:22s} max relative loss difference {worst:.3g}, all finite: {finite}")
    if args.json:
        args.json.write_text(json.dumps({"argv": LOOP + rest, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
