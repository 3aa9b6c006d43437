"""One rank of a multi-rank job on the CPU, run under torchrun: ``examples/train_gpt.py`` or
``examples/rl_loop.py`` with the given arguments, with the fake CUDA graph capture of
``tests/fakes.py`` (``graphs``: the capture records the real aten ops and gloo collectives
and replays them) or without it (``eager``). Rank 0 writes the run's summary as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fake_graph_job.py \\
        OUT.json {train_gpt|rl_loop} {graphs|eager} -- [the loop's arguments]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE)]


def main(argv: list[str]) -> int:
    out, loop, mode, dashes, *args = argv
    if mode not in ("graphs", "eager") or loop not in ("train_gpt", "rl_loop") or dashes != "--":
        raise SystemExit(__doc__)
    if mode == "graphs":
        import pytest

        from fakes import install_fake_cuda_graphs

        install_fake_cuda_graphs(pytest.MonkeyPatch())  # (the process ends with the job)
    module = __import__(loop)
    summary = module.run(args)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
