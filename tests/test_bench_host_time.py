"""benchmarks/plugin_host_time.py on the fake capture: its instrumentation must time the
plugin as it runs, not change what the plugin does.

Its first version handed the plugin a new timed stand-in of the host's forward/backward
function on every call; the plugin keys megatron-core's wrapper by that function, so it
built a new ``FullCudaGraphWrapper`` (with a new CUDA stream) on every step and the
benchmark counted that as the plugin's host time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cpu_only import needs_mcore_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import plugin_host_time

pytestmark = needs_mcore_on_cpu


def test_the_instrumented_run_builds_one_wrapper_and_reports_each_piece(fake_graphs, monkeypatch):
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    built = []
    init, call = FullCudaGraphWrapper.__init__, FullCudaGraphWrapper.__call__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(FullCudaGraphWrapper, "__init__", counting_init)
    monkeypatch.setattr(plugin_host_time, "SIZE", plugin_host_time.gpu_modes.Size("t", 1, 16, 2))
    args = argparse.Namespace(steps=8, warmup=2, cpu=True)
    result = plugin_host_time.measure("full_iteration", args)
    assert len(built) == 1
    assert result["capture_step"] == 2 and result["steady_steps"] == 5
    pieces = result["us_per_step"]
    assert pieces["hooks"] > 0 and pieces["forward_backward"] > 0 and pieces["guard"] > 0
    assert pieces["optimizer"] == 0  # no optimizer graph in this mode
    # the plugin's step hooks are timed inside the dispatch, so part of it
    assert 0 < pieces["plugin_hooks"] < pieces["hooks"]
    assert result["plugin_code_us_per_step"] < result["total_us_per_step"]
    assert FullCudaGraphWrapper.__call__ is call  # the benchmark's patches are undone
