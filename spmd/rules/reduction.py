"""Reductions: the input is lettered ``abc..``, the output drops the reduced letters (or keeps
them as unshardable ``1`` dims with keepdim). A sharded reduced letter makes the output
Partial when the reduction composes over pieces (sum, max, min); otherwise it must be
replicated (norms, variances, arg-reductions).
"""
from __future__ import annotations

from typing import Iterable

from ...ir.core import Op
from ..registry import register, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters
from .common import same_dtype, schema_args


def reduced_dims(rank: int, dim: int | Iterable[int] | None) -> set[int]:
    """Normalised reduced dims; ``None`` or ``[]`` reduce every dim (ATen's convention)."""
    if dim is None:
        return set(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return set(range(rank))
    return {d % rank for d in dims} if rank else set()


def reduction(op: Op, dim, keepdim: bool, reduce: str | None, linear: str = "none",
              partial_ops: Iterable[str] = ("sum", "avg")) -> Spec:
    rank = len(tensor_inputs(op)[0].type.shape)
    inp = letters(rank)
    dims = reduced_dims(rank, dim)
    out = "".join(UNSHARDABLE if d in dims else c for d, c in enumerate(inp)
                  if keepdim or d not in dims)
    outs = tuple(None if not v.is_tensor else out for v in op.outputs)
    return Spec((inp,), outs, reduce=reduce, linear=linear, partial_ops=partial_ops)


@register("aten.sum.dim_IntList", "aten.mean.dim")
def sum_dim(op: Op) -> Spec:
    # A mean's local form divides the local sum by the global count, so P(sum) is exact.
    a = schema_args(op)
    return reduction(op, a["dim"], a["keepdim"], "sum",
                     linear="sum" if same_dtype(op) else "none")


@register("aten.sum.default", "aten.mean.default")
def sum_all(op: Op) -> Spec:
    return reduction(op, None, False, "sum", linear="sum" if same_dtype(op) else "none")


@register("aten.amax.default", "aten.max.default")
def amax(op: Op) -> Spec:
    # The max of local maxima is the max; a Partial(max) input passes through as well.
    a = schema_args(op)
    return reduction(op, a.get("dim"), a.get("keepdim", False), "max", linear="sum",
                     partial_ops={"max"})


@register("aten.amin.default", "aten.min.default")
def amin(op: Op) -> Spec:
    a = schema_args(op)
    return reduction(op, a.get("dim"), a.get("keepdim", False), "min", linear="sum",
                     partial_ops={"min"})


@register("aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default",
          "aten.linalg_vector_norm.default", "aten.var.correction", "aten.var_mean.correction",
          "aten.std.correction", "aten.std_mean.correction")
def whole_reduction(op: Op) -> Spec:
    # Indices, norms and variances of pieces do not combine into the whole's by one op.
    a = schema_args(op)
    return reduction(op, a["dim"], a["keepdim"], None)
