"""What the host's loop must do for the graphs it asked for, checked as the run goes.

A run that asked for CUDA graphs must never end up eager without a word: several
Megatron-Core-based trainers accept the CUDA-graph flags and then capture nothing, because
nothing drives the capture. So, on a CUDA device with graphs on:

* training starts only after ``run.model_built()`` (the build checks and the TE helper;
  checked without a device too, as are the build checks that need none:
  :func:`~cudagraph_plugin.runtime.build.rehearse_model_checks`);
* a full-iteration capture needs the DDP forward pre-hooks on where the model uses them
  (else the captured iteration has no parameter all-gather and every replay trains on
  stale shards), and their all-gather due: one a forward-only call already did is made due
  again (:func:`compat.rearm_param_gather`);
* by the end of the capture step every requested graph exists: the TE helper found
  graphable layers, the forward/backward came from ``run.forward_backward_func()`` and ran,
  ``optimizer.step`` went through the optimizer graph.

A missing piece is a :class:`CudaGraphWiringError` naming it and its fix, unless the
configuration accepts eager explicitly (``cuda_graph_accept_eager``): then one warning.
"""

from __future__ import annotations

import logging

from cudagraph_plugin import compat
from cudagraph_plugin.runtime.capture import Captures
from cudagraph_plugin.runtime.state import Phase, RunState
from hookspecs import ConfigurationError

logger = logging.getLogger("cudagraph_plugin")

ACCEPT_EAGER = (
    "or set cuda_graph_accept_eager (--cuda-graph-accept-eager) to run eagerly on purpose"
)


class CudaGraphWiringError(ConfigurationError, RuntimeError):
    """The host's loop does not drive the CUDA graphs it asked for; names what is missing
    and the fix. A :class:`~hookspecs.ConfigurationError` (the run cannot work as set up),
    and a ``RuntimeError``."""


def te_layers_across_ranks(layer_count: int) -> tuple[bool, bool]:
    """(some rank has graphable layers, some rank has none): one all-reduce, the same
    answer on every rank."""
    empty, layers = compat.max_across_ranks([int(layer_count == 0), int(layer_count > 0)])
    return bool(layers), bool(empty)


class Wiring:
    def __init__(self, state: RunState, captures: Captures) -> None:
        self.state = state
        self.captures = captures
        self.warned = False
        self.optimizer_due = -1
        """Past the capture step: the step at whose end the optimizer graph must exist (its
        warm-up started over when the bucket graphs it is tied to were invalidated)."""

    def buckets_invalidated(self, step: int | None, reason: str, freed: int) -> None:
        """The bucket graphs, and the optimizer graph tied to them, were freed
        (``BucketGraphs.on_invalidate``). Before the optimizer graph's first capture its
        warm-up starts over: it is due ``warmup_steps`` calls later, a step more when the
        host invalidated between two steps (``step``: the last one that began)."""
        state = self.state
        if not state.optimizer_graph or step is None or "optimizer" in self._stages():
            return
        self.optimizer_due = step + state.settings.warmup_steps + 1

    @property
    def expects_graphs(self) -> bool:
        return self.state.active or self.state.optimizer_graph

    def training_starts(self) -> None:
        # (without a device too: a loop wired on a laptop learns it there)
        asked = self.expects_graphs or self.state.settings.enabled
        if asked and self.state.phase is Phase.CONFIGURED:
            raise CudaGraphWiringError(
                "training started before run.model_built(): the CUDA graph plugin has not "
                "checked the model or set up its graphs. Fix: call run.model_built(model=..., "
                "optimizer=..., model_config=..., seq_length=..., micro_batch_size=...) after "
                "building DDP and the optimizer, before the first run.train_step()"
            )

    def full_iteration_capture(self, stage: str) -> None:
        """Before a full-iteration capture of ``stage``."""
        model = self.state.model
        if (
            stage == "training"
            and model is not None
            and compat.uses_forward_pre_hooks(model)
            and not compat.forward_pre_hooks_enabled(model)
        ):
            raise CudaGraphWiringError(
                f"the full-iteration capture at step {self.state.step} would run with the DDP "
                "forward pre-hooks disabled: the captured iteration would not all-gather the "
                "parameters, and every replay would train on stale shards. Fix: enable them "
                "(run.enable_forward_pre_hook(model)) before the capture step, e.g. after the "
                "first step as Megatron-LM does, or raise cuda_graph_warmup_steps past the "
                "step at which the host enables them"
            )
        rearmed = compat.rearm_param_gather(model) if model is not None else 0
        if rearmed:
            logger.info(
                "full-iteration %s capture at step %s: the DDP parameter all-gather of %d "
                "bucket group(s) was already done (a forward-only call since the last "
                "training iteration: an evaluation, a rollout); made due again so that the "
                "graph records it (else every replay would run on stale shards)",
                stage,
                self.state.step,
                rearmed,
            )

    def te_layers_found(self, layer_count: int, skips_empty_stage: bool) -> None:
        """After the TE helper was built on every rank: decided over the whole job, as a
        pipeline stage may have no layer of the scope (a Mamba stage under ``attn``, the
        dense first layers under ``moe_router``) while the others have."""
        anywhere, empty_somewhere = te_layers_across_ranks(layer_count)
        self.state.te_layers_anywhere = anywhere
        scope = ",".join(self.state.settings.scope)
        if not anywhere:
            self._nothing(
                f"no layer of the model is graphable for scope {scope} on any rank "
                '(megatron-core: "No graphable layers found"): the TE helper would capture '
                "nothing",
                "choose scopes the model has (attn,mlp for a dense GPT; mamba only for Mamba "
                "layers; moe_router,moe_preprocess for MoE), build the layers from Transformer "
                "Engine modules (--transformer-impl transformer_engine)",
            )
            return
        if empty_somewhere and not skips_empty_stage:
            raise CudaGraphWiringError(
                f"a pipeline stage has no layer graphable for scope {scope} (this rank: "
                f"{layer_count}), and this megatron-core's TECudaGraphHelper cannot capture "
                "on such a stage (it hands Transformer Engine no layer; 0.19's skips the "
                "stage). Fix: choose scopes every stage has, or a megatron-core whose helper "
                "skips such a stage (0.19); cuda_graph_impl=none runs eagerly"
            )
        if layer_count == 0:
            logger.info(
                "TE CUDA graphs: this rank's model chunks have no layer graphable for scope "
                "%s; megatron-core captures none here, the other pipeline stages' are captured",
                scope,
            )

    def _stages(self) -> set[str]:
        return {record["stage"] for record in self.captures.records}

    def capture_step_ended(self, step: int) -> None:
        """At the end of the step that had to capture: every requested graph exists."""
        state = self.state
        if state.phase is Phase.FALLEN_BACK:
            return  # the graphs were freed for the rest of the run (the host's word), said then
        if step == self.optimizer_due:
            self._optimizer_captured(step, self._stages())
        if state.start_step is None or step - state.start_step != state.settings.warmup_steps:
            return
        stages = self._stages()
        # (bucketed graphs are captured each after its own warm-up, whatever the step, but
        # every training call goes through their routing)
        if state.buckets is not None and not state.buckets.stats:
            self._nothing(
                f"the capture step {step} ended without a training call through the CUDA "
                "graph buckets: the training forward_backward_func did not come from "
                "run.forward_backward_func(), or was not called",
                "call the function run.forward_backward_func(get_forward_backward_func()) "
                "returns, once per training step",
            )
        if state.full_iteration_mode and state.buckets is None and "training" not in stages:
            self._nothing(
                f"the capture step {step} ended without a full-iteration capture: the training "
                "forward_backward_func did not come from run.forward_backward_func(), or was "
                "not called during the step",
                "call the function run.forward_backward_func(get_forward_backward_func()) "
                "returns, once per training step",
            )
        # (what the capture made: the host may have invalidated it since, in its step end;
        # a pipeline stage without a layer of the scope makes none, said at the build)
        if (
            state.te_mode
            and state.te is not None
            and state.te.layer_count()
            and not self.captures.made_graphs("training")
        ):
            failed = self.captures.failed
            if failed is not None and failed[0] == "training":
                # (the host carried on after the capture raised)
                problem = (
                    f"the TE capture at step {failed[1]} raised ({failed[2]}) and made no graph"
                )
                fix = "fix what made the capture fail (its traceback was raised at that step)"
            elif not state.post_warmup_fired:
                problem = (
                    f"the run's post-warmup step, where TE graphs are captured, did not come by "
                    f"step {step}: another plugin answered mcgraph_warmup_steps with None (or "
                    "more steps), or the host fired the step hooks without a TrainingRun"
                )
                fix = (
                    "let the CUDA graph plugin's warm-up answer stand (a wrapper returns it "
                    "unchanged), or fire mcgraph_post_warmup_step at the step it answers"
                )
            else:
                problem = f"the TE capture at step {step} produced no graph"
                fix = "check that the scope matches layers the model has"
            self._nothing(problem, fix)
        if self.optimizer_due < 0:
            self._optimizer_captured(step, stages)

    def _optimizer_captured(self, step: int, stages: set[str]) -> None:
        if self.state.optimizer_graph and "optimizer" not in stages:
            self._nothing(
                f"the capture step {step} ended without capturing the optimizer step: "
                "optimizer.step() was not called, or was called through a reference taken "
                "before run.model_built() installed the optimizer graph",
                "call optimizer.step() on the optimizer passed to run.model_built(), after it",
            )

    def _nothing(self, problem: str, fix: str) -> None:
        if not self.state.settings.accept_eager:
            raise CudaGraphWiringError(
                f"CUDA graphs were asked for but {problem}. Fix: {fix}; {ACCEPT_EAGER}"
            )
        if not self.warned:
            self.warned = True
            logger.warning(
                "CUDA graphs were asked for but %s; running eagerly as "
                "cuda_graph_accept_eager allows",
                problem,
            )
