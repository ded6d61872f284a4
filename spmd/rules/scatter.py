"""Scatters: ``self`` with values written (or added) at positions an index tensor names
along one dim: ``scatter`` (topk's and gather's backward), ``scatter_add`` and
``index_add`` (the backward of an indexed read), as mixture-of-experts routing makes them.

The scattered dim is read whole: which position a value lands on is an index value, so
``self`` is replicated there and the index/source dim along it is never split (a rank
holding part of the indices would write into positions it does not hold). Every other dim
shards where ``self``, index and source have the same size, so each rank's pieces line up
(gather's rule in reverse). A scatter moves values without combining them, so it is
linear in ``self`` and the source jointly: Partial(sum) in both passes through.
"""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register
from ..spec import UNSHARDABLE, Spec, letters
from .common import input_letters, schema_args


def _scatter_spec(op: Op, source: str | None, linear: str) -> Spec:
    """index (and source) have self's rank; a dim shards where all of them are as long as
    self's, so each rank's pieces line up; the scattered dim and shorter dims stay whole."""
    a = schema_args(op)
    shape = a["self"].type.shape
    abc = letters(len(shape))
    dim = a["dim"] % len(shape) if shape else 0
    shapes = [a["index"].type.shape] + ([a[source].type.shape] if source else [])
    whole = {abc[dim]} if shape else set()
    lined = ""
    for d in range(len(shapes[0])):
        if d != dim and all(s[d] == shape[d] for s in shapes):
            lined += abc[d]
        else:
            lined += UNSHARDABLE
            whole.add(abc[d])
    by_name = {"self": abc, "index": lined}
    if source is not None:
        by_name[source] = lined
    return Spec(input_letters(op, by_name), (abc,), replicated=whole, linear=linear,
                linear_inputs={0, 2} if source else {0})


@register("aten.scatter.src", "aten.scatter_add.default")
def scatter_src(op: Op) -> Spec:
    """``out = self; out[..., index[i, j], ...] = src[i, j]`` (or ``+=``)."""
    return _scatter_spec(op, "src", linear="sum")


@register("aten.scatter.value")
def scatter_value(op: Op) -> Spec:
    # writing a constant is linear in self only when the constant is zero
    return _scatter_spec(op, None, linear="sum" if schema_args(op)["value"] == 0 else "none")


@register("aten.index_add.default")
def index_add(op: Op) -> Spec:
    """``out = self; out.select(dim, index[i]) += alpha * source.select(dim, i)``: the dim
    is read whole, the other dims of self and source line up."""
    a = schema_args(op)
    shape = a["self"].type.shape
    abc = letters(len(shape))
    dim = a["dim"] % len(shape) if shape else 0
    source = abc[:dim] + UNSHARDABLE + abc[dim + 1:] if shape else ""
    ins = input_letters(op, {"self": abc, "index": UNSHARDABLE, "source": source})
    return Spec(ins, (abc,), replicated={abc[dim]} if shape else set(), linear="sum",
                linear_inputs={0, 2})
