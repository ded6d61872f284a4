"""Batch norm by each micro-batch's own statistics (``pipeline.batch_norm: per_micro_batch``;
kernels in ``ir/kernels/pipeline.py``, made by ``passes/micro_batch_norm.py``).

On every mesh dim but ``mb`` it is batch norm (the batch and spatial letters whole, the
channel letter sharding). On ``mb`` it is local by definition: a micro-batch's rows
(``Shard(0)``) are normalized by their own statistics, which each micro-batch holds for
itself (``Replicate`` on ``mb``: not a piece of anything, read only by the same
micro-batch's backward). The backward's weight and bias gradients and the forward's
running-statistic terms are sums over micro-batches, ``Partial(sum)`` on ``mb``: gradient
accumulation, and the running statistics' updates one micro-batch after another.
"""
from __future__ import annotations

from typing import Collection, Sequence

from ...ir.core import Op
from ...ir.dist import (
    DistAttr,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    micro_batch_dim,
)
from ...ir.reason import MeshDimChoice, Option
from ..einsum import Decision
from ..rule_registry import EinsumRule, register, tensor_inputs
from ..spec import Spec, letters

FORWARD = "autopar.micro_batch_norm"
BACKWARD = "autopar.micro_batch_norm_backward"


def _forward_spec(op: Op) -> Spec:
    """Training batch norm: (out, mean, invstd, mean_term, var_term)."""
    full = letters(len(op.args[0].type.shape))
    c = full[1]
    ins = [full] + [c] * (len(tensor_inputs(op)) - 1)
    return Spec(tuple(ins), (full, c, c, c, c), replicated=set(full) - {c}, reduce="sum")


def _backward_spec(op: Op) -> Spec:
    """(grad_out, input, [weight], mean, invstd) -> (grad_input, grad_weight, grad_bias)."""
    full = letters(len(op.args[0].type.shape))
    c = full[1]
    ins = [full, full] + [c] * (len(tensor_inputs(op)) - 2)
    outs = tuple(w if v.is_tensor else None for v, w in zip(op.outputs, (full, c, c)))
    return Spec(tuple(ins), outs, replicated=set(full) - {c}, reduce="sum", linear="each",
                linear_inputs={0})


class PerMicroBatch:
    """``inner`` on every mesh dim but ``mb``; on ``mb`` the first ``rows`` tensor inputs
    need their micro-batch's rows, the others whole, and output ``o`` is ``on_mb[o]``."""

    def __init__(self, spec_of, rows: int, on_mb: tuple[Placement, ...]):
        self.inner, self.rows, self.on_mb = EinsumRule(spec_of), rows, on_mb

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available: Sequence[Collection[DistAttr]] | None = None) -> Decision:
        mb = micro_batch_dim(mesh)
        if mb is None:
            return self.inner.forward(op, in_dists, mesh, available)
        whole = [_whole(d, mb) for d in in_dists]
        moved = None if available is None else [[_whole(d, mb) for d in a] for a in available]
        decision = self.inner.forward(op, whole, mesh, moved)
        return self._on_mb(decision, mb)

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        mb = micro_batch_dim(mesh)
        if mb is None:
            return self.inner.reverse(op, out_hints, mesh)
        needs = self.inner.reverse(op, [_whole(h, mb) for h in out_hints], mesh)
        return self._needs(needs, mb)

    def _needs(self, needs: Sequence[DistAttr], mb: int) -> tuple[DistAttr, ...]:
        return tuple(d.with_placement(mb, Shard(0) if i < self.rows else Replicate())
                     for i, d in enumerate(needs))

    def _on_mb(self, decision: Decision, mb: int) -> Decision:
        outs = tuple(None if d is None else d.with_placement(mb, p)
                     for d, p in zip(decision.outputs, self.on_mb))
        choices = list(decision.choices)
        choices[mb] = MeshDimChoice(mb, Option("shard", "a"), 0.0, ())
        return Decision(self._needs(decision.needs, mb), outs, tuple(choices))


def _whole(d: DistAttr | None, mb: int) -> DistAttr | None:
    return None if d is None else d.with_placement(mb, Replicate())


register(FORWARD)(PerMicroBatch(_forward_spec, rows=1, on_mb=(
    Shard(0), Replicate(), Replicate(), Partial("sum"), Partial("sum"))))
register(BACKWARD)(PerMicroBatch(_backward_spec, rows=2, on_mb=(
    Shard(0), Partial("sum"), Partial("sum"))))
