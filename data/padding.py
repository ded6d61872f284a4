"""Fit a batch to a planned shape (``data: {seq_buckets | pad_to_multiple, pad_rows}``).

A program is specialised to its batch's shapes, and a new shape plans a new program (a
capture and every pass: a few hundred milliseconds for a small model). Real data has
sequences of every length and a short last batch. Padding each batch up to one of a few
lengths keeps the plans few: the token ids with ``pad_id``, the labels (the ``labels``
argument and any fed tensor named ``labels``) with ``ignore_index``, so the loss ignores the
padded positions, and an ``attention_mask`` with 0. With ``pad_rows``, a batch of fewer rows
than the first one gets rows whose labels are all ``ignore_index``.

That leaves a token-averaged loss and its gradients as they were, up to the order of the
additions, when no real position reads a padded one: the padding is at the end of each
sequence, so a causal model never reads it; any other model must mask it
(``attention_mask``). Predicted outputs are cut back to the real rows and length.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..capture import batch_dim_of, batch_paths, flatten_batch


class PaddingError(ValueError):
    pass


@dataclass(frozen=True)
class Fit:
    """How one batch was padded: its real sequence length and rows (None: not padded),
    and the planned length ``to``."""

    length: int | None = None
    rows: int | None = None
    seq_dim: int = 1
    to: int | None = None

    @property
    def padded(self) -> bool:
        return self.length is not None or self.rows is not None


def bucket_length(length: int, buckets: tuple[int, ...] | None, multiple: int | None,
                  where: str = "a batch") -> int:
    """The planned length a sequence of ``length`` is padded to."""
    if buckets:
        i = bisect.bisect_left(buckets, length)
        if i == len(buckets):
            raise PaddingError(f"{where}: sequence length {length} is longer than the largest "
                               f"of data.seq_buckets {list(buckets)}: add a bucket of at least "
                               f"{length}, or cut the data to {buckets[-1]}")
        return buckets[i]
    if multiple:
        return -(-length // multiple) * multiple
    return length


def _pad_value(path: str, pad_id: int, ignore_index: int) -> int:
    last = path.rsplit(".", 1)[-1]
    if path == "labels" or path.startswith("labels.") or last == "labels":
        return ignore_index
    if last == "attention_mask":
        return 0
    return pad_id


def _pad_dim(t: torch.Tensor, dim: int, to: int, value: int) -> torch.Tensor:
    if t.shape[dim] == to:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, to - t.shape[dim]]
    return F.pad(t, pad, value=value)


def fit_batch(inputs: Any, labels: Any, *, seq_dim: int, buckets: tuple[int, ...] | None,
              multiple: int | None, rows: int | None, pad_id: int, ignore_index: int,
              batch_dim: int | dict[str, int] = 0) -> tuple[Any, Any, Fit]:
    """``(inputs, labels)`` padded to the planned length (and to ``rows`` rows);
    ``batch_dim``: the strategy's (one dim, or one per fed tensor path)."""
    leaves, rebuild = flatten_batch(inputs, labels)
    paths = batch_paths(inputs, labels)
    seq = [t for t in leaves if t.dim() > seq_dim]
    if not seq:
        return inputs, labels, Fit(seq_dim=seq_dim)
    length = seq[0].shape[seq_dim]
    to = bucket_length(length, buckets, multiple)
    first = paths[leaves.index(seq[0])]
    real_rows = seq[0].shape[batch_dim_of(batch_dim, first, tuple(seq[0].shape))]
    pad_rows = rows is not None and real_rows < rows
    out = []
    for path, t in zip(paths, leaves):
        value = _pad_value(path, pad_id, ignore_index)
        if t.dim() > seq_dim and t.shape[seq_dim] == length:
            t = _pad_dim(t, seq_dim, to, value)
        if pad_rows and t.dim() > 0:
            if value == ignore_index:
                _check_ignorable(path, t)
            t = _pad_dim(t, batch_dim_of(batch_dim, path, tuple(t.shape)), rows, value)
        out.append(t)
    new_inputs, new_labels = rebuild(out)
    return new_inputs, new_labels, Fit(length if to != length else None,
                                       real_rows if pad_rows else None, seq_dim, to)


def _check_ignorable(path: str, t: torch.Tensor) -> None:
    if t.is_floating_point():
        raise PaddingError(f"data.pad_rows: the fed tensor {path} ({t.dtype}) is not class "
                           "ids: padded rows could not be ignored by the loss")


def cut_outputs(outputs: Any, fit: Fit, batch_dim: int | dict[str, int] = 0) -> Any:
    """Predicted outputs cut back to the batch's real rows and sequence length (an output's
    dims of the planned rows and length, at the batch and sequence dims)."""
    if not fit.padded:
        return outputs
    rows_dim = batch_dim if isinstance(batch_dim, int) else 0

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if fit.rows is not None and t.dim() > rows_dim:
            t = t.narrow(rows_dim, 0, fit.rows)
        if fit.length is not None and t.dim() > fit.seq_dim and t.shape[fit.seq_dim] == fit.to:
            t = t.narrow(fit.seq_dim, 0, fit.length)
        return t
    return pytree.tree_map(cut, outputs)
