"""Rewrite a mean-reduced ``nll_loss_forward`` into its sum and an explicit division by the
total weight. Numerically identical on one device (ATen divides the same two numbers), but
now the sum and the weight are each a plain ``Partial(sum)`` when the batch is sharded, so
data parallelism needs no special loss rule: the global-batch mean falls out of the SPMD
rules and matches eager even for uneven shards and ignored targets."""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Value
from .context import PassContext

_NLL = "aten.nll_loss_forward.default"
_MEAN, _SUM = 1, 2
_REDUCTION = 3   # nll_loss_forward(self, target, weight, reduction, ignore_index)


def decompose_loss(program: Program, ctx: PassContext) -> Program:
    for op in list(program.ops):
        if (op.kind is OpKind.CALL and op.target == _NLL and len(op.args) > _REDUCTION
                and op.args[_REDUCTION] == _MEAN):
            _split_mean(program, op)
    return program


def _split_mean(program: Program, op: Op) -> None:
    mean, total_weight = op.outputs
    total = Value(mean.type)
    op.args = op.args[:_REDUCTION] + (_SUM,) + op.args[_REDUCTION + 1:]
    op.outputs = [total, total_weight]
    total.producer, total.index = op, 0
    divide = Op(OpKind.CALL, "aten.div.Tensor", (total, total_weight), outputs=[mean],
                role=op.role, module=op.module, forward_op=op.forward_op)
    program.insert_after(op, divide)
