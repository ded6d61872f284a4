"""Out-of-place writes into part of a tensor (what ``passes/functionalize_writes.py`` makes of
``copy_``/``fill_`` into a view): the written dim stays whole, every other dim shards with the
base. A scatter is jointly linear in the base and the written part (each element is one of
them), so Partial bases and sources pass through together."""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register
from ..spec import Spec, letters
from .common import elementwise, same_dtype, schema_args, shape


def _dim(op: Op, rank: int) -> int:
    return schema_args(op)["dim"] % rank


@register("aten.slice_scatter.default")
def slice_scatter(op: Op) -> Spec:
    a = schema_args(op)
    full = letters(len(shape(a["self"])))
    d = full[_dim(op, len(full))]
    return Spec((full, full), (full,), replicated={d}, linear="sum")


@register("aten.select_scatter.default")
def select_scatter(op: Op) -> Spec:
    a = schema_args(op)
    full = letters(len(shape(a["self"])))
    d = full[_dim(op, len(full))]
    return Spec((full, full.replace(d, "")), (full,), replicated={d}, linear="sum")


@register("aten.copy.default")
def copy(op: Op) -> Spec:
    # the result is ``src`` broadcast to ``self``'s shape and cast to its dtype: linear in
    # src unless the cast rounds
    return elementwise(op, linear="each" if same_dtype(op, 1) else "none", linear_inputs={1})


@register("aten.fill.Scalar", "aten.fill.Tensor")
def fill(op: Op) -> Spec:
    return elementwise(op)
