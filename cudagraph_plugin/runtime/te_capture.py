"""The per-layer (TE) capture at the post-warmup step, with the DDP forward pre-hooks.

With the distributed optimizer and ``overlap_param_gather``, DDP's forward pre-hooks
all-gather parameters; a capture must not record them, so they are disabled
(``param_sync=False``) around ``create_cudagraphs()`` and enabled again, and then
megatron-core's manual hooks are set (graph replays fire no module hook). A host that keeps
the pre-hooks off at the capture step (Megatron-LM does for its first step, warm-up 0) gets
the manual hooks when it enables them: through ``run.enable_forward_pre_hook()`` or, found
on the next forward/backward, directly.
"""

from __future__ import annotations

import logging

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.release import release_each, settle
from cudagraph_plugin.runtime.state import RunState
from hookspecs import call_hook

logger = logging.getLogger("cudagraph_plugin")


class TECapture:
    def __init__(self, state: RunState, captures: Captures) -> None:
        self.state = state
        self.captures = captures
        self.manual_hooks_pending = False
        self.graphs_freed = 0  # by undoing a capture that raised

    def capture(self, step: int) -> None:
        state = self.state
        te = state.te
        assert te is not None  # built in mcgraph_model_built
        if te.capture_done():
            raise RuntimeError(f"TE CUDA graphs were already captured before step {step}")
        if not state.te_layers_anywhere:
            # no rank has a layer to capture (accepted eager, said at the model build): every
            # rank skips alike (0.16's helper would fail on an empty capture)
            logger.info("TE CUDA graphs: no graphable layer on any rank; nothing captured")
            return
        uses_hooks = compat.uses_forward_pre_hooks(state.model)
        toggle = uses_hooks and compat.forward_pre_hooks_enabled(state.model)
        if toggle:
            call_hook(
                state.pm, "mcgraph_disable_forward_pre_hook", model=state.model, param_sync=False
            )
        try:
            self.captures.bracket("training", te.create)
        except BaseException as error:
            # Undone now, not at shutdown: a host that carries on (retries the step) would
            # otherwise run with megatron-core's capture flag set (every TE layer capturing,
            # DDP's hooks skipped) or with graphs the layers replay without manual hooks.
            undone = release_each(te.undo_steps())
            self.graphs_freed += undone.graphs_freed
            logger.warning(
                "the TE capture at step %s raised (%r): megatron-core's capture flag cleared, "
                "%d graph(s) the layers held freed",
                step,
                error,
                undone.graphs_freed,
            )
            settle(undone.failures, error)
            raise
        finally:
            if toggle:
                call_hook(state.pm, "mcgraph_enable_forward_pre_hook", model=state.model)
        if toggle:
            te.set_manual_hooks()
        elif uses_hooks:
            # The host keeps the pre-hooks off for now (Megatron-LM does for its first step);
            # the manual hooks are set when it enables them (mcgraph_enable_forward_pre_hook).
            self.manual_hooks_pending = True

    def pre_hooks_enabled(self, why: str) -> None:
        """The host enabled the pre-hooks: set the manual hooks if a capture awaits them."""
        if self.manual_hooks_pending:
            self._set_pending_manual_hooks(why)

    def check_host_enabled_pre_hooks(self) -> None:
        """Before a forward/backward: the host may have enabled the pre-hooks directly."""
        if self.manual_hooks_pending and compat.forward_pre_hooks_enabled(self.state.model):
            self._set_pending_manual_hooks("forward pre-hooks found enabled by the host")

    def _set_pending_manual_hooks(self, why: str) -> None:
        assert self.state.te is not None
        self.manual_hooks_pending = False
        self.state.te.set_manual_hooks()
        logger.info("%s: set the CUDA graph manual hooks", why)

    def forget_manual_hooks(self) -> None:
        self.manual_hooks_pending = False
