"""Ops that read along one dim as a whole (masks over a matrix, padding, indexing): that
dim's letter stays whole, the others pass through. All are linear in the data they move."""
from __future__ import annotations

from ...ir.core import Op
from ..registry import register
from ..spec import UNSHARDABLE, Spec, letters
from .common import input_letters, schema_args


@register("aten.tril.default", "aten.triu.default")
def triangle(op: Op) -> Spec:
    # Which entries survive depends on the (row, column) index pair.
    abc = letters(len(schema_args(op)["self"].type.shape))
    return Spec((abc,), (abc,), replicated=set(abc[-2:]), linear="sum")


@register("aten.constant_pad_nd.default")
def constant_pad_nd(op: Op) -> Spec:
    a = schema_args(op)
    abc = letters(len(a["self"].type.shape))
    pad = list(a["pad"])
    # pad lists (before, after) pairs from the last dim backwards.
    padded = {abc[-1 - i // 2] for i, p in enumerate(pad) if p != 0}
    return Spec((abc,), (abc,), replicated=padded, linear="sum" if a["value"] == 0 else "none")


@register("aten.index_select.default")
def index_select(op: Op) -> Spec:
    # out[.., j, ..] = self[.., index[j], ..]: the indexed dim is read whole, the index (and
    # the output along that dim) may shard.
    a = schema_args(op)
    rank = len(a["self"].type.shape)
    abc = letters(rank)
    dim = a["dim"] % rank if rank else 0
    i = letters(1, start=rank) if len(a["index"].type.shape) else ""
    out = abc[:dim] + (i or UNSHARDABLE) + abc[dim + 1:] if rank else ""
    ins = input_letters(op, {"self": abc, "index": i})
    return Spec(ins, (out,), replicated={abc[dim]} if rank else set(), linear="each",
                linear_inputs={0})


@register("aten.gather.default")
def gather(op: Op) -> Spec:
    # out[i][j] = self[index[i][j]][j] (dim 0): the gathered dim is read whole; another dim
    # shards only where index and self have the same size, so the pieces line up.
    a = schema_args(op)
    self_shape, index_shape = a["self"].type.shape, a["index"].type.shape
    rank = len(self_shape)
    abc = letters(rank)
    dim = a["dim"] % rank if rank else 0
    whole = {abc[dim]} if rank else set()
    index = ""
    for d in range(len(index_shape)):
        if d == dim:
            index += letters(1, start=rank)
        elif index_shape[d] == self_shape[d]:
            index += abc[d]
        else:
            index += UNSHARDABLE
            whole.add(abc[d])
    ins = input_letters(op, {"self": abc, "index": index})
    return Spec(ins, (index,), replicated=whole, linear="each", linear_inputs={0})
