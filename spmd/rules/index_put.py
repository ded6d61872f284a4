"""``index_put(self, indices, values, accumulate)``: ``self[i0, i1, ...] = values`` (or
``+=``), with index tensors (None: a whole dim). It is the backward of an indexed read
(``pos_emb[position_ids]`` on a Parameter gives ``index_put(zeros, [ids], grad, True)``)
and the functional form of an indexed write.

The letters are ``aten.index``'s in reverse: ``self[indices]`` has the index letters where
the indexed dims were (or leading, when they are not adjacent) and ``values`` broadcasts
against that shape. The indexed dims of ``self`` are read whole (where a value lands is an
index value); the other dims of ``self`` shard with the matching dims of ``values``.

With ``accumulate`` a sharded index letter makes the result Partial(sum): each rank adds
its rows of ``values`` at its indices, and the sum over ranks adds them all, as
``embedding_dense_backward`` does. ``self`` then joins as a Partial term (one rank keeps
it, the others add zeros), as an ``addmm`` bias does (``BiasedProduct``). Without
``accumulate`` a rank would keep ``self`` where another rank wrote, so the index letters
stay whole. Either way each result element is ``self``'s, a value, or their sum: jointly
linear in ``self`` and ``values``. Boolean masks (which index several dims at once) keep
every letter whole.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from ...ir.core import Op
from ..rule_registry import register
from ..spec import Spec, letters
from .common import broadcast_letters, schema_args
from .matmul import BiasedProduct

S = TypeVar("S", str, tuple)


def picked(dims: S, indices: Sequence, index_part: S) -> S:
    """``self[indices]``'s dims (letters or sizes) from ``self``'s: the index dims replace
    adjacent indexed dims in place, else lead the result (NumPy's rule)."""
    indexed = [d for d, ix in enumerate(indices) if ix is not None]
    n = len(indices)
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        return dims[:indexed[0]] + index_part + dims[indexed[-1] + 1:]
    kept = [dims[d] for d in range(n) if d not in indexed]
    return index_part + (("".join(kept) if isinstance(dims, str) else tuple(kept))
                         + dims[n:])


class IndexPut(BiasedProduct):
    """The spec above; ``self`` is the bias that joins a Partial result."""

    def spec(self, op: Op) -> Spec:
        a = schema_args(op)
        shape = a["self"].type.shape
        abc = letters(len(shape))
        indices = list(a["indices"])
        tensors = [ix for ix in indices if ix is not None]
        if any(ix.type.dtype in (torch.bool, torch.uint8) for ix in tensors):
            return _whole(abc, tensors, a["values"].type.shape)
        index_shape = tuple(torch.broadcast_shapes(*(ix.type.shape for ix in tensors)))
        idx = letters(len(index_shape), start=len(shape))
        values = broadcast_letters(a["values"].type.shape, picked(abc, indices, idx),
                                   picked(tuple(shape), indices, index_shape))
        ins = ([abc] + [broadcast_letters(ix.type.shape, idx, index_shape) for ix in tensors]
               + [values])
        whole = {abc[d] for d, ix in enumerate(indices) if ix is not None}
        if not a["accumulate"]:
            whole |= set(idx)
        return Spec(tuple(ins), (abc,), replicated=whole, reduce="sum", linear="sum",
                    linear_inputs={0, len(ins) - 1})

    def bias_index(self, op: Op) -> int | None:
        return 0 if schema_args(op)["accumulate"] else None


def _whole(abc: str, masks: list, values_shape: tuple[int, ...]) -> Spec:
    """A boolean-mask write: every letter of every tensor stays whole."""
    start = len(abc)
    ins = [abc]
    for t in [m.type.shape for m in masks] + [values_shape]:
        ins.append(letters(len(t), start=start))
        start += len(t)
    return Spec(tuple(ins), (abc,), replicated=set("".join(ins)), linear="sum",
                linear_inputs={0, len(ins) - 1})


register("aten.index_put.default", "aten.index_put_.default")(IndexPut())
