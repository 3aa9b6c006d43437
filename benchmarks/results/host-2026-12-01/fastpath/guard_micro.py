"""The guard's check of one micro-batch (5 keys: four tensors and None), warm and with the
caches swept between calls (BENCHMARKS.md 2f). From the project root, on the CPU::

    .venv/bin/python benchmarks/results/host-2026-12-01/fastpath/guard_micro.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch

from cudagraph_plugin.runtime.guard import ShapeGuard

batch = {k: torch.zeros(2, 512, dtype=torch.int64) for k in ("tokens", "labels", "position_ids")}
batch["loss_mask"] = torch.zeros(2, 512)
batch["attention_mask"] = None
guard = ShapeGuard()
call = {"num_microbatches": 1, "seq_length": 512, "micro_batch_size": 2}
next(guard.check_call("training", 0, {**call, "data_iterator": iter([batch])}, record=True))
guard.commit("training")
sweep = bytearray(64 << 20)


def median_us(cold: bool, calls: int = 2000) -> float:
    spent = []
    for _ in range(calls):
        if cold:  # write every page, then read 32 MiB: caches and TLBs hold other data
            sweep[::4096] = bytes(len(sweep[::4096]))
            bytes(sweep[: 32 << 20])
        kwargs = {**call, "data_iterator": iter([batch])}
        start = time.perf_counter_ns()
        next(guard.check_call("training", 1, kwargs, record=False))
        spent.append(time.perf_counter_ns() - start)
    return statistics.median(spent) / 1000


print(f"guard check per call: warm {median_us(False):.1f} us, swept {median_us(True):.1f} us")
