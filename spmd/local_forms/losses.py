"""Class-sharded (vocab-parallel) negative log-likelihood and its backward (kernels:
``ir/kernels/sharded.py``).

A rank holds classes [offset, offset + classes) of the log-probabilities (and of the class
weights). Forward: it reads only the rows whose target falls in that range, so its loss and
total_weight are exact terms of a Partial(sum): every counted row is counted on exactly one
rank. Backward: each row's -w/total lands in the class range of the rank holding its target.
Targets equal to ``ignore_index`` are ignored on every rank, wherever the index lies.
Means keep the class axis whole (the rule), so no form here divides.
"""
from __future__ import annotations

from ...ir.core import Op
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext


def _arg(op: Op, index: int, name: str):
    """An argument by its schema name (given by position or keyword, or its default)."""
    return schema_args(op)[name]


def _class_offset(op: Op, ctx: LocalContext, self_index: int) -> int | None:
    """Global index of this rank's first class, or None when the class axis is whole."""
    self_value = _arg(op, self_index, "self")
    class_dim = len(self_value.type.shape) - 1
    tensors = [v for v in op.inputs if v.is_tensor]
    position = tensors.index(self_value)
    if not ctx.in_shard_mesh_dims(position, class_dim):
        return None
    return ctx.in_offsets(op, position)[1][class_dim]


@register_local_form("aten.nll_loss_forward.default")
def _nll_loss(op: Op, ctx: LocalContext) -> LocalCall | None:
    offset = _class_offset(op, ctx, 0)
    if offset is None:
        return None
    args = (_arg(op, 0, "self"), _arg(op, 1, "target"), _arg(op, 2, "weight"),
            _arg(op, 3, "reduction"), _arg(op, 4, "ignore_index"), offset)
    return LocalCall("autopar.vocab_nll_loss", args, {},
                     f"classes from {offset}; other targets give 0 (masked partial)")


@register_local_form("aten.nll_loss_backward.default")
def _nll_loss_backward(op: Op, ctx: LocalContext) -> LocalCall | None:
    offset = _class_offset(op, ctx, 1)
    if offset is None:
        return None
    names = ("grad_output", "self", "target", "weight", "reduction", "ignore_index",
             "total_weight")
    args = tuple(_arg(op, i, n) for i, n in enumerate(names)) + (offset,)
    return LocalCall("autopar.vocab_nll_loss_backward", args, {},
                     f"gradient of classes from {offset}")
