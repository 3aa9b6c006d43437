"""Recording plugins shared by the lifecycle tests (CPU) and the GPU tests."""

from __future__ import annotations

from typing import Any

from cudagraph_plugin.entry import RUN_PLUGIN_NAME
from hookspecs import hookimpl


class Recorder:
    """Records the hooks of interest, the capture events and the run report."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.report: Any = None
        self.graph_plugin: Any = None

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    @hookimpl
    def mcgraph_train_step_start(self, step):
        self.events.append(("step", step))

    @hookimpl
    def mcgraph_post_warmup_step(self, step, start_step):
        self.events.append(("post_warmup", step, start_step))

    @hookimpl
    def mcgraph_before_capture(self, step, impl, scope):
        self.events.append(("before_capture", step, impl, tuple(scope)))

    @hookimpl
    def mcgraph_after_capture(self, step, impl, scope, seconds, graph_count):
        self.events.append(("after_capture", step, graph_count))

    @hookimpl(wrapper=True)
    def mcgraph_disable_forward_pre_hook(self, model, param_sync):
        self.events.append(("disable_pre_hook", param_sync))
        return (yield)

    @hookimpl(wrapper=True)
    def mcgraph_enable_forward_pre_hook(self, model):
        self.events.append(("enable_pre_hook",))
        return (yield)

    @hookimpl
    def mcgraph_report(self, report):
        self.report = report
        self.graph_plugin = self.pm.get_plugin(RUN_PLUGIN_NAME)
        self.events.append(("report",))

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.events.append(("shutdown", str(reason)))

    def names(self) -> list[str]:
        return [event[0] for event in self.events]


class RaiseAt:
    def __init__(self, step: int, exc: BaseException) -> None:
        self.step, self.exc = step, exc

    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        if step == self.step:
            raise self.exc


class InvalidateAt:
    """The host's ``run.invalidate_graphs(reason)`` between two steps (after a checkpoint
    load or an offload's reload): ``mcgraph_invalidate_graphs`` once per reason, at the
    start or the end of ``step``."""

    def __init__(
        self, step: int, *, at: str = "end", reasons: tuple[str, ...] = ("checkpoint loaded",)
    ) -> None:
        self.step, self.at, self.reasons = step, at, reasons
        self.pm: Any = None

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    def _tell(self, step: int, when: str) -> None:
        if step == self.step and when == self.at:
            for reason in self.reasons:
                self.pm.hook.mcgraph_invalidate_graphs(reason=reason)

    @hookimpl
    def mcgraph_train_step_start(self, step):
        self._tell(step, "start")

    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        self._tell(step, "end")


# The example host's flags the CPU lifecycle tests combine.
FULL = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
TE = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp", "--bf16"]
OVERLAP = ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"]


def run_recorded(*argv: str, plugins: Any = (), steps: int = 8) -> tuple[dict[str, Any], Recorder]:
    """One run of the example loop (``train_gpt.run``) for ``steps`` steps, no log lines, with
    a :class:`Recorder` registered first: its summary and the recorder."""
    import train_gpt

    recorder = Recorder()
    summary = train_gpt.run(
        ["--train-iters", str(steps), "--log-interval", "0", *argv],
        plugins=[recorder, *plugins],
    )
    return summary, recorder
