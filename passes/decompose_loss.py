"""Rewrite a mean-reduced ``nll_loss_forward`` (or ``nll_loss2d_forward``: a loss over
positions, ``[N, C, *spatial]``) into its sum and an explicit division by the total weight.
Numerically identical on one device (ATen divides the same two numbers), but now the sum and
the weight are each a plain ``Partial(sum)`` when the batch is sharded, so data parallelism
needs no special loss rule: the global-batch mean falls out of the SPMD rules and matches
eager even for uneven shards and ignored targets.

Without class weights the total weight is the number of targets that are not ignored: it is
counted straight from the labels, at the top of the program, so under data parallel its
all-reduce can travel during the forward instead of stopping every rank at the loss
(``bucket_collectives`` makes it asynchronous). ATen counts the same targets in the loss
dtype, so the value is the same to the bit."""
from __future__ import annotations

import torch

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.core import TensorType
from ..ir.ops import schema_args
from ..pass_infra.context import PassContext

_NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
_MEAN, _SUM = 1, 2
_RESHAPES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
             "aten.clone.default", "aten.flatten.using_ints"}


def decompose_loss(program: Program, ctx: PassContext) -> Program:
    for op in list(program.ops):
        if op.kind is OpKind.CALL and op.target in _NLL \
                and schema_args(op)["reduction"] == _MEAN:
            _split_mean(program, op)
    return program


def _split_mean(program: Program, op: Op) -> None:
    mean, total_weight = op.outputs
    total = Value(mean.type)
    a = schema_args(op)
    op.args, op.kwargs = (a["self"], a["target"], a["weight"], _SUM, a["ignore_index"]), {}
    op.outputs = [total, total_weight]
    total.producer, total.index = op, 0
    divisor = total_weight
    if a["weight"] is None:
        divisor = _count_targets(program, op, total_weight.type)
        _read_instead(program, total_weight, divisor)
    divide = Op(OpKind.CALL, "aten.div.Tensor", (total, divisor), outputs=[mean],
                role=op.role, module=op.module, forward_op=op.forward_op)
    program.insert_after(op, divide)


def _count_targets(program: Program, op: Op, dtype_of: TensorType) -> Value:
    """``(labels != ignore_index).sum()`` in the loss dtype, from the labels as fed (a
    reshape keeps the count), placed right after they are."""
    labels = op.args[1]
    while labels.producer.kind is OpKind.CALL and labels.producer.target in _RESHAPES:
        labels = labels.producer.args[0]
    ignore = schema_args(op)["ignore_index"]
    kept = Value(TensorType(labels.type.shape, torch.bool))
    ones = Value(TensorType(labels.type.shape, dtype_of.dtype))
    weight = Value(dtype_of)
    anchor = labels.producer
    # cast, then sum: the sum is then the Partial that travels (whole numbers below 2**24
    # add exactly in any order)
    for new in (Op(OpKind.CALL, "aten.ne.Scalar", (labels, ignore), outputs=[kept]),
                Op(OpKind.CALL, "aten._to_copy.default", (kept,), {"dtype": dtype_of.dtype},
                   outputs=[ones]),
                Op(OpKind.CALL, "aten.sum.default", (ones,), outputs=[weight])):
        new.role, new.module = Role.LOSS, op.module
        anchor = program.insert_after(anchor, new)
    return weight


def _read_instead(program: Program, old: Value, new: Value) -> None:
    for reader in program.users().get(old, ()):
        reader.map_inputs(lambda v: new if v is old else v)
