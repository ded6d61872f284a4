"""The random numbers a step draws: every runtime forks the generator its random ops draw
from (the CPU's, or the process's CUDA device's: ``ir.kernels.generator_state``) for a step,
seeded ``strategy.seed + step`` (what ``torch.manual_seed`` gives eager code on either), and
restores the caller's state afterwards. Seeding the generator directly skips
``manual_seed``'s per-call accelerator hooks. On CUDA every rank still draws a sharded
random tensor whole and keeps its piece, as on CPU (drawing only the piece at its Philox
offset is issue 28's next step).

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
from ..ir.kernels.generator_state import compute_device, draw_generator
from ..ir.ops import resolve

__all__ = ["forked_generator", "eager_rng_states", "draw_generator"]


@contextlib.contextmanager
def forked_generator(seed: int | None) -> Iterator[None]:
    """Run the body with the draw generator seeded ``seed`` (left as it is when None); the
    caller's generator state comes back afterwards either way."""
    generator = draw_generator()
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
            states[key] = draw_generator().get_state()
            _draw_like(op)
    return states


def _draw_like(op: Op) -> None:
    """Draw what ``op`` draws at its global shape, in the traced layout, and drop it: the
    generator advances as eager's does (draws depend on shapes and strides, not values)."""
    strides = op.attrs.get(STRIDES) or ()
    layout = strides[1] if op.target == "aten.native_dropout.default" else \
        (strides[0] if strides else None)
    first = True
    device = compute_device()

    def fake(v):
        nonlocal first
        shape, dtype = tuple(v.type.shape), v.type.dtype
        if first and layout is not None and len(layout) == len(shape):
            first = False
            return torch.empty_strided(shape, layout, dtype=dtype, device=device)
        first = False
        return torch.zeros(shape, dtype=dtype, device=device)

    args = [fake(a) if hasattr(a, "type") and a.is_tensor else a for a in op.args]
    kwargs = {k: (fake(a) if hasattr(a, "type") and a.is_tensor else a)
              for k, a in op.kwargs.items()}
    resolve(op.target)(*args, **kwargs)
