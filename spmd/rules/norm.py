"""Normalizations. Layer norm: statistics run over the trailing ``normalized_shape`` dims, so
those letters stay whole; the leading (token) letters shard freely. mean/rstd keep the
normalized dims as size 1. In the backward, grad_weight/grad_bias sum over the leading
letters, so a sharded token letter makes them Partial(sum); every backward output is linear
in grad_out."""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register
from ..spec import UNSHARDABLE, Spec, letters
from .common import input_letters, schema_args


def _letters(op: Op, name: str) -> tuple[str, str, str]:
    """(all input letters, the leading ones, the normalized ones)."""
    a = schema_args(op)
    rank, k = len(a[name].type.shape), len(a["normalized_shape"])
    lead, normed = letters(rank - k), letters(k, start=rank - k)
    return lead + normed, lead, normed


@register("aten.native_layer_norm.default")
def layer_norm(op: Op) -> Spec:
    full, lead, normed = _letters(op, "input")
    stats = lead + UNSHARDABLE * len(normed)
    ins = input_letters(op, {"input": full, "weight": normed, "bias": normed})
    return Spec(ins, (full, stats, stats), replicated=set(normed))


@register("aten.native_layer_norm_backward.default")
def layer_norm_backward(op: Op) -> Spec:
    full, lead, normed = _letters(op, "grad_out")
    stats = lead + UNSHARDABLE * len(normed)
    ins = input_letters(op, {"grad_out": full, "input": full, "mean": stats, "rstd": stats,
                             "weight": normed, "bias": normed})
    # An output masked off in output_mask is not a tensor in the IR.
    wanted = (full, normed, normed)
    outs = tuple(w if v.is_tensor else None for v, w in zip(op.outputs, wanted))
    return Spec(ins, outs, replicated=set(normed), reduce="sum", linear="each",
                linear_inputs={0})


# Batch norm over input (N, C, *spatial): each channel is normalized on its own, so the
# channel letter shards. In training the statistics run over N and the spatial dims (those
# stay whole); in eval the running statistics make the op elementwise, so they shard too and
# the backward's weight/bias grads (sums over them) come out Partial(sum). save_mean and
# save_invstd are (C,), or empty in eval. Training also updates running_mean/var in place;
# a channel shard updates its own slice. Where the batch may be sharded (data parallelism),
# passes/sync_batch_norm.py rewrites training batch norm into means and sums whose rules keep
# the batch sharded (its statistics all-reduced), so "whole" here is what serial and
# reduced-precision programs see.
def _batch_norm_letters(op: Op, training: bool) -> tuple[str, str, set[str]]:
    rank = len(schema_args(op)["input"].type.shape)
    full = letters(rank)
    return full, full[1], (set(full) - {full[1]} if training else set())


def _per_channel(v, c: str) -> str:
    """``c`` for a (C,) statistic; an empty one (eval's save_mean) is unshardable."""
    shape = v.type.shape
    return c if len(shape) == 1 and shape[0] > 0 else UNSHARDABLE * len(shape)


@register("aten.native_batch_norm.default",
          "aten._native_batch_norm_legit_functional.default")   # + new running_mean/var
def batch_norm(op: Op) -> Spec:
    a = schema_args(op)
    full, c, whole = _batch_norm_letters(op, a["training"])
    ins = input_letters(op, {"input": full, "weight": c, "bias": c, "running_mean": c,
                             "running_var": c})
    outs = (full,) + tuple(_per_channel(v, c) for v in op.outputs[1:])
    return Spec(ins, outs, replicated=whole, reduce="sum")


@register("aten.native_batch_norm_backward.default")
def batch_norm_backward(op: Op) -> Spec:
    a = schema_args(op)
    full, c, whole = _batch_norm_letters(op, a["train"])
    by_name = {"grad_out": full, "input": full, "weight": c, "running_mean": c,
               "running_var": c}
    for name in ("save_mean", "save_invstd"):
        if getattr(a[name], "is_tensor", False):
            by_name[name] = _per_channel(a[name], c)
    ins = input_letters(op, by_name)
    wanted = (full, c, c)
    outs = tuple(w if v.is_tensor else None for v, w in zip(op.outputs, wanted))
    return Spec(ins, outs, replicated=whole, reduce="sum", linear="each", linear_inputs={0})
