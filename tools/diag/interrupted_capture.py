"""What ``CUDAGraph.reset()`` does to a capture that an exception interrupted (one GPU).

    python tools/diag/interrupted_capture.py

``BucketGraphs._capture`` resets a graph whose capture was interrupted (a Ctrl-C or a
peer's ``PeerFailed`` inside ``torch.cuda.graph``, or in the barrier right after it). Three
cases on a real device, each into its own pool, each printing the memory the pool held before
and after the reset, and whether a new capture and replay into a fresh graph then work:

* ``inside``: the exception inside the ``with torch.cuda.graph(...)`` block (its
  ``__exit__`` still ends the capture);
* ``after``: the capture completed, the exception right after it (the barrier);
* ``invalidated``: a forbidden call inside the capture (a host read, ``.item()``), so that
  ``capture_end`` itself fails and replaces the exception.

Exit status 0 when every reset returned without an error and the later capture replayed
the right numbers. The memory columns are indicative only: ``torch.cuda.graph`` collects
garbage and empties the cache on entry, which moves the reserved figure by itself.

Run on one H200 (torch 2.11.0+cu130, 2026-12-02): every reset returned without an error
in all three cases, and each later capture replayed the eager numbers bit for bit; in the
``invalidated`` case ``capture_end`` replaced the exception ("operation failed due to a
previous error during capture", its context the forbidden read's error).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch


class Interrupted(BaseException):
    pass


def allocated_mib() -> str:
    """Allocated / reserved MiB (a graph's private pool shows in the reserved memory)."""
    torch.cuda.synchronize()
    return f"{torch.cuda.memory_allocated() / 2**20:.0f}/{torch.cuda.memory_reserved() / 2**20:.0f}"


def work(x: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(8):
        y = torch.relu(y @ x + 1.0)  # 64 MiB intermediates: the pool's share shows
    return y


def capture(kind: str, graph: torch.cuda.CUDAGraph, x: torch.Tensor, stream: Any) -> Any:
    """The interrupted capture; keeps no output (a live output holds its pool blocks)."""
    try:
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
            out = work(x)
            if kind == "inside":
                raise Interrupted("inside the capture")
            if kind == "invalidated":
                out.sum().item()
            del out
        if kind == "after":
            raise Interrupted("after the capture")
    except BaseException as exc:
        for link in (exc, exc.__context__):
            if link is not None:
                link.__traceback__ = None  # its frames would hold the capture's tensors
        return exc
    return None


def case(kind: str) -> bool:
    x = torch.randn(4096, 4096, device="cuda") / 64
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work(x)  # warm-up on the side stream, as a capture wants
    torch.cuda.current_stream().wait_stream(stream)
    gc.collect()
    before = allocated_mib()
    graph = torch.cuda.CUDAGraph()
    error = capture(kind, graph, x, stream)
    gc.collect()
    held = allocated_mib()
    try:
        graph.reset()
        reset = "reset ok"
    except Exception as exc:
        reset = f"reset raised {type(exc).__name__}: {exc}"
    after = allocated_mib()
    fresh = torch.cuda.CUDAGraph()
    with torch.cuda.graph(fresh, stream=stream):
        again = work(x)
    fresh.replay()
    same = bool(torch.equal(again, work(x)))
    context = (
        f" (context: {type(error.__context__).__name__})" if error and error.__context__ else ""
    )
    print(
        f"{kind:12s} {type(error).__name__ if error else None}: "
        f"{str(error).splitlines()[0] if error else ''}{context}\n"
        f"{'':12s} allocated/reserved MiB: before {before}, with the interrupted graph {held}, "
        f"after its reset {after}; {reset}; a new capture replays right: {same}",
        flush=True,
    )
    del again
    fresh.reset()
    return reset == "reset ok" and same


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    results = [case(kind) for kind in ("inside", "after", "invalidated")]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
