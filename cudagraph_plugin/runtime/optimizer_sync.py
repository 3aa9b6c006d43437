"""What the host writes into the optimizer's param groups reaches the captured optimizer step.

A captured optimizer step reads its hyperparameters as they were at capture:

* a **device tensor** (the learning rate of Transformer Engine's and Apex's ``FusedAdam`` with
  ``capturable=True``, and of ``torch.optim.Adam``/``AdamW`` given a tensor ``lr``; TE's
  ``group["step"]``) is read *by address* at every replay. Filling it in place (megatron-core
  0.19's ``OptimizerParamScheduler``) reaches the graph. Replacing it in the param group (a
  Python float, as megatron-core 0.16's scheduler and most custom loops write, or a new tensor
  such as ``0.1 * group["lr"]``) does not: the graph keeps the old address, and once nothing
  references the old tensor the caching allocator hands its memory to other tensors, so
  replays read whatever lands there (a loss of 4.5 became 512, then NaN, on an H200);
* a **Python number** (``weight_decay``, ``betas``, ``eps`` everywhere; ``lr`` of a torch
  Adam built with a float) is baked into the captured kernels: later writes never reach them.

:class:`HyperparameterSync` holds the captured tensors (so their memory is never reused while
the graph lives), and before every replay copies a value the host wrote in their place into
them (``fill_``/``copy_``, on the device, ordered before the replay on the current stream),
and says so once per key in the log. A number written in its place is filled in and the
captured tensor is put back into the param group; a tensor the host put in place of a
hyperparameter (``lr``, ``weight_decay``, ``betas``, ``eps``) on the same device stays there
(the host may keep filling it in place) and is copied before every replay; any other
(a loaded ``step`` counter, which the captured step keeps counting on, or a tensor on another
device) is copied once and the captured tensor put back. A changed Python
number, a value it cannot copy, different values written to groups that read one captured
tensor (torch gives every group the optimizer's ``lr`` tensor unless the group names its own),
or parameters added to or removed from a group, raise :class:`HyperparameterChangedError`
naming the group, key, both values and the fix, before the replay.
:func:`promote_lr_to_tensor` gives a capturable torch Adam a tensor learning rate before the
capture, so a scheduled learning rate keeps working.

torch is imported inside the functions only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import sys
from typing import Any

from cudagraph_plugin import compat

logger = logging.getLogger("cudagraph_plugin")

# Read by every Adam's step; anything else a param group holds as a tensor is watched too.
WATCHED_KEYS = ("lr", "weight_decay", "betas", "eps")

_MISSING = object()

FIX_LR = (
    "give the optimizer a tensor learning rate before the capture "
    "(cudagraph_plugin.runtime.optimizer_sync.promote_lr_to_tensor(optimizer) does it for "
    "torch.optim.Adam/AdamW with capturable=True; Transformer Engine's and Apex's FusedAdam "
    "with capturable=True hold one already), or turn the optimizer graph off"
)
FIX_BAKED = (
    "keep {key} constant for the whole run (megatron-core: weight_decay_incr_style='constant', "
    "i.e. start_weight_decay == end_weight_decay; Megatron-LM: --weight-decay-incr-style "
    "constant), or turn the optimizer graph off"
)
# OptimizerConfig fields megatron-core reads in Python inside the step it captures (the clip
# branch and factor; the zero count; 0.19's skip threshold, whose default inf skips the
# comparison): the captured step keeps their capture-time values.
CONFIG_KEYS = ("clip_grad", "log_num_zeros_in_grad", "grad_norm_skip_threshold")
FIX_CONFIG = (
    "keep OptimizerConfig.{key} fixed for the whole run (set it before run.model_built()), or "
    "free the graphs first with run.invalidate_graphs() (buckets are captured again)"
)

FIX_GROUPS = (
    "build all param groups and their parameters before the capture and keep them (no "
    "add_param_group, no removed groups, no parameters added to or removed from a group) "
    "while the optimizer graph lives, or turn the optimizer graph off"
)
FIX_SHARED = (
    "give each param group its own {key} tensor before the capture (e.g. "
    "{{'params': [...], '{key}': torch.tensor(value, device='cuda')}} per group, or a float "
    "{key} and cudagraph_plugin.runtime.optimizer_sync.promote_lr_to_tensor(optimizer)), or "
    "write the same value to every group that shares it"
)


class HyperparameterChangedError(RuntimeError):
    """A param-group value or an optimizer setting changed after the optimizer step was
    captured, in a way the captured step cannot follow. ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = [
            f"{len(self.problems)} optimizer setting(s) changed after the optimizer step was "
            "captured in a CUDA graph; the next replay would not use them:"
        ]
        lines += [f"  {i}. {p}" for i, p in enumerate(self.problems, 1)]
        super().__init__("\n".join(lines))


def _is_tensor(value: Any) -> bool:
    # runs for every watched value before every replay: torch from sys.modules (without
    # torch imported, nothing is a tensor)
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


# Values compared with == directly (no tensor can hide inside them).
_PLAIN = (float, int, str)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _same(captured: Any, current: Any) -> bool:
    """Whether ``current`` is what the captured step reads: the same tensor object, or an
    equal Python value (compared without reading any tensor)."""
    if captured is current:
        return True
    if type(current) is type(captured) and type(current) in _PLAIN and current == captured:
        return True  # the common case before each replay, a value rewritten unchanged
    if _is_tensor(captured) or _is_tensor(current):
        return False
    if isinstance(captured, (tuple, list)) and isinstance(current, (tuple, list)):
        return len(captured) == len(current) and all(
            _same(a, b) for a, b in zip(captured, current, strict=True)
        )
    if _is_number(captured) and _is_number(current):
        # an int 0 at capture and a float 0.0 written later bake the same kernel argument
        return captured == current or (math.isnan(captured) and math.isnan(current))
    return type(captured) is type(current) and captured == current


def _show(value: Any) -> str:
    if value is _MISSING:
        return "no value (the key was removed)"
    if _is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{type(value).__name__} {value!r}"


@dataclasses.dataclass
class _Group:
    group: dict[str, Any]
    tensors: dict[str, Any]  # key -> the captured device tensor
    baked: dict[str, Any]  # key -> the captured Python value
    n_params: int = 0  # how many parameters the captured step updates in this group


class HyperparameterSync:
    """The param-group values a captured optimizer step reads, and their upkeep.

    Call :meth:`watch` right before the capture call, :meth:`before_replay` before every
    later ``optimizer.step()`` (each one replays), :meth:`release` when the graph is freed.
    ``copies`` counts the host writes copied into captured tensors.
    """

    def __init__(self, optimizer: Any, groups: list[_Group | None]) -> None:
        self.optimizer = optimizer
        self._groups: list[_Group | None] = groups
        # id of each captured tensor -> the tensor and the (group, key) slots that read it
        slots: dict[int, tuple[Any, list[tuple[int, str]]]] = {}
        for index, watched in enumerate(groups):
            for key, captured in (watched.tensors if watched else {}).items():
                slots.setdefault(id(captured), (captured, []))[1].append((index, key))
        self._captured_ids = frozenset(slots)
        # the captured tensors read by more than one slot, with those slots
        self._shared = [(captured, where) for captured, where in slots.values() if len(where) > 1]
        self._logged: set[tuple[str, bool]] = set()
        self.copies = 0
        self._released = False
        config = compat.optimizer_config(optimizer)
        self._config = config
        self._config_values = {
            key: getattr(config, key) for key in CONFIG_KEYS if hasattr(config, key)
        }

    @classmethod
    def watch(cls, optimizer: Any) -> HyperparameterSync:
        """Record what the step about to be captured reads from ``optimizer.param_groups``
        (megatron-core's optimizers and ``ChainedOptimizer`` expose their inner groups there).
        Groups without parameters are not read by any Adam's step and are not watched."""
        groups: list[_Group | None] = []
        for group in optimizer.param_groups:
            if not group.get("params"):
                groups.append(None)
                continue
            tensors: dict[str, Any] = {}
            baked: dict[str, Any] = {}
            for key, value in group.items():
                if key == "params":
                    continue
                if _is_tensor(value):
                    tensors[key] = value
                elif key in WATCHED_KEYS:
                    baked[key] = value
            groups.append(_Group(group, tensors, baked, len(group["params"])))
        return cls(optimizer, groups)

    @property
    def description(self) -> str:
        """One line for the run report."""
        watched = [g for g in self._groups if g is not None]
        in_tensors = sorted({k for g in watched for k in g.tensors})
        baked = sorted({k for g in watched for k in g.baked})
        return (
            f"optimizer graph hyperparameters: {len(watched)} param group(s); read from device "
            f"tensors: {', '.join(in_tensors) or 'none'}; baked at capture: "
            f"{', '.join(baked) or 'none'}; host writes copied before replays: {self.copies}"
        )

    def before_replay(self) -> None:
        """Bring host writes into the captured tensors, or raise before the replay.

        Nothing is changed when anything is wrong: every problem is reported at once.
        """
        if self._released:
            raise RuntimeError(
                "HyperparameterSync.before_replay() after release(): the optimizer graph it "
                "watched was freed; watch() the optimizer again before a new capture"
            )
        config = self._config
        if config is not None:
            changed = [
                (key, getattr(config, key, _MISSING), captured)
                for key, captured in self._config_values.items()
                if not _same(captured, getattr(config, key, _MISSING))
            ]
            if changed:
                raise HyperparameterChangedError(
                    [
                        f"OptimizerConfig.{key} is now {_show(value)}, {_show(captured)} at "
                        "capture: megatron-core reads it in Python inside the captured step, "
                        f"which keeps the capture's value; fix: {FIX_CONFIG.format(key=key)}"
                        for key, value, captured in changed
                    ]
                )
        # Read every time through the optimizer itself, though megatron-core's wrappers
        # build the list anew in a property: reading the inner torch optimizers' lists
        # directly is sound only with a check of the wrappers on the way (a host may swap
        # an inner optimizer or add a chained one), and on the H200 that check cost what
        # the direct read saved (BENCHMARKS.md 2i).
        current = self.optimizer.param_groups
        if type(current) is not list:
            current = list(current)
        if self._unchanged(current):
            return
        if len(current) != len(self._groups):
            raise HyperparameterChangedError(
                [
                    f"optimizer.param_groups has {len(current)} group(s), "
                    f"{len(self._groups)} at capture; fix: {FIX_GROUPS}"
                ]
            )
        problems: list[str] = []
        copies: list[tuple[int, str, Any, Any]] = []
        for index, (watched, group) in enumerate(zip(self._groups, current, strict=True)):
            n_params = len(group.get("params") or ())
            if watched is None and not n_params:
                continue
            if watched is None or n_params != watched.n_params:
                problems.append(
                    f"param_groups[{index}] has {n_params} parameter(s), "
                    f"{watched.n_params if watched else 0} at capture: the captured step "
                    f"updates only the parameters it was captured with; fix: {FIX_GROUPS}"
                )
                continue
            for key, captured in watched.tensors.items():
                value = group.get(key, _MISSING)
                if value is captured:
                    continue
                problem = self._copy_problem(captured, value)
                if problem:
                    problems.append(
                        f"param_groups[{index}][{key!r}] is now {_show(value)}; the captured "
                        f"step reads {_show(captured)}: {problem}"
                    )
                else:
                    copies.append((index, key, captured, value))
            for key, captured in watched.baked.items():
                value = group.get(key, _MISSING)
                if not _same(captured, value):
                    fix = FIX_LR if key == "lr" else FIX_BAKED.format(key=key)
                    problems.append(
                        f"param_groups[{index}][{key!r}] is now {_show(value)}, "
                        f"{_show(captured)} at capture: a Python value is baked into the "
                        f"captured kernels; fix: {fix}"
                    )
        problems += self._shared_problems(current)
        if problems:
            raise HyperparameterChangedError(problems)
        captured_ids = self._captured_ids
        # a captured tensor written into another slot (two groups' tensors swapped) is read
        # before any copy overwrites it
        copies = [
            (i, k, c, v.clone() if _is_tensor(v) and id(v) in captured_ids else v)
            for i, k, c, v in copies
        ]
        for index, key, captured, value in copies:
            if _is_tensor(value):
                captured.copy_(value.reshape(captured.shape))
            else:
                captured.fill_(value)
            kept = (
                key in WATCHED_KEYS  # read, never written, by the step ("step" counts on)
                and _is_tensor(value)
                and id(current[index][key]) not in captured_ids
                and value.device == captured.device  # no host-to-device copy every step
            )
            if not kept:  # a number, a loaded step counter, a tensor on another device, or
                current[index][key] = captured  # another group's captured tensor
            self.copies += 1
            if (key, kept) not in self._logged:
                self._logged.add((key, kept))
                logger.info(
                    "optimizer graph: the host replaced param_groups[%d][%r] (now %s) after the "
                    "capture; its value is copied into the captured device tensor before each "
                    "replay (%s; logged once per key and way; filling the tensor in place, as "
                    "megatron-core 0.19's scheduler does, needs no copy)",
                    index,
                    key,
                    _show(value),
                    "the host's tensor stays in the group, so later in-place writes to it are "
                    "copied too"
                    if kept
                    else "the captured tensor is put back in the group",
                )

    def _shared_problems(self, current: list[Any]) -> list[str]:
        """Groups that read one captured tensor must be given one value: a replay can give
        them nothing else. Only numbers are compared (equal) and tensors by identity, so
        nothing is read from the device."""
        problems = []
        for captured, where in self._shared:
            values = [current[i].get(k, _MISSING) for i, k in where]
            if all(v is captured for v in values):
                continue
            first = values[0]
            if all(v is first for v in values) or (
                all(_is_number(v) for v in values) and all(v == first for v in values)
            ):
                continue
            names = ", ".join(f"param_groups[{i}][{k!r}]" for i, k in where)
            shown = "; ".join(
                f"[{i}] {'the captured tensor, unchanged' if v is captured else _show(v)}"
                for (i, _), v in zip(where, values, strict=True)
            )
            problems.append(
                f"{names} read one captured tensor, and they now hold different values "
                f"({shown}); a replay can give them only one; fix: "
                + FIX_SHARED.format(key=where[0][1])
            )
        return problems

    def _unchanged(self, current: Any) -> bool:
        """Every watched value is what the captured step reads: the captured tensor itself,
        or a number, string or the same object equal to the captured value (the usual case
        before a replay, e.g. megatron-core's scheduler rewriting an unchanged weight decay).
        False sends :meth:`before_replay` the long way, which decides and explains."""
        if len(current) != len(self._groups):
            return False
        for watched, group in zip(self._groups, current, strict=True):
            if watched is None:
                if group.get("params"):
                    return False
                continue
            if len(group.get("params") or ()) != watched.n_params:
                return False
            for key, captured in watched.tensors.items():
                if group.get(key, _MISSING) is not captured:
                    return False
            for key, captured in watched.baked.items():
                value = group.get(key, _MISSING)
                if value is not captured and not (
                    type(value) is type(captured) and type(value) in _PLAIN and value == captured
                ):
                    return False
        return True

    @staticmethod
    def _copy_problem(captured: Any, value: Any) -> str | None:
        if _is_number(value):
            return None
        if _is_tensor(value):
            if value.numel() != captured.numel():
                return (
                    f"it has {value.numel()} element(s), the captured tensor "
                    f"{captured.numel()}; fix: write a number or a one-element tensor, or "
                    "fill the tensor in place (group[key].fill_(value))"
                )
            return None
        return (
            "only a number or a tensor of the same size can be copied into the captured "
            "tensor; fix: write a number, or fill the tensor in place (group[key].fill_(value))"
        )

    def release(self) -> None:
        """Drop the captured tensors (the graph that read them is gone)."""
        self._groups = []
        self.optimizer = None
        self._released = True


def promote_lr_to_tensor(optimizer: Any) -> int:
    """Give every param group of a capturable ``torch.optim.Adam``/``AdamW`` (inside
    megatron-core's wrappers too) whose learning rate is a Python number a float32 tensor
    with that value on its parameters' device; torch reads a tensor ``lr`` on the device
    when ``capturable=True``. Call it before the capture. Returns how many groups changed.
    Other optimizers are left alone (Transformer Engine's and Apex's capturable FusedAdam
    hold a tensor already; others may not accept one)."""
    import torch

    changed = 0
    for inner in compat.torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            params = group.get("params") or []
            if not group.get("capturable") or not params or not _is_number(group.get("lr")):
                continue
            group["lr"] = torch.tensor(
                float(group["lr"]), dtype=torch.float32, device=params[0].device
            )
            changed += 1
    if changed:
        logger.info(
            "optimizer graph: %d param group(s) of a capturable torch Adam now hold their "
            "learning rate in a device tensor, so the captured step follows the schedule",
            changed,
        )
    return changed
