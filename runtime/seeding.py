"""The random numbers a step draws: every runtime forks the CPU generator for a step, seeded
``strategy.seed + step`` (what ``torch.manual_seed`` gives eager code), and restores the
caller's state afterwards. Seeding the generator directly skips ``manual_seed``'s
per-call accelerator hooks.

A pipeline process runs only its stages' random ops, and a micro-batch's draw is its slice
of the whole batch's draw, so each random op restores the state eager has before it
(``eager_rng_states``, replayed from the global program's random ops) instead of following
the process's own generator.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..ir import Op
from ..ir.attrs import STRIDES
from ..ir.ops import resolve

__all__ = ["forked_generator", "eager_rng_states"]


@contextlib.contextmanager
def forked_generator(seed: int | None) -> Iterator[None]:
    """Run the body with the CPU generator seeded ``seed`` (left as it is when None); the
    caller's generator state comes back afterwards either way."""
    generator = torch.default_generator
    saved = generator.get_state()
    if seed is not None:
        generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


def eager_rng_states(random_ops: Sequence[tuple[str, Op]], seed: int) -> dict[str, torch.Tensor]:
    """The generator state before each random op of the global program, by feed key, as
    eager has it after ``manual_seed(seed)``."""
    states = {}
    with forked_generator(seed):
        for key, op in random_ops:
            states[key] = torch.default_generator.get_state()
            _draw_like(op)
    return states


def _draw_like(op: Op) -> None:
    """Draw what ``op`` draws at its global shape, in the traced layout, and drop it: the
    generator advances as eager's does (draws depend on shapes and strides, not values)."""
    strides = op.attrs.get(STRIDES) or ()
    layout = strides[1] if op.target == "aten.native_dropout.default" else \
        (strides[0] if strides else None)
    first = True

    def fake(v):
        nonlocal first
        shape, dtype = tuple(v.type.shape), v.type.dtype
        if first and layout is not None and len(layout) == len(shape):
            first = False
            return torch.empty_strided(shape, layout, dtype=dtype)
        first = False
        return torch.zeros(shape, dtype=dtype)

    args = [fake(a) if hasattr(a, "type") and a.is_tensor else a for a in op.args]
    kwargs = {k: (fake(a) if hasattr(a, "type") and a.is_tensor else a)
              for k, a in op.kwargs.items()}
    resolve(op.target)(*args, **kwargs)
