"""What a rank runs for an op on sharded pieces where the ATen call cannot say it; the local
forms in ``spmd/local_forms`` choose these calls (and say why in the dumps)."""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..ops import kernel, resolve


@kernel("autopar.annotate")
def annotate(x: torch.Tensor) -> torch.Tensor:
    """A placement annotation; on a rank's local program it is the identity."""
    return x


# -- empty pieces (uneven shards leave trailing ranks empty) ------------------------------
@kernel("autopar.empty_outputs")
def empty_outputs(shapes: Sequence[Sequence[int] | None], dtypes: Sequence[torch.dtype | None],
                  single: bool = False):
    """The op's outputs when every one of them is empty on this rank (None where the op
    returns no tensor; ``single``: the op returns one tensor, not a sequence)."""
    outs = tuple(None if s is None else torch.empty(tuple(s), dtype=d)
                 for s, d in zip(shapes, dtypes))
    return outs[0] if single else outs


# -- vocab-parallel embedding: a rank holds rows [offset, offset + rows) of the table -------
@kernel("autopar.vocab_embedding")
def vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int) -> torch.Tensor:
    """Rows this rank holds; zeros for ids outside them (the sum over ranks is the lookup)."""
    rows = weight.shape[0]
    outside = (indices < offset) | (indices >= offset + rows)
    if rows == 0:
        return weight.new_zeros((*indices.shape, *weight.shape[1:]))
    local = (indices - offset).masked_fill(outside, 0)
    out = torch.ops.aten.embedding.default(weight, local)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@kernel("autopar.vocab_embedding_backward")
def vocab_embedding_backward(grad: torch.Tensor, indices: torch.Tensor, rows: int, offset: int,
                             padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """The rows [offset, offset+rows) of the weight gradient: ids outside go to a dummy row
    that is dropped, so counts (scale_grad_by_freq) of the held ids stay exact."""
    outside = (indices < offset) | (indices >= offset + rows)
    local = (indices - offset).masked_fill(outside, rows)
    pad = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else -1
    full = torch.ops.aten.embedding_dense_backward.default(grad, local, rows + 1, pad,
                                                           scale_grad_by_freq)
    return full[:rows]


# -- class-sharded nll_loss: a rank holds classes [offset, offset + classes) ----------------
# What the kernels pass ATen as ignore_index once targets are local: no local class is
# negative, so it never meets a kept target.
_MASKED = -100


def _local_targets(target: torch.Tensor, offset: int, classes: int,
                   ignore_index: int) -> torch.Tensor:
    """Targets relative to this rank's first class; ignored or held elsewhere -> _MASKED."""
    held = (target >= offset) & (target < offset + classes) & (target != ignore_index)
    return torch.where(held, target - offset, torch.full_like(target, _MASKED))


@kernel("autopar.vocab_nll_loss")
def vocab_nll_loss(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                   reduction: int, ignore_index: int, offset: int):
    """(loss, total_weight) over the rows whose target this rank holds; 0 for the others."""
    local = _local_targets(target, offset, x.shape[-1], ignore_index)
    return torch.ops.aten.nll_loss_forward.default(x, local, weight, reduction, _MASKED)


@kernel("autopar.vocab_nll_loss_backward")
def vocab_nll_loss_backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                            weight: torch.Tensor | None, reduction: int, ignore_index: int,
                            total_weight: torch.Tensor, offset: int) -> torch.Tensor:
    """This rank's class columns of the input gradient (``total_weight`` is the global one)."""
    local = _local_targets(target, offset, x.shape[-1], ignore_index)
    return torch.ops.aten.nll_loss_backward.default(grad, x, local, weight, reduction,
                                                    _MASKED, total_weight)


# -- means: the local sum over the global count, an exact term of a Partial(sum) ----------
@kernel("autopar.global_mean")
def _global_mean(target: str, count: int | float, *args, **kwargs) -> torch.Tensor:
    """``target`` is the sum-reduced form of a mean; dividing by the *global* count makes
    the local result an exact term of a Partial(sum)."""
    return resolve(target)(*args, **kwargs) / count


# -- attention on a rank's rows of the query (context parallelism) --------------------------
@kernel("autopar.causal_rows_attention")
def causal_rows_attention(target: str, rows: tuple[int, int], key_length: int, *args,
                          **kwargs):
    """``target`` (a fused attention op or its backward) on global query rows
    ``rows[0] .. rows[1]`` against all ``key_length`` keys, causal: ``is_causal`` off and the
    explicit mask of those rows on (key ``j`` is seen by row ``i`` iff ``j <= i``), as the
    kernel's own causal mask is for a whole sequence. (Splitting the keys into the block
    before the rows and the rows' causal block, merged by log-sum-exp, needs no mask but
    rounds differently from the whole-sequence kernel: AdamW then drifts from eager.)"""
    op = resolve(target)
    call = dict(zip([a.name for a in op._schema.arguments], args), **kwargs)
    query = call["query"]
    mask = _rows_mask(tuple(rows), key_length, query.dtype, query.device)
    return op(**{**call, "is_causal": False, "attn_mask": mask})


@functools.lru_cache(maxsize=8)
def _rows_mask(rows: tuple[int, int], key_length: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """The additive causal mask of global rows ``rows`` over ``key_length`` keys (made once
    per shape: every layer's attention, forward and backward, reads the same)."""
    row = torch.arange(rows[0], rows[1], device=device).unsqueeze(1)
    seen = torch.arange(key_length, device=device).unsqueeze(0) <= row
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen,
                                                                           float("-inf"))
