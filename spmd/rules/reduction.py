"""Reductions: the input is lettered ``abc..``, the output drops the reduced letters (or keeps
them as unshardable ``1`` dims with keepdim). A sharded reduced letter makes the output
Partial when the reduction composes over pieces (sum, max, min, p-norms); otherwise it must
be replicated (variances, arg-reductions, norms of order <= 0).

A p-norm (``linalg_vector_norm``, p > 0) over a sharded letter gives ``Partial(norm<p>)``
(DTensor's ``_NormPartial``): each rank holds the norm of its piece, and the norm of those
terms is the norm of the whole. A norm of the same order over a ``P(norm<p>)`` input stays
``P(norm<p>)``, over any dims: ``||(||x_r||)_r|| = ||x||``. So gradient clipping's total
norm (per-gradient norms, then the norm of their stack) over sharded gradients is one
all-reduce of a scalar per mesh dim, and no gradient moves.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from ...ir.core import Op
from ...ir.dist import Partial, micro_batch_dim, norm_order, norm_partial
from ..einsum import Decision, infer_forward, infer_reverse
from ..rule_registry import describe, output_types, register, tensor_inputs
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
          "aten.var.correction", "aten.var_mean.correction",
          "aten.std.correction", "aten.std_mean.correction")
def whole_reduction(op: Op) -> Spec:
    # Indices and variances of pieces do not combine into the whole's by one op.
    a = schema_args(op)
    return reduction(op, a["dim"], a["keepdim"], None)


def vector_norm_spec(op: Op) -> Spec:
    """``linalg_vector_norm(x, ord, dim, keepdim)``: a p-norm (p > 0) composes over pieces
    as ``P(norm<p>)`` and passes a ``P(norm<p>)`` input through; other orders (0 counts
    non-zeros, negative orders) reduce whole."""
    a = schema_args(op)
    p = float(a["ord"])
    if not p > 0:
        return reduction(op, a["dim"], a["keepdim"], None)
    norm = norm_partial(p)
    return reduction(op, a["dim"], a["keepdim"], norm,
                     linear="sum" if same_dtype(op) else "none", partial_ops={norm})


class VectorNorm:
    """The norm spec, except over a pipeline's micro-batch dim: sums over time (gradient
    accumulation) know no norm, so a reduced letter the micro-batches cut is gathered."""

    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        spec = vector_norm_spec(op)
        mb = micro_batch_dim(mesh)
        dist = in_dists[0]
        if mb is not None and dist is not None and norm_order(spec.reduce[0] or "") is not None:
            cut = dist.placements[mb]
            if cut.is_shard() and spec.inputs[0][cut.dim] not in (spec.outputs[0] or ""):
                spec = replace(spec, reduce=(None,) * len(spec.outputs))
        return infer_forward(spec, mesh, [v.type for v in tensor_inputs(op)], output_types(op),
                             in_dists, describe(op), available)

    def reverse(self, op, out_hints, mesh):
        return infer_reverse(vector_norm_spec(op), mesh, [v.type for v in tensor_inputs(op)],
                             output_types(op), out_hints, describe(op))


register("aten.linalg_vector_norm.default")(VectorNorm())


def norms_of_every_input(op: Op, in_dists) -> frozenset[str]:
    """The norm partial ops (``norm2``, ...) that every tensor input of ``op`` holds on some
    mesh dim. A value placed so is a norm, never negative, so where it is replicated on a
    mesh dim it joins ``P(norm<p>)`` terms exactly (kept on one rank, zeros elsewhere): a
    move (stack) of such values may carry the norm partial through. (A value whole on every
    mesh dim does not count, even if a norm made it: a rule decides from placements only,
    and completion reuses a decision for ops whose types and placements are equal.)"""
    found = {p.op for d in in_dists if d is not None for p in d.placements
             if p.is_partial() and norm_order(p.op) is not None}
    return frozenset(norm for norm in found
                     if all(d is not None and Partial(norm) in d.placements for d in in_dists))


@register("autopar.unscale_checked")
def unscale_checked(op: Op) -> Spec:
    """Loss scaling's ``(grad * inv_scale, found)``: the product keeps the gradient's
    letters; ``found`` (whether max |g| is finite) composes over pieces as a max, so a
    sharded gradient's flag is ``P(max)`` (one all-reduce of the combined flag settles it).
    Not linear: a Partial gradient is summed first (an overflow of the sum is caught, as
    eager's one-device gradient would be)."""
    grad = letters(len(op.args[0].type.shape))
    return Spec((grad, ""), (grad, ""), reduce=("max", "max"))
