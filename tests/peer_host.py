"""One rank of the multi-rank CPU jobs of ``test_peer_failure_cpu.py`` and
``test_cross_rank_decisions_cpu.py``, over gloo, launched by torchrun (or by ``--launch``).

This module owns what those jobs run:

* ``run`` (the default): a ``TrainingRun`` with one gloo all-reduce per step and the peer
  watch wired as the CUDA graph plugin is to wire it (:class:`Wiring`). Faults are injected
  per rank: a raise, a refused configuration (printed as the example hosts print it) or a
  SIGTERM at a step, a rank that blocks at a step in a wait only its
  abort ends (:class:`DeviceStandIn`, standing in for a CUDA synchronisation behind an NCCL
  collective that can never complete), a slow shutdown, a rank that finishes late, a rank
  that swallows the ``PeerFailed`` and then blocks for good (only the exit deadline,
  ``--exit-deadline``, ends it), a rank whose loop leaves early (``--leave``: an
  ``early_exit``, no failure) and keeps its process and process group for a while. Each
  rank writes ``rank<N>.json`` into ``--out`` at the end of its shutdown (a rank that
  swallowed it, when it swallows it).
* ``decisions``: the cross-rank decisions, each rank in turn holding the verdict: the real
  ``cudagraph_plugin.compat.any_rank`` and the real peer watch over the job's store. Each
  rank writes ``decisions<N>.json``.
* ``--launch N``: start N ranks without torchrun (``MASTER_ADDR``/``MASTER_PORT``), so rank
  0's process hosts the job's store and takes it with it when it exits.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hookspecs import ConfigurationError, hookimpl

BLOCK_S = 600
"""The stand-in device wait's own timeout: far past any job's, so that only the abort ends
it in time."""

REFUSAL = (
    "CUDA graphs were asked for but rank {rank} refused step {step}. Fix: "
    + "every problem is listed with its fix; " * 20
    + "the end of the refusal"
)
"""A refusal longer than a failure's reason (``MAX_REASON_CHARS``): printed whole, once (by
the refusing rank), and marked whole for the told ranks' ``PeerRefused``."""


def _pairs(values: list[str]) -> dict[int, str]:
    """``RANK:VALUE`` arguments as a dict."""
    pairs = {}
    for value in values:
        rank, _, rest = value.partition(":")
        pairs[int(rank)] = rest
    return pairs


class DeviceStandIn:
    """A wait that neither a signal nor a peer's exit ends, only this rank's abort: a C++
    wait with the GIL released, on a store of this process (a gloo collective would end
    when the failed peer's process exits, which an NCCL one does not)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._store = dist.HashStore()

    def wait(self) -> None:
        self._store.wait(["released"], datetime.timedelta(seconds=BLOCK_S))

    def release(self) -> None:
        self._store.set("released", "1")


class Wiring:
    """The peer watch wired as the CUDA graph plugin is to wire it: started once the
    process groups exist, ended first thing at shutdown, the peers waited for last."""

    def __init__(self, args: argparse.Namespace, rank: int, record: dict[str, Any]) -> None:
        self.args = args
        self.rank = rank
        self.record = record
        self.device = DeviceStandIn()
        self.watch: Any = None
        self.progress: Any = None  # the run's StepProgress (what the plugin reads)

    def abort(self) -> None:
        import torch.distributed as dist

        from cudagraph_plugin.compat import abort_process_groups

        abort_process_groups()
        self.record["process_group_after_abort"] = dist.is_initialized()
        self.device.release()

    @hookimpl
    def mcgraph_train_start(self, start_step: int, train_iters: int, progress: Any) -> None:
        self.progress = progress
        from cudagraph_plugin.runtime.peers import PeerWatch

        self.watch = PeerWatch.start(
            poll_s=self.args.poll_s,
            abort=self.abort,
            exit_deadline_s=self.args.exit_deadline,
            current_step=lambda: self.progress.step,
        )

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        self.record["t_shutdown"] = time.time()
        self.record["reason"] = str(reason)
        self.record["exception_type"] = type(exception).__name__ if exception else None
        self.record["exception"] = str(exception) if exception else None
        context = exception.__context__ if exception else None
        self.record["exception_context"] = str(context) if context else None
        try:
            if self.watch is not None:  # (what the watcher read, before end() reads it too)
                early = self.watch._early.record if self.watch._early else None
                self.record["early_end_seen"] = early and {"rank": early.rank, "step": early.step}
                self.watch.end(reason, exception)
            return (yield)
        finally:
            if self.watch is not None:
                self.record["settled"] = self.watch.finish()  # as the plugin's JobWatch does
                self.record["peers_ended"] = self.watch.wait_for_peers()
                failure = self.watch.peer_failure
                first = self.watch.first_failure
                self.record["peer_failure"] = failure and {
                    "rank": failure.rank,
                    "reason": failure.reason,
                }
                self.record["first_failure"] = first and {
                    "rank": first.rank,
                    "reason": first.reason,
                }
            self.record["t_end"] = time.time()
            _write(self.args.out / f"rank{self.rank}.json", self.record)


class SlowShutdown:
    """An inner shutdown implementation that takes a while (freeing graphs, say): a watch
    that reacted to a mark during it would raise into it."""

    def __init__(self, seconds: float, record: dict[str, Any]) -> None:
        self.seconds = seconds
        self.record = record

    @hookimpl
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> None:
        time.sleep(self.seconds)
        self.record["inner_shutdown_done"] = True


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _init() -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=BLOCK_S))
    return dist.get_rank(), dist.get_world_size()


def _end_distributed(reason: Any) -> None:
    """The example hosts' teardown: abort after an abnormal end, else destroy."""
    import torch.distributed as dist

    if reason is not None and reason.abnormal and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    from hookspecs import PeerRefused, print_refusal

    try:
        return train(args)
    except (ConfigurationError, PeerRefused) as refused:  # as the example hosts do
        return print_refusal(refused)


def block(
    args: argparse.Namespace, rank: int, device: DeviceStandIn, record: dict[str, Any]
) -> None:
    """Wait in the stand-in device wait (``--block``), recorded; with ``--swallow``, a host's
    ``except BaseException`` around it, then a wait nothing ends."""
    record["t_block"] = time.time()
    try:
        device.wait()
    except BaseException as exc:
        if rank not in args.swallow:
            raise
        record["swallowed"] = type(exc).__name__
        _write(args.out / f"rank{rank}.json", record)
        DeviceStandIn().wait()
    record["t_unblocked"] = time.time()


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from hookspecs import TrainingRun, get_plugin_manager

    rank, world_size = _init()
    record: dict[str, Any] = {"rank": rank, "world_size": world_size, "pid": os.getpid()}
    fails, blocks, lingers = _pairs(args.fail), _pairs(args.block), _pairs(args.linger)
    leaves = {rank: step.split(":") for rank, step in _pairs(args.leave).items()}
    pm = get_plugin_manager(load_entrypoints=False)
    wiring = Wiring(args, rank, record)
    pm.register(wiring)
    if args.slow_shutdown:
        pm.register(SlowShutdown(args.slow_shutdown, record))
    training = TrainingRun(pm, config=args, train_iters=args.steps)
    try:
        with training:
            for step in range(args.steps):
                if rank in leaves and step > int(leaves[rank][0]):
                    record["t_fault"] = time.time()
                    break  # this rank's own loop ends early; its process group lives on
                with training.train_step(step):
                    if blocks.get(rank) == f"{step}:first":  # (standing in for the all-reduce)
                        block(args, rank, wiring.device, record)
                    dist.all_reduce(torch.ones(1))
                    record["last_step"] = step
                    if fails.get(rank, "").startswith(f"{step}:"):
                        kind = fails[rank].split(":")[1]
                        record["t_fault"] = time.time()
                        if kind == "sigterm":
                            os.kill(os.getpid(), signal.SIGTERM)
                        if kind == "refuse":  # as the plugin's checks of the capture step do
                            raise ConfigurationError(REFUSAL.format(rank=rank, step=step))
                        raise RuntimeError(f"injected failure at step {step} on rank {rank}")
                    if blocks.get(rank) == str(step):
                        block(args, rank, wiring.device, record)
                    last = int(leaves[rank][0]) if rank in leaves else args.steps - 1
                    if step == last and rank in lingers:
                        time.sleep(float(lingers[rank]))
        if rank in leaves:
            time.sleep(float(leaves[rank][1]))  # (after its run ended: the store stays up)
    finally:
        _end_distributed(training.shutdown_reason)
    return 0


def decisions(args: argparse.Namespace) -> int:
    """Every cross-rank decision, with the verdict on one rank at a time."""
    import torch.distributed as dist

    from cudagraph_plugin import compat
    from cudagraph_plugin.runtime.peers import PeerWatch
    from cudagraph_plugin.runtime.wiring import te_layers_across_ranks

    rank, world_size = _init()
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "any_rank": {}, "watch": {}}
    for holder in [*range(world_size), None]:
        out["any_rank"][str(holder)] = compat.any_rank(rank == holder)
    # TE scopes: the holder's pipeline stage has no graphable layer ("all": no stage has)
    out["te_layers"] = {
        str(holder): te_layers_across_ranks(0 if holder in (rank, "all") else 3)
        for holder in [*range(world_size), None, "all"]
    }
    for holder in range(world_size):
        aborted: list[float] = []
        watch = PeerWatch.start(
            poll_s=0.1, abort=lambda seen=aborted: seen.append(1), interrupt=False
        )
        assert watch is not None
        dist.barrier()
        if rank == holder:
            watch.end("exception", RuntimeError(f"verdict of rank {holder}"))
        else:
            deadline = time.monotonic() + 30
            while watch.peer_failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            watch.end("peer_failed" if watch.peer_failure else "completed")
        seen = watch.peer_failure
        out["watch"][str(holder)] = {
            "seen_rank": seen.rank if seen else None,
            "seen_reason": seen.reason if seen else None,
            "aborted": len(aborted),
        }
        dist.barrier()
    _write(args.out / f"decisions{rank}.json", out)
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port-0 bind lands in that range,
    and so do the connections and stores of the jobs running beside this one, so one of them
    could take such a port before rank 0 binds it (seen: rank 0's store failed with
    EADDRINUSE in a clean-clone run)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # (no luck below the range: the kernel's choice)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nproc: int, argv: list[str]) -> int:
    """N ranks without torchrun: rank 0 hosts the store (env:// rendezvous)."""
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    codes = [proc.wait() for proc in procs]
    print(f"launch: exit codes {codes}", flush=True)
    return next((code for code in codes if code != 0), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("run", "decisions"), default="run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument(
        "--fail", action="append", default=[], help="RANK:STEP:raise|sigterm|refuse"
    )
    parser.add_argument(
        "--block",
        action="append",
        default=[],
        help="RANK:STEP (after the step's all-reduce) or RANK:STEP:first (instead of it)",
    )
    parser.add_argument(
        "--linger", action="append", default=[], help="RANK:SECONDS in its last step"
    )
    parser.add_argument(
        "--leave",
        action="append",
        default=[],
        help="RANK:STEP:SECONDS: that rank's loop ends after STEP (early_exit); the process "
        "then waits SECONDS before its teardown",
    )
    parser.add_argument("--slow-shutdown", type=float, default=0.0)
    parser.add_argument("--swallow", type=int, action="append", default=[], help="RANK")
    parser.add_argument("--exit-deadline", type=float, default=None, help="SECONDS")
    parser.add_argument("--launch", type=int, default=0, help="start N ranks (no torchrun)")
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.launch:
        rest = [a for i, a in enumerate(raw) if a != "--launch" and raw[i - 1] != "--launch"]
        return launch(args.launch, rest)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # jobs.run_job's dump on timeout
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s",
    )
    return decisions(args) if args.mode == "decisions" else run(args)


if __name__ == "__main__":
    sys.exit(main())
