"""Vocab-parallel embedding and its backward, with their kernels."""
from __future__ import annotations

import torch

from ...ir.core import Op
from ...runtime.kernels import kernel
from .context import LocalCall, LocalContext
from .registry import register_local_form


# ----------------------------------------------------------------------------------------
# vocab-parallel embedding: a rank holds rows [offset, offset + rows) of the table
# ----------------------------------------------------------------------------------------
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


@register_local_form("aten.embedding.default")
def _embedding(op: Op, ctx: LocalContext) -> LocalCall | None:
    if not ctx.in_shard_mesh_dims(0, 0):
        return None
    offset = ctx.in_offsets(op, 0)[1][0]
    return LocalCall("autopar.vocab_embedding", (op.args[0], op.args[1], offset), {},
                     f"vocab rows from {offset}; other ids give 0 (masked partial)")


@register_local_form("aten.embedding_dense_backward.default")
def _embedding_backward(op: Op, ctx: LocalContext) -> LocalCall | None:
    placements = ctx.out_placements(0)
    if not any(p.is_shard(0) for p in placements):
        return None     # (a grouped vocab shard goes on: out_offsets refuses it by name)
    (rows, *_), (offset, *_) = ctx.out_offsets(op, 0)
    grad, indices, _, padding_idx, scale = (tuple(op.args) + (None,) * 5)[:5]
    padding_idx = op.kwargs.get("padding_idx", padding_idx)
    scale = op.kwargs.get("scale_grad_by_freq", scale)
    return LocalCall("autopar.vocab_embedding_backward",
                     (grad, indices, rows, offset, -1 if padding_idx is None else padding_idx,
                      bool(scale)), {}, f"gradient of vocab rows [{offset}, {offset + rows})")
