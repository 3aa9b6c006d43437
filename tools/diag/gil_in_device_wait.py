"""Which device waits hold the GIL? (issue 22's diagnosis, one GPU)

    python tools/diag/gil_in_device_wait.py

For each way of reading a CUDA scalar behind a ~3 s kernel (``torch.cuda._sleep``), a
Python thread ticks every 10 ms; the longest gap between its ticks during the read says
whether the reading thread held the GIL while it waited (gap ~3 s) or not (gap ~10 ms).
"""

import threading
import time

import torch

ticks: list[float] = []
stop = threading.Event()


def tick() -> None:
    while not stop.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.01)


def cycles_for(seconds: float) -> int:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds * 1000 / start.elapsed_time(end))


READS = {
    "item": lambda t: t.item(),
    "float": lambda t: float(t),
    "tensor_of_list": lambda t: torch.tensor([[t]]),  # megatron-core's local l2-norm fallback
    "cpu": lambda t: t.cpu(),
    "synchronize": lambda t: torch.cuda.synchronize(),
}
cycles = cycles_for(3.0)
thread = threading.Thread(target=tick, daemon=True)
thread.start()
for name, read in READS.items():
    value = torch.ones((), device="cuda")
    torch.cuda._sleep(cycles)
    value = value * 2
    ticks.clear()
    began = time.monotonic()
    read(value)
    took = time.monotonic() - began
    seen = [t for t in ticks if t >= began]
    gaps = [b - a for a, b in zip([began, *seen], [*seen, time.monotonic()], strict=True)]
    print(
        f"{name:15s} read took {took:5.2f} s; longest tick gap {max(gaps):5.2f} s "
        f"-> {'HOLDS the GIL' if max(gaps) > 0.5 else 'releases the GIL'}",
        flush=True,
    )
stop.set()
