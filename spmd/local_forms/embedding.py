"""Vocab-parallel embedding and its backward (kernels: ``ir/kernels/sharded.py``)."""
from __future__ import annotations

from ...ir.core import Op
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext


# ----------------------------------------------------------------------------------------
# vocab-parallel embedding: a rank holds rows [offset, offset + rows) of the table
# ----------------------------------------------------------------------------------------
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
    a = schema_args(op)
    return LocalCall("autopar.vocab_embedding_backward",
                     (a["grad_output"], a["indices"], rows, offset, a["padding_idx"],
                      bool(a["scale_grad_by_freq"])), {},
                     f"gradient of vocab rows [{offset}, {offset + rows})")
