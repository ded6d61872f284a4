"""Random ops (sliced draws, ``native_dropout``): each rank keeps its slice of one global
random tensor, drawn exactly as the single-device run draws it."""
from __future__ import annotations

from ...ir.attrs import STRIDES
from ...ir.core import Op
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext, UnsupportedLocalForm


# ----------------------------------------------------------------------------------------
# Every rank draws the global tensor from the same generator state and keeps its slice, so
# the generators stay in step and a sharded run equals the serial one. CPU kernels draw in
# the order they walk memory (bernoulli_, uniform_, ...) and some pick another algorithm
# for contiguous tensors (normal_), so the numbers depend on the strides of the tensor
# filled. A rank's piece may be laid out unlike the single-device tensor (an all-gather
# returns it contiguous; a size-1 or empty piece has no stride order), so the global
# tensor is drawn in the strides the trace recorded, never in the piece's.
# ----------------------------------------------------------------------------------------
def _traced_strides(op: Op, index: int) -> tuple[int, ...]:
    strides = op.attrs.get(STRIDES)
    if strides is None or strides[index] is None:
        raise UnsupportedLocalForm(
            f"random op {op.target} ({op.module or 'top level'}) carries no traced layout "
            f"(op.attrs[{STRIDES!r}]): a rank cannot draw what the single-device run "
            "draws without the strides of the tensor it fills")
    if len(strides[index]) != len(op.outputs[index].type.shape):
        raise UnsupportedLocalForm(
            f"random op {op.target} ({op.module or 'top level'}): traced strides "
            f"{strides[index]} do not fit its output {op.outputs[index].type}")
    return tuple(strides[index])


# ops that fill their first argument (or a tensor shaped like it) with fresh numbers,
# ignoring its values
_TEMPLATE_RANDOM = (
    "aten.bernoulli_.float", "aten.bernoulli.p", "aten.uniform_.default",
    "aten.normal_.default", "aten.exponential_.default", "aten.random_.default",
    "aten.random_.from", "aten.random_.to", "aten.geometric_.default",
    "aten.log_normal_.default", "aten.cauchy_.default", "aten.rand_like.default",
    "aten.randn_like.default", "aten.randint_like.default", "aten.randint_like.low_dtype",
)
# factories whose size arguments are global
_FACTORY_RANDOM = (
    "aten.rand.default", "aten.randn.default", "aten.randint.default", "aten.randint.low",
    "aten.randperm.default", "aten.normal.float_float",
)


@register_local_form(*_TEMPLATE_RANDOM, *_FACTORY_RANDOM)
def _random(op: Op, ctx: LocalContext) -> LocalCall | None:
    shape, bounds = op.outputs[0].type.shape, ctx.out_bounds(op, 0)
    if op.target in _FACTORY_RANDOM:
        if not ctx.out_sharded(0):
            return None     # global size arguments, same generator state: the same tensor
        return LocalCall("autopar.sliced_random",
                         (op.target, shape, _traced_strides(op, 0), bounds, False, None,
                          *op.args), dict(op.kwargs), "slice of the global random tensor")
    # even a replicated template may be laid out unlike the traced one (it can come out of
    # a collective): the kernel calls the op unchanged only when the layouts agree
    inplace = op.target.split(".")[1].endswith("_")
    return LocalCall("autopar.sliced_random",
                     (op.target, shape, _traced_strides(op, 0), bounds, inplace, op.args[0],
                      *op.args[1:]), dict(op.kwargs),
                     "slice of the global random tensor, drawn in the traced layout")


@register_local_form("aten.native_dropout.default")
def _native_dropout(op: Op, ctx: LocalContext) -> LocalCall | None:
    a = schema_args(op)
    x, p, train = a["input"], a["p"], a["train"]
    if train is False:
        return None     # no draw: the input and a mask of ones
    if ctx.out_placements(0) != ctx.out_placements(1):
        raise UnsupportedLocalForm(f"native_dropout with output {ctx.outputs[0]} but mask "
                                   f"{ctx.outputs[1]}: the two must be placed alike")
    return LocalCall("autopar.sliced_native_dropout",
                     (x, p, train, op.outputs[0].type.shape, _traced_strides(op, 1),
                      ctx.out_bounds(op, 0)), {},
                     "mask sliced from the global mask, drawn in the traced layout")
