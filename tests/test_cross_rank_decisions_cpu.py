"""One rank's verdict changes every rank's decision, over real gloo ranks (torchrun).

A decision that changes what a rank executes must be the same on every rank, or a
collective deadlocks. Every other test replaces ``compat.any_rank`` with a stub (one process
cannot all-reduce with itself), so a version that skipped the all-reduce would pass them
all; here the real one runs on 2 and 3 ranks with the verdict on each rank in turn. The same
for the decision ``cudagraph_plugin.runtime.peers`` adds: one rank's failure mark, written in
the job's real store, makes every other rank's watch act (and not the marking rank's own).
Each job is ``tests/peer_host.py --mode decisions``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs import run_cpu_ranks

HOST = Path(__file__).resolve().parent / "peer_host.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def decisions(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Each rank's answers: ``{rank: {"any_rank": {holder: result}, "watch": {holder: ...}}}``."""
    nproc = request.param
    out = tmp_path_factory.mktemp(f"decisions{nproc}")
    result = run_cpu_ranks(
        nproc, HOST, "--mode", "decisions", "--out", str(out),
        log_dir=out, name=f"decisions-{nproc}", timeout_s=150,
    )  # fmt: skip
    answers: dict[int, dict[str, Any]] = {}
    for rank in range(nproc):
        path = out / f"decisions{rank}.json"
        assert path.exists(), f"rank {rank} wrote no answers\n{result.tail()}"
        answers[rank] = json.loads(path.read_text())
    return nproc, answers


def test_any_rank_is_true_on_every_rank_when_one_rank_says_so(decisions):
    nproc, answers = decisions
    for holder in range(nproc):
        got = {rank: answers[rank]["any_rank"][str(holder)] for rank in range(nproc)}
        assert got == dict.fromkeys(range(nproc), True), f"flag true on rank {holder} only"


def test_any_rank_is_false_everywhere_when_no_rank_says_so(decisions):
    nproc, answers = decisions
    assert {rank: answers[rank]["any_rank"]["None"] for rank in range(nproc)} == dict.fromkeys(
        range(nproc), False
    )


def test_one_pipeline_stage_without_graphable_layers_is_known_to_every_rank(decisions):
    # (layers somewhere, a stage without any): what decides whether to capture at all, and
    # whether megatron-core 0.16's helper is refused, must be the same on every rank
    nproc, answers = decisions
    for holder in range(nproc):
        got = {rank: tuple(answers[rank]["te_layers"][str(holder)]) for rank in range(nproc)}
        assert got == dict.fromkeys(range(nproc), (True, True)), f"rank {holder} has none"
    none = {rank: tuple(answers[rank]["te_layers"]["None"]) for rank in range(nproc)}
    assert none == dict.fromkeys(range(nproc), (True, False))
    empty = {rank: tuple(answers[rank]["te_layers"]["all"]) for rank in range(nproc)}
    assert empty == dict.fromkeys(range(nproc), (False, True))


def test_one_rank_failure_mark_is_acted_on_by_every_other_rank(decisions):
    nproc, answers = decisions
    for holder in range(nproc):
        for rank in range(nproc):
            seen = answers[rank]["watch"][str(holder)]
            if rank == holder:  # the rank that marked never reacts to its own mark
                assert seen == {"seen_rank": None, "seen_reason": None, "aborted": 0}
            else:
                assert seen["seen_rank"] == holder, (rank, holder, seen)
                assert seen["seen_reason"] == f"exception: RuntimeError: verdict of rank {holder}"
                assert seen["aborted"] == 1
