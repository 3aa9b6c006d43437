"""When does aborting NCCL process groups return with CUDA graphs around? (issue 22)

    torchrun --standalone --nproc-per-node 2 tools/diag/abort_unblocks.py MODE

Every mode captures one all-reduce in a CUDA graph on both ranks and replays it once
together. Then, on rank 0, a thread aborts the process groups and the main thread reports
whether (and when) the abort returned, waiting at most 8 s:

* ``alive``: the graph is still alive and idle;
* ``reset``: ``graph.reset()`` before the abort;
* ``mcore``: as ``reset``, with megatron-core's process groups (``initialize_model_parallel``,
  gloo groups included) and the all-reduce on its data-parallel group;
* ``stuck``: rank 0 replays the graph again while rank 1 never does (a collective that
  cannot complete); the main thread waits on the device, then resets the graph.

NCCL's communicator teardown waits for every CUDA graph that references the communicator
to be destroyed (``persistentRefs``), so ``alive`` is expected to hang.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from graphed_all_reduce import graphed_all_reduce

mode = sys.argv[1]
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group = None
if mode == "mcore":
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    group = parallel_state.get_data_parallel_group()
graph = graphed_all_reduce(group)
dist.barrier()
torch.cuda.synchronize()
if rank == 1:
    time.sleep(20)
    os._exit(0)

start = time.monotonic()
returned = threading.Event()


def abort() -> None:
    dist.distributed_c10d._abort_process_group()
    returned.set()


def say(what: str) -> None:
    print(f"rank 0 [{mode}] {time.monotonic() - start:5.2f} s: {what}", flush=True)


if mode in ("reset", "mcore"):
    graph.reset()
    say("graph reset")
if mode == "stuck":
    graph.replay()
    threading.Timer(1.0, abort).start()
    torch.cuda.synchronize()
    say("synchronize returned")
    graph.reset()
    say("graph reset")
else:
    threading.Thread(target=abort, daemon=True).start()
say("abort returned" if returned.wait(8) else "abort did NOT return within 8 s")
if mode == "alive" and not returned.is_set():
    graph.reset()
    say("graph reset")
    say("abort returned" if returned.wait(8) else "abort still did NOT return")
os._exit(0)
