"""Ops that read along one dim as a whole (masks over a matrix, padding, indexing): that
dim's letter stays whole, the others pass through. All are linear in the data they move."""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register
from ..spec import UNSHARDABLE, Spec, letters
from .common import broadcast_letters, input_letters, same_dtype, schema_args


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


def _along(op: Op) -> tuple[str, int]:
    """The letters of ``self`` and the dim the op reads along."""
    a = schema_args(op)
    rank = len(a["self"].type.shape)
    return letters(rank), (a["dim"] % rank if rank else 0)


@register("aten.cumsum.default")
def cumsum(op: Op) -> Spec:
    # each output element sums a prefix of the dim: the dim is read whole; linear
    abc, dim = _along(op)
    return Spec((abc,), (abc,), replicated={abc[dim]} if abc else set(),
                linear="sum" if same_dtype(op) else "none")


@register("aten.topk.default")
def topk(op: Op) -> Spec:
    # the k largest along the dim: the dim is read whole, the output's k-long dim is new
    abc, dim = _along(op)
    out = abc[:dim] + UNSHARDABLE + abc[dim + 1:] if abc else ""
    return Spec((abc,), (out, out), replicated={abc[dim]} if abc else set())


@register("aten.index.Tensor")
def index(op: Op) -> Spec:
    """``self[i0, i1, ...]`` with index tensors (None: a whole dim): the indexed dims are read
    whole, the index tensors broadcast to the result's index dims (which may shard), the
    other dims pass through. Index dims replace the indexed ones in place when those are
    adjacent, else lead the result (NumPy's rule)."""
    a = schema_args(op)
    shape = a["self"].type.shape
    abc = letters(len(shape))
    indices = list(a["indices"])
    indexed = [d for d, ix in enumerate(indices) if ix is not None]
    width = max(len(indices[d].type.shape) for d in indexed)
    idx = letters(width, start=len(shape))
    broadcast_shape = _broadcast([indices[d].type.shape for d in indexed])
    index_letters = {d: broadcast_letters(indices[d].type.shape, idx, broadcast_shape)
                     for d in indexed}
    rest = abc[len(indices):]
    kept = [abc[d] for d in range(len(indices)) if d not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    if adjacent:
        out = abc[:indexed[0]] + idx + abc[indexed[-1] + 1:len(indices)] + rest
    else:
        out = idx + "".join(kept) + rest
    ins = [abc] + [index_letters[d] for d in indexed]
    return Spec(tuple(ins), (out,), replicated={abc[d] for d in indexed}, linear="each",
                linear_inputs={0})


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    width = max(len(s) for s in shapes)
    padded = [(1,) * (width - len(s)) + tuple(s) for s in shapes]
    return tuple(max(dims) for dims in zip(*padded))
