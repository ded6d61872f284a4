"""Batch norm by each micro-batch's own statistics (``pipeline.batch_norm: per_micro_batch``),
as ``sync_batch_norm`` writes it when a training pipeline has several micro-batches.

Batch norm's statistics are of the whole batch, which a pipeline never holds at once: by
default it is refused (``assign_phases`` names the op). Asked for, each micro-batch is
normalized by its own statistics, as ``torch.distributed.pipelining`` runs a model:

    out, mean, invstd = native_batch_norm(x, w, b, rm, rv, True, momentum, eps)
      ->  out, mean, invstd, tm, tv = autopar.micro_batch_norm(x, w, b, momentum, eps)
          rm' = rm * (1 - momentum)**m + tm           tm: Partial(sum) over mb
          rv' = rv * (1 - momentum)**m + tv
    gx, gw, gb = native_batch_norm_backward(dy, x, w, rm, rv, mean, invstd, True, eps, mask)
      ->  gx, gw, gb = autopar.micro_batch_norm_backward(dy, x, w, mean, invstd, eps, mask)

The running statistics see ``m`` updates one after another, micro-batch 0 first: each
micro-batch's term is its ``momentum * stat`` times ``(1 - momentum)`` per later
micro-batch, so their sum over micro-batches (an accumulation, like gradients') plus the
decayed old value is what ``m`` eager forwards leave; ``num_batches_tracked`` grows by
``m``. The rules (``spmd/rules/micro_batch_norm.py``) keep the op local on ``mb``.
A ``momentum=None`` batch norm (a cumulative average) is refused by name, and so is data
parallelism beside it (a micro-batch then spans the dp ranks: not supported yet).
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, TensorType, Value
from ..ir.attrs import NAME, StateKind
from ..ir.ops import schema_args
from ..pass_infra.context import PassContext

_FORWARD = "aten.native_batch_norm.default"
_BACKWARD = "aten.native_batch_norm_backward.default"
MICRO_BATCH_NORM = "autopar.micro_batch_norm"
MICRO_BATCH_NORM_BACKWARD = "autopar.micro_batch_norm_backward"


class MicroBatchNormError(ValueError):
    """A batch norm that per-micro-batch statistics cannot reproduce."""


def micro_batches_apart(ctx: PassContext) -> int:
    """The micro-batches each batch norm normalizes apart (0: whole-batch statistics)."""
    pipe = ctx.strategy.pipeline
    if pipe is None or pipe.batch_norm != "per_micro_batch" or ctx.inputs.mode != "train":
        return 0
    m = ctx.inputs.micro_batches
    if m > 1 and ctx.strategy.degree("data_parallel") > 1:
        raise MicroBatchNormError(
            "pipeline.batch_norm: per_micro_batch with data_parallel over "
            f"{ctx.strategy.degree('data_parallel')} ranks is not supported yet: a micro-batch "
            "spans the data-parallel ranks, and its statistics would need its rows gathered "
            "from every one of them; use it without data_parallel, or whole_batch statistics "
            "with pipeline.micro_batches: 1")
    return m if m > 1 else 0


def is_training_batch_norm(op: Op) -> bool:
    return (op.kind is OpKind.CALL and op.target == _FORWARD
            and bool(schema_args(op)["training"]))


def is_its_backward(op: Op, rewritten: set[Value]) -> bool:
    """The backward of a batch norm rewritten here (it reads that op's saved mean)."""
    return (op.kind is OpKind.CALL and op.target == _BACKWARD
            and schema_args(op)["save_mean"] in rewritten)


def forward(op: Op, m: int) -> tuple[list[Op], list[tuple[Value, Value]]]:
    """The per-micro-batch op and the running statistics' new values: (ops, [(old, new)])."""
    a = schema_args(op)
    momentum = a["momentum"]
    if not isinstance(momentum, (int, float)):
        raise MicroBatchNormError(
            f"{op.target} ({op.module or 'top level'}): pipeline.batch_norm: per_micro_batch "
            f"needs a numeric momentum, got {momentum!r} (momentum=None, a cumulative "
            "average, is not supported)")
    x = a["input"]
    stat_type = TensorType((x.type.shape[1],), x.type.dtype)
    terms = [Value(stat_type), Value(stat_type)]
    new = _op(op, MICRO_BATCH_NORM, (x, a["weight"], a["bias"], momentum, a["eps"]),
              list(op.outputs) + terms)
    ops, updates = [new], []
    for name, term in zip(("running_mean", "running_var"), terms):
        old = a[name]
        if not (isinstance(old, Value) and old.is_tensor):
            continue
        kept = _op(op, "aten.mul.Tensor", (old, (1.0 - momentum) ** m), [Value(old.type)])
        total = _op(op, "aten.add.Tensor", (kept.result, term), [Value(old.type)])
        ops += [kept, total]
        updates.append((old, total.result))
    return ops, updates


def backward(op: Op) -> Op:
    a = schema_args(op)
    return _op(op, MICRO_BATCH_NORM_BACKWARD,
               (a["grad_out"], a["input"], a["weight"], a["save_mean"], a["save_invstd"],
                a["eps"], list(a["output_mask"])), list(op.outputs))


def count_each_micro_batch(program: Program, modules: set[str], m: int) -> None:
    """``num_batches_tracked += 1`` of a rewritten batch norm adds ``m``: one per
    micro-batch, as ``m`` eager forwards count."""
    buffers = {op.result for op in program.states(StateKind.BUFFER)
               if op.attrs[NAME].endswith("num_batches_tracked")}
    for op in program.ops:
        if (op.kind is OpKind.CALL and op.target == "aten.add_.Tensor" and op.module in modules
                and op.args[0] in buffers and op.args[1] == 1):
            op.args = (op.args[0], m) + tuple(op.args[2:])


def _op(like: Op, target: str, args: tuple, outputs: list[Value]) -> Op:
    new = Op(OpKind.CALL, target, args, {}, outputs, like.role, like.module, like.forward_op)
    for i, v in enumerate(outputs):
        v.producer, v.index = new, i
    return new
