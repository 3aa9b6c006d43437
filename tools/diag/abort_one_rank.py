"""One rank over real NCCL: does the plugin's abort of megatron-core's process groups end
once the CUDA graph that captured a collective is freed? (issue 22)

    torchrun --standalone --nproc-per-node 1 tools/diag/abort_one_rank.py [--keep-graph]

What ``PeerWatch`` relies on, on one GPU (a collective that never completes needs two; that
is ``abort_unblocks.py stuck``): megatron-core's process groups are made, a CUDA graph
captures an all-reduce on its data-parallel group and is replayed; then
``compat.begin_abort_process_groups()`` starts the abort of every group, each from its own
thread, as the watcher does. After 2 s it prints which aborts are still running (NCCL's
teardown of a communicator waits for every graph that captured it), frees the graph (what
the peer-failed shutdown does; skipped with ``--keep-graph``) and waits with
``compat.abort_process_groups(timeout_s=10)``, as ``PeerWatch.finish`` does. Prints one
JSON line: the groups, the aborts alive before and after the free, the seconds each step
took, and whether torch still has a process group.

Run on one H200 on 2026-12-02 (torch 2.11.0+cu130, NCCL 2.28.9, megatron-core 0.19.2; raw
output in ``benchmarks/results/abort-2026-12-02/``): all 24 of megatron-core's groups were
aborted in 4-9 ms and forgotten, with and without the free. But at one rank torch leaves a
one-rank all-reduce out of the graph ("The CUDA Graph is empty"), so the graph holds no
communicator and the wait on it cannot show here: that part needs two GPUs
(``abort_unblocks.py``, BENCHMARKS.md section 1.1).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from graphed_all_reduce import graphed_all_reduce

from cudagraph_plugin import compat

keep_graph = "--keep-graph" in sys.argv
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
from megatron.core import parallel_state  # noqa: E402

parallel_state.initialize_model_parallel()
group = parallel_state.get_data_parallel_group()
graph = graphed_all_reduce(group)

names = dict(dist.distributed_c10d._world.pg_names)
facts: dict = {"groups": len(names), "keep_graph": keep_graph}
start = time.monotonic()
compat.begin_abort_process_groups()
facts["begin_s"] = round(time.monotonic() - start, 3)
running = compat.device._abort_in_flight
time.sleep(2.0)


def alive() -> list[str]:
    groups = list(names)
    return [names[groups[i]] for i, thread in enumerate(running.threads) if thread.is_alive()]


facts["alive_after_2s"] = alive()
if not keep_graph:
    freed = time.monotonic()
    graph.reset()
    facts["reset_s"] = round(time.monotonic() - freed, 3)
waited = time.monotonic()
facts["ended"] = compat.abort_process_groups(timeout_s=10.0)
facts["wait_s"] = round(time.monotonic() - waited, 3)
facts["alive_at_end"] = alive()
facts["process_group_initialized"] = dist.is_initialized()
facts["versions"] = {
    "torch": torch.__version__,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())),
}
print("ABORT_ONE_RANK " + json.dumps(facts), flush=True)
os._exit(0)
