"""The RL-style host (``examples/rl_loop.py``) with bucketed full-iteration graphs, on real
megatron-core 0.16.1 on the CPU.

Rollouts (forward only, unpadded lengths) alternate with training steps whose random
lengths are padded to buckets; the training state is offloaded and brought back through
megatron-core's own offload API. The plugin is driven only through the hooks, as any host
drives it; graph capture is faked (``tests/fakes.py``: a replay re-runs the captured work on
the captured tensors and refuses to run once memory it reads has moved).
"""

from __future__ import annotations

import collections
import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest
import rl_loop
import torch
from bucket_schedule import expected_schedule, lengths_of, schedule_of
from cpu_only import needs_mcore_on_cpu

from cudagraph_plugin.runtime.fingerprint import MoveWatch
from hookspecs import get_plugin_manager, hookimpl
from jobs import torchrun_command
from recording import InvalidateAt

pytestmark = needs_mcore_on_cpu

EXAMPLES = Path(rl_loop.__file__).resolve().parent
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
WARMUP = 2
LOOP = [
    "--seq-length", "48", "--min-length", "4", "--max-length", "48", "--train-iters", "24",
    "--steps-per-round", "4", "--rollout-batches", "2", "--log-interval", "0",
    "--cuda-graph-warmup-steps", str(WARMUP),
]  # fmt: skip


def run(tmp_path: Path, *argv: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    report_path = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    summary = rl_loop.run([*LOOP, *argv, "--cuda-graph-report-json", str(report_path)])
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return summary, report


def test_each_bucket_replays_every_step_after_its_capture_and_trains_as_eager(
    bucket_fakes, tmp_path
):
    graphs, report = run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48")
    eager, _ = run(tmp_path, "--pad-to-buckets", "16,32,48")
    lengths = graphs["seq_lengths"]
    assert lengths == eager["seq_lengths"] == lengths_of(report)
    counts = collections.Counter(lengths)
    assert set(counts) == {16, 32, 48} and min(counts.values()) >= WARMUP + 2, counts
    assert schedule_of(report) == expected_schedule(lengths, {16, 32, 48}, WARMUP)
    replays = sum(row["replays"] for row in report["buckets"])
    # every step after its bucket's warm-up and capture step, as the report counts them
    assert replays == len(lengths) - (WARMUP + 1) * 3 == report["replays"]["training"]
    assert graphs["losses"] == eager["losses"]  # bitwise: the same work on the same values
    assert graphs["rollout_losses"] == eager["rollout_losses"]
    assert graphs["losses"][-1] < graphs["losses"][0]
    assert report["graphs_captured"] and report["graphs_held"] == 3
    assert [g.resets for g in bucket_fakes.graphs] == [1, 1, 1]  # each freed once at the end
    assert len({g.capture_pool for g in bucket_fakes.graphs}) == 1  # one pool for all
    row = {r["seq_length"]: r for r in report["buckets"]}[16]
    assert 0 < row["padding_waste_percent"] < 75  # lengths 4..16 padded to 16


def test_a_length_outside_every_bucket_runs_eagerly_with_one_log_line(
    bucket_fakes, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="cudagraph_plugin")
    graphs, report = run(
        tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32", "--pad-to-buckets", "16,32,48"
    )
    eager, _ = run(tmp_path, "--pad-to-buckets", "16,32,48")
    lengths = graphs["seq_lengths"]
    assert 48 in lengths
    assert schedule_of(report) == expected_schedule(lengths, {16, 32}, WARMUP)
    outside = [r for r in caplog.records if "outside every CUDA graph bucket" in r.getMessage()]
    assert len(outside) == 1 and "seq_length 48" in outside[0].getMessage()
    assert graphs["losses"] == eager["losses"]
    # (review of 2026-12-05: --pad-to-buckets overrode the graph buckets without a word)
    said = [r.getMessage() for r in caplog.records if "--pad-to-buckets" in r.getMessage()]
    assert said == [
        "--pad-to-buckets 16,32,48 pads some steps to 48, not a --cuda-graph-buckets length "
        "(16,32): those steps run eagerly (leave --pad-to-buckets out to pad to the graph "
        "buckets)"
    ]


def test_lengths_above_every_bucket_keep_their_length_and_run_eagerly(
    bucket_fakes, tmp_path, caplog
):
    """Review finding: padding to the graph buckets (the default), a length above the
    largest one used to stop the example (BucketOverflowError)."""
    caplog.set_level(logging.INFO, logger="cudagraph_plugin")
    graphs, report = run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32")
    eager, _ = run(tmp_path, "--pad-to-buckets", "16,32")
    lengths = graphs["seq_lengths"]
    above = {length for length in lengths if length > 32}
    assert above and lengths == eager["seq_lengths"]
    assert schedule_of(report) == expected_schedule(lengths, {16, 32}, WARMUP)
    outside = [r for r in caplog.records if "outside every CUDA graph bucket" in r.getMessage()]
    assert sorted(m.getMessage().split("seq_length ")[1].split(",")[0] for m in outside) == sorted(
        str(length) for length in above
    )  # one line per new shape
    assert graphs["losses"] == eager["losses"]


@pytest.mark.parametrize("explicit", [True, False], ids=["host-invalidates", "fingerprint"])
def test_offload_and_reload_recapture_every_bucket_and_train_as_eager(
    bucket_fakes, tmp_path, caplog, monkeypatch, explicit
):
    """Gradient buffers and optimizer state go off the device after every 8 steps and come
    back after the rollout. Told by the host, or seeing the buffers' addresses move (each
    reload here allocates the gradient buffers afresh somewhere else: a tensor is kept on
    the old place meanwhile, as the rollout's activations would take it on a GPU), the
    plugin frees every graph and captures each bucket again after its warm-up; a replay on
    the old addresses would raise in the fake graph."""
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    if not explicit:
        _reloads_land_elsewhere(monkeypatch)
    offload = ["--offload-interval", "8", "--train-iters", "24", "--pad-to-buckets", "16,32,48"]
    flags = ["--invalidate-after-reload"] if explicit else []
    graphs, report = run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48", *offload, *flags)
    eager, _ = run(tmp_path, *offload)
    assert graphs["offloads"] == eager["offloads"] == 2
    lengths = graphs["seq_lengths"]
    assert schedule_of(report) == expected_schedule(lengths, {16, 32, 48}, WARMUP, {8, 16})
    freed = [r for r in caplog.records if "CUDA graph buckets:" in r.getMessage()]
    assert len(freed) == 2
    why = "reloaded after the rollout" if explicit else "memory the graphs point at moved"
    assert all(why in r.getMessage() for r in freed)
    # in the report too: the host's word after the last step of a round, the address
    # check's at the next training step
    steps = [7, 15] if explicit else [8, 16]
    assert [e["step"] for e in report["invalidations"]] == steps
    assert all(why in e["reason"] and e["graphs_freed"] > 0 for e in report["invalidations"])
    if not explicit:
        assert graphs["reloads_moved"] == 2  # the host saw what the plugin's check saw
    assert graphs["losses"] == eager["losses"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_optimizer_reload_recaptures_exactly_when_it_moves_the_weights(
    bucket_fakes, tmp_path, caplog, monkeypatch, precision
):
    """Review finding. Without a main copy (fp32, no distributed optimizer) megatron-core's
    optimizer offload moves the model's own weights, one tensor at a time (``p.data =
    p.data.cuda()``), and the bucket graphs read them. Here no weight is in the address
    sample and the gradient buffers stay: only the watch on the offload API sees the move
    (it was on only with the optimizer graph); a stale replay would raise in the fake. With
    bf16 the optimizer moves only its fp32 main copy, which no bucket graph reads: no
    recapture."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    from cudagraph_plugin.runtime.fingerprint import AddressFingerprint

    kwdefaults = {**AddressFingerprint.__init__.__kwdefaults__, "params_per_chunk": 0}
    monkeypatch.setattr(AddressFingerprint.__init__, "__kwdefaults__", kwdefaults)
    restore = MegatronOptimizer.restore_from_cpu

    def restore_elsewhere(self):  # the weights come back elsewhere, as on a GPU
        restore(self)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.data = param.data.clone()

    monkeypatch.setattr(MegatronOptimizer, "restore_from_cpu", restore_elsewhere)
    from megatron.core.distributed import DistributedDataParallel

    for name in ("offload_grad_buffers", "restore_grad_buffers"):
        monkeypatch.setattr(DistributedDataParallel, name, lambda self, *a, **k: None)
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    offload = ["--offload-interval", "8", "--pad-to-buckets", "16,32,48"]
    offload += ["--bf16"] if precision == "bf16" else []
    graphs, report = run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48", *offload)
    eager, _ = run(tmp_path, *offload)
    if precision == "fp32":
        assert [e["step"] for e in report["invalidations"]] == [8, 16]
        assert all("restore_from_cpu() ran" in e["reason"] for e in report["invalidations"])
    else:
        assert report["invalidations"] == []
        assert schedule_of(report) == expected_schedule(
            graphs["seq_lengths"], {16, 32, 48}, WARMUP
        )  # each bucket captured once, replayed ever after
    assert graphs["losses"] == eager["losses"]


def _reloads_land_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a freed block of the same size usually comes back at the same address;
    while megatron-core's offload has the gradient storage shrunk to nothing, a block of
    its size is taken (as a GPU's rollout would take the memory), so the reload lands
    elsewhere."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    offload, reload = _ParamAndGradBuffer.offload_to_cpu, _ParamAndGradBuffer.reload_from_cpu
    taken: list[torch.Tensor] = []
    before: dict[int, int] = {}

    def squat(buffer: _ParamAndGradBuffer) -> None:
        taken.append(torch.ones(buffer.grad_data_size, dtype=buffer.grad_data.dtype))

    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        if move_grads and self.grad_data is not None:
            before[id(self)] = self.grad_data.data_ptr()
        offload(self, move_params=move_params, move_grads=move_grads)
        if move_grads and self.grad_data is not None:
            squat(self)

    def reload_from_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        reload(self, move_params=move_params, move_grads=move_grads)
        # The allocator may have handed the freed block back to the system and mapped it
        # again for the reload, squatter or not: the gradients once more, one more
        # squatter held, until they land elsewhere.
        for _ in range(8):
            if before.get(id(self)) != self.grad_data.data_ptr():
                break
            offload(self, move_params=False, move_grads=True)
            squat(self)
            reload(self, move_params=False, move_grads=True)
        assert before.pop(id(self), None) != self.grad_data.data_ptr()
        taken.clear()

    monkeypatch.setattr(_ParamAndGradBuffer, "offload_to_cpu", offload_to_cpu)
    monkeypatch.setattr(_ParamAndGradBuffer, "reload_from_cpu", reload_from_cpu)


def test_a_run_that_ends_in_the_warmup_after_a_reload_reports_no_graph_held(bucket_fakes, tmp_path):
    """The reload before step 8 frees every bucket graph; the run ends at step 8, in the
    warm-up: the report's "held now" says none, as its bucket rows do (review finding: it
    kept the count of the last capture)."""
    _, report = run(
        tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48", "--train-iters", "9",
        "--offload-interval", "8", "--invalidate-after-reload",
    )  # fmt: skip
    [event] = report["invalidations"]
    assert event["graphs_freed"] > 0
    assert report["graphs_held"] == 0 == sum(row["graph_held"] for row in report["buckets"])


def test_invalidations_that_come_faster_than_the_warmup_are_said_once(
    bucket_fakes, tmp_path, caplog
):
    """Rounds of 2 steps, a reload and the host's invalidation after each, a warm-up of 2:
    every bucket's warm-up starts over before it ends, nothing is ever captured. Said once,
    with the fix, instead of a run that asked for graphs staying eager without a word."""
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    argv = ["--steps-per-round", "2", "--offload-interval", "2", "--invalidate-after-reload"]
    _, report = run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48", *argv)
    assert report["graphs_captured"] is False and len(report["invalidations"]) > 2
    said = [r.getMessage() for r in caplog.records if "nothing is ever captured" in r.getMessage()]
    assert len(said) == 1 and "--cuda-graph-warmup-steps" in said[0], said
    # a pace the warm-up fits in says nothing
    caplog.clear()
    paced = ["--offload-interval", "8", "--invalidate-after-reload"]
    _, report = run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48", *paced)
    assert report["graphs_captured"] is True
    assert not [r for r in caplog.records if "nothing is ever captured" in r.getMessage()]


def test_two_invalidations_in_one_step_are_not_taken_for_a_starved_warmup(
    bucket_fakes, tmp_path, caplog
):
    """Second review: two invalidations in a row freeing nothing, in the same step, raised
    the "nothing is ever captured" warning (for good: it is said once)."""
    caplog.set_level(logging.WARNING, logger="cudagraph_plugin")
    path = tmp_path / "report.json"
    rl_loop.run(
        [*LOOP, *GRAPHS, "--cuda-graph-buckets", "16,32,48", "--cuda-graph-report-json", str(path)],
        plugins=[InvalidateAt(0, reasons=("weights reloaded", "optimizer state reloaded"))],
    )
    report = json.loads(path.read_text())
    assert [e["step"] for e in report["invalidations"]] == [0, 0]
    assert {e["then"] for e in report["invalidations"]} == {"each bucket's warm-up starts over"}
    assert report["graphs_captured"] is True
    assert not [r for r in caplog.records if "nothing is ever captured" in r.getMessage()]


class InvalidateBeforeTraining:
    """The host's invalidation before the first step (a checkpoint loaded after the build)."""

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.pm = pluginmanager

    @hookimpl(trylast=True)  # (after the CUDA graph plugin's)
    def mcgraph_model_built(self):
        self.pm.hook.mcgraph_invalidate_graphs(reason="checkpoint loaded")


def test_an_invalidation_that_frees_nothing_says_what_it_did(bucket_fakes, tmp_path, caplog):
    """(review of 2026-12-05: one before the first step read "invalidated  step None: ...
    (0 freed; recaptured after their warm-up)": nothing was freed, nothing to recapture.)"""
    caplog.set_level(logging.INFO, logger="cudagraph_plugin")
    path = tmp_path / "report.json"
    rl_loop.run(
        [*LOOP, *GRAPHS, "--cuda-graph-buckets", "16,32,48", "--cuda-graph-report-json", str(path)],
        plugins=[InvalidateBeforeTraining()],
    )
    [event] = json.loads(path.read_text())["invalidations"]
    assert event == {
        "step": None, "reason": "checkpoint loaded", "graphs_freed": 0,
        "then": "each bucket's warm-up starts over",
    }  # fmt: skip
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "invalidated  before the first step: checkpoint loaded (0 freed; each bucket's" in said
    assert "step None" not in said


def test_the_fingerprint_check_is_what_catches_the_move(bucket_fakes, tmp_path, monkeypatch):
    """Without the plugin's address check the replay after a reload reads the old
    gradient buffers: the fake graph refuses it (a real one would read freed memory)."""
    _reloads_land_elsewhere(monkeypatch)
    monkeypatch.setattr(MoveWatch, "moved", lambda self, holds_graphs=True: [])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(tmp_path, *GRAPHS, "--cuda-graph-buckets", "16,32,48", "--offload-interval", "8")


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--eval-interval", "2"], "--eval-interval does not apply"),
        (["--min-length", "40", "--max-length", "20"], "--min-length"),
        (["--offload-interval", "6"], "multiple of --steps-per-round"),
        (["--pad-to-buckets", "16,64"], "exceeds --seq-length"),
        (["--pad-to-buckets", "16,x"], "--pad-to-buckets: 'x' is not a sequence length"),
        (["--pad-to-buckets", "16,16"], "--pad-to-buckets has a length twice"),
    ],
)
def test_bad_loop_flags_are_refused_with_the_fix(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rl_loop.run([*LOOP, "--cpu", *argv])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


TE = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"]


@pytest.mark.parametrize(
    "argv,refused",
    [
        (GRAPHS, "its rollouts (forward only, never padded) and training steps would come "
         "at length(s) 4, 5, 6, ... 48"),
        (["--cuda-graph-impl", "full_iteration"], "add --cuda-graph-buckets"),
        # megatron-core 0.19's field name, read as the plugin reads it
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "full_iteration"],
         "add --cuda-graph-buckets"),
        # the training steps are all 48: only the rollouts change
        ([*GRAPHS, "--pad-to-buckets", "48"], "its rollouts (forward only, never padded) "
         "would come at length(s) 4, 5, 6, ... 48"),
        ([*TE, "--pad-to-buckets", "16,32,48"], "its training steps (after --pad-to-buckets) "
         "would come at length(s) 16, 32, 48"),
        ([*TE, "--pad-to-buckets", "32"], "length(s) 32, 33, 34, ... 48"),
        (TE, "pad every training step to it (--pad-to-buckets 48)"),
        # one length, but not the model's: TE captured its graphs for --seq-length (seen on
        # an H100, 2026-12-05: StaticShapeError after the capture, "captured for seq_length=32")
        ([*TE, "--pad-to-buckets", "24", "--max-length", "24"], "captured for the model's "
         "--seq-length (48), and its training steps (after --pad-to-buckets) would come at "
         "length(s) 24"),
        ([*TE, "--min-length", "20", "--max-length", "20"], "and its training steps would "
         "come at length(s) 20"),
        ([*TE, "--pad-to-buckets", "48"], None),
        ([*TE, "--min-length", "48"], None),
        ([*GRAPHS, "--cuda-graph-buckets", "16,32,48"], None),
        # a bad --cuda-graph-buckets beside --pad-to-buckets is the plugin's to name (it was
        # told "add --cuda-graph-buckets")
        ([*GRAPHS, "--pad-to-buckets", "16,32", "--cuda-graph-buckets", "16,x"], None),
        ([*GRAPHS, "--pad-to-buckets", "16,32", "--cuda-graph-buckets", "0"], None),
        ([*GRAPHS, "--min-length", "48"], None),
        ([*GRAPHS, "--min-length", "20", "--max-length", "20"], None),
        (["--cuda-graph-impl", "local"], None),  # (the plugin refuses it, with its own fix)
        ([], None),
    ],
)  # fmt: skip
def test_graphs_that_would_see_a_changed_shape_are_refused_before_the_build(argv, refused, capsys):
    """Without buckets a CUDA graph holds one shape: lengths this loop would draw that change
    it are refused up front, not by the plugin's guard once the model is built."""
    parser = rl_loop.build_parser(get_plugin_manager())
    args = parser.parse_args([*LOOP, *argv])
    if refused is None:
        rl_loop._check(parser, args, use_cuda=False)
        return
    with pytest.raises(SystemExit) as exit_info:
        rl_loop._check(parser, args, use_cuda=False)
    assert exit_info.value.code == 2
    assert refused in capsys.readouterr().err


def test_a_refused_shape_stops_the_run_before_the_model_is_built(monkeypatch, capsys):
    monkeypatch.setattr(rl_loop.train_gpt, "set_up", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(SystemExit) as exit_info:
        rl_loop.run([*LOOP, "--cpu", *GRAPHS])
    assert exit_info.value.code == 2
    assert "a full-iteration graph holds one shape" in capsys.readouterr().err


def test_every_problem_of_the_loop_flags_is_said_at_once(capsys):
    """(each was said alone, after a 50-line usage dump; the host's before the loop's, so
    the first fix could point the wrong way: --eval-iters, for a flag the loop refuses)"""
    with pytest.raises(SystemExit) as exit_info:
        rl_loop.run(
            [*LOOP, "--cpu", "--offload-interval", "6", "--pad-to-buckets", "16,64",
             "--eval-interval", "2", "--eval-iters", "0"]
        )  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "rl_loop.py: error: 4 problems:\n  1. --eval-interval 2 needs --eval-iters >= 1" in err
    assert "\n  2. --eval-interval does not apply to rl_loop.py" in err, err
    assert "\n  3. --offload-interval 6 must be" in err, err
    assert "\n  4. --pad-to-buckets: the largest bucket (64) exceeds --seq-length" in err, err
    assert "usage:" not in err


@pytest.mark.parametrize("bf16,refused", [([], True), (["--bf16"], False)])
def test_offload_on_a_gpu_needs_bf16(bf16, refused, capsys):
    """An fp32 optimizer's parameters are the model's: megatron-core's offload_to_cpu() would
    take the rollout's weights off the GPU (seen on an H200: the rollout then fails in the
    embedding with tensors on two devices). On the CPU it moves nothing."""
    parser = rl_loop.build_parser(get_plugin_manager())
    args = parser.parse_args([*LOOP, "--offload-interval", "8", *bf16])
    if not refused:
        rl_loop._check(parser, args, use_cuda=True)
        return
    with pytest.raises(SystemExit):
        rl_loop._check(parser, args, use_cuda=True)
    assert "--offload-interval needs --bf16 on a GPU" in capsys.readouterr().err


def test_offload_without_bf16_on_the_cpu_goes_on_with_the_gpus_refusal_as_a_warning(caplog):
    """(A user trial: the CPU rehearsal accepted what the GPU run then refused, without a
    word.) On the CPU the offload moves nothing, so the run goes on, saying it."""
    parser = rl_loop.build_parser(get_plugin_manager())
    args = parser.parse_args([*LOOP, "--offload-interval", "8"])
    with caplog.at_level(logging.WARNING, logger="rl_loop"):
        rl_loop._check(parser, args, use_cuda=False)
    warned = [r.getMessage() for r in caplog.records if r.name == "rl_loop"]
    assert len(warned) == 1 and warned[0].startswith("--offload-interval needs --bf16 on a GPU")
    assert warned[0].endswith("on the CPU the offload moves nothing, so this run goes on")
    caplog.clear()
    args = parser.parse_args([*LOOP, "--offload-interval", "8", "--bf16"])
    with caplog.at_level(logging.WARNING, logger="rl_loop"):
        rl_loop._check(parser, args, use_cuda=False)
    assert not [r for r in caplog.records if r.name == "rl_loop"]


def test_two_data_parallel_ranks_pad_each_step_to_one_agreed_bucket(tmp_path, subprocess_env):
    """Each rank draws its own lengths; the ranks agree on the step's longest, so every
    step has one bucket on both ranks (the graphs of a step hold collectives)."""
    script = tmp_path / "host.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "import rl_loop\n"
        f"summary = rl_loop.run({[*LOOP, '--cpu', '--pad-to-buckets', '16,32,48']!r})\n"
        f"path = os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK'] + '.json')\n"
        "json.dump(summary, open(path, 'w'))\n"
    )
    result = subprocess.run(
        torchrun_command(2, script),
        capture_output=True, text=True, timeout=300, env=subprocess_env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["seq_lengths"] == second["seq_lengths"]
    assert len(set(first["seq_lengths"])) > 1
    # the ranks' own data differ: their losses do
    assert first["losses"] != second["losses"]


@pytest.mark.parametrize("replay_factor,verdict", [(0.5, "faster"), (1.5, "slower")])
def test_the_verdict_compares_each_buckets_replays_with_its_own_eager_steps(
    bucket_fakes, tmp_path, monkeypatch, replay_factor, verdict
):
    """Step times made up per bucket (eager 10, 20 or 80 ms by length, a replay
    ``replay_factor`` of that, a capture 5x): every bucket replays at exactly
    ``replay_factor`` of its own eager time, so the run's speed-up is its inverse, whatever
    the mix of lengths before and after the first capture."""
    from cudagraph_plugin.runtime.buckets import Action, BucketGraphs
    from cudagraph_plugin.runtime.timing import StepTimer

    seen: dict[int, tuple[int, Action]] = {}
    run_route = BucketGraphs.run

    def recorded(self, route, eager, kwargs, step=None):
        if route.key is not None:
            seen[step] = (route.key.seq_length, route.action)
        return run_route(self, route, eager, kwargs, step)

    def made_up(self, sync=True):
        base = {16: 10.0, 32: 20.0, 48: 80.0}
        factor = {Action.REPLAY: replay_factor, Action.CAPTURE: 5.0}
        return {s: base[length] * factor.get(a, 1.0) for s, (length, a) in seen.items()}

    monkeypatch.setattr(BucketGraphs, "run", recorded)
    monkeypatch.setattr(StepTimer, "durations_ms", made_up)
    argv = [*GRAPHS, "--cuda-graph-buckets", "16,32,48", "--train-iters", "40"]
    _, report = run(tmp_path, *argv, "--cuda-graph-warmup-steps", "3")
    assert report["verdict"] == verdict
    assert report["speedup"] == pytest.approx(1 / replay_factor)
    replays = {s for s, (_, a) in seen.items() if a is Action.REPLAY}
    assert set(report["replay_steps"]) == replays
    firsts = {min(s for s, (n, _) in seen.items() if n == length) for length in (16, 32, 48)}
    eager = {s for s, (_, a) in seen.items() if a is Action.WARMUP} - firsts
    assert set(report["eager_steps"]) == eager
    if verdict == "slower":
        assert "150% of the eager step time" in report["verdict_text"]
    assert report["break_even_steps"] is None  # each bucket has its own


def test_with_sequence_parallelism_every_length_drawn_splits_over_the_tensor_parallel_ranks():
    # megatron-core splits each sequence over the tensor-parallel ranks: a rollout (no bucket
    # pads it) of an odd length would fail in the model
    from types import SimpleNamespace

    def data(*argv: str) -> rl_loop._Data:
        parser = rl_loop.build_parser(get_plugin_manager())
        args = parser.parse_args(["--seq-length", "64", "--min-length", "5", *argv])
        rl_loop._check(parser, args, use_cuda=False)
        return rl_loop._Data(args, SimpleNamespace(device=torch.device("cpu"), dp_rank=0))

    split = data("--sequence-parallel", "--tensor-model-parallel-size", "4")
    lengths = [split.micro_batch()["tokens"].shape[-1] for _ in range(40)]
    assert all(n % 4 == 0 and 8 <= n <= 64 for n in lengths) and len(set(lengths)) > 3
    # without sequence parallelism, the draws are those of before (any length in range)
    plain = [data().micro_batch()["tokens"].shape[-1] for _ in range(1)]
    assert plain == [data().lengths.randint(5, 64)]
    parser = rl_loop.build_parser(get_plugin_manager())
    narrow = parser.parse_args(
        ["--seq-length", "64", "--min-length", "5", "--max-length", "7", "--sequence-parallel",
         "--tensor-model-parallel-size", "4"]
    )  # fmt: skip
    with pytest.raises(SystemExit):
        rl_loop._check(parser, narrow, use_cuda=False)
    # the eager twin's --pad-to-buckets too (the plugin's rule checks --cuda-graph-buckets)
    uneven = parser.parse_args(
        ["--seq-length", "64", "--sequence-parallel", "--tensor-model-parallel-size", "4",
         "--pad-to-buckets", "10,32,62"]
    )  # fmt: skip
    with pytest.raises(SystemExit):
        rl_loop._check(parser, uneven, use_cuda=False)
