"""The CUDA graph both abort diagnostics start from: one all-reduce, warmed up on a side
stream, captured and replayed once (``abort_unblocks.py``, ``abort_one_rank.py``)."""

import torch
import torch.distributed as dist


def graphed_all_reduce(group=None) -> torch.cuda.CUDAGraph:
    """Capture an all-reduce of a 4 MiB tensor on ``group`` (the default group if None),
    replay it once and wait for the device; return the graph, alive."""
    x = torch.ones(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x, group=group)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x, group=group)
    graph.replay()
    torch.cuda.synchronize()
    return graph
