"""That every rank of a job runs the same CUDA graph settings, checked once the process group
exists (the first of ``run.rng_initialized`` and ``run.model_built``), and the same steps
(``start_step``, ``train_iters``: at the training start).

Each rank validates its own configuration alone; a launcher that gives one rank other
arguments or another environment (``--cuda-graph-warmup-steps 5`` on one node, graphs off
on another) passes every rank's check, and the job then deadlocks: one rank captures at its
capture step while another runs its step eagerly, each waiting in a different collective,
with no word. One all-reduce of a digest of each setting (its maximum and its minimum over
the ranks) tells every rank which settings differ; every rank then refuses the run the same
way, naming them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NoReturn

from cudagraph_plugin import compat
from cudagraph_plugin.config.errors import CudaGraphConfigError, Violation
from cudagraph_plugin.config.settings import Settings

# (a rank's own path: made absolute in its working directory, which may differ by node)
_PER_RANK = frozenset({"report_json"})


def compared_fields() -> list[str]:
    """The settings compared across ranks: every field a configuration sets, not where it
    was read from (``sources``, ``paths``) nor a rank's own file."""
    return [
        field.name
        for field in dataclasses.fields(Settings)
        if field.compare and field.name not in _PER_RANK
    ]


def _canonical(value: Any) -> str:
    """``value``'s text, the items of a tuple in sorted order: a scope or module list read
    from a set has its process's hash order (``PYTHONHASHSEED`` differs by process), and
    megatron-core reads those as sets."""
    if isinstance(value, tuple | list | set | frozenset):
        value = sorted(map(repr, value))
    return repr(value)


def _digest(value: Any) -> int:
    """A 56-bit digest of ``value``'s canonical text (its negation still fits an int64)."""
    return int.from_bytes(hashlib.sha256(_canonical(value).encode()).digest()[:7], "big")


def _differ_across_ranks(values: list[int]) -> list[bool]:
    """For each value, whether it differs between the ranks: one all-reduce of the values and
    their negations (the maximum and the minimum over the ranks), the same answer on every
    rank; nothing differs in a single-rank job."""
    folded = compat.max_across_ranks(values + [-value for value in values])
    highest, lowest = folded[: len(values)], folded[len(values) :]
    return [high != -low for high, low in zip(highest, lowest, strict=True)]


def _refuse(differing: list[tuple[str, Any]], consequence: str, fix: str) -> NoReturn:
    """Every rank's refusal of the run: one problem per (field, this rank's value), each
    saying which ranks have which value (every rank refuses, so every rank joins the one
    gather this takes)."""
    mine = [(_canonical(value), repr(value)) for _, value in differing]
    everyone = compat.gather_across_ranks(mine)
    raise CudaGraphConfigError(
        [
            Violation(
                (field,),
                value,
                f"differs between the ranks of this job ({_spread([v[i] for v in everyone])}): "
                + consequence,
                fix,
            )
            for i, ((field, _), (_, value)) in enumerate(zip(differing, mine, strict=True))
        ]
    )


def _spread(values: list[tuple[str, str]], shown: int = 4) -> str:
    """Which ranks hold which value (``3 on ranks 0-1; 5 on rank 2``), from each rank's
    (canonical text, shown text): the most common value first, a value as its first rank
    shows it; past ``shown`` values, how many more there are."""
    ranks: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    for rank, (canonical, value) in enumerate(values):
        ranks.setdefault(canonical, []).append(rank)
        text.setdefault(canonical, value)
    groups = sorted(ranks.items(), key=lambda item: (-len(item[1]), item[1][0]))
    said = [
        f"{text[canonical]} on rank{'s' if len(held) > 1 else ''} {_rank_ranges(held)}"
        for canonical, held in groups[:shown]
    ]
    if len(groups) > shown:
        said.append(f"{len(groups) - shown} more value(s)")
    return "; ".join(said)


def _rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5`` (sorted ranks)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def differing_settings(settings: Settings) -> list[str]:
    """The settings whose value differs between the ranks (one all-reduce over the default
    group; the same list on every rank; none in a single-rank job)."""
    names = compared_fields()
    differ = _differ_across_ranks([_digest(getattr(settings, name)) for name in names])
    return [name for name, differs in zip(names, differ, strict=True) if differs]


def check_once(state: Any) -> None:
    """:func:`check_settings_agree` for the run (``RunState``), once, where the process group
    exists with more than one rank."""
    if state.settings_agreed or compat.distributed_world()[1] < 2:
        return
    state.settings_agreed = True
    check_settings_agree(state.settings)


def check_settings_agree(settings: Settings) -> None:
    """Refuse the run on every rank where the ranks' settings differ: one problem per
    setting, with this rank's value."""
    differing = differing_settings(settings)
    if not differing or (settings.impl == "none" and "impl" not in differing):
        return  # (graphs off on every rank: nothing of the plugin's can disagree)
    _refuse(
        [(settings.field(name), getattr(settings, name)) for name in differing],
        "ranks that capture at different steps, or some with graphs and some without, wait "
        "in different collectives for good",
        "give every rank the same CUDA graph settings (the same arguments and environment "
        "from the launcher)",
    )


def check_steps_agree(start_step: int, train_iters: int) -> None:
    """Refuse the run on every rank where the ranks train different steps (one all-reduce,
    at the training start of a multi-rank job): a rank that ends its run first leaves the
    others in a collective that no peer joins, which over NCCL only its timeout ends (a
    normal end marks no failure for the peer watch to act on)."""
    if compat.distributed_world()[1] < 2:
        return
    steps = (
        ("TrainingRun(start_step=...)", start_step),
        ("TrainingRun(train_iters=...)", train_iters),
    )
    differ = _differ_across_ranks([start_step, train_iters])
    differing = [step for step, differs in zip(steps, differ, strict=True) if differs]
    if differing:
        _refuse(
            differing,
            "a rank that ends its run first leaves the others waiting in a collective no peer "
            "joins",
            "give every rank the same steps (the same --train-iters and resume step from the "
            "launcher)",
        )
