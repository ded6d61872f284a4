"""Random ops (sliced draws, ``native_dropout``): each rank keeps its slice of one global
random tensor."""
from __future__ import annotations

from typing import Sequence

import torch

from ...ir.core import Op
from ...runtime.kernels import kernel, resolve
from .context import LocalCall, LocalContext, UnsupportedLocalForm
from .registry import register_local_form


# ----------------------------------------------------------------------------------------
# random ops: every rank draws the global tensor from the same generator state and keeps
# its slice, so the generators stay in step and a sharded run equals the serial one
# ----------------------------------------------------------------------------------------
def _empty_in_order(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dims lie in memory in ``like``'s order."""
    if like.dim() != len(shape):
        return like.new_empty(tuple(shape))
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    permuted = like.new_empty(tuple(shape[d] for d in order))
    return permuted.permute([order.index(d) for d in range(like.dim())])


@kernel("autopar.sliced_random")
def sliced_random(target: str, global_shape: Sequence[int], bounds: Sequence[Sequence[int]],
                  inplace: bool, template: torch.Tensor | None, *args, **kwargs):
    """Run random ``target`` at the global shape and keep the piece at ``bounds``.

    ``template`` is the op's first (shape-giving) tensor argument, whose values the op
    ignores (``bernoulli_.float``, ``rand_like`` ...); None for factories, whose size
    arguments are global already. In-place ops fill ``template`` with the piece.
    """
    fn = resolve(target)
    if template is None:
        full = fn(*args, **kwargs)
    else:
        full = fn(_empty_in_order(template, global_shape), *args, **kwargs)
    piece = full[tuple(slice(a, b) for a, b in bounds)]
    if inplace:
        return template.copy_(piece)
    return piece.clone()


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
    if not ctx.out_sharded(0):
        return None      # same generator state on every rank: the same whole tensor
    shape = op.outputs[0].type.shape
    bounds = ctx.out_bounds(op, 0)
    if op.target in _FACTORY_RANDOM:
        return LocalCall("autopar.sliced_random",
                         (op.target, shape, bounds, False, None, *op.args), dict(op.kwargs),
                         "slice of the global random tensor")
    inplace = op.target.split(".")[1].endswith("_")
    return LocalCall("autopar.sliced_random",
                     (op.target, shape, bounds, inplace, op.args[0], *op.args[1:]),
                     dict(op.kwargs), "slice of the global random tensor")


@kernel("autopar.sliced_native_dropout")
def sliced_native_dropout(x: torch.Tensor, p: float, train: bool | None,
                          global_shape: Sequence[int], bounds: Sequence[Sequence[int]]):
    """native_dropout's mask is drawn at the global shape (on ones: the mask does not
    depend on the values) and sliced; the output is the piece times the mask, scaled."""
    ones = _empty_in_order(x, global_shape).fill_(1)
    _, mask = torch.ops.aten.native_dropout.default(ones, p, train)
    mask = mask[tuple(slice(a, b) for a, b in bounds)]
    if train is False:
        return x.clone(), mask.clone()
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask.clone()


@register_local_form("aten.native_dropout.default")
def _native_dropout(op: Op, ctx: LocalContext) -> LocalCall | None:
    if not (ctx.out_sharded(0) or ctx.out_sharded(1)):
        return None
    if ctx.out_placements(0) != ctx.out_placements(1):
        raise UnsupportedLocalForm(f"native_dropout with output {ctx.outputs[0]} but mask "
                                   f"{ctx.outputs[1]}: the two must be placed alike")
    x, p = op.args[0], op.args[1]
    train = op.args[2] if len(op.args) > 2 else op.kwargs.get("train")
    return LocalCall("autopar.sliced_native_dropout",
                     (x, p, train, op.outputs[0].type.shape, ctx.out_bounds(op, 0)), {},
                     "mask sliced from the global mask")
