"""The probe: a test plugin that records what each rank of a launched training job did, and
injects faults on request.

Installed the way real plugins are: ``mcgraph_probe-0.dist-info/entry_points.txt`` beside
this module declares it (``probe``) in the ``mcgraph`` entry-point group, and the tests put
this folder on ``PYTHONPATH`` only for the jobs they launch (``tests/train_jobs.py``). It
does nothing unless one of its variables is set.

Environment contract (``R`` is the ``RANK`` variable, 0 without torchrun):

``MCGRAPH_PROBE_DIR=<dir>``
    Each rank writes ``<dir>/rank<R>.json`` when its run shuts down, on every exit path
    (completed, early exit, exception, signal), and again at interpreter exit with
    ``at_exit`` added (not after a death by signal). The record holds: ``rank``,
    ``world_size``, ``pid``, ``argv``; ``plugins`` (registered plugin names) and
    ``distributions`` (plugin name -> distribution it came from); ``events``, the hooks in
    call order (``train_start``, ``step``, ``post_warmup``, ``step_end``,
    ``disable_pre_hook``/``enable_pre_hook``, ``evaluation_start``/``evaluation_end``,
    ``before_capture``/``after_capture``, ``fault``, ``report``, ``shutdown``);
    ``shutdown_reason`` and ``exception``; ``report`` (the run report's ``to_dict()``);
    ``loss_steps`` and ``losses`` (floats; ``None`` unless the run completed or exited
    early: reading a device loss synchronises, and on an error path that can block on a dead
    peer); ``eval_losses``; ``memory`` (the probe's own allocator readings, MiB: just before
    the capture and when the record is written, after the graphs were freed);
    ``graph_plugin`` (the CUDA graph plugin's cleanup facts, see :func:`graph_plugin_facts`);
    ``at_exit`` (``process_group_initialized``); ``fault_at``, ``shutdown_at`` and
    ``recorded_at`` (wall-clock seconds since the epoch: the injected fault, the start of
    the shutdown hook, the record written; ``None`` when it did not happen).
``MCGRAPH_PROBE_RAISE=<step>:<rank>``
    Raise ``RuntimeError`` at the end of training step ``<step>`` on rank ``<rank>``
    (``all`` for every rank).
``MCGRAPH_PROBE_SIGTERM=<step>:<rank>``
    Send SIGTERM to this process at the end of that step, on that rank.
``MCGRAPH_PROBE_SIGINT=<step>:<rank>``
    Send SIGINT to this process at the end of that step, on that rank (``all``: what
    torchrun does with a Ctrl-C, which it passes on to every worker).
``MCGRAPH_PROBE_SIGKILL=<step>:<rank>``
    Write the record (the fault in it, no shutdown) and SIGKILL this process at the end of
    that step, on that rank: a rank that dies without a word (the OOM killer, a lost node),
    marking nothing for its peers.
``MCGRAPH_PROBE_EXIT=<step>:<rank>``
    Raise ``SystemExit(0)`` at the end of that step, on that rank: a loop that ends early
    on one rank only (``sys.exit(0)``, a ``break`` on a condition only that rank sees); its
    run ends ``early_exit`` and the process exits 0, while the other ranks go on.
``MCGRAPH_PROBE_REFUSE=<step>:<rank>``
    Raise ``hookspecs.ConfigurationError`` at the end of that step, on that rank, as a
    plugin's check of that step refuses the run (the CUDA graph plugin's "asked for graphs,
    got none", reached by one rank first): the other ranks are told with ``PeerRefused``.
``MCGRAPH_PROBE_RAISE_SEEDING=<rank>|all``
    Raise ``RuntimeError`` in ``mcgraph_rng_options`` on that rank: a failure of the host's
    set-up after its process group exists and before any hook starts the CUDA graph
    plugin's peer watch.
``MCGRAPH_PROBE_SCALE_LR=<step>:<factor>[:fill]``
    At the start of training step ``<step>`` (every rank), write each param group's
    learning rate back multiplied by ``<factor>`` as a Python float, as many custom loops
    do (``for g in optimizer.param_groups: g["lr"] = new_lr``); with ``:fill``, a tensor
    learning rate is filled in place instead (what an eager capturable Adam needs).
``MCGRAPH_PROBE_PLAIN_FWD_BWD=1``
    The host gets its plain ``forward_backward_func`` back from
    ``run.forward_backward_func()`` (a ``tryfirst`` wrapper returns what it was given), as a
    loop that never routes it through the run would use it.
``MCGRAPH_PROBE_DUMP_EVERY=<seconds>``
    A diagnosis aid: every rank writes the stacks of all its threads to stderr every
    ``<seconds>`` from its configure on (``faulthandler.dump_traceback_later``), to see
    where a rank that does not end is waiting.
``MCGRAPH_PROBE_FAIL_CAPTURE=<rank>|all``
    A capture that fails on that rank: by default ``mcgraph_before_capture`` raises;
    with ``MCGRAPH_PROBE_FAIL_CAPTURE_AT=inside`` a forward pre-hook on every module raises
    while the current stream is capturing, i.e. midway through the capture.

The record is written after the CUDA graph plugin has freed the graphs: the per-run probe is
registered from a ``trylast`` ``mcgraph_configure``, after the CUDA graph plugin registered
its per-run plugin, so the probe's ``tryfirst`` shutdown wrapper is the outermost one.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hookspecs import hookimpl

DIR_VAR = "MCGRAPH_PROBE_DIR"
RAISE_VAR = "MCGRAPH_PROBE_RAISE"
RAISE_SEEDING_VAR = "MCGRAPH_PROBE_RAISE_SEEDING"
SIGTERM_VAR = "MCGRAPH_PROBE_SIGTERM"
SIGINT_VAR = "MCGRAPH_PROBE_SIGINT"
SIGKILL_VAR = "MCGRAPH_PROBE_SIGKILL"
REFUSE_VAR = "MCGRAPH_PROBE_REFUSE"
EXIT_VAR = "MCGRAPH_PROBE_EXIT"
FAIL_CAPTURE_VAR = "MCGRAPH_PROBE_FAIL_CAPTURE"
FAIL_CAPTURE_AT_VAR = "MCGRAPH_PROBE_FAIL_CAPTURE_AT"
SCALE_LR_VAR = "MCGRAPH_PROBE_SCALE_LR"
PLAIN_VAR = "MCGRAPH_PROBE_PLAIN_FWD_BWD"
DUMP_EVERY_VAR = "MCGRAPH_PROBE_DUMP_EVERY"
PROBE_VARS = (
    DIR_VAR,
    RAISE_VAR,
    RAISE_SEEDING_VAR,
    SIGTERM_VAR,
    SIGINT_VAR,
    SIGKILL_VAR,
    REFUSE_VAR,
    EXIT_VAR,
    FAIL_CAPTURE_VAR,
    SCALE_LR_VAR,
    PLAIN_VAR,
)
RUN_NAME = "mcgraph-probe-run"
MIB = 1024 * 1024
# Losses are read from the device only for these reasons (see the module docstring).
LOSS_REASONS = ("completed", "early_exit")


def graph_plugin_facts(pluginmanager: Any) -> dict[str, Any] | None:
    """The CUDA graph plugin's cleanup facts, ``None`` where it is not registered.

    The only place in the probe that reads the plugin's internals (its capture records,
    ``plugin.capture``, and release facts): an attribute it cannot find is ``None``.
    """
    try:
        from cudagraph_plugin.entry import RUN_PLUGIN_NAME
    except ImportError:
        return None
    plugin = pluginmanager.get_plugin(RUN_PLUGIN_NAME)
    if plugin is None:
        return None
    capture = getattr(plugin, "capture", None)
    before = getattr(capture, "memory_before", None)
    captures = getattr(capture, "records", None)
    return {
        "graphs_freed": getattr(plugin, "graphs_freed", None),
        "allocated_after_free_mib": getattr(plugin, "allocated_after_free_mib", None),
        "memory_before": (
            dataclasses.asdict(before)
            if dataclasses.is_dataclass(before) and not isinstance(before, type)
            else None
        ),
        "captures": [dict(capture) for capture in captures] if captures is not None else None,
    }


def parse_step_rank(value: str, var: str) -> tuple[int, str]:
    """``"<step>:<rank>"`` -> ``(step, rank)``; the rank is a number or ``all``."""
    step, sep, rank = value.partition(":")
    if not sep or not step.strip().isdigit() or not _is_rank(rank.strip()):
        raise ValueError(f"{var}={value!r}: expected <step>:<rank>, e.g. 6:1 or 6:all")
    return int(step), rank.strip()


def _step_rank(environ: Any, var: str) -> tuple[int, str] | None:
    value = environ.get(var)
    return parse_step_rank(value, var) if value else None


def _step_factor(value: str | None) -> tuple[int, float, bool] | None:
    """``"<step>:<factor>[:fill]"`` -> ``(step, factor, fill)``."""
    if not value:
        return None
    step, _, rest = value.partition(":")
    factor, _, mode = rest.partition(":")
    try:
        if mode not in ("", "fill"):
            raise ValueError(mode)
        return int(step), float(factor), mode == "fill"
    except ValueError:
        raise ValueError(
            f"{SCALE_LR_VAR}={value!r}: expected <step>:<factor>, e.g. 10:0.1"
        ) from None


def _is_rank(rank: str) -> bool:
    return rank == "all" or rank.isdigit()


def _applies(rank_spec: str | None, rank: int) -> bool:
    return rank_spec is not None and (rank_spec == "all" or int(rank_spec) == rank)


def _allocated_mib() -> float | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.memory_allocated() / MIB


def _floats(values: list[Any]) -> list[float]:
    import torch

    if values and all(isinstance(v, torch.Tensor) for v in values):
        # One device-to-host copy for all of them.
        return torch.stack([v.detach().float().reshape(()) for v in values]).tolist()
    return [float(v) for v in values]


class Probe:
    """One run's probe (registered per run, like the CUDA graph plugin's run plugin)."""

    def __init__(self, pluginmanager: Any, environ: dict[str, str] | os._Environ[str]) -> None:
        self.pm = pluginmanager
        self.rank = int(environ.get("RANK", "0"))
        probe_dir = environ.get(DIR_VAR)
        self.path = Path(probe_dir) / f"rank{self.rank}.json" if probe_dir else None
        self.raise_at = _step_rank(environ, RAISE_VAR)
        raise_seeding = environ.get(RAISE_SEEDING_VAR) or None
        if raise_seeding is not None and not _is_rank(raise_seeding):
            raise ValueError(f"{RAISE_SEEDING_VAR}={raise_seeding!r}: expected a rank or all")
        self.raise_seeding = _applies(raise_seeding, self.rank)
        self.sigterm_at = _step_rank(environ, SIGTERM_VAR)
        self.sigint_at = _step_rank(environ, SIGINT_VAR)
        self.sigkill_at = _step_rank(environ, SIGKILL_VAR)
        self.refuse_at = _step_rank(environ, REFUSE_VAR)
        self.exit_at = _step_rank(environ, EXIT_VAR)
        self.scale_lr = _step_factor(environ.get(SCALE_LR_VAR))
        self.plain_fwd_bwd = environ.get(PLAIN_VAR) == "1"
        self.optimizer: Any = None
        fail_capture = environ.get(FAIL_CAPTURE_VAR) or None
        if fail_capture is not None and not _is_rank(fail_capture):
            raise ValueError(f"{FAIL_CAPTURE_VAR}={fail_capture!r}: expected a rank or all")
        self.fail_capture_at = environ.get(FAIL_CAPTURE_AT_VAR, "before")
        if self.fail_capture_at not in ("before", "inside"):
            raise ValueError(f"{FAIL_CAPTURE_AT_VAR}={self.fail_capture_at!r}: before or inside")
        self.fail_capture = _applies(fail_capture, self.rank)
        self.capturing = False
        self.events: list[list[Any]] = []
        self.loss_steps: list[int] = []
        self.loss_values: list[Any] = []
        self.eval_losses: list[Any] = []
        self.memory: dict[str, float | None] = {"before_capture_mib": None, "at_record_mib": None}
        self.record: dict[str, Any] = {
            "rank": self.rank,
            "world_size": int(environ.get("WORLD_SIZE", "1")),
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "shutdown_reason": None,
            "exception": None,
            "report": None,
            "events": self.events,
            "fault_at": None,
            "shutdown_at": None,
            "recorded_at": None,
        }

    # -- hooks ---------------------------------------------------------------------------

    @hookimpl
    def mcgraph_rng_options(self, config: Any) -> None:
        if self.raise_seeding:
            self.events.append(["fault", "raise_seeding"])
            self.record["fault_at"] = time.time()
            raise RuntimeError(f"mcgraph probe: injected failure in seeding on rank {self.rank}")

    @hookimpl
    def mcgraph_model_built(
        self,
        model: list[Any],
        optimizer: Any,
        model_config: Any,
        seq_length: int,
        micro_batch_size: int,
    ) -> None:
        self.optimizer = optimizer
        if self.fail_capture and self.fail_capture_at == "inside":
            for chunk in model:
                for module in chunk.modules():
                    module.register_forward_pre_hook(self._fail_while_capturing)

    def _fail_while_capturing(self, module: Any, args: Any) -> None:
        import torch

        if self.capturing and torch.cuda.is_current_stream_capturing():
            self.events.append(["fault", "fail_inside_capture", type(module).__name__])
            self.record["fault_at"] = time.time()
            raise RuntimeError(
                f"mcgraph probe: injected failure inside the CUDA graph capture on rank "
                f"{self.rank} ({type(module).__name__})"
            )

    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_forward_backward_func(self, forward_backward_func: Any) -> Any:
        wrapped = yield
        return forward_backward_func if self.plain_fwd_bwd else wrapped

    @hookimpl
    def mcgraph_train_start(self, start_step: int, train_iters: int) -> None:
        self.events.append(["train_start", start_step, train_iters])

    @hookimpl
    def mcgraph_train_step_start(self, step: int) -> None:
        self.events.append(["step", step])
        if self.scale_lr is not None and self.scale_lr[0] == step and self.optimizer is not None:
            _, factor, fill = self.scale_lr
            for group in self.optimizer.param_groups:
                if fill and hasattr(group["lr"], "fill_"):
                    group["lr"].fill_(float(group["lr"]) * factor)
                else:
                    group["lr"] = float(group["lr"]) * factor  # a Python float, as loops do
            self.events.append(["scale_lr", step, factor])

    @hookimpl
    def mcgraph_post_warmup_step(self, step: int, start_step: int) -> None:
        self.events.append(["post_warmup", step, start_step])

    @hookimpl
    def mcgraph_train_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.events.append(["step_end", step])
        if metrics.get("loss") is not None:
            loss = metrics["loss"]
            self.loss_steps.append(step)
            self.loss_values.append(loss.detach() if hasattr(loss, "detach") else loss)
        if self.raise_at is not None and self._due(self.raise_at, step):
            self.events.append(["fault", "raise", step])
            self.record["fault_at"] = time.time()
            raise RuntimeError(
                f"mcgraph probe: injected failure at step {step} on rank {self.rank}"
            )
        if self.sigterm_at is not None and self._due(self.sigterm_at, step):
            self.events.append(["fault", "sigterm", step])
            self.record["fault_at"] = time.time()
            os.kill(os.getpid(), signal.SIGTERM)
        if self.sigint_at is not None and self._due(self.sigint_at, step):
            self.events.append(["fault", "sigint", step])
            self.record["fault_at"] = time.time()
            os.kill(os.getpid(), signal.SIGINT)
        if self.sigkill_at is not None and self._due(self.sigkill_at, step):
            self.events.append(["fault", "sigkill", step])
            self.record["fault_at"] = time.time()
            self.write()  # (nothing runs after the kill)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.exit_at is not None and self._due(self.exit_at, step):
            self.events.append(["fault", "exit", step])
            self.record["fault_at"] = time.time()
            raise SystemExit(0)
        if self.refuse_at is not None and self._due(self.refuse_at, step):
            from hookspecs import ConfigurationError

            self.events.append(["fault", "refuse", step])
            self.record["fault_at"] = time.time()
            raise ConfigurationError(
                f"mcgraph probe: rank {self.rank} refuses the run at step {step}. Fix: unset "
                f"{REFUSE_VAR}"
            )

    def _due(self, spec: tuple[int, str], step: int) -> bool:
        return spec[0] == step and _applies(spec[1], self.rank)

    @hookimpl(wrapper=True)
    def mcgraph_disable_forward_pre_hook(self, model: list[Any], param_sync: bool) -> Any:
        self.events.append(["disable_pre_hook", param_sync])
        return (yield)

    @hookimpl(wrapper=True)
    def mcgraph_enable_forward_pre_hook(self, model: list[Any]) -> Any:
        self.events.append(["enable_pre_hook"])
        return (yield)

    @hookimpl
    def mcgraph_evaluation_start(self, step: int) -> None:
        self.events.append(["evaluation_start", step])

    @hookimpl
    def mcgraph_evaluation_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.events.append(["evaluation_end", step])
        if metrics.get("loss") is not None:
            self.eval_losses.append(metrics["loss"])

    @hookimpl
    def mcgraph_before_capture(self, step: int, impl: str, scope: list[str]) -> None:
        self.events.append(["before_capture", step, impl, list(scope)])
        if self.memory["before_capture_mib"] is None:
            self.memory["before_capture_mib"] = _allocated_mib()
        if self.fail_capture and self.fail_capture_at == "before":
            self.events.append(["fault", "fail_capture", step])
            self.record["fault_at"] = time.time()
            raise RuntimeError(f"mcgraph probe: injected capture failure on rank {self.rank}")
        self.capturing = True

    @hookimpl
    def mcgraph_after_capture(
        self, step: int, impl: str, scope: list[str], seconds: float, graph_count: int
    ) -> None:
        self.capturing = False
        self.events.append(["after_capture", step, graph_count])

    @hookimpl
    def mcgraph_report(self, report: Any) -> None:
        self.events.append(["report"])
        try:
            self.record["report"] = report.to_dict()
        except Exception as exc:  # the record must still be written
            self.record["report"] = {"error": repr(exc)}

    # Outermost (see the module docstring): the record is written after every other
    # shutdown implementation ran, the CUDA graph plugin's cleanup included.
    @hookimpl(wrapper=True, tryfirst=True)
    def mcgraph_shutdown(self, reason: Any, exception: BaseException | None) -> Any:
        self.capturing = False
        self.record["shutdown_at"] = time.time()
        try:
            return (yield)
        finally:
            self.events.append(["shutdown", str(reason)])
            self.record["shutdown_reason"] = str(reason)
            self.record["exception"] = repr(exception) if exception is not None else None
            self._fill(read_losses=str(reason) in LOSS_REASONS)
            self.record["recorded_at"] = time.time()
            self.write()

    # -- the record ----------------------------------------------------------------------

    def _fill(self, read_losses: bool) -> None:
        record = self.record
        record["plugins"] = [name for name, _ in self.pm.list_name_plugin()]
        record["distributions"] = {
            self.pm.get_name(plugin): dist.metadata["Name"]
            for plugin, dist in self.pm.list_plugin_distinfo()
        }
        record["loss_steps"] = list(self.loss_steps)
        record["losses"] = None
        if read_losses:
            try:
                record["losses"] = _floats(self.loss_values)
            except Exception as exc:
                record["losses_error"] = repr(exc)
        record["eval_losses"] = [float(v) for v in self.eval_losses]
        self.memory["at_record_mib"] = _allocated_mib()
        record["memory"] = dict(self.memory)
        try:
            record["graph_plugin"] = graph_plugin_facts(self.pm)
        except Exception as exc:
            record["graph_plugin"] = {"error": repr(exc)}

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "w") as out:
            json.dump(self.record, out, indent=1, default=repr)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)

    def at_exit(self) -> None:
        """Interpreter exit: add whether a process group is still initialised."""
        dist = sys.modules.get("torch.distributed")
        initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
        self.record["at_exit"] = {"process_group_initialized": initialized}
        if "plugins" not in self.record:  # the run never shut down (a failed configure)
            self._fill(read_losses=False)
        self.write()


def _install_exit_hooks(probe: Probe) -> None:
    atexit.register(probe.at_exit)
    # A launcher that times a job out sends SIGUSR1 first: the stacks show where it hung.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


@hookimpl(trylast=True)
def mcgraph_configure(config: Any, pluginmanager: Any) -> None:
    if not any(os.environ.get(var) for var in PROBE_VARS):
        return
    if os.environ.get(DUMP_EVERY_VAR):
        faulthandler.dump_traceback_later(float(os.environ[DUMP_EVERY_VAR]), repeat=True)
    probe = Probe(pluginmanager, os.environ)
    pluginmanager.register(probe, name=RUN_NAME)
    if probe.path is not None:
        _install_exit_hooks(probe)
