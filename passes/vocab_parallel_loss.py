"""Vocab-parallel log-softmax (Megatron's vocab-parallel cross-entropy, the autopar way).

``_log_softmax`` and its backward are one op each whose rule keeps the class axis whole, so
class-sharded logits (a vocab-sharded tied head, a colwise ``head``) would be all-gathered
whole, ``[tokens, vocab]``, before the loss. This pass rewrites both into ops whose own SPMD
rules let that axis stay sharded; completion then places them and reshard writes the few
collectives they imply, all of per-token scalars ``[tokens, 1]``:

    out = log_softmax(x)   ->   m = amax(x, dim, keepdim)      Partial(max) -> all_reduce(max)
                                z = x - m
                                s = sum(exp(z), dim, keepdim)  Partial(sum) -> all_reduce(sum)
                                out = z - log(s)
    gx = log_softmax_backward(g, out)
                           ->   gx = g - exp(out) * sum(g, dim, keepdim)   (all_reduce(sum))

The target logit is the loss rules' business (``nll_loss`` with the class letter sharded:
a masked local lookup whose sum over ranks is exact, spmd/local_forms/losses.py).

The max is only a shift for numerical stability; any per-row constant gives the same
result (and the all-reduced max is exact, so every rank shifts by the same one). Gradients
need no care: the backward is already explicit in the program and reads only ``out``, so
nothing differentiates through ``amax``. The new ops keep the replaced op's role, module
and forward link, carry ``decomposes=<op>`` for the dumps, and backward ops that pointed at
the fused forward op point at the op that now makes its result. They round differently
from the fused kernel (last-bit differences, well inside fp32 parity).

When: only where the class axis could be sharded, i.e. a tensor-parallel axis of more than
one rank, or a ``shard_tensor`` annotation that shards something on a multi-rank mesh dim.
Serial and pure data-parallel programs keep the fused kernels (serial stays bit-identical to
eager; data parallelism shards only the batch, so the decomposition would only cost time).
Where the class axis ends up replicated anyway the decomposed ops run locally, without
communication. A 0-d or dtype-changing (``half_to_float``, CUDA only) log-softmax is kept.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, TensorType, Value
from ..ir.annotation import ANNOTATE_TARGET, decode
from ..ir.attrs import DECOMPOSES
from ..ir.dist import DistAttr
from ..ir.ops import schema_args
from ..pass_infra.context import PassContext
from ..spmd.rule_registry import tensor_inputs

_FORWARD = "aten._log_softmax.default"          # (self, dim, half_to_float)
_BACKWARD = "aten._log_softmax_backward_data.default"   # (grad, output, dim, input_dtype)
_A = "aten."


def vocab_parallel_loss(program: Program, ctx: PassContext) -> Program:
    if not classes_may_shard(program, ctx):
        return program
    producer_of: dict[Op, Op] = {}    # a replaced forward op -> the op now making its result
    ops: list[Op] = []
    for op in program.ops:
        if _rewritable(op, _FORWARD):
            new = _forward(op)
            producer_of[op] = new[-1]
        elif _rewritable(op, _BACKWARD):
            new = _backward(op)
        else:
            new = [op]
        ops.extend(new)
    program.ops = ops
    program.relink_forward_ops(producer_of)
    return program


def classes_may_shard(program: Program, ctx: PassContext) -> bool:
    """Whether some placement may shard a non-batch dim: a tensor-parallel axis of more than
    one rank, or a ``shard_tensor`` (on a parameter or in forward) that shards a tensor over
    a mesh dim of more than one rank."""
    if ctx.strategy.degree("tensor_parallel") > 1:
        return True
    dists = list(ctx.inputs.param_annotations.values())
    dists += [decode(op.args[1]) for op in program.ops
              if op.kind is OpKind.CALL and op.target == ANNOTATE_TARGET]
    return any(_shards(d) for d in dists)


def _rewritable(op: Op, target: str) -> bool:
    """A 0-d log-softmax has no class axis to shard; one that changes dtype (half_to_float,
    CUDA only) keeps its fused kernel, which rounds once."""
    if op.kind is not OpKind.CALL or op.target != target:
        return False
    first, out = tensor_inputs(op)[0].type, op.outputs[0].type
    return bool(out.shape) and first.dtype == out.dtype


def _shards(dist: DistAttr) -> bool:
    return any(p.is_shard() and n > 1 for p, n in zip(dist.placements, dist.mesh.shape))


# -- the two rewrites ------------------------------------------------------------------


class _Builder:
    """New ops standing in for ``op``: same role, module and forward link."""

    def __init__(self, op: Op):
        self.op, self.ops = op, []

    def call(self, name: str, args: tuple, type_: TensorType,
             result: Value | None = None) -> Value:
        out = result if result is not None else Value(type_)
        new = Op(OpKind.CALL, _A + name, args, {}, [out], self.op.role,
                 self.op.module, self.op.forward_op,
                 {DECOMPOSES: self.op.target.removeprefix(_A).removesuffix(".default")})
        out.producer, out.index = new, 0
        self.ops.append(new)
        return out


def _arg(op: Op, index: int, name: str):
    """An argument by its schema name (given by position or keyword, or its default)."""
    return schema_args(op)[name]


def _row_type(t: TensorType, dim: int) -> TensorType:
    """The type of a keepdim reduction of ``t`` over ``dim``: one scalar per row."""
    return TensorType(tuple(1 if d == dim else n for d, n in enumerate(t.shape)), t.dtype)


def _dim(op: Op, t: TensorType) -> int:
    return _arg(op, 2 if op.target == _BACKWARD else 1, "dim") % len(t.shape)


def _forward(op: Op) -> list[Op]:
    """log_softmax(x) = (x - max) - log(sum(exp(x - max)))."""
    out = op.outputs[0]
    b = _Builder(op)
    x = _arg(op, 0, "self")
    dim = _dim(op, x.type)
    row = _row_type(x.type, dim)
    shift = b.call("amax.default", (x, [dim], True), row)
    z = b.call("sub.Tensor", (x, shift), x.type)
    total = b.call("sum.dim_IntList", (b.call("exp.default", (z,), x.type), [dim], True), row)
    b.call("sub.Tensor", (z, b.call("log.default", (total,), row)), x.type, result=out)
    return b.ops


def _backward(op: Op) -> list[Op]:
    """grad_input = grad - exp(out) * sum(grad)."""
    grad, out = _arg(op, 0, "grad_output"), _arg(op, 1, "output")
    result = op.outputs[0]
    b = _Builder(op)
    dim = _dim(op, grad.type)
    total = b.call("sum.dim_IntList", (grad, [dim], True), _row_type(grad.type, dim))
    scaled = b.call("mul.Tensor", (b.call("exp.default", (out,), out.type), total), out.type)
    b.call("sub.Tensor", (grad, scaled), result.type, result=result)
    return b.ops
