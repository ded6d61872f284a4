"""Synchronized batch norm (SyncBatchNorm's way, the autopar way): statistics all-reduced,
activations never gathered.

A training ``native_batch_norm`` is one op whose rule keeps the batch and spatial letters
whole, so under data parallelism its input would be all-gathered over the batch and the rest
of the forward would run replicated. This pass rewrites it and its backward into ops whose
own SPMD rules let the batch stay sharded; completion places them and reshard writes the
collectives they imply, all of per-channel ``[1, C, 1..]`` statistics:

    out, mean, invstd = native_batch_norm(x, w, b, rm, rv, True, momentum, eps)
      ->  mean = mean(x, dims, keepdim)              Partial(sum) -> all_reduce(sum)
          d = x - mean
          var = mean(d * d, dims, keepdim)           Partial(sum) -> all_reduce(sum)
          invstd = rsqrt(var + eps)
          out = d * invstd * w + b
          rm' = rm * (1 - momentum) + mean * momentum
          rv' = rv * (1 - momentum) + var * n / (n - 1) * momentum
    gx, gw, gb = native_batch_norm_backward(dy, x, w, rm, rv, mean, invstd, True, eps, mask)
      ->  sum_dy = sum(dy, dims, keepdim)            Partial(sum) -> all_reduce(sum)
          dotp = sum((x - mean) * dy, dims, keepdim) Partial(sum) -> all_reduce(sum)
          gx = (dy - sum_dy / n - (x - mean) * dotp * invstd^2 / n) * invstd * w
          gw = dotp * invstd;  gb = sum_dy

``dims`` are the batch and spatial dims, ``n`` their global element count. A mean's local
form divides the local sum by that global count, so uneven batch shards are exact; the
variance is two-pass (as ATen's CPU kernel), not E[x^2] - E[x]^2, which would cancel.

Running statistics: the fused kernel updates ``running_mean``/``running_var`` in place; here
the new values are explicit and become ``update`` results, which the runtime writes back
like an optimizer's. Other in-place updates of buffers (``num_batches_tracked += 1``) are
made explicit the same way: every rank computes the same replicated update, and an update
result, unlike a write into a tensor the ranks may share, is applied once.

When: in training programs of more than one rank. Where the batch could be sharded (a
data-parallel axis of more than one rank, or a ``shard_tensor`` that shards something on a
multi-rank mesh dim) batch norm is decomposed as above. Elsewhere (tensor or pipeline
parallelism alone) and in reduced precision (the kernel accumulates its statistics in fp32;
its input is then gathered) the fused kernel stays, in its out-of-place form
``_native_batch_norm_legit_functional`` (bit-identical), so its running statistics are
update results as well. Serial programs keep the captured kernels (bit-identical to eager);
eval keeps them too (with running statistics the op is elementwise, its rule shards the
batch, and nothing is written). A pipeline asked for per-micro-batch statistics
(``pipeline.batch_norm: per_micro_batch``) gets ``micro_batch_norm.py``'s ops instead. New
ops keep the replaced op's role, module and forward link and decomposed ones carry
``decomposes=<op>`` for the dumps.
"""
from __future__ import annotations

import math

import torch

from ..ir import Op, OpKind, Program, TensorType, Value
from ..ir.annotation import ANNOTATE_TARGET, decode
from ..ir.attrs import DECOMPOSES, NAME, Slot, StateKind
from ..ir.ops import op_info, schema_args
from ..pass_infra.context import PassContext
from . import micro_batch_norm
from .functionalize_writes import out_of_place
from .micro_batch_norm import micro_batches_apart

_A = "aten."
_FORWARD = _A + "native_batch_norm.default"
_BACKWARD = _A + "native_batch_norm_backward.default"
_FUNCTIONAL = _A + "_native_batch_norm_legit_functional.default"
_EXACT = (torch.float32, torch.float64)


def sync_batch_norm(program: Program, ctx: PassContext) -> Program:
    if ctx.inputs.mode != "train" or not _several_ranks(program, ctx):
        return program
    decompose = batch_may_shard(program, ctx)
    apart = micro_batches_apart(ctx)
    producer_of: dict[Op, Op] = {}     # a replaced forward op -> the op now making its result
    updates: list[tuple[Value, Value]] = []   # (running statistic, its new value), in order
    per_micro_batch: set[Value] = set()       # saved means of per-micro-batch batch norms
    ops: list[Op] = []
    for op in program.ops:
        if apart and micro_batch_norm.is_training_batch_norm(op):
            new, made = micro_batch_norm.forward(op, apart)
            producer_of[op] = new[0]
            per_micro_batch.add(op.outputs[1])
            updates += made
        elif micro_batch_norm.is_its_backward(op, per_micro_batch):
            new = [micro_batch_norm.backward(op)]
        elif decompose and _rewritable(op, _FORWARD, "training"):
            new, made = _forward(op)
            producer_of[op] = op.outputs[0].producer   # the new op making its output
            updates += made
        elif decompose and _rewritable(op, _BACKWARD, "train"):
            new = _backward(op)
        elif _updates_running_stats(op):
            new, made = _functional(op)
            producer_of[op] = new[0]
            updates += made
        else:
            new = [op]
        ops.extend(new)
    program.ops = ops
    program.relink_forward_ops(producer_of)
    micro_batch_norm.count_each_micro_batch(
        program, {op.module for op in producer_of if op.outputs[1] in per_micro_batch}, apart)
    _explicit_buffer_updates(program, updates)
    return program


def batch_may_shard(program: Program, ctx: PassContext) -> bool:
    """Whether some placement may shard the batch: a data-parallel axis of more than one
    rank, or a ``shard_tensor`` (on a parameter or in forward) that shards a tensor over a
    mesh dim of more than one rank."""
    if ctx.strategy.degree("data_parallel") > 1:
        return True
    dists = list(ctx.inputs.param_annotations.values())
    dists += [decode(op.args[1]) for op in program.ops
              if op.kind is OpKind.CALL and op.target == ANNOTATE_TARGET]
    return any(p.is_shard() and n > 1
               for d in dists for p, n in zip(d.placements, d.mesh.shape))


def _several_ranks(program: Program, ctx: PassContext) -> bool:
    """Whether the program may run on more than one rank (the strategy's mesh, or a
    ``shard_tensor`` annotation's)."""
    if ctx.inputs.mesh is not None and ctx.inputs.mesh.size > 1:
        return True
    meshes = [d.mesh for d in ctx.inputs.param_annotations.values()]
    meshes += [decode(op.args[1]).mesh for op in program.ops
               if op.kind is OpKind.CALL and op.target == ANNOTATE_TARGET]
    return any(mesh.size > 1 for mesh in meshes)


def _rewritable(op: Op, target: str, flag: str) -> bool:
    """Training batch norm over (N, C, *spatial) in fp32/fp64 (reduced precision keeps the
    fused kernel, which accumulates its statistics in fp32) with more than one value per
    channel (torch refuses one; the unbiased variance would divide by zero)."""
    if op.kind is not OpKind.CALL or op.target != target:
        return False
    a = schema_args(op)
    shape = a["input"].type.shape
    return (bool(a[flag]) and len(shape) >= 2 and a["input"].type.dtype in _EXACT
            and math.prod(shape) > shape[1])


def _updates_running_stats(op: Op) -> bool:
    """A fused training batch norm that is kept (the batch is not sharded, or reduced
    precision) and writes its running statistics in place."""
    if op.kind is not OpKind.CALL or op.target != _FORWARD:
        return False
    a = schema_args(op)
    return bool(a["training"]) and _tensor(a["running_mean"]) is not None


def _functional(op: Op) -> tuple[list[Op], list[tuple[Value, Value]]]:
    """The same fused kernel in its out-of-place form (bit-identical results): the new
    running statistics are results, not writes into the buffers."""
    a = schema_args(op)
    new_stats = [Value(a[name].type) for name in ("running_mean", "running_var")]
    args = tuple(a[name] for name in ("input", "weight", "bias", "running_mean",
                                      "running_var", "training", "momentum", "eps"))
    new = Op(OpKind.CALL, _FUNCTIONAL, args, {}, list(op.outputs) + new_stats, op.role,
             op.module, op.forward_op, dict(op.attrs))
    for i, v in enumerate(new.outputs):
        v.producer, v.index = new, i
    return [new], [(a["running_mean"], new_stats[0]), (a["running_var"], new_stats[1])]


# -- building ------------------------------------------------------------------------------


class _Builder:
    """New ops standing in for ``op``: same role, module and forward link."""

    def __init__(self, op: Op):
        self.op, self.ops = op, []
        x = schema_args(op)["input"].type
        self.dtype, self.channels = x.dtype, x.shape[1]
        self.dims = [0] + list(range(2, len(x.shape)))          # batch and spatial
        self.count = math.prod(x.shape[d] for d in self.dims)   # global, for every rank
        self.stat_shape = tuple(x.shape[1] if d == 1 else 1 for d in range(len(x.shape)))

    def call(self, name: str, args: tuple, shape: tuple[int, ...],
             result: Value | None = None) -> Value:
        out = result if result is not None else Value(TensorType(tuple(shape), self.dtype))
        new = Op(OpKind.CALL, _A + name, args, {}, [out], self.op.role, self.op.module,
                 self.op.forward_op,
                 {DECOMPOSES: self.op.target.removeprefix(_A).removesuffix(".default")})
        out.producer, out.index = new, 0
        self.ops.append(new)
        return out

    def stat(self, v: Value) -> Value:
        """A (C,) per-channel tensor shaped to broadcast against the input."""
        return self.call("view.default", (v, list(self.stat_shape)), self.stat_shape)

    def flat(self, v: Value, result: Value | None = None) -> Value:
        """A [1, C, 1..] statistic as (C,)."""
        return self.call("view.default", (v, [self.channels]), (self.channels,), result)

    def mean(self, v: Value) -> Value:
        return self.call("mean.dim", (v, self.dims, True), self.stat_shape)

    def sum(self, v: Value) -> Value:
        return self.call("sum.dim_IntList", (v, self.dims, True), self.stat_shape)

    def like(self, name: str, args: tuple, like: Value, result: Value | None = None) -> Value:
        return self.call(name, args, like.type.shape, result)


def _tensor(v) -> Value | None:
    return v if isinstance(v, Value) and v.is_tensor else None


def _forward(op: Op) -> tuple[list[Op], list[tuple[Value, Value]]]:
    a = schema_args(op)
    x, w, bias = a["input"], _tensor(a["weight"]), _tensor(a["bias"])
    out, save_mean, save_invstd = op.outputs
    b = _Builder(op)
    mean = b.mean(x)
    d = b.like("sub.Tensor", (x, mean), x)
    var = b.mean(b.like("mul.Tensor", (d, d), x))
    invstd = b.like("rsqrt.default", (b.like("add.Tensor", (var, a["eps"]), var),), var)
    y = b.like("mul.Tensor", (d, invstd), x, None if w is not None or bias is not None else out)
    if w is not None:
        y = b.like("mul.Tensor", (y, b.stat(w)), x, None if bias else out)
    if bias is not None:
        b.like("add.Tensor", (y, b.stat(bias)), x, out)
    b.flat(invstd, save_invstd)
    return b.ops, _running_updates(b, a, b.flat(mean, save_mean), var)


def _running_updates(b: _Builder, a: dict, mean: Value, var: Value
                     ) -> list[tuple[Value, Value]]:
    """The running statistics' new values (``mean`` is (C,), ``var`` [1, C, 1..]): the
    kernel's exponential average, the variance unbiased by the global count."""
    momentum, made = a["momentum"], []
    for name in ("running_mean", "running_var"):
        old = _tensor(a[name])
        if old is None:
            continue
        new_stat = mean
        if name == "running_var":
            new_stat = b.like("mul.Tensor", (b.flat(var), b.count / (b.count - 1)), mean)
        kept = b.like("mul.Tensor", (old, 1.0 - momentum), old)
        made.append((old, b.like("add.Tensor", (kept, b.like("mul.Tensor", (new_stat, momentum),
                                                              new_stat)), old)))
    return made


def _backward(op: Op) -> list[Op]:
    a = schema_args(op)
    dy, x, w = a["grad_out"], a["input"], _tensor(a["weight"])
    gx, gw, gb = op.outputs
    b = _Builder(op)
    mean, invstd = b.stat(a["save_mean"]), b.stat(a["save_invstd"])
    sum_dy = b.sum(dy)
    d = b.like("sub.Tensor", (x, mean), x)
    dotp = b.sum(b.like("mul.Tensor", (d, dy), x))
    if gx.is_tensor:
        # ATen's CPU formulation: dx = d * dotp * invstd^2 / n; gx = (dy - mean_dy - dx) * k
        k = b.like("div.Scalar", (b.like("mul.Tensor", (dotp, b.like(
            "mul.Tensor", (invstd, invstd), invstd)), dotp), b.count), dotp)
        dx = b.like("mul.Tensor", (d, k), x)
        mean_dy = b.like("div.Scalar", (sum_dy, b.count), sum_dy)
        centered = b.like("sub.Tensor", (b.like("sub.Tensor", (dy, mean_dy), x), dx), x)
        scale = invstd if w is None else b.like("mul.Tensor", (invstd, b.stat(w)), invstd)
        b.like("mul.Tensor", (centered, scale), x, gx)
    if gw.is_tensor:
        b.flat(b.like("mul.Tensor", (dotp, invstd), dotp), gw)
    if gb.is_tensor:
        b.flat(sum_dy, gb)
    return b.ops


# -- in-place buffer updates made explicit ----------------------------------------------------


def _explicit_buffer_updates(program: Program, updates: list[tuple[Value, Value]]) -> None:
    """Every buffer's new value becomes an ``update`` result: the batch norms' running
    statistics (``updates``: (buffer, new value) in program order) and what in-place ops
    write into buffers, rewritten to their out-of-place form. Later readers of a buffer read
    its newest value."""
    names = {op.outputs[0]: op.attrs[NAME] for op in program.states(StateKind.BUFFER)}
    made_by: dict[Op, list[tuple[Value, Value]]] = {}
    for old, new in updates:
        made_by.setdefault(new.producer, []).append((old, new))
    latest: dict[Value, Value] = {}     # a buffer -> its newest value
    buffer_of = {v: v for v in names}   # a buffer's value, old or new -> the buffer
    for op in program.ops:
        if op.kind is not OpKind.CALL:
            continue
        op.map_inputs(lambda v: latest.get(v, v))
        first = op.args[0] if op.args else None
        base = buffer_of.get(first) if isinstance(first, Value) else None
        if base is not None and _in_place(op):
            op.target = out_of_place(op.target)
            latest[base], buffer_of[op.outputs[0]] = op.outputs[0], base
        for old, new in made_by.get(op, ()):
            base = buffer_of.get(old, old)   # a statistic that is no buffer: readers only
            latest[base], buffer_of[new] = new, base
    program.set_results(program.results() + [(Slot("update", names[v]), latest[v])
                                              for v in names if v in latest])


def _in_place(op: Op) -> bool:
    """An ATen op that writes its first argument and has an out-of-place form (``add_``,
    ``mul_``, ``copy_``...)."""
    schema = op_info(op.target).schema
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write and out_of_place(op.target) is not None
