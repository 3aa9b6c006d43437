"""The skip marker for tests that run megatron-core on the CPU (``examples/cpu_redirect``).

Those tests are the CPU suite CI runs. In an environment where megatron-core picked fused
GPU kernels (Transformer Engine or Apex installed, e.g. the GPU machine), a CPU run cannot
work (:func:`cpu_redirect.cpu_run_blocker` says why) and they are skipped with that reason;
there the GPU tests (``tests/test_gpu.py``) cover the same paths on the device.
"""

from __future__ import annotations

import pytest

from cpu_redirect import cpu_run_blocker

CPU_RUN_BLOCKER = cpu_run_blocker()

needs_mcore_on_cpu = pytest.mark.skipif(
    CPU_RUN_BLOCKER is not None, reason=f"CPU test: {CPU_RUN_BLOCKER}"
)
