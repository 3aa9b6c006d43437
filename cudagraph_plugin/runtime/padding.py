"""Padding micro-batches to a sequence-length bucket (torch, no megatron-core): the host's
helper for bucketed full-iteration graphs.

Bucketed full-iteration CUDA graphs (``cudagraph_plugin.runtime.buckets``) keep one graph per
(bucket length, micro-batch size, micro-batch count): a host whose sequence lengths vary
pads each step's micro-batches to one bucket length and passes that length as
``seq_length``. This module owns that padding and the waste it costs:

* :func:`pad_to_bucket` pads one micro-batch dict: ``tokens`` with the pad token, ``labels``
  with the label pad id, ``loss_mask`` with zeros (padding never counts in the loss),
  ``position_ids`` by counting on from each row's last position, megatron-core's MoE
  ``padding_mask`` (``[b, s]``, ``True`` = padding) with ``True``, a megatron-core attention
  mask (boolean ``[b, 1, s, s]``, ``True`` = masked) with every padded key masked, and any
  key the host names in ``extra``. Padding goes on the right: with megatron-core's causal
  attention no real token attends to a later (padded) one, so the real tokens' outputs and
  losses are those of the unpadded batch. With MoE layers padded tokens are routed like
  real ones; passing the padded ``padding_mask`` to the model keeps them out of
  megatron-core's auxiliary and z losses and expert-bias counts, but not out of expert
  capacity: with ``moe_expert_capacity_factor`` (token dropping) padding can change which
  real tokens are dropped, so the losses then differ from the unpadded batch's (dropless
  MoE is unaffected).
* every call checks the whole micro-batch, whether or not this one needs padding, so a bad
  input fails on the first step rather than on the first step of another length.
* :func:`pad_step` pads all micro-batches of one step to one common bucket (the graph of a
  step reads every micro-batch at the same shape).
* the bucket arithmetic (:func:`bucket_for`, :func:`check_buckets`, :func:`parse_buckets`,
  :func:`padding_waste_percent`) is :mod:`cudagraph_plugin.config.buckets`' (re-exported here).

A length above the largest bucket raises :class:`BucketOverflowError` by default: a host
that pads expects a graph. ``overflow="keep"`` returns such a batch unpadded instead (its
``seq_length`` is then outside every bucket, and the step runs eagerly).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cudagraph_plugin.config.buckets import (
    bucket_for,
    check_buckets,
    padding_waste_percent,
    parse_buckets,
)

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "padding_mask")
"""The micro-batch keys padded along their last dimension (megatron-core's GPT batch, and
the ``padding_mask`` its MoE routing reads)."""

OVERFLOW_CHOICES = ("error", "keep")


class BucketOverflowError(ValueError):
    """A sequence is longer than the largest bucket."""


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """One padded micro-batch.

    :ivar batch: a new dict (the input is not modified); values that need no padding are
        the input's own objects.
    :ivar seq_length: the bucket length (``length``, or the batch's own, when
        ``overflow="keep"`` let a too-long batch through): pass it to
        ``forward_backward_func`` as ``seq_length``.
    :ivar padding: padded token positions added (rows x added length).
    :ivar tokens: token positions after padding (rows x ``seq_length``).
    """

    batch: dict[str, Any]
    seq_length: int
    padding: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class PaddedStep:
    """All micro-batches of one step, padded to one bucket (see :func:`pad_step`)."""

    batches: list[dict[str, Any]]
    seq_length: int
    padding: int
    tokens: int


def sequence_length(batch: Mapping[str, Any]) -> int:
    """The length of a micro-batch: the last dimension of its sequence tensors (which must
    agree)."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"a micro-batch must be a dict of tensors (tokens, labels, loss_mask, "
            f"position_ids, attention_mask), got {type(batch).__name__}. Fix: pad the dict "
            "your data iterator yields, before a get_batch() turns it into a tuple"
        )
    lengths = {
        key: batch[key].shape[-1]
        for key in SEQUENCE_KEYS
        if isinstance(batch.get(key), torch.Tensor)
    }
    if not lengths:
        raise ValueError(
            f"the micro-batch has none of the sequence tensors {', '.join(SEQUENCE_KEYS)} "
            f"(keys: {', '.join(map(str, batch)) or 'none'}); pad_to_bucket needs at least one"
        )
    if len(set(lengths.values())) > 1:
        found = ", ".join(f"batch[{key!r}] {length}" for key, length in lengths.items())
        raise ValueError(
            f"the micro-batch's sequence tensors disagree on their length ({found}); give "
            "them one length in their last dimension"
        )
    return next(iter(lengths.values()))


def pad_to_bucket(
    batch: Mapping[str, Any],
    buckets: Sequence[int],
    *,
    pad_token_id: int,
    label_pad_id: int | None = None,
    length: int | None = None,
    overflow: str = "error",
    extra: Mapping[str, int | float | bool] | None = None,
) -> PaddedBatch:
    """Pad one micro-batch to the smallest bucket >= its length.

    :param batch: the micro-batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
        (``[..., s]``) and ``attention_mask`` (``None`` or megatron-core's boolean
        ``[b, 1, s, s]``, ``True`` = masked) where present; other values pass through.
    :param buckets: the bucket lengths (a list of ints, or the setting's string form
        ``"256,512"``).
    :param pad_token_id: the token id of padded positions (an int).
    :param label_pad_id: the label of padded positions (default ``pad_token_id``: a valid
        vocabulary id, which every cross-entropy implementation accepts; ``loss_mask`` is 0
        there, so it never counts). A micro-batch with ``labels`` but no ``loss_mask`` is
        refused unless ``label_pad_id`` is given: only a loss that ignores that label keeps
        padded positions out of it.
    :param length: pad as if the batch were this long (at least its own length): the step's
        or the job's longest micro-batch, so that every micro-batch and rank picks the same
        bucket (every rank must run the same graph in each step).
    :param overflow: ``"error"`` (default) raises :class:`BucketOverflowError` above the
        largest bucket; ``"keep"`` pads to ``length`` (unpadded without it) and the step
        runs eagerly.
    :param extra: more per-token keys to pad, each with its pad value (e.g.
        ``{"advantages": 0.0}``), along the sequence: the tokens' own dimension where the
        tensor has more after it (``[b, s, k]``, a teacher's top-k log-probabilities),
        else its last, which must then be the sequence length. Any other tensor with the
        sequence length there (of two or more dimensions; of any in a batch of 1-D
        sequences) is refused, since leaving it unpadded would break the model's shapes.
    """
    if overflow not in OVERFLOW_CHOICES:
        raise ValueError(
            f"overflow must be one of {OVERFLOW_CHOICES}, got {overflow!r}: 'error' raises "
            "above the largest bucket, 'keep' lets such a batch run eagerly"
        )
    buckets = _buckets(buckets)
    length = _length(length)
    extra = dict(extra or {})
    own = sequence_length(batch)
    wanted = own if length is None else length
    if wanted < own:
        raise ValueError(
            f"length={length} is shorter than the micro-batch ({own} tokens); pass the "
            "longest length of the step (or job), or leave length out"
        )
    values = _pad_values(batch, pad_token_id, label_pad_id, extra)
    _check_batch(batch, own, values, extra)
    bucket = bucket_for(wanted, buckets)
    if bucket is None:
        if overflow == "keep":
            bucket = wanted  # no graph: the step runs eagerly, at the length asked for
        else:
            what = (
                f"a micro-batch of length {own}"
                if length is None
                else f"length={length} (this micro-batch: {own} tokens)"
            )
            raise BucketOverflowError(
                f"{what} exceeds the largest CUDA graph bucket ({buckets[-1]}; buckets: "
                f"{', '.join(map(str, buckets))}). Fix: truncate the sequence; or, where the "
                f"model takes {wanted} tokens (learned position embeddings end at its "
                f"max_sequence_length), add a bucket >= {wanted} (e.g. --cuda-graph-buckets "
                f"{','.join(map(str, (*buckets, wanted)))}) or pass overflow='keep' to run "
                "such steps eagerly"
            )
    added = bucket - own
    padded = dict(batch)
    if added:
        dims = _token_dims(batch)
        for key, (value, _) in values.items():
            tensor = batch.get(key)
            if isinstance(tensor, torch.Tensor):
                axis = _sequence_axis(tensor, own, dims) if key in extra else None
                padded[key] = _pad_along(tensor, tensor.dim() - 1 if axis is None else axis,
                                         added, value)  # fmt: skip
        if isinstance(batch.get("position_ids"), torch.Tensor):
            padded["position_ids"] = _continue_positions(batch["position_ids"], added)
        if batch.get("attention_mask") is not None:
            padded["attention_mask"] = _pad_attention_mask(batch["attention_mask"], added)
    rows = _rows(batch)
    return PaddedBatch(padded, bucket, rows * added, rows * bucket)


def pad_step(
    batches: Sequence[Mapping[str, Any]],
    buckets: Sequence[int],
    *,
    pad_token_id: int,
    label_pad_id: int | None = None,
    length: int | None = None,
    overflow: str = "error",
    extra: Mapping[str, int | float | bool] | None = None,
) -> PaddedStep:
    """Pad every micro-batch of one step to the bucket of the longest (or of ``length``, if
    longer: the job-wide longest, agreed across ranks by the host)."""
    if not batches:
        raise ValueError("pad_step needs at least one micro-batch")
    buckets = _buckets(buckets)
    length = _length(length)
    lengths = [sequence_length(batch) for batch in batches]
    longest = max(lengths)
    if length is not None and length < longest:
        # (the job-wide longest is never below this rank's: a broken agreement)
        raise ValueError(
            f"length={length} is shorter than micro-batch {lengths.index(longest)} ({longest} "
            "tokens); pass the longest length of the step over every data-parallel rank (an "
            "all-reduce MAX of each rank's longest), or leave length out"
        )
    # Above every bucket (overflow="keep") the step runs eagerly, but still at one length
    # for all its micro-batches (forward_backward_func takes one seq_length).
    target = longest if length is None else length
    results = [
        pad_to_bucket(
            batch,
            buckets,
            pad_token_id=pad_token_id,
            label_pad_id=label_pad_id,
            length=target,
            overflow=overflow,
            extra=extra,
        )
        for batch in batches
    ]
    return PaddedStep(
        [result.batch for result in results],
        results[0].seq_length,
        sum(result.padding for result in results),
        sum(result.tokens for result in results),
    )


def _rows(batch: Mapping[str, Any]) -> int:
    """Sequences in the micro-batch: the product of the leading dimensions of its first
    sequence tensor."""
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            rows = 1
            for size in value.shape[:-1]:
                rows *= size
            return rows
    return 0


def _length(length: Any) -> int | None:
    """``length`` as an int: a numpy integer or a one-element integer tensor (an
    all-reduce's result) too; a bool, a float or anything else is refused, naming it."""
    if length is None:
        return None
    if isinstance(length, torch.Tensor) and length.numel() == 1 and not length.is_floating_point():
        length = length.item()
    if not isinstance(length, bool):
        try:
            return operator.index(length)
        except TypeError:
            pass
    raise TypeError(
        f"length={length!r} ({type(length).__name__}) is not an integer; pass the step's "
        "longest length as an int (int(t.item()) of an all-reduced tensor)"
    )


def _buckets(buckets: Any) -> tuple[int, ...]:
    try:
        return parse_buckets(buckets, "buckets")
    except ValueError as error:
        message = str(error)
        if message.startswith("buckets"):
            raise
        raise ValueError(
            f"buckets: {message} (got {buckets!r}); give the bucket lengths as a list of "
            "ints or a string such as '256,512,1024'"
        ) from None


_PadValues = dict[str, tuple[Any, str]]
"""Each padded key's pad value and the parameter that gave it."""


def _pad_values(
    batch: Mapping[str, Any],
    pad_token_id: Any,
    label_pad_id: Any,
    extra: Mapping[str, Any],
) -> _PadValues:
    for name, value in (("pad_token_id", pad_token_id), ("label_pad_id", label_pad_id)):
        if name == "label_pad_id" and value is None:
            continue
        # (a NumPy integer is an int here: tokenizers and datasets hand those out)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(
                f"{name} must be an int (a token id), got {value!r}. Fix: pass the tokenizer's "
                "pad id (its eos id when it has none)"
            )
    for key, value in extra.items():
        numpy_bool = getattr(getattr(value, "dtype", None), "kind", None) == "b"
        if not (isinstance(value, numbers.Real) or numpy_bool):
            raise ValueError(
                f"extra[{key!r}] must be the pad value (an int, float or bool), got {value!r}"
            )
    pad_token_id = int(pad_token_id)
    if pad_token_id < 0:
        raise ValueError(
            f"pad_token_id={pad_token_id} is not a token id (the embedding looks it up, and "
            "a negative index fails there, on a GPU as a device-side assert). Fix: pass the "
            "tokenizer's pad id (its eos id when it has none); an ignored label such as -100 "
            "is label_pad_id's"
        )
    label_pad_id = None if label_pad_id is None else int(label_pad_id)
    extra = {key: _plain(value) for key, value in extra.items()}
    if (
        isinstance(batch.get("labels"), torch.Tensor)
        and not isinstance(batch.get("loss_mask"), torch.Tensor)
        and label_pad_id is None
    ):
        raise ValueError(
            "batch['labels'] would be padded but the micro-batch has no loss_mask, so padded "
            f"positions (label pad_token_id={pad_token_id}, a real token) would count in the "
            "loss. Fix: add batch['loss_mask'] (ones; padding adds zeros) and weigh the loss "
            "with it, or pass label_pad_id=<the label your loss ignores>"
        )
    return {
        "tokens": (pad_token_id, "pad_token_id"),
        "labels": (
            (pad_token_id, "pad_token_id")
            if label_pad_id is None
            else (label_pad_id, "label_pad_id")
        ),
        "loss_mask": (0, "loss_mask's zero"),
        "padding_mask": (True, "padding_mask's True"),
        **{key: (value, f"extra[{key!r}]") for key, value in extra.items()},
    }


def _plain(value: Any) -> int | float | bool:
    """A NumPy scalar as the Python number ``torch.full`` takes."""
    if isinstance(value, (bool, int, float)):
        return value
    return bool(value) if value.dtype.kind == "b" else value.item()


def _check_batch(
    batch: Mapping[str, Any], length: int, values: _PadValues, extra: Mapping[str, Any]
) -> None:
    sequence_dims = _token_dims(batch)
    for key, (value, source) in values.items():
        tensor = batch.get(key)
        if key in extra and tensor is not None and not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"extra names batch[{key!r}], which is a {type(tensor).__name__}, not a "
                "tensor; pad it yourself or leave it out of extra"
            )
        if not isinstance(tensor, torch.Tensor):
            continue
        if key in extra and _sequence_axis(tensor, length, sequence_dims) is None:
            raise ValueError(
                f"batch[{key!r}] (shape {tuple(tensor.shape)}) is named in extra but neither "
                f"its last dimension nor the tokens' sequence dimension is the sequence length "
                f"{length}; extra pads per-token tensors only. Fix: drop it from extra (a "
                "per-sequence tensor needs no padding)"
            )
        _check_fits(key, tensor, value, source)
    packed = sorted(
        key
        for key, value in batch.items()
        if str(key).startswith("cu_seqlens") and value is not None
    )
    if packed:
        raise ValueError(
            f"batch[{packed[0]!r}] describes packed sequences (THD); pad_to_bucket pads "
            "per-token tensors only, so the padding would lie outside every packed sequence "
            "(and the sequence count changes the graph's shapes). Fix: pad packed batches "
            "yourself (grow the last sequence, or add a padding sequence, in cu_seqlens), or "
            "give unpacked [b, s] micro-batches"
        )
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            described = (
                f"shape {tuple(mask.shape)} dtype {mask.dtype}"
                if isinstance(mask, torch.Tensor)
                else type(mask).__name__
            )
            raise ValueError(
                f"batch['attention_mask'] is {described}; pad_to_bucket pads megatron-core's "
                "boolean [b, 1, s, s] mask (True = masked) or None. Fix: build that mask, or "
                "pass attention_mask=None for causal attention"
            )
        if tuple(mask.shape[-2:]) != (length, length):
            raise ValueError(
                f"batch['attention_mask'] has shape {tuple(mask.shape)} but the sequence "
                f"length is {length}; pad_to_bucket pads megatron-core's [b, 1, s, s] mask. "
                f"Fix: build it at [b, 1, {length}, {length}] (a [b, 1, 1, s] key-padding "
                "mask is not padded here)"
            )
    known = {*SEQUENCE_KEYS, "attention_mask", *extra}
    for key, value in batch.items():
        if key in known or not isinstance(value, torch.Tensor):
            continue
        axis = _sequence_axis(value, length, sequence_dims)
        if value.dim() >= min(2, sequence_dims) and axis is not None:
            raise ValueError(
                f"batch[{key!r}] (shape {tuple(value.shape)}) has the sequence length {length} "
                f"in its dimension {axis} but pad_to_bucket does not know how to pad it. Fix: "
                f"pass extra={{{key!r}: <pad value>}}, or drop it from the micro-batch"
            )


def _token_dims(batch: Mapping[str, Any]) -> int:
    """The dimensions of the batch's per-token tensors (2 for ``[b, s]``, 1 for ``[s]``)."""
    return min(
        batch[key].dim() for key in SEQUENCE_KEYS if isinstance(batch.get(key), torch.Tensor)
    )


def _sequence_axis(tensor: torch.Tensor, length: int, token_dims: int) -> int | None:
    """The dimension of ``tensor`` that runs along the sequence: the tokens' own where the
    tensor has more after it (``[b, s, k]``), else its last; None where that one is not
    ``length``."""
    axis = token_dims - 1
    if tensor.dim() > token_dims and tensor.shape[axis] == length:
        return axis
    if tensor.dim() > 0 and tensor.shape[-1] == length:
        return tensor.dim() - 1
    return None


def _check_fits(key: str, tensor: torch.Tensor, value: Any, source: str) -> None:
    """``value`` pads ``tensor`` without being changed by its dtype."""
    if tensor.dtype == torch.bool:
        fits = value in (0, 1)
    elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        fits = True
    else:
        info = torch.iinfo(tensor.dtype)
        fits = float(value).is_integer() and info.min <= value <= info.max
    if not fits:
        raise ValueError(
            f"{source}={value!r} cannot pad batch[{key!r}] (dtype {tensor.dtype}) without "
            f"changing: give a value of that dtype, or convert batch[{key!r}]"
        )


def _pad_along(
    tensor: torch.Tensor, axis: int, added: int, value: int | float | bool
) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[axis] = added
    filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, filler], dim=axis)


def _continue_positions(position_ids: torch.Tensor, added: int) -> torch.Tensor:
    # Each row counts on from its own last position (packed rows restart their count).
    dtype = position_ids.dtype
    if not (dtype.is_floating_point or dtype == torch.bool) and torch.iinfo(dtype).max < 2**31 - 1:
        # a narrow integer type would wrap around (read only for such types: it may sync)
        last = int(position_ids.max()) if position_ids.numel() else -1
        if last + added > torch.iinfo(dtype).max:
            raise ValueError(
                f"batch['position_ids'] (dtype {dtype}) cannot count on to {last + added}, the "
                f"last position once padded: it would wrap around; convert it to torch.long"
            )
    steps = torch.arange(1, added + 1, dtype=position_ids.dtype, device=position_ids.device)
    if position_ids.shape[-1] == 0:
        return torch.cat([position_ids, (steps - 1).expand(*position_ids.shape[:-1], added)], -1)
    return torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)


def _pad_attention_mask(mask: torch.Tensor, added: int) -> torch.Tensor:
    length = mask.shape[-1]
    size = length + added
    padded = torch.ones((*mask.shape[:-2], size, size), dtype=torch.bool, device=mask.device)
    padded[..., :length, :length] = mask
    # A padded query attends to itself only: no row is fully masked (a fully masked row
    # gives NaN in some attention kernels), and no real query sees a padded key.
    index = torch.arange(length, size, device=mask.device)
    padded[..., index, index] = False
    return padded


__all__ = [
    "BucketOverflowError",
    "PaddedBatch",
    "PaddedStep",
    "bucket_for",
    "check_buckets",
    "pad_step",
    "pad_to_bucket",
    "padding_waste_percent",
    "parse_buckets",
    "sequence_length",
]
