"""Hand-made mutants of the lifecycle guarantees, each with the CPU tests that must kill it.

Each mutant breaks one guarantee the plugin makes (DESIGN.md, "The lifecycle the plugin must
get right") by a small textual change to a copy of the repository; the named tests run on
that copy and must fail. The unmutated copy must pass them first. A mutant whose text is no
longer in the source fails the run: update its ``find`` with the code.

    python tools/mutation/handmade.py            # every mutant; exit 1 if one survives
    python tools/mutation/handmade.py --list     # the mutants and their killing tests
    python tools/mutation/handmade.py -k guard   # those whose id contains "guard"

docs/mutation-testing.md records the last run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIFECYCLE = "tests/test_plugin_lifecycle.py::"
FAST_PATH = "tests/test_replay_fast_path.py::"
BUCKETS = "tests/test_buckets.py::"
BUCKETS_PY = "cudagraph_plugin/runtime/buckets.py"
RL = "tests/test_rl_loop.py::"
STEPS = "tests/test_step_listener.py::"
GUARD = "tests/test_guard.py::"
PEERS = "tests/test_peer_failure_cpu.py::"
DEADLINE = "tests/test_peer_deadline.py::"
PARAM_GATHER = "tests/test_param_gather_cpu.py::"
CALLEE = "tests/test_guard_callee.py::"


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    breaks: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant(
        "manual-hooks-not-set",
        "after a TE capture the manual hooks are never set (pre-hooks in use)",
        "cudagraph_plugin/runtime/te_capture.py",
        "        if toggle:\n            te.set_manual_hooks()\n",
        "        if toggle:\n            pass\n",
        (
            LIFECYCLE + "test_te_replay_gets_the_param_all_gather_through_the_manual_hooks",
            LIFECYCLE + "test_te_replay_fires_no_module_hook_of_a_graphed_layer",
        ),
    ),
    Mutant(
        "pending-manual-hooks-not-set",
        "warm-up 0: the manual hooks are never set when the host enables the pre-hooks",
        "cudagraph_plugin/runtime/te_capture.py",
        "        self.manual_hooks_pending = False\n        self.state.te.set_manual_hooks()\n",
        "        self.manual_hooks_pending = False\n",
        (
            LIFECYCLE + "test_te_warmup_zero_sets_manual_hooks_when_the_host_enables_the_pre_hooks",
            "tests/test_plugin_failures.py::"
            "test_manual_hooks_are_set_when_the_host_enables_pre_hooks_itself",
        ),
    ),
    Mutant(
        "pre-hooks-not-disabled",
        "the DDP forward pre-hooks stay on while the TE graphs are captured",
        "cudagraph_plugin/runtime/te_capture.py",
        "        if toggle:\n            call_hook(\n"
        '                state.pm, "mcgraph_disable_forward_pre_hook"',
        "        if False:\n            call_hook(\n"
        '                state.pm, "mcgraph_disable_forward_pre_hook"',
        (LIFECYCLE + "test_te_pre_hooks_toggled_around_capture_then_manual_hooks",),
    ),
    Mutant(
        "capture-one-step-late",
        "the post-warmup step (the TE capture) fires one step after the warm-up",
        "hookspecs/run.py",
        "and step - self.start_step == self._warmup_steps\n",
        "and step - self.start_step == self._warmup_steps + 1\n",
        (
            LIFECYCLE + "test_te_captures_once_at_the_post_warmup_step",
            "tests/test_hookspecs_run.py::test_post_warmup_fires_once_relative_to_start_step",
        ),
    ),
    Mutant(
        "capture-counted-from-step-0",
        "the capture step is counted from step 0 instead of the start step (resume)",
        "hookspecs/run.py",
        "and step - self.start_step == self._warmup_steps\n",
        "and step == self._warmup_steps\n",
        (
            LIFECYCLE + "test_te_captures_once_at_the_post_warmup_step[3-6]",
            "tests/test_hookspecs_run.py::test_post_warmup_fires_once_relative_to_start_step",
        ),
    ),
    Mutant(
        "static-buffers-not-released",
        "shutdown keeps megatron-core's full-iteration static input buffers",
        "cudagraph_plugin/runtime/mechanisms.py",
        '            ReleaseStep("full-iteration static input buffers", '
        "compat.clear_static_buffers),\n",
        "",
        (LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held[full]",),
    ),
    Mutant(
        "te-graphs-not-released",
        "shutdown keeps the TE per-layer graphs",
        "cudagraph_plugin/runtime/mechanisms.py",
        '            ReleaseStep("TE per-layer graphs", self._free, frees_graphs=True),\n',
        "",
        (
            LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held[te]",
            LIFECYCLE + "test_graphs_are_freed_once_on_every_exit_path",
        ),
    ),
    Mutant(
        "model-kept-after-shutdown",
        "shutdown keeps its references to the model, its config and the forward/backward",
        "cudagraph_plugin/runtime/plugin.py",
        '        ReleaseStep("model and optimizer references", plugin._drop_references),\n',
        "",
        (LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held",),
    ),
    Mutant(
        "cublas-workspaces-kept",
        "shutdown keeps the cuBLAS workspaces the capture allocated",
        "cudagraph_plugin/runtime/release_plan.py",
        '            steps.append(ReleaseStep("cuBLAS workspaces", '
        "compat.clear_cublas_workspaces))\n",
        "            pass\n",
        (
            LIFECYCLE + "test_shutdown_releases_every_resource_the_run_held",
            LIFECYCLE + "test_te_captures_once_at_the_post_warmup_step",
        ),
    ),
    Mutant(
        "shutdown-fired-twice",
        "TrainingRun fires mcgraph_shutdown again when the run is left twice",
        "hookspecs/run.py",
        '(see signals)."""\n        if self.shutdown_reason is not None:\n',
        '(see signals)."""\n        if False:\n',
        (
            "tests/test_hookspecs_shutdown.py::test_shutdown_fires_once_even_if_exit_is_called_again",
        ),
    ),
    Mutant(
        "guard-skipped-after-full-capture",
        "full-iteration replays skip the static-shape guard (only the capture call is seen)",
        "cudagraph_plugin/runtime/interceptor.py",
        '        kwargs["data_iterator"] = self.guard.check_call(\n'
        "            stage, self.state.step, kwargs, record=capturing, copied=True, "
        "static_buffers=True\n        )\n",
        "        if capturing:\n"
        '            kwargs["data_iterator"] = self.guard.check_call(\n'
        "                stage, self.state.step, kwargs, record=capturing, copied=True, "
        "static_buffers=True\n"
        "            )\n",
        (
            FAST_PATH
            + "test_a_shape_change_is_refused_on_the_first_replay_and_on_remembered_ones"
            + "[first-replay]",
            LIFECYCLE + "test_microbatch_count_change_after_capture_raises",
        ),
    ),
    Mutant(
        "guard-skipped-on-remembered-replays",
        "full-iteration replays after the first (the interceptor's remembered path) skip the "
        "static-shape guard",
        "cudagraph_plugin/runtime/interceptor.py",
        '            kwargs["data_iterator"] = guard.check_replay(kwargs)\n',
        "            pass\n",
        (
            LIFECYCLE + "test_shape_change_after_capture_raises_instead_of_replaying[full]",
            FAST_PATH
            + "test_a_shape_change_is_refused_on_the_first_replay_and_on_remembered_ones"
            + "[many-replays-after-the-capture]",
        ),
    ),
    Mutant(
        "remembered-replay-outlives-megatron-cores-graph",
        "the interceptor's remembered replay is not tied to the graph megatron-core holds: a "
        "recapture after megatron-core dropped its graph runs unbracketed",
        "cudagraph_plugin/runtime/interceptor.py",
        '            and replay.graphs["training"] is replay.graph\n',
        "",
        (FAST_PATH + "test_a_graph_megatron_core_drops_is_forgotten_and_its_recapture_bracketed",),
    ),
    Mutant(
        "optimizer-replay-outlives-megatron-cores-graph",
        "the optimizer step's remembered replay is not tied to the graph megatron-core holds",
        "cudagraph_plugin/runtime/interceptor.py",
        "            if replay.holder.cuda_graph is replay.graph and sync is not None:\n",
        "            if sync is not None:\n",
        (
            FAST_PATH
            + "test_an_optimizer_graph_megatron_core_drops_is_forgotten_and_its_"
            + "recapture_bracketed",
        ),
    ),
    Mutant(
        "optimizer-replay-unchecked",
        "the optimizer step's remembered replays skip the param-group check (a host write "
        "after the first replay goes stale)",
        "cudagraph_plugin/runtime/interceptor.py",
        "                sync.before_replay()\n",
        "",
        (
            FAST_PATH
            + "test_a_hyperparameter_write_is_seen_before_any_optimizer_replay"
            + "[remembered-replay]",
        ),
    ),
    Mutant(
        "remembered-replay-survives-invalidation",
        "the interceptor's remembered replay ignores the phase, megatron-core's graph and the "
        "guard's reference: it outlives the host's invalidation",
        "cudagraph_plugin/runtime/interceptor.py",
        '            and replay.graphs["training"] is replay.graph\n'
        "            and interceptor.state.phase is Phase.CAPTURED\n"
        "            and guard.generation == replay.guard_generation\n",
        "",
        (
            FAST_PATH
            + "test_invalidation_after_replays_runs_the_plain_function_from_the_next_step[4]",
        ),
    ),
    Mutant(
        "guard-skipped-after-te-capture",
        "TE replays skip the static-shape guard (only the reference call is recorded)",
        "cudagraph_plugin/runtime/interceptor.py",
        '                kwargs["data_iterator"] = self.guard.check_call(\n'
        "                    stage, state.step, kwargs, record=record\n                )\n",
        "                if record:\n"
        '                    kwargs["data_iterator"] = self.guard.check_call(\n'
        "                        stage, state.step, kwargs, record=record\n"
        "                    )\n",
        (LIFECYCLE + "test_shape_change_after_capture_raises_instead_of_replaying[te]",),
    ),
    Mutant(
        "bucket-warmup-shared",
        "bucket graphs: one warm-up count for all buckets instead of each bucket's own",
        BUCKETS_PY,
        "        if self._calls[key] >= self.warmup_steps:\n",
        "        if sum(self._calls.values()) >= self.warmup_steps:\n",
        (
            BUCKETS + "test_each_bucket_is_captured_after_its_own_warmup_and_replayed_"
            "for_its_steps",
            RL + "test_each_bucket_replays_every_step_after_its_capture_and_trains_as_eager",
        ),
    ),
    Mutant(
        "bucket-buffers-shared",
        "bucket graphs: one list of static input buffers for every bucket",
        BUCKETS_PY,
        "self._buffers.setdefault((key.seq_length, key.micro_batch_size), [])",
        "self._buffers.setdefault(0, [])",
        (BUCKETS + "test_bucket_graphs_train_exactly_as_eager_with_the_same_padding",),
    ),
    Mutant(
        "bucket-outside-replays",
        "bucket graphs: a shape outside every bucket is warmed up and captured like a bucket",
        BUCKETS_PY,
        "        if key.seq_length not in self.buckets:\n            above = [",
        "        if False:\n            above = [",
        (
            BUCKETS + "test_a_shape_outside_every_bucket_runs_eagerly_with_one_log_line_per_"
            "new_shape",
            RL + "test_a_length_outside_every_bucket_runs_eagerly_with_one_log_line",
        ),
    ),
    Mutant(
        "bucket-outside-logged-every-step",
        "bucket graphs: a log line on every step of a shape outside the buckets",
        BUCKETS_PY,
        "        if what not in self._logged:\n",
        "        if True:\n",
        (
            BUCKETS + "test_a_shape_outside_every_bucket_runs_eagerly_with_one_log_line_per_"
            "new_shape",
        ),
    ),
    Mutant(
        "bucket-forward-only-graphed",
        "bucket graphs: forward-only calls are routed like training calls",
        BUCKETS_PY,
        '        if kwargs.get("forward_only"):\n',
        "        if False:\n",
        (BUCKETS + "test_forward_only_calls_run_eagerly",),
    ),
    Mutant(
        "bucket-replay-unchecked",
        "bucket graphs: replays skip the static-shape guard",
        BUCKETS_PY,
        "        data_iterator = self.guard.check_call(label, step, kwargs, record=capturing, "
        "copied=True)\n",
        "        data_iterator = (\n"
        "            self.guard.check_call(label, step, kwargs, record=True, copied=True)\n"
        '            if capturing\n            else kwargs["data_iterator"]\n        )\n',
        (BUCKETS + "test_a_replayed_bucket_refuses_a_forward_step_func_with_another_coefficient",),
    ),
    Mutant(
        "bucket-moved-memory-unchecked",
        "bucket graphs: no address check; graphs replay onto moved memory",
        BUCKETS_PY,
        "        moved = self.moves.moved(self._holds_graphs())\n",
        "        moved = []\n",
        (
            BUCKETS + "test_graphs_are_freed_and_recaptured_after_warmup_when_memory_moves"
            "[grad-buffers-offloaded]",
            BUCKETS + "test_graphs_are_freed_and_recaptured_after_warmup_when_memory_moves"
            "[parameter-reallocated]",
            RL + "test_offload_and_reload_recapture_every_bucket_and_train_as_eager[fingerprint]",
        ),
    ),
    Mutant(
        "bucket-loss-scale-unchecked",
        "bucket graphs: a replaced loss-scale tensor goes unnoticed",
        "cudagraph_plugin/runtime/fingerprint.py",
        "            if scale is not None:\n",
        "            if False:\n",
        (
            BUCKETS + "test_graphs_are_freed_and_recaptured_after_warmup_when_memory_moves"
            "[loss-scale-replaced]",
        ),
    ),
    Mutant(
        "bucket-recapture-without-warmup",
        "bucket graphs: after an invalidation a bucket is captured again without warm-up",
        BUCKETS_PY,
        "        self._calls.clear()\n        self.guard.disarm()\n",
        "        self.guard.disarm()\n",
        (
            BUCKETS + "test_the_host_can_invalidate_the_graphs_explicitly",
            RL + "test_offload_and_reload_recapture_every_bucket_and_train_as_eager"
            "[host-invalidates]",
        ),
    ),
    Mutant(
        "bucket-pool-per-graph",
        "bucket graphs: every graph gets its own memory pool",
        BUCKETS_PY,
        "        pool = self._pool if self._pool is not None else torch.cuda.graph_pool_handle()\n",
        "        pool = torch.cuda.graph_pool_handle()\n",
        (BUCKETS + "test_each_bucket_is_captured_after_its_own_warmup_and_replayed_for_its_steps",),
    ),
    Mutant(
        "bucket-stale-pool-handle",
        "bucket graphs: the pool handle of freed graphs is captured into again",
        BUCKETS_PY,
        "        if not self._graphs:\n            self._pool = None\n",
        "        if not self._graphs:\n            pass\n",
        (
            BUCKETS + "test_graphs_are_freed_and_recaptured_after_warmup_when_memory_moves"
            "[grad-buffers-offloaded]",
        ),
    ),
    Mutant(
        "bucket-scratch-not-kept",
        "bucket graphs: megatron-core's scratch buffers are not kept for the graphs",
        BUCKETS_PY,
        "_Captured(graph, result, step, self._scratch(), cached)",
        "_Captured(graph, result, step, [], cached)",
        (BUCKETS + "test_graphs_keep_the_scratch_buffers_megatron_core_replaces",),
    ),
    Mutant(
        "bucket-rng-not-registered",
        "bucket graphs: the RNG tracker's generator states are not registered in a graph",
        BUCKETS_PY,
        "                graph.register_generator_state(state)\n",
        "                pass\n",
        (BUCKETS + "test_capture_registers_every_tracker_generator_state_in_each_graph",),
    ),
    Mutant(
        "bucket-ranks-not-agreed",
        "bucket graphs: ranks routing different shapes are not made to run eagerly",
        BUCKETS_PY,
        "        if agreed[:3] != [-v for v in agreed[3:6]]:\n",
        "        if False:\n",
        (BUCKETS + "test_ranks_that_disagree_on_the_shape_run_the_step_eagerly",),
    ),
    Mutant(
        "bucket-stale-streams-not-overridden",
        "bucket graphs: the capture leaves autograd's stale-stream override off",
        "cudagraph_plugin/compat/buckets.py",
        "    setter(True)\n",
        "    setter(before)\n",
        (BUCKETS + "test_capture_runs_on_one_stream_with_stale_streams_overridden_only_meanwhile",),
    ),
    Mutant(
        "padding-counts-in-the-loss",
        "padding: padded positions keep loss_mask 1",
        "cudagraph_plugin/runtime/padding.py",
        '        "loss_mask": (0, "loss_mask\'s zero"),\n',
        '        "loss_mask": (1, "loss_mask\'s zero"),\n',
        (
            "tests/test_padding.py::"
            "test_pads_each_sequence_key_to_the_smallest_bucket_at_least_its_length",
        ),
    ),
    Mutant(
        "step-listeners-never-looked-up",
        "TrainingRun never looks again which step hooks have implementations: it dispatches "
        "them on every step whether anyone listens or not",
        "hookspecs/run.py",
        "        if counted is not None and counted.registrations != self._seen:\n",
        "        if False:\n",
        (
            STEPS + "test_step_hooks_that_nobody_implements_are_not_dispatched_and_a_late_"
            "plugin_is_heard",
        ),
    ),
    Mutant(
        "step-listener-never-stops",
        "the plugin's step listener stays registered for the whole run (every step dispatches)",
        "cudagraph_plugin/runtime/steps.py",
        "            self.stop()\n",
        "            pass\n",
        (STEPS + "test_the_plugin_stops_listening_after_the_timed_window",),
    ),
    Mutant(
        "step-listener-stops-before-the-fallback-decides",
        "the step listener stops after the timed window even while the fallback must decide",
        "cudagraph_plugin/runtime/steps.py",
        "            and not deciding\n",
        "",
        (STEPS + "test_the_plugin_keeps_listening_while_the_fallback_has_to_decide",),
    ),
    Mutant(
        "step-not-read-from-progress",
        "the plugin's step is what the step hooks last said, also after it stopped listening",
        "cudagraph_plugin/runtime/state.py",
        "        return self._step if progress is None else progress.step\n",
        "        return self._step\n",
        (STEPS + "test_the_plugin_stops_listening_after_the_timed_window",),
    ),
    Mutant(
        "replay-call-values-unchecked",
        "the remembered replay's guard check skips the call's micro-batch count and shapes",
        "cudagraph_plugin/runtime/guard.py",
        "            tuple(map(kwargs.get, self.CALL_KEYS)) != self._replay_values\n",
        "            False\n",
        (GUARD + "test_check_replay_refuses_a_changed_call_as_check_call_does",),
    ),
    Mutant(
        "step-listener-stops-without-progress",
        "the step listener stops for a host without a StepProgress: the step then freezes",
        "cudagraph_plugin/runtime/steps.py",
        "            and state.progress is not None\n",
        "",
        (STEPS + "test_a_host_without_progress_is_heard_on_every_step",),
    ),
    Mutant(
        "timer-stops-before-other-plugins",
        "the step timer stops before other plugins' step-end work (left out of the step)",
        "cudagraph_plugin/runtime/steps.py",
        "    @hookimpl(trylast=True)\n",
        "    @hookimpl\n",
        (STEPS + "test_the_timed_step_includes_other_plugins_step_hooks",),
    ),
    Mutant(
        "replay-list-subclass-wrapped-whole",
        "the remembered replay's guard wraps a list subclass of chunk iterators as one iterator",
        "cudagraph_plugin/runtime/guard.py",
        "        if data_iterator is None or isinstance(data_iterator, list):\n",
        "        if data_iterator is None or type(data_iterator) is list:\n",
        (GUARD + "test_check_replay_wraps_a_list_subclass_per_chunk_as_check_call_does",),
    ),
    Mutant(
        "process-groups-aborted-one-by-one",
        "the process groups are aborted one after the other (an abort whose teardown waits "
        "on another communicator's stuck kernel then holds that communicator's abort back)",
        "cudagraph_plugin/compat/device.py",
        "        for thread in self.threads:\n            thread.start()\n",
        "        for thread in self.threads:\n"
        "            thread.start()\n"
        "            thread.join()\n",
        (PEERS + "test_every_group_is_aborted_at_once",),
    ),
    Mutant(
        "shutdown-waits-for-the-abort-first",
        "the watcher waits for the abort to end (after the graphs are freed) before the "
        "shutdown may go on to free them",
        "cudagraph_plugin/runtime/peer_interrupt.py",
        "        try:\n            self._abort()\n",
        "        try:\n            self._abort()\n"
        "            self._settle(10.0)  # (ABORT_WAIT_S)\n",
        (PEERS + "test_the_shutdown_frees_the_graphs_before_it_waits_for_the_abort",),
    ),
    Mutant(
        "abort-end-never-awaited",
        "the shutdown never waits for the abort of the process groups to end",
        "cudagraph_plugin/runtime/job_watch.py",
        "            self.peers.finish()\n",
        "",
        (PEERS + "test_the_shutdown_frees_the_graphs_before_it_waits_for_the_abort",),
    ),
    Mutant(
        "abort-restarted-by-every-call",
        "a second abort of the same process groups (the host's, after the watch's) starts new "
        "aborts instead of waiting for the ones in flight",
        "cudagraph_plugin/compat/device.py",
        "        if _abort_in_flight is not None and _abort_in_flight.world is world:\n"
        "            return\n",
        "",
        (PEERS + "test_the_real_groups_are_aborted_once_and_forgotten",),
    ),
    Mutant(
        "exit-deadline-never-armed",
        "a rank whose watch acted on a peer's failure has no exit deadline: stuck in C, it "
        "waits for torchrun's SIGKILL",
        "cudagraph_plugin/runtime/peer_interrupt.py",
        "                self.deadline.arm(failure.describe())\n",
        "                pass\n",
        (
            DEADLINE + "test_the_watch_arms_the_deadline_when_it_acts_and_a_settled_shutdown_"
            "cancels_it",
        ),
    ),
    Mutant(
        "exit-deadline-kept-after-a-settled-shutdown",
        "a shutdown that settled leaves the exit deadline armed (a host going on after it is "
        "ended)",
        "cudagraph_plugin/runtime/peers.py",
        "                self.deadline.cancel()\n",
        "                pass\n",
        (
            DEADLINE + "test_the_watch_arms_the_deadline_when_it_acts_and_a_settled_shutdown_"
            "cancels_it",
        ),
    ),
    Mutant(
        "exit-backstop-kept-after-cancel",
        "a cancelled deadline leaves its faulthandler backstop running",
        "cudagraph_plugin/runtime/peer_deadline.py",
        "            faulthandler.cancel_dump_traceback_later()\n",
        "            pass\n",
        (DEADLINE + "test_a_cancelled_deadline_cancels_its_backstop_too",),
    ),
    Mutant(
        "bucket-interrupted-capture-kept",
        "a bucket graph whose capture was interrupted is held by nothing and never freed",
        BUCKETS_PY,
        "                self._discard(graph, key, error)\n",
        "                pass\n",
        (BUCKETS + "test_a_capture_interrupted_frees_its_graph_before_the_error_goes_on",),
    ),
    Mutant(
        "guard-not-kept-outermost",
        "a tryfirst shutdown wrapper registered after the plugin sits outside its guard",
        "hookspecs/manager.py",
        "        if not outermost:\n            self._keep_outermost_last()\n",
        "        if False:\n            self._keep_outermost_last()\n",
        (
            "tests/test_hookspecs_names.py::"
            "test_an_outermost_object_stays_outside_tryfirst_wrappers_registered_after_it",
            LIFECYCLE
            + "test_cleanup_runs_even_if_another_shutdown_wrapper_raises_before_its_yield",
            LIFECYCLE + "test_the_configured_warm_up_is_the_answer_whatever_registers_later",
        ),
    ),
    Mutant(
        "second-shutdown-reports-again",
        "a mcgraph_shutdown fired again (by a plugin) reports and frees a second time",
        "cudagraph_plugin/runtime/shutdown.py",
        "        if self.entered:  # fired again",
        "        if False:  # fired again",
        (
            LIFECYCLE
            + "test_a_plugin_firing_mcgraph_shutdown_itself_gets_one_report_and_one_release",
        ),
    ),
    Mutant(
        "host-wrapper-around-the-run-unseen",
        "a host's own FullCudaGraphWrapper around the run's forward_backward_func goes unseen",
        "cudagraph_plugin/runtime/interceptor.py",
        "        if seen - base > ours:\n",
        "        if False:\n",
        (
            LIFECYCLE
            + "test_a_host_s_own_full_cuda_graph_wrapper_around_the_run_s_function_is_refused",
        ),
    ),
    Mutant(
        "bucket-odd-first-call-kept",
        "bucket graphs: static buffers made from an odd first call keep the bucket eager",
        BUCKETS_PY,
        "        if agreed[7]:  # (every rank alike",
        "        if False:  # (every rank alike",
        (BUCKETS + "test_an_odd_first_micro_batch_does_not_keep_its_bucket_eager",),
    ),
    Mutant(
        "warm-up-unchecked-against-static-buffers",
        "full-iteration warm-up calls reach megatron-core's static buffers unchecked: a "
        "broadcastable shape change trains on the wrong data and is captured",
        "cudagraph_plugin/runtime/interceptor.py",
        "copied=True, static_buffers=True\n",
        "copied=True, static_buffers=False\n",
        (
            LIFECYCLE + "test_a_shape_change_between_warm_up_calls_is_refused_before_megatron_core_"
            "copies_it[broadcastable]",
        ),
    ),
    Mutant(
        "warm-up-stale-key-unseen",
        "a key a micro-batch no longer passes keeps its old value in megatron-core's static "
        "buffer, unrefused",
        "cudagraph_plugin/compat/full_iteration.py",
        "    gone = sorted((key for key in passed_before if key in buffer and key not in batch)",
        "    gone = sorted((key for key in () if key in buffer and key not in batch)",
        (GUARD + "test_a_warm_up_call_megatron_core_would_copy_wrongly_is_refused[key-gone]",),
    ),
    Mutant(
        "param-gather-not-rearmed-before-capture",
        "a capture after a forward-only call records no DDP parameter all-gather: every "
        "replay trains on stale shards",
        "cudagraph_plugin/runtime/wiring.py",
        "        rearmed = compat.rearm_param_gather(model) if model is not None else 0\n",
        "        rearmed = 0\n",
        (
            PARAM_GATHER + "test_evaluations_between_steps_keep_graphed_losses_equal_to_eager"
            "[before-the-capture]",
        ),
    ),
    Mutant(
        "param-gather-left-done-after-replay",
        "after a training replay (the remembered fast path) DDP still says the parameters "
        "are gathered: the next eager evaluation runs on stale shards",
        "cudagraph_plugin/runtime/interceptor.py",
        "            if replay.gather_groups:\n",
        "            if False:\n",
        (
            PARAM_GATHER + "test_evaluations_between_steps_keep_graphed_losses_equal_to_eager"
            "[eager-after-remembered-replays]",
        ),
    ),
    Mutant(
        "param-gather-left-done-after-bucket-replay",
        "after a bucket's replay DDP still says the parameters are gathered: the next RL "
        "rollout runs on stale shards",
        "cudagraph_plugin/runtime/interceptor.py",
        "        if groups:\n            compat.mark_param_gather_due(groups)\n",
        "        if False:\n            compat.mark_param_gather_due(groups)\n",
        (
            PARAM_GATHER
            + "test_rl_rollouts_between_bucketed_steps_keep_graphed_losses_equal_to_eager",
        ),
    ),
    Mutant(
        "mode-of-the-capture-unchecked",
        "a full-iteration graph replays its capture's train/eval mode for a call in the other",
        "cudagraph_plugin/runtime/guard.py",
        "    elif callee.modes(model) != ref.modes:\n",
        "    elif False:\n",
        (
            CALLEE + "test_a_full_iteration_call_in_another_train_eval_mode_than_its_capture_"
            "is_refused[check_call]",
        ),
    ),
    Mutant(
        "mode-of-the-capture-unchecked-on-the-fast-path",
        "the remembered replay path replays a training graph with the model in another mode",
        "cudagraph_plugin/runtime/guard.py",
        "            or callee.modes(model) != self._replay_modes\n",
        "",
        (
            CALLEE + "test_a_full_iteration_call_in_another_train_eval_mode_than_its_capture_"
            "is_refused[check_replay]",
        ),
    ),
    Mutant(
        "stale-optimizer-wrapper-not-collected",
        "a wrapper of an earlier run, collected mid-run, frees the running optimizer graph",
        "cudagraph_plugin/runtime/mechanisms.py",
        "        gc.collect()\n        if compat.optimizer_graph_state_dirty():\n",
        "        if compat.optimizer_graph_state_dirty():\n",
        (
            "tests/test_optimizer_graph.py::test_a_wrapper_left_by_an_earlier_run_does_not_"
            "free_this_runs_graph",
        ),
    ),
    Mutant(
        "plugin-name-clash-loaded",
        "a second distribution's plugin of one name (a third-party `cudagraph`) is dropped "
        "or replaces the CUDA graph plugin without a word",
        "hookspecs/manager.py",
        "        _one_plugin_per_name(pm)\n",
        "",
        (
            "tests/test_hookspecs_manager.py::test_two_distributions_giving_a_plugin_one_name_"
            "are_refused",
        ),
    ),
    Mutant(
        "changed-warmup-answer-accepted",
        "a wrapper that changes the warm-up answer moves the post-warmup (TE capture) step",
        "cudagraph_plugin/runtime/plugin.py",
        "        if step - start_step != own and self.state.active:",
        "        if False:",
        (
            LIFECYCLE + "test_a_wrapper_that_changes_the_warmup_answer_is_refused_at_the_post_"
            "warmup_step",
        ),
    ),
    Mutant(
        "blocked-run-object-accepted",
        "a blocked part of the CUDA graph plugin leaves a run that asked for graphs eager, exit 0",
        "cudagraph_plugin/entry.py",
        "        if pluginmanager.register(plugin) is None:\n",
        "        if pluginmanager.register(plugin) is None and False:\n",
        (LIFECYCLE + "test_blocking_a_part_of_the_plugin_is_refused_not_a_run_without_graphs",),
    ),
    Mutant(
        "bucket-over-position-embeddings-accepted",
        "a bucket longer than the learned position embeddings fails in the embedding lookup",
        "cudagraph_plugin/runtime/build.py",
        "        violations += _bucket_position_problems(settings, model)\n",
        "        pass\n",
        (
            LIFECYCLE + "test_buckets_longer_than_the_learned_position_embeddings_are_refused_"
            "at_the_build",
        ),
    ),
    Mutant(
        "step-padded-between-steps-accepted",
        "padding reported between steps counts for the next step's bucket",
        "hookspecs/run.py",
        "        if self._running_step is None:\n            raise RuntimeError(\n"
        '                f"{where} called between steps',
        "        if False:\n            raise RuntimeError(\n"
        '                f"{where} called between steps',
        (
            "tests/test_hookspecs_run.py::test_step_padded_between_steps_is_refused_naming_"
            "where_to_call_it",
        ),
    ),
    Mutant(
        "ranks-settings-not-compared",
        "ranks whose CUDA graph settings differ run on (and deadlock at the capture step)",
        "cudagraph_plugin/runtime/agreement.py",
        "    state.settings_agreed = True\n    check_settings_agree(state.settings)\n",
        "    state.settings_agreed = True\n",
        (
            "tests/test_settings_agreement_cpu.py::test_ranks_with_different_warmups_refuse_"
            "the_run_naming_the_setting",
        ),
    ),
    Mutant(
        "ranks-steps-not-compared",
        "ranks training different steps run on (the first to end leaves the others waiting)",
        "cudagraph_plugin/runtime/plugin.py",
        "        agreement.check_steps_agree(start_step, train_iters)\n",
        "        pass\n",
        (
            "tests/test_settings_agreement_cpu.py::test_ranks_with_different_train_iters_refuse_"
            "the_run_at_the_training_start",
        ),
    ),
    Mutant(
        "stuck-signal-never-ends",
        "a SIGTERM the main thread cannot handle (blocked in C) leaves the process running",
        "hookspecs/run_signals.py",
        "        os._exit(128 + signum)\n",
        "        return\n",
        (
            "tests/test_hookspecs_stuck_signal.py::test_a_sigterm_the_blocked_main_thread_"
            "cannot_handle_ends_the_process",
        ),
    ),
    Mutant(
        "stuck-signal-wait-ignores-steps",
        "a replay step longer than the floor wait is taken for a hang and the process ended",
        "hookspecs/run_signals.py",
        "        return max(self.seconds, 2.0 * self.run._longest_step_s)\n",
        "        return self.seconds\n",
        ("tests/test_hookspecs_stuck_signal.py::test_the_wait_is_at_least_twice_the_longest_step",),
    ),
    Mutant(
        "report-path-of-rank-0-checked",
        "rank N's own report file is not checked at configure (it fails after the last step)",
        "cudagraph_plugin/config/rules/report.py",
        "    written = rank_path(str(s.report_json), rank)\n",
        "    written = str(s.report_json)\n",
        ("tests/test_validation.py::test_a_rank_checks_the_report_file_it_writes",),
    ),
    Mutant(
        "told-rank-marks-own-failure",
        "a rank ended after its watch acted on a peer's failure marks a failure of its own",
        "cudagraph_plugin/runtime/peers.py",
        "            if self.peer_failure is None:\n",
        "            if True:\n",
        (PEERS + "test_an_end_after_the_watch_acted_is_no_failure_of_this_rank",),
    ),
    Mutant(
        "full-iteration-scope-cleared",
        "graphs off with a full_iteration scope that megatron-core 0.18+ reads as on: cleared",
        "cudagraph_plugin/config/fixes.py",
        "        and not full_iteration_scope_turns_graphs_on(settings)\n",
        "        and True\n",
        (
            "tests/test_check_megatron_lm.py::test_full_iteration_scope_without_impl_is_a_"
            "problem_where_it_means_graphs",
        ),
    ),
    Mutant(
        "signal-at-exit-entry-skips-shutdown",
        "a signal handled as the run's __exit__ is entered leaves it before any shutdown",
        "hookspecs/run_signals.py",
        "        if self._shutting_down or _entering_exit(self, frame):\n",
        "        if self._shutting_down:\n",
        (
            "tests/test_hookspecs_stuck_signal.py::test_the_watch_leaves_a_signal_whose_"
            "outcome_is_not_the_end[previous_handler-host handler after shutdown-0]",
        ),
    ),
    Mutant(
        "one-virtual-stage-kept",
        "one virtual stage per pipeline rank is taken for the interleaved schedule (OK, then "
        "the capture fails on batched p2p)",
        "cudagraph_plugin/cli/megatron_lm.py",
        "        if vpp is None or vpp == 1:\n",
        "        if vpp is None:\n",
        (
            "tests/test_check_megatron_lm.py::test_one_virtual_stage_per_rank_is_none_and_"
            "batches_p2p",
        ),
    ),
    Mutant(
        "deadline-leaves-the-stuck-exit-in-charge",
        "a rank told of a peer's failure, blocked in a collective with a SIGTERM pending, is "
        "ended by the stuck-signal exit without its shutdown before the abort releases it",
        "cudagraph_plugin/runtime/peer_deadline.py",
        "            end_bounded_elsewhere(f\"rank {self.rank}'s peer exit deadline, "
        '{self.seconds:g} s")\n',
        "            pass\n",
        (
            DEADLINE + "test_an_armed_deadline_holds_the_stuck_signal_exit_until_it_is_"
            "cancelled_or_fires",
            DEADLINE + "test_an_armed_deadline_takes_over_from_the_stuck_signal_exit[armed-70-"
            "still running 3 s after rank 0]",
        ),
    ),
    Mutant(
        "peer-wait-ignores-a-held-signal",
        "a failing rank waits its whole 5 s for peers while the launcher is ending the job",
        "cudagraph_plugin/runtime/peers.py",
        "            if held is not None:  # (the launcher ends every rank: waiting serves none)\n",
        "            if False:\n",
        (PEERS + "test_wait_for_peers_gives_up_at_once_when_a_signal_came_during_the_shutdown",),
    ),
    Mutant(
        "early-end-not-recorded",
        "a rank that ended its run early is not named by the failure it leaves behind",
        "cudagraph_plugin/runtime/peers.py",
        "                if early:  # (the first to end early is kept, as the first failure is)\n",
        "                if False:\n",
        (PEERS + "test_a_failure_after_a_rank_ended_early_names_that_rank[early_exit]",),
    ),
    Mutant(
        "early-end-gone-past-left-waiting",
        "a rank in a step after a peer's early end is left waiting in that step's collective",
        "cudagraph_plugin/runtime/peer_early.py",
        "        if step <= record.step:\n",
        "        if True:\n",
        (PEERS + "test_a_rank_in_a_step_after_a_peers_early_end_is_released_and_told",),
    ),
    Mutant(
        "early-end-same-step-ended",
        "a rank still in the step where a peer ended early is told, as if it had gone past it",
        "cudagraph_plugin/runtime/peer_early.py",
        "        if step <= record.step:\n",
        "        if step < record.step:\n",
        (PEERS + "test_a_rank_not_past_a_peers_early_end_is_left_alone[same_step]",),
    ),
    Mutant(
        "marks-read-every-poll",
        "every poll checks the failure mark, not only on news (and every tenth poll)",
        "cudagraph_plugin/runtime/peers.py",
        "        if news > seen or self._polls % RECHECK_POLLS == 0:\n",
        "        if True:\n",
        (PEERS + "test_a_poll_is_one_store_request_and_the_marks_are_read_once",),
    ),
    Mutant(
        "early-read-every-poll",
        "every poll reads the early end's key, not only on news",
        "cudagraph_plugin/runtime/peers.py",
        "        if news > seen and self._early is not None:\n",
        "        if self._early is not None:\n",
        (PEERS + "test_a_poll_is_one_store_request_and_the_marks_are_read_once",),
    ),
    Mutant(
        "early-end-adds-no-news",
        "an early end does not move the news counter: no watcher reads it",
        "cudagraph_plugin/runtime/peers.py",
        "                    store.add(self.news_key, 1)\n",
        "                    pass\n",
        (PEERS + "test_a_rank_in_a_step_after_a_peers_early_end_is_released_and_told",),
    ),
    Mutant(
        "news-never-rechecked",
        "a failure mark whose news was never added (the store call timed out between the "
        "two) is never read",
        "cudagraph_plugin/runtime/peers.py",
        "        if news > seen or self._polls % RECHECK_POLLS == 0:\n",
        "        if news > seen:\n",
        (PEERS + "test_a_mark_whose_news_was_never_added_is_still_found",),
    ),
    Mutant(
        "no-late-watch",
        "a clean end reads the early end once: a record written a moment later is missed",
        "cudagraph_plugin/runtime/peers.py",
        "            self._late = LateWatch("
        "self._early, self._store, self.poll_s, self._tell_late)\n",
        "            pass\n",
        (PEERS + "test_an_early_end_recorded_after_this_ranks_clean_end_is_still_told[past]",),
    ),
    Mutant(
        "sys-exit-0-swallows-the-shutdowns-error",
        "after sys.exit(0) in the loop, what the shutdown raises is logged and the process "
        "exits 0 (a PeerFailed said at the clean end included)",
        "hookspecs/run.py",
        "            if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):\n",
        "            if exc is None:\n",
        (
            "tests/test_hookspecs_shutdown.py::"
            "test_a_shutdown_raising_after_sys_exit_0_propagates_as_after_a_clean_end[0]",
        ),
    ),
    Mutant(
        "mark-adds-no-news",
        "a failure's mark does not move the news counter the watchers poll",
        "cudagraph_plugin/runtime/peers.py",
        "            store.add(self.news_key, 1)  # (after the mark: a watcher reads it on news)\n",
        "            pass\n",
        (PEERS + "test_a_mark_is_found_through_its_news_alone",),
    ),
    Mutant(
        "clean-end-past-early-end-not-told",
        "a rank whose loop finished past a peer's early end before its watch looked ends "
        "cleanly, its shutdown waiting on the device",
        "cudagraph_plugin/runtime/peers.py",
        "            self._tell_late(failure)\n",
        "            pass\n",
        (PEERS + "test_a_clean_end_past_a_peers_early_end_is_told_at_its_end[past]",),
    ),
    Mutant(
        "told-at-end-not-raised",
        "a run told at its clean end that it went past a peer's early end ends cleanly (exit 0)",
        "cudagraph_plugin/runtime/plugin.py",
        "        self.job.raise_told_at_end()\n",
        "        pass\n",
        (
            "tests/test_run_guarantees.py::"
            "test_a_clean_end_past_a_peers_early_end_frees_the_graphs_then_raises_peer_failed",
        ),
    ),
    Mutant(
        "past-early-end-device-waits",
        "the shutdown of a run past a peer's early end waits on the device (the collectives "
        "of steps that peer never entered)",
        "cudagraph_plugin/runtime/shutdown.py",
        "    if reason is ShutdownReason.PEER_FAILED or state.past_peer_early_end:\n",
        "    if reason is ShutdownReason.PEER_FAILED:\n",
        (
            "tests/test_run_guarantees.py::"
            "test_a_clean_end_past_a_peers_early_end_frees_the_graphs_then_raises_peer_failed",
        ),
    ),
    Mutant(
        "refusal-names-no-spread",
        "ranks whose settings differ are refused naming only the speaker's own value",
        "cudagraph_plugin/runtime/agreement.py",
        "    everyone = compat.gather_across_ranks(mine)\n",
        "    everyone = [mine]\n",
        ("tests/test_settings_agreement_cpu.py::test_a_refusal_says_which_ranks_hold_which_value",),
    ),
    Mutant(
        "stuck-exit-asks-no-release",
        "the stuck-signal watch ends the process without asking the release a plugin offered",
        "hookspecs/run_signals.py",
        "        released = _release_main_thread(signum, waited)\n",
        "        released = False\n",
        (
            "tests/test_hookspecs_stuck_signal.py::test_an_offered_release_ends_the_blocked_call_"
            "so_that_the_shutdown_runs[releases]",
        ),
    ),
    Mutant(
        "peer-watch-offers-no-release",
        "a rank that a peer left in an NCCL collective by dying without a word ends without its "
        "shutdown (the peer watch never offers its abort to the stuck-signal watch)",
        "cudagraph_plugin/runtime/peers.py",
        "        if release and watch.deadline is not None:  # (a release needs a bound)\n",
        "        if False:\n",
        (
            DEADLINE + "test_a_signal_the_blocked_main_thread_cannot_act_on_begins_the_abort_"
            "under_the_deadline",
            DEADLINE + "test_over_gloo_no_release_is_offered_by_default",
        ),
    ),
    Mutant(
        "released-rank-waits-for-the-dead-peer",
        "a rank released from a dead peer's collective waits its 5 s for that peer anyway",
        "cudagraph_plugin/runtime/peers.py",
        "        if self.released_by is not None:  # (the launcher ends every rank: waiting "
        "serves none)\n",
        "        if False:\n",
        (
            DEADLINE + "test_a_signal_the_blocked_main_thread_cannot_act_on_begins_the_abort_"
            "under_the_deadline",
        ),
    ),
    Mutant(
        "stuck-exit-trusts-an-unbounded-release",
        "a release that says True without a bound of its own takes the process's end over: the "
        "process waits for torchrun's SIGKILL, or for ever",
        "hookspecs/run_signals.py",
        "        if released:  # (said so without a bound of its own: this watch keeps its own)\n",
        "        if released:\n            return\n        if released:\n",
        (
            "tests/test_hookspecs_stuck_signal.py::test_an_offered_release_ends_the_blocked_call_"
            "so_that_the_shutdown_runs[claims_without_a_bound]",
        ),
    ),
    Mutant(
        "failed-watch-start-leaves-its-offer",
        "a peer watch whose thread cannot start leaves its release offered, its handler "
        "installed and itself registered",
        "cudagraph_plugin/runtime/peers.py",
        "            watch.stop()  # (the offer, the handler and the registry taken back)\n",
        "            pass\n",
        (DEADLINE + "test_a_watch_whose_thread_cannot_start_leaves_no_offer_handler_or_registry",),
    ),
    Mutant(
        "te-layers-any-precision",
        "TE layer graphs on fp32 or fp16 layers pass the configure-time check and fail at the "
        "capture step, after the warm-up",
        "cudagraph_plugin/config/rules/model.py",
        '        s.impl != "transformer_engine"\n',
        "        True\n",
        (
            "tests/test_validation.py::test_each_rule_accepts_and_rejects[_te_graphs_need_bf16_"
            "layers]",
            "tests/test_example_cpu.py::test_te_graphs_on_layers_not_in_bf16_are_refused_at_the_"
            "start[fp32]",
        ),
    ),
    Mutant(
        "te-built-layers-dtype-unchecked",
        "a model none of whose parameters is bf16, its config silent on the precision, reaches "
        "the TE capture",
        "cudagraph_plugin/runtime/build.py",
        "        violations += _layer_dtype_problems(model)\n",
        "        pass\n",
        (
            "tests/test_build_checks.py::test_te_layers_not_in_bf16_are_refused_where_the_config_"
            "did_not_say[float32]",
        ),
    ),
    Mutant(
        "cpu-build-checks-skipped",
        "without a CUDA device the build checks that need none are skipped (a loop wired on a "
        "laptop learns nothing there)",
        "cudagraph_plugin/runtime/plugin.py",
        "        elif self.settings.enabled:\n            build.rehearse_model_checks(state)\n",
        "        elif False:\n            build.rehearse_model_checks(state)\n",
        (
            "tests/test_cpu_rehearsal.py::test_te_scopes_on_fp32_layers_are_refused_at_the_build_"
            "on_the_cpu_too",
        ),
    ),
    Mutant(
        "cpu-training-before-build-unchecked",
        "... and training before run.model_built() goes on there",
        "cudagraph_plugin/runtime/wiring.py",
        "        asked = self.expects_graphs or self.state.settings.enabled\n",
        "        asked = self.expects_graphs\n",
        (
            "tests/test_cpu_rehearsal.py::test_training_before_model_built_is_refused_on_the_cpu_"
            "too[full_iteration]",
        ),
    ),
    Mutant(
        "stray-impl-only-noted",
        "graphs asked for where nothing reads them, none where they are read, only noted "
        "(a Hydra tree passed whole ran eagerly)",
        "cudagraph_plugin/config/rules/names.py",
        "        if not stray.asks_for_graphs:\n",
        "        if True:\n",
        (
            "tests/test_omegaconf_configs.py::test_graphs_asked_for_in_a_section_nothing_reads_"
            "are_a_problem[two-down]",
        ),
    ),
    Mutant(
        "omegaconf-mandatory-read-as-absent",
        "OmegaConf's ??? read as an unset field (cuda_graph_impl: ??? ran eagerly)",
        "cudagraph_plugin/config/fields.py",
        "            if value is MISSING and leaf and is_omegaconf(obj) and name in obj.keys():\n",
        "            if False:\n",
        (
            "tests/test_omegaconf_configs.py::test_a_mandatory_value_left_unfilled_is_a_"
            "problem_not_an_unset_field",
        ),
    ),
    Mutant(
        "refused-writes-one-per-attempt",
        "the run names only the first field its config refuses to take",
        "cudagraph_plugin/config/fixes.py",
        "            continue\n        written.append((fix.path, before))\n",
        "            break\n        written.append((fix.path, before))\n",
        (
            "tests/test_omegaconf_configs.py::test_every_field_a_config_refuses_is_named_and_"
            "nothing_stays_written",
        ),
    ),
    Mutant(
        "typed-config-write-untried",
        "check_config says OK for a fix a frozen pydantic/attrs object refuses; the run refuses",
        "cudagraph_plugin/config/fixes.py",
        "        why = write_refusal(config, fix.path) or tried\n",
        "        why = write_refusal(config, fix.path)\n",
        (
            "tests/test_typed_configs.py::test_a_fix_a_typed_config_refuses_is_a_problem_of_the_"
            "check_as_of_the_run[pydantic-frozen]",
        ),
    ),
    Mutant(
        "typed-config-not-walked",
        "a misspelt CUDA graph field in a pydantic model is ignored (the run eager)",
        "cudagraph_plugin/config/strays.py",
        "        return field_names(obj)\n",
        "        return None\n",
        (
            "tests/test_typed_configs.py::test_graphs_asked_for_where_nothing_reads_them_are_a_"
            "problem_in_typed_configs[pydantic-extra]",
        ),
    ),
    Mutant(
        "interrupt-speaker-not-noted",
        "a Ctrl-C that reaches every rank is said by each (none told whose came first)",
        "cudagraph_plugin/runtime/peer_mark.py",
        "    if not isinstance(exception, ConfigurationError | KeyboardInterrupt):\n",
        "    if not isinstance(exception, ConfigurationError):\n",
        (
            PEERS + "test_the_mark_tells_print_refusal_which_rank_says_the_refusal",
            "tests/test_probe_jobs_cpu.py::test_a_ctrl_c_passed_to_every_rank_is_said_once_per_"
            "job_without_a_traceback",
        ),
    ),
    Mutant(
        "job-parser-not-counted",
        "a host's usage error is said by rank 0 alone, never by the one rank that refused",
        "cudagraph_plugin/runtime/configure_refusal.py",
        "        sys.exit(print_refusal(note_refusal_speaker(ConfigurationError(text)), "
        "said=text))\n",
        "        sys.exit(print_refusal(ConfigurationError(text), said=text))\n",
        (
            "tests/test_talk_once.py::test_a_hosts_refusal_on_one_rank_alone_is_said_by_it",
            "tests/test_minimal_loop.py::test_a_bad_command_line_is_refused_in_two_lines_once_per_job",
        ),
    ),
    Mutant(
        "told-rank-tells-no-launcher",
        "a told rank's entry in torchrun's summary says only 'To enable traceback see ...'",
        "hookspecs/errors.py",
        "    tell_launcher(f\"{type(error).__name__}: this rank's run ended because of another "
        'rank: {said}")\n',
        "",
        (
            "tests/test_launcher_file.py::test_a_told_rank_leaves_its_reason_naming_the_rank_that_failed",
            "tests/test_example_cpu.py::test_a_rank_failing_ends_a_two_rank_job_with_every_process_group_aborted",
            "tests/test_probe_jobs_cpu.py::test_a_told_rank_says_its_line_when_torchruns_sigterm_comes_during_its_shutdown",
        ),
    ),
    Mutant(
        "launcher-file-written-in-place",
        "an interrupt mid-write leaves torchrun an error file cut short (its report then raises)",
        "hookspecs/errors.py",
        '    aside = f"{path}.{os.getpid()}.part"\n',
        "    aside = path\n",
        ("tests/test_launcher_file.py::test_an_interrupt_mid_write_leaves_the_file_whole",),
    ),
    Mutant(
        "example-main-not-recorded",
        "the failing rank's entry in torchrun's summary has no traceback (main() not under record)",
        "examples/train_gpt.py",
        "@record  # a failure's traceback in torchrun's summary of the failed job\n",
        "",
        (
            "tests/test_probe_jobs_cpu.py::test_two_gloo_ranks_end_non_zero_in_time_when_rank_1_raises",
        ),
    ),
    Mutant(
        "report-json-before-the-sinks",
        "a report JSON that cannot be written keeps every mcgraph_report implementation from it",
        "cudagraph_plugin/runtime/reporter.py",
        "            return unwritten\n",
        "            raise unwritten\n",
        (
            "tests/test_run_guarantees.py::test_a_report_json_that_cannot_be_written_names_the_field_after_every_sink_had_it",
        ),
    ),
]


def _copy_tree(destination: Path) -> None:
    """The working tree as git sees it (tracked and new files, nothing ignored)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


_NO_CACHE = ("-p", "no:cacheprovider")
_WHERE = "import cudagraph_plugin, hookspecs; print(cudagraph_plugin.__file__)"


def _pytest(tree: Path, test: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *_NO_CACHE, test],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return result.returncode, lines[-1] if lines else result.stderr.strip()[-200:]


def _check_imports_the_copy(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    where = subprocess.run(
        [sys.executable, "-c", _WHERE],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(tree), f"the copy imports {where}, not its own package"


def run(mutants: list[Mutant]) -> int:
    failures = 0
    with tempfile.TemporaryDirectory(prefix="handmade-mutants-") as scratch:
        tree = Path(scratch)
        _copy_tree(tree)
        _check_imports_the_copy(tree)
        tests = sorted({test for mutant in mutants for test in mutant.tests})
        print(f"baseline: {len(tests)} named test(s) on the unmutated copy")
        for test in tests:
            code, last = _pytest(tree, test)
            if code != 0:
                print(f"  BROKEN BASELINE {test}: exit {code}: {last}")
                failures += 1
        if failures:
            return 1
        for mutant in mutants:
            path = tree / mutant.path
            original = path.read_text()
            count = original.count(mutant.find)
            if count != 1:
                print(f"{mutant.id}: its text occurs {count} times in {mutant.path}: update it")
                failures += 1
                continue
            path.write_text(original.replace(mutant.find, mutant.replace))
            try:
                print(f"{mutant.id} ({mutant.path}): {mutant.breaks}")
                for test in mutant.tests:
                    start = time.monotonic()
                    code, last = _pytest(tree, test)
                    verdict = "KILLED" if code == 1 else f"SURVIVED (exit {code})"
                    failures += code != 1
                    print(f"  {verdict:<8} by {test} in {time.monotonic() - start:.0f} s: {last}")
            finally:
                path.write_text(original)
    print("every hand-made mutant killed" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens, also in a log
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    parser.add_argument("-k", default="", help="only mutants whose id contains this")
    args = parser.parse_args()
    mutants = [mutant for mutant in MUTANTS if args.k in mutant.id]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.id} ({mutant.path}): {mutant.breaks}")
            for test in mutant.tests:
                print(f"    {test}")
        return 0
    return run(mutants)


if __name__ == "__main__":
    sys.exit(main())
