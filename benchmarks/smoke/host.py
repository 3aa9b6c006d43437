"""The smoke jobs' host: ``train_gpt.run`` plus fault injection from environment variables.

``MCG_RAISE=<step>:<rank|all>`` raises at the end of that step, ``MCG_SIGTERM=<step>:<rank>``
sends SIGTERM to itself, ``MCG_FAIL_CAPTURE=<rank|all>`` raises before the capture, and
``MCG_NO_BUILD_STREAM=1`` builds DDP on the default stream (the cause of issue 11, on purpose).
The CUDA graph plugin is registered directly where the project is not installed (the device).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import sys
import time

sys.path.insert(0, "examples")

import train_gpt
from cudagraph_plugin import compat
from cudagraph_plugin import entry as cudagraph_entry
from hookspecs import hookimpl

RANK = int(os.environ.get("RANK", "0"))


def _at(var: str) -> tuple[int, str] | None:
    value = os.environ.get(var)
    if not value:
        return None
    step, rank = value.split(":")
    return int(step), rank


class Faults:
    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        fault = _at("MCG_RAISE")
        if fault and step == fault[0] and fault[1] in ("all", str(RANK)):
            raise RuntimeError(f"injected failure on rank {RANK} at step {step}")
        fault = _at("MCG_SIGTERM")
        if fault and step == fault[0] and fault[1] in ("all", str(RANK)):
            os.kill(os.getpid(), signal.SIGTERM)

    @hookimpl
    def mcgraph_before_capture(self, step, impl, scope):
        if os.environ.get("MCG_FAIL_CAPTURE") in ("all", str(RANK)):
            raise RuntimeError(f"injected capture failure on rank {RANK}")


def main() -> None:
    if os.environ.get("MCG_NO_BUILD_STREAM"):
        compat.DDPBuildContext.needs_stream = property(lambda self: False)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s r{RANK} %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("megatron.core.distributed", "megatron.core.optimizer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    installed = {ep.name for ep in importlib.metadata.entry_points(group="mcgraph")}
    plugins = [Faults()] if "cudagraph" in installed else [cudagraph_entry, Faults()]
    start = time.time()
    summary = train_gpt.run(sys.argv[1:], plugins=plugins)
    losses = [round(x, 4) for x in summary["losses"]]
    print(
        f"SUMMARY rank={RANK} steps={summary['steps']} losses={losses} "
        f"reason={summary['shutdown_reason']} wall={time.time() - start:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
