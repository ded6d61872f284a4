"""Means (``mean``, ``mse_loss`` and its backward): the count they divide by is global. The
max-norm of an empty piece (an uneven shard's trailing rank): 0."""
from __future__ import annotations

import math
from typing import Any, Sequence

from ...ir.core import Op
from ...ir.dist import Partial, Shard, local_shape
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext


# ----------------------------------------------------------------------------------------
# means: divide the local sum by the global count, so the terms add up to the mean
# ----------------------------------------------------------------------------------------
def _mean_count(op: Op, ctx: LocalContext, reduced: Sequence[int]) -> int | float | None:
    """The divisor each rank uses, or None when no reduced dim is sharded (the local mean
    is then the global one). ``Partial(avg)`` outputs already divide by the ranks of their
    mesh dim, so their share of the count is taken out again."""
    shape = [v for v in op.inputs if v.is_tensor][0].type.shape
    sharded = {m: p for m, p in enumerate(ctx.needs[0].placements)
               if isinstance(p, Shard) and p.dim in reduced}
    if not sharded:
        return None
    count = math.prod(shape[d] for d in reduced)
    out = ctx.out_placements(0)
    ranks = math.prod(ctx.mesh.shape[m] for m in sharded
                      if m < len(out) and out[m] == Partial("avg"))
    # an avg over ranks of s_r / (N / ranks) is sum(s_r) / N, even for uneven pieces
    return count // ranks if count % ranks == 0 else count / ranks


def _dims(dims: Any, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % ndim if ndim else 0 for d in dims]


@register_local_form("aten.mean.dim", "aten.mean.default")
def _mean(op: Op, ctx: LocalContext) -> LocalCall | None:
    a = schema_args(op)
    x = a["self"]
    ndim = len(x.type.shape)
    dims = _dims(a.get("dim"), ndim)
    keepdim, dtype = bool(a.get("keepdim")), a["dtype"]
    count = _mean_count(op, ctx, dims)
    if count is None:
        return None
    return LocalCall("autopar.global_mean", ("aten.sum.dim_IntList", count, x, dims, keepdim),
                     {"dtype": dtype}, f"local sum / global count {count}")


_MSE_MEAN = 1   # at::Reduction::Mean
_MSE_SUM = 2


@register_local_form("aten.mse_loss.default")
def _mse_loss(op: Op, ctx: LocalContext) -> LocalCall | None:
    if schema_args(op)["reduction"] != _MSE_MEAN:
        return None
    count = _mean_count(op, ctx, range(len(op.args[0].type.shape)))
    if count is None:
        return None
    return LocalCall("autopar.global_mean",
                     ("aten.mse_loss.default", count, op.args[0], op.args[1], _MSE_SUM), {},
                     f"local squared-error sum / global count {count}")


@register_local_form("aten.mse_loss_backward.default")
def _mse_loss_backward(op: Op, ctx: LocalContext) -> LocalCall | None:
    """mean reduction scales by 1/numel: the global numel, not the piece's."""
    grad, x, target = op.args[:3]
    if schema_args(op)["reduction"] != _MSE_MEAN:
        return None
    tensors = [v for v in op.inputs if v.is_tensor]
    x_index = tensors.index(x)
    if not any(isinstance(p, Shard) for p in ctx.needs[x_index].placements):
        return None
    return LocalCall("autopar.global_mean",
                     ("aten.mse_loss_backward.default", x.type.numel, grad, x, target,
                      _MSE_SUM), {}, f"scale by the global count {x.type.numel}")


# ----------------------------------------------------------------------------------------
# max-norms of empty pieces: 0, the identity of a max over norms
# ----------------------------------------------------------------------------------------
@register_local_form("aten.linalg_vector_norm.default")
def _max_norm_of_empty(op: Op, ctx: LocalContext) -> LocalCall | None:
    """An uneven shard leaves trailing ranks an empty piece; torch has no inf-norm of an
    empty dim, but a rank's term of ``P(norminf)`` is 0 there (norms are never negative,
    so 0 is what the max over ranks ignores)."""
    a = schema_args(op)
    x = a["self"]
    ndim = len(x.type.shape)
    if float(a["ord"]) != math.inf or not ndim:
        return None
    piece = local_shape(x.type.shape, ctx.mesh, ctx.needs[0].placements, ctx.coordinate)
    if not any(piece[d] == 0 for d in _dims(a["dim"], ndim)):
        return None
    dtype = a["dtype"] or op.outputs[0].type.dtype
    return LocalCall("aten.zeros.default", (list(ctx.out_shape(op, 0)),), {"dtype": dtype},
                     "inf-norm of an empty piece: 0")
