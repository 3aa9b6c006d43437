"""CPU stand-in of the plugin's host time (BENCHMARKS.md 2e).

``plugin_host_time.measure`` on the fake capture of ``tests/fakes.py``, a 1-layer/16-hidden
model, 120 steps. On the CPU, ``examples/cpu_redirect.py``'s TorchFunctionMode is active,
which slows tensor attribute reads such as the guard's. From the project root::

    BD=0 .venv/bin/python benchmarks/results/host-2026-12-01/cpu_standin.py full_iteration 3
    BD=1 ...   # with --breakdown's nested timers
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / p) for p in ("tests", "benchmarks", ".", "examples")]

import plugin_host_time  # noqa: E402
import pytest  # noqa: E402

from fakes import install_fake_cuda_graphs  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "full_iteration"
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
breakdown = os.environ.get("BD", "0") == "1"
results = []
for _ in range(repeats):
    with pytest.MonkeyPatch.context() as patch:
        install_fake_cuda_graphs(patch)
        patch.setattr(plugin_host_time, "SIZE", plugin_host_time.gpu_modes.Size("t", 1, 16, 2))
        args = argparse.Namespace(steps=120, warmup=2, cpu=True, breakdown=breakdown)
        results.append(plugin_host_time.measure(mode, args))
for piece in plugin_host_time.PIECES:
    print(piece, [round(r["us_per_step"][piece] or 0, 1) for r in results])
totals = [round(r["total_us_per_step"], 1) for r in results]
untimed = [round(r["untimed_steps"]["total_us_per_step"] or 0, 1) for r in results]
print("total", totals, "untimed", untimed)
if breakdown:
    print("own", [round(r["plugin_code_us_per_step"], 1) for r in results])
