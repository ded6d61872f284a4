"""Embedding lookups. Forward ``weight[v,h], indices[...] -> [..., h]``: a sharded vocab
letter v makes the output Partial(sum) (vocab parallel: each rank looks up the rows it holds
and zeros the rest, in the local form). Backward scatters grad rows into a ``[v,h]`` grad:
sharded index letters make it Partial(sum); v cannot shard there (no input carries it)."""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register
from ..spec import Spec, letters
from .common import input_letters, schema_args


@register("aten.embedding.default")
def embedding(op: Op) -> Spec:
    idx = letters(len(schema_args(op)["indices"].type.shape))
    v, h = letters(2, start=len(idx))
    ins = input_letters(op, {"weight": v + h, "indices": idx})
    return Spec(ins, (idx + h,), reduce="sum", linear="each", linear_inputs={0})


@register("aten.embedding_dense_backward.default")
def embedding_dense_backward(op: Op) -> Spec:
    a = schema_args(op)
    idx = letters(len(a["indices"].type.shape))
    v, h = letters(2, start=len(idx))
    ins = input_letters(op, {"grad_output": idx + h, "indices": idx})
    # scale_grad_by_freq divides by how often each index occurs in the whole batch.
    whole = set(idx) if a["scale_grad_by_freq"] else set()
    return Spec(ins, (v + h,), replicated=whole, reduce="sum", linear="each",
                linear_inputs={0})
