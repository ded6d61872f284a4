"""Layer norm: statistics run over the trailing ``normalized_shape`` dims, so those letters
stay whole; the leading (token) letters shard freely. mean/rstd keep the normalized dims as
size 1. In the backward, grad_weight/grad_bias sum over the leading letters, so a sharded
token letter makes them Partial(sum); every backward output is linear in grad_out."""
from __future__ import annotations

from ...ir.core import Op
from ..registry import register
from ..spec import UNSHARDABLE, Spec, letters
from .pointwise import input_letters, schema_args


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

