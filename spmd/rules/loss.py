"""Losses. Negative log-likelihood: each row reads one class entry. The batch letter shards;
how it combines follows ``reduction``: none keeps it in the output, sum makes both the loss
and total_weight Partial(sum), mean (a weighted mean; a pass rewrites it into sum + div
before completion) needs it whole. The class letter shards too (vocab parallel): a rank
reads only the targets in its class range and counts only their weights, so the loss and
total_weight are Partial(sum) over the class mesh dims (their local form,
spmd/local_forms/losses.py, masks the other targets); the backward writes each row's
-w/total only into the class range the rank holds. Mean needs the class letter whole (a
ratio of local sums is no term of the global ratio). Inputs may be 1-D (one sample, no
batch letter). Mean squared error: see below."""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register
from ..spec import Spec, letters
from .common import broadcast_letters, input_letters, schema_args

NONE, MEAN, SUM = 0, 1, 2


def _batch_and_class(op: Op) -> tuple[str, str]:
    batched = len(schema_args(op)["self"].type.shape) == 2
    return ("b" if batched else ""), "c"


@register("aten.nll_loss_forward.default")
def nll_loss_forward(op: Op) -> Spec:
    b, c = _batch_and_class(op)
    reduction = schema_args(op)["reduction"]
    ins = input_letters(op, {"self": b + c, "target": b, "weight": c})
    out = b if reduction == NONE else ""
    whole = {b, c} - {""} if reduction == MEAN else set()
    # total_weight is a 0-d sum of the rows' weights (0 with reduction none): Partial(sum)
    # under a sharded batch or class letter is exact for it in every mode that lets them
    # shard. The op is linear in self, but not total_weight, so Partial inputs are reduced
    # first.
    return Spec(ins, (out, ""), replicated=whole, reduce="sum")


@register("aten.nll_loss_backward.default")
def nll_loss_backward(op: Op) -> Spec:
    # grad_input[i, t_i] = -w[t_i] * g(_i) [/ total_weight]: rows are independent given the
    # whole total_weight, whatever the reduction, and so are classes (a class-sharded piece
    # is written by the local form); linear in grad_output.
    b, c = _batch_and_class(op)
    reduction = schema_args(op)["reduction"]
    grad = b if reduction == NONE else ""
    ins = input_letters(op, {"grad_output": grad, "self": b + c, "target": b, "weight": c,
                             "total_weight": ""})
    return Spec(ins, (b + c,), linear="each", linear_inputs={0})


# nll_loss2d: self [N, C, *spatial], target [N, *spatial] (cross entropy over an image's or
# a sequence's positions, ``F.cross_entropy(logits[B, C, T], y[B, T])``). Every position is
# a row of its own: the batch and spatial letters shard like nll_loss's batch letter. The
# class letter stays whole (no class-sharded local form for it).
def _nll2d_letters(op: Op) -> tuple[str, str, str]:
    """(self's letters, target's, the class letter)."""
    full = letters(len(schema_args(op)["self"].type.shape))
    return full, full[0] + full[2:], full[1]


@register("aten.nll_loss2d_forward.default")
def nll_loss2d_forward(op: Op) -> Spec:
    full, rows, c = _nll2d_letters(op)
    reduction = schema_args(op)["reduction"]
    ins = input_letters(op, {"self": full, "target": rows, "weight": c})
    out = rows if reduction == NONE else ""
    whole = set(rows) | {c} if reduction == MEAN else {c}
    return Spec(ins, (out, ""), replicated=whole, reduce="sum")


@register("aten.nll_loss2d_backward.default")
def nll_loss2d_backward(op: Op) -> Spec:
    full, rows, c = _nll2d_letters(op)
    reduction = schema_args(op)["reduction"]
    ins = input_letters(op, {"grad_output": rows if reduction == NONE else "", "self": full,
                             "target": rows, "weight": c, "total_weight": ""})
    return Spec(ins, (full,), replicated={c}, linear="each", linear_inputs={0})


# mse_loss(self, target, reduction): elementwise squared errors, then none/sum/mean over all
# of them. Every letter shards: a sum of pieces is Partial(sum), and the mean's local form
# divides the local sum by the global count (and the backward scales by the global numel).
def _mse_letters(op: Op) -> tuple[str, str]:
    """(self's letters, target's)."""
    a = schema_args(op)
    self_shape = a["self"].type.shape
    full = letters(len(self_shape))
    return full, broadcast_letters(a["target"].type.shape, full, self_shape)


@register("aten.mse_loss.default")
def mse_loss(op: Op) -> Spec:
    full, target = _mse_letters(op)
    out = full if schema_args(op)["reduction"] == NONE else ""
    return Spec(input_letters(op, {"self": full, "target": target}), (out,), reduce="sum")


@register("aten.mse_loss_backward.default")
def mse_loss_backward(op: Op) -> Spec:
    # 2 * (self - target) * grad [/ numel]: linear in grad_output.
    full, target = _mse_letters(op)
    grad = full if schema_args(op)["reduction"] == NONE else ""
    ins = input_letters(op, {"grad_output": grad, "self": full, "target": target})
    return Spec(ins, (full,), linear="each", linear_inputs={0})
