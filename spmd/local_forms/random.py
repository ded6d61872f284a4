"""Random ops (sliced draws, ``native_dropout``): each rank keeps its slice of one global
random tensor, drawn exactly as the single-device run draws it."""
from __future__ import annotations

from typing import Sequence

import torch

from ...ir.core import Op
from ...ir.lower_fx import STRIDES_ATTR
from ...runtime.kernels import kernel, resolve
from .context import LocalCall, LocalContext, UnsupportedLocalForm
from .registry import register_local_form

Bounds = Sequence[Sequence[int]]


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
    strides = op.attrs.get(STRIDES_ATTR)
    if strides is None or strides[index] is None:
        raise UnsupportedLocalForm(
            f"random op {op.target} ({op.module or 'top level'}) carries no traced layout "
            f"(op.attrs[{STRIDES_ATTR!r}]): a rank cannot draw what the single-device run "
            "draws without the strides of the tensor it fills")
    if len(strides[index]) != len(op.outputs[index].type.shape):
        raise UnsupportedLocalForm(
            f"random op {op.target} ({op.module or 'top level'}): traced strides "
            f"{strides[index]} do not fit its output {op.outputs[index].type}")
    return tuple(strides[index])


def _is_global(x: torch.Tensor, shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``x`` is the whole global tensor laid out as traced."""
    return tuple(x.shape) == tuple(shape) and tuple(x.stride()) == tuple(strides)


def _slice(full: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    return full[tuple(slice(a, b) for a, b in bounds)]


@kernel("autopar.sliced_random")
def sliced_random(target: str, global_shape: Sequence[int], strides: Sequence[int],
                  bounds: Bounds, inplace: bool, template: torch.Tensor | None, *args,
                  **kwargs):
    """Run random ``target`` at the global shape, in the traced ``strides``, and keep the
    piece at ``bounds``.

    ``template`` is the op's first (shape-giving) tensor argument, whose values the op
    ignores (``bernoulli_.float``, ``rand_like`` ...); None for factories, whose size
    arguments are global already (their results are contiguous). In-place ops fill
    ``template`` with the piece.
    """
    fn = resolve(target)
    if template is None:
        full = fn(*args, **kwargs)
    elif _is_global(template, global_shape, strides):
        return fn(template, *args, **kwargs)      # the rank holds the traced tensor itself
    else:
        full = fn(template.new_empty_strided(tuple(global_shape), tuple(strides)),
                  *args, **kwargs)
    piece = _slice(full, bounds)
    if inplace:
        return template.copy_(piece)
    return piece.clone() if piece.shape != full.shape else full


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


@kernel("autopar.sliced_native_dropout")
def sliced_native_dropout(x: torch.Tensor, p: float, train: bool | None,
                          global_shape: Sequence[int], mask_strides: Sequence[int],
                          bounds: Bounds):
    """native_dropout's mask is drawn at the global shape in the traced mask strides (on
    ones: the mask does not depend on the values, and the kernel lays it out like its
    input) and sliced; the output is the piece times the mask, scaled, as the kernel does."""
    if _is_global(x, global_shape, mask_strides):
        return torch.ops.aten.native_dropout.default(x, p, train)
    ones = x.new_empty_strided(tuple(global_shape), tuple(mask_strides)).fill_(1)
    _, mask = torch.ops.aten.native_dropout.default(ones, p, train)
    mask = _slice(mask, bounds).clone()
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask


@register_local_form("aten.native_dropout.default")
def _native_dropout(op: Op, ctx: LocalContext) -> LocalCall | None:
    x, p = op.args[0], op.args[1]
    train = op.args[2] if len(op.args) > 2 else op.kwargs.get("train")
    if train is False:
        return None     # no draw: the input and a mask of ones
    if ctx.out_placements(0) != ctx.out_placements(1):
        raise UnsupportedLocalForm(f"native_dropout with output {ctx.outputs[0]} but mask "
                                   f"{ctx.outputs[1]}: the two must be placed alike")
    return LocalCall("autopar.sliced_native_dropout",
                     (x, p, train, op.outputs[0].type.shape, _traced_strides(op, 1),
                      ctx.out_bounds(op, 0)), {},
                     "mask sliced from the global mask, drawn in the traced layout")
