"""A rank's slice of one global random tensor, drawn exactly as the single-device run draws
it: every rank draws the global tensor from the same generator state (in the strides the
trace recorded, since CPU kernels draw in the order they walk memory) and keeps its slice.
The local forms that choose these kernels are ``spmd/local_forms/random.py``."""
from __future__ import annotations

from typing import Sequence

import torch
from torch._prims.rng_prims import run_with_rng_state

from ..ops import kernel, resolve
from .generator_state import functional_target

Bounds = Sequence[Sequence[int]]


def _is_global(x: torch.Tensor, shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``x`` is the whole global tensor laid out as traced."""
    return tuple(x.shape) == tuple(shape) and tuple(x.stride()) == tuple(strides)


def _resolved(target: str):
    """The kernel of ``target``: an ATen op's overload by attribute (so ``torch.compile``
    traces the lookup), any other through the op registry."""
    namespace, name, overload = (target.split(".") + ["default"])[:3]
    if namespace != "aten":
        return resolve(target)
    return getattr(getattr(torch.ops.aten, name), overload)


def _draw(rng_state: torch.Tensor | None, fn, *args, **kwargs):
    """``fn``'s draw from the generator, or from ``rng_state`` (leaving the generator as it
    was) when given: how a compiled program draws where the uncompiled one sets the
    generator first (``runtime/codegen.py``)."""
    if rng_state is None:
        return fn(*args, **kwargs)
    return run_with_rng_state(rng_state, fn, *args, **kwargs)


def _slice(full: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    return full[tuple(slice(a, b) for a, b in bounds)]


@kernel("autopar.sliced_random", random=True, mutates=True)
def sliced_random(target: str, global_shape: Sequence[int], strides: Sequence[int],
                  bounds: Bounds, inplace: bool, template: torch.Tensor | None, *args,
                  rng_state: torch.Tensor | None = None, **kwargs):
    """Run random ``target`` at the global shape, in the traced ``strides``, and keep the
    piece at ``bounds``.

    ``template`` is the op's first (shape-giving) tensor argument, whose values the op
    ignores (``bernoulli_.float``, ``rand_like`` ...); None for factories, whose size
    arguments are global already (their results are contiguous). In-place ops fill
    ``template`` with the piece. ``rng_state``: draw from it (``_draw``).
    """
    fn = _resolved(target if rng_state is None else functional_target(target))
    if template is None:
        full = _draw(rng_state, fn, *args, **kwargs)
    elif _is_global(template, global_shape, strides):
        # the rank holds the traced tensor itself
        return _draw(rng_state, fn, template, *args, **kwargs)
    else:
        full = _draw(rng_state, fn, template.new_empty_strided(tuple(global_shape),
                                                               tuple(strides)),
                     *args, **kwargs)
    piece = _slice(full, bounds)
    if inplace:
        return template.copy_(piece)
    return piece.clone() if piece.shape != full.shape else full


@kernel("autopar.sliced_native_dropout", random=True)
def sliced_native_dropout(x: torch.Tensor, p: float, train: bool | None,
                          global_shape: Sequence[int], mask_strides: Sequence[int],
                          bounds: Bounds, rng_state: torch.Tensor | None = None):
    """native_dropout's mask is drawn at the global shape in the traced mask strides (on
    ones: the mask does not depend on the values, and the kernel lays it out like its
    input) and sliced; the output is the piece times the mask, scaled, as the kernel does."""
    dropout = torch.ops.aten.native_dropout.default
    if _is_global(x, global_shape, mask_strides):
        return _draw(rng_state, dropout, x, p, train)
    ones = x.new_empty_strided(tuple(global_shape), tuple(mask_strides)).fill_(1)
    _, mask = _draw(rng_state, dropout, ones, p, train)
    mask = _slice(mask, bounds).clone()
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask
