"""Device-side gradient norm and clipping for megatron-core's clip-grad path.

megatron-core's ``megatron.core.optimizer.clip_grads`` picks its multi-tensor kernels at import
time, as module globals: Transformer Engine's (``transformer_engine.pytorch.optimizers``; 0.19
also imports ``multi_tensor_scale_tensor``, first shipped in TE 2.14), else Apex's ``amp_C``,
else its local fallback from ``megatron.core.utils``. The fallback's ``local_multi_tensor_l2_norm``
reads every per-tensor norm and the total on the host (``torch.tensor(list of norms)``,
``float(...)``); and where no tensor-scale kernel exists (``multi_tensor_scale_tensor_impl is
None`` in 0.19, always in 0.16) ``get_grad_norm_fp32`` reads the norm with ``.item()``. A host
read cannot be captured in a CUDA graph, and in eager runs it stalls the host once per tensor.

This module owns:

* torch-foreach versions of the kernels, with the call signature megatron-core gives them
  (``op(chunk_size, noop_flag, tensor_lists, *args)``, the ``multi_tensor_applier`` form):
  :func:`multi_tensor_l2norm`, :func:`multi_tensor_scale`, :func:`multi_tensor_scale_tensor`.
  None of them reads a tensor on the host;
* the decision whether megatron-core's clip-grad path reads the host here
  (:func:`plan`, from what the module globals are, never from version numbers);
* the installer (:func:`install`) that replaces those globals and hands back a handle whose
  :meth:`GradNormInstall.restore` puts megatron-core's own objects back.

torch and megatron-core are imported inside the functions only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cudagraph_plugin.config.logs import JOB_WIDE, LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

CLIP_GRADS = "megatron.core.optimizer.clip_grads"

# The module globals megatron-core's clip-grad path calls its kernels through.
L2_NORM = "l2_norm_impl"
SCALE = "multi_tensor_scale_impl"
SCALE_TENSOR = "multi_tensor_scale_tensor_impl"  # megatron-core 0.19+ only

# megatron-core's local fallback, by the name megatron.core.utils defines it under.
_LOCAL_L2_NORM = "megatron.core.utils.local_multi_tensor_l2_norm"
_LOCAL_SCALE = "megatron.core.utils.local_multi_tensor_scale"

_MARK = "_cudagraph_plugin_device_side"


# -- the kernels ------------------------------------------------------------------------------


def _one_list(tensor_lists: Any, op: str) -> list[Any]:
    if len(tensor_lists) != 1:
        raise ValueError(
            f"{op}: tensor_lists has {len(tensor_lists)} list(s); the l2-norm kernel takes "
            "exactly one list of tensors ([grads]), as Transformer Engine's and Apex's do"
        )
    return list(tensor_lists[0])


def _two_lists(tensor_lists: Any, op: str) -> tuple[list[Any], list[Any]]:
    if len(tensor_lists) != 2 or len(tensor_lists[0]) != len(tensor_lists[1]):
        shape = [len(t) for t in tensor_lists]
        raise ValueError(
            f"{op}: tensor_lists has list lengths {shape}; the scale kernel takes two lists "
            "of equal length ([sources, destinations]; [grads, grads] scales in place)"
        )
    return list(tensor_lists[0]), list(tensor_lists[1])


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool | None = None
) -> tuple[Any, Any]:
    """The L2 norm of all tensors in ``tensor_lists[0]``, computed in float32 on their device.

    The contract of Transformer Engine's and Apex's ``multi_tensor_l2norm``: returns
    ``(norm, per_tensor_norms)``, ``norm`` a float32 tensor of shape ``[1]``,
    ``per_tensor_norms`` float32 of shape ``[len(tensors)]`` when ``per_tensor`` is true and
    of shape ``[0]`` otherwise (megatron-core's local fallback returns ``None`` there; its
    callers discard it). It sets ``noop_flag`` to 1 when the norm is not finite and leaves it
    alone otherwise, as older Apex kernels do (newer ones leave it alone either way;
    megatron-core's clip-grad path passes a flag it never reads). ``chunk_size`` is accepted
    for the signature only. An empty list has norm 0, on ``noop_flag``'s device.
    """
    import torch

    tensors = _one_list(tensor_lists, "multi_tensor_l2norm")
    device = tensors[0].device if tensors else noop_flag.device
    if tensors:
        per = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32))
        norm = torch.linalg.vector_norm(per).reshape(1)
    else:
        per = torch.zeros(0, dtype=torch.float32, device=device)
        norm = torch.zeros(1, dtype=torch.float32, device=device)
    if noop_flag is not None:
        noop_flag.masked_fill_(torch.isfinite(norm).logical_not(), 1)
    if not per_tensor:
        per = torch.zeros(0, dtype=torch.float32, device=device)
    return norm, per


def _scale_into(sources: list[Any], destinations: list[Any], scale: Any) -> None:
    import torch

    if not destinations:
        return
    if all(s is d for s, d in zip(sources, destinations, strict=True)):
        torch._foreach_mul_(destinations, scale)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


def multi_tensor_scale(chunk_size: int, noop_flag: Any, tensor_lists: Any, scale: float) -> None:
    """``destinations[i] = sources[i] * scale`` for ``tensor_lists = [sources, destinations]``
    (in place when both lists hold the same tensors), ``scale`` a Python number.

    ``noop_flag`` is left alone, as megatron-core's local fallback does (the fused kernels set
    it for non-finite inputs; megatron-core's clip-grad path passes a dummy it never reads).
    """
    sources, destinations = _two_lists(tensor_lists, "multi_tensor_scale")
    _scale_into(sources, destinations, scale)


def multi_tensor_scale_tensor(
    chunk_size: int, noop_flag: Any, tensor_lists: Any, scale: Any
) -> None:
    """:func:`multi_tensor_scale` with ``scale`` a one-element tensor on the device (megatron-core
    0.19's clip coefficient, shape ``[1]``), read by the kernel, never by the host."""
    if scale.numel() != 1:
        raise ValueError(
            f"multi_tensor_scale_tensor: scale has shape {tuple(scale.shape)}; it must hold "
            "exactly one element (megatron-core passes the clip coefficient, shape [1])"
        )
    sources, destinations = _two_lists(tensor_lists, "multi_tensor_scale_tensor")
    _scale_into(sources, destinations, scale.reshape(()))


for _kernel in (multi_tensor_l2norm, multi_tensor_scale, multi_tensor_scale_tensor):
    setattr(_kernel, _MARK, True)


# -- the decision -----------------------------------------------------------------------------


def _qualified(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or ""
    return f"{module}.{name}" if module else name


def _describe(obj: Any) -> str:
    if obj is None:
        return "None"
    name = getattr(obj, "__name__", None)
    return name if isinstance(name, str) else type(obj).__name__


def _is_ours(obj: Any) -> bool:
    return bool(getattr(obj, _MARK, False))


@dataclasses.dataclass(frozen=True)
class GradNormPlan:
    """What megatron-core's clip-grad path does here and what :func:`install` would change.

    ``reads_host``: whether the path reads the gradient norm on the host as installed;
    ``reads_host_after``: whether it still does once ``replacements`` are in place (the
    ``.item()`` of a megatron-core without a tensor-scale global cannot be replaced);
    ``None``: the module's layout is not known. ``replacements`` maps global names to the
    device-side kernels that replace them; ``reason`` says why, in one sentence.
    """

    reads_host: bool | None
    reads_host_after: bool | None
    replacements: dict[str, Callable[..., Any]]
    reason: str
    already_installed: bool = False


_ITEM_REMAINS = (
    "its get_grad_norm_fp32 reads the norm with .item() whatever the kernels (it has no "
    f"{SCALE_TENSOR} global to choose a device-side clip coefficient)"
)


def plan(clip_grads: ModuleType) -> GradNormPlan:
    """Decide, from ``clip_grads``'s globals, whether its clip-grad path reads the host and
    which globals the device-side kernels replace. Changes nothing.

    * ``l2_norm_impl`` is megatron-core's ``local_multi_tensor_l2_norm`` (neither Transformer
      Engine's nor Apex's kernels imported): replace it and the local
      ``multi_tensor_scale_impl``, and ``multi_tensor_scale_tensor_impl`` where that global
      exists (megatron-core 0.19+) and is ``None``;
    * fused kernels without a tensor scale (``multi_tensor_scale_tensor_impl is None``, e.g.
      Apex on 0.19): replace the tensor-scale global only; the fused norm stays;
    * fused kernels with a tensor scale: leave everything alone;
    * no ``multi_tensor_scale_tensor_impl`` global (0.16): the ``.item()`` remains whatever
      is replaced.
    """
    if not hasattr(clip_grads, L2_NORM) or not hasattr(clip_grads, SCALE):
        return GradNormPlan(
            None,
            None,
            {},
            f"{clip_grads.__name__} has no {L2_NORM}/{SCALE} globals: a layout this plugin "
            "does not know; left alone",
        )
    l2_norm = getattr(clip_grads, L2_NORM)
    scale = getattr(clip_grads, SCALE)
    has_tensor_scale_global = hasattr(clip_grads, SCALE_TENSOR)
    scale_tensor = getattr(clip_grads, SCALE_TENSOR, None)
    if _is_ours(l2_norm) or _is_ours(scale_tensor):
        return GradNormPlan(
            True,
            not has_tensor_scale_global,
            {},
            "the device-side kernels are already installed",
            already_installed=True,
        )
    local_norm = _qualified(l2_norm) == _LOCAL_L2_NORM
    replacements: dict[str, Callable[..., Any]] = {}
    if local_norm:
        replacements[L2_NORM] = multi_tensor_l2norm
        if _qualified(scale) == _LOCAL_SCALE:
            replacements[SCALE] = multi_tensor_scale
    if has_tensor_scale_global and scale_tensor is None:
        replacements[SCALE_TENSOR] = multi_tensor_scale_tensor

    reads_host_after = not has_tensor_scale_global
    if local_norm:
        reason = (
            "megatron-core's clip-grad path uses its local fallback (neither Transformer "
            "Engine's nor Apex's multi-tensor kernels were importable): "
            "local_multi_tensor_l2_norm reads every norm on the host (float(...))"
        )
        if has_tensor_scale_global:
            reason += f", and with {SCALE_TENSOR}=None get_grad_norm_fp32 calls .item()"
        return GradNormPlan(True, reads_host_after, replacements, reason)
    if not has_tensor_scale_global:
        return GradNormPlan(
            True,
            True,
            {},
            f"the norm kernel is {_describe(l2_norm)} (fused, on the device), but " + _ITEM_REMAINS,
        )
    if scale_tensor is None:
        return GradNormPlan(
            True,
            False,
            replacements,
            f"the norm kernel is {_describe(l2_norm)} (fused, on the device), but there is no "
            f"tensor-scale kernel ({SCALE_TENSOR}=None, e.g. Apex): get_grad_norm_fp32 then "
            "reads the norm with .item()",
        )
    return GradNormPlan(
        False,
        False,
        {},
        f"megatron-core's fused kernels keep the norm on the device ({_describe(l2_norm)}, "
        f"{_describe(scale_tensor)})",
    )


# -- the installer ----------------------------------------------------------------------------


@dataclasses.dataclass
class GradNormInstall:
    """What :func:`install` did; :meth:`restore` undoes it exactly.

    ``replaced`` maps each replaced global to the object megatron-core had there.
    ``reads_host_after`` is the verdict for the optimizer graph: ``True`` means
    ``optimizer.step()`` still reads the norm on the host (it cannot be captured); ``None``:
    not known.
    """

    module: ModuleType | None
    replaced: dict[str, Any]
    reason: str
    reads_host_after: bool | None
    _restored: bool = False

    @property
    def description(self) -> str:
        """One line for the run report."""
        if not self.replaced:
            return f"gradient norm: megatron-core's own kernels ({self.reason})"
        names = ", ".join(f"{name} ({_describe(old)})" for name, old in self.replaced.items())
        verdict = (
            "the norm stays on the device"
            if self.reads_host_after is False
            else "a host read remains: " + _ITEM_REMAINS
        )
        return f"gradient norm: torch foreach kernels in place of {names}; {verdict}"

    def restore(self) -> None:
        """Put megatron-core's own globals back (once; later calls do nothing)."""
        if self._restored or self.module is None:
            self._restored = True
            return
        for name, original in self.replaced.items():
            setattr(self.module, name, original)
        self._restored = True
        if self.replaced:
            logger.info(
                "gradient norm: megatron-core's own %s restored",
                ", ".join(self.replaced),
                extra=JOB_WIDE,
            )


def install(clip_grads: ModuleType | None = None) -> GradNormInstall:
    """Install the device-side kernels into megatron-core's clip-grad module where its path
    would read the host (:func:`plan`), log one line saying what was replaced and why, and
    return the handle that restores megatron-core's objects.

    ``clip_grads`` defaults to ``megatron.core.optimizer.clip_grads`` (imported here). A
    second ``install`` while the first is in force changes nothing and its ``restore`` does
    nothing.
    """
    if clip_grads is None:
        import importlib

        clip_grads = importlib.import_module(CLIP_GRADS)
    decision = plan(clip_grads)
    replaced = {name: getattr(clip_grads, name) for name in decision.replacements}
    for name, kernel in decision.replacements.items():
        setattr(clip_grads, name, kernel)
    handle = GradNormInstall(
        clip_grads if replaced else None, replaced, decision.reason, decision.reads_host_after
    )
    if replaced:
        logger.info(
            "gradient norm: replaced %s with torch foreach kernels: %s%s",
            ", ".join(
                f"{clip_grads.__name__}.{name} ({_describe(old)})" for name, old in replaced.items()
            ),
            decision.reason,
            "" if decision.reads_host_after is False else f"; a host read remains: {_ITEM_REMAINS}",
            extra=JOB_WIDE,
        )
    else:
        logger.info(
            "gradient norm: left megatron-core's kernels alone: %s", decision.reason, extra=JOB_WIDE
        )
    return handle
