"""Tensor factories. Ops with no tensor input (arange, zeros, full, ...) are born replicated:
the engine has nothing to follow. ``*_like`` ops take their input's shape and so follow its
shards; zeros_like is also linear (zeros sum to zeros), the others are not."""
from __future__ import annotations

from ...ir.core import Op
from ..registry import output_types, register
from ..spec import Spec, letters
from .pointwise import elementwise


@register("aten.arange.default", "aten.arange.start", "aten.arange.start_step",
          "aten.ones.default", "aten.zeros.default", "aten.full.default",
          "aten.empty.memory_format", "aten.scalar_tensor.default")
def factory(op: Op) -> Spec:
    return Spec((), tuple(None if t is None else letters(len(t.shape)) for t in output_types(op)))


@register("aten.empty_like.default", "aten.ones_like.default", "aten.full_like.default")
def like(op: Op) -> Spec:
    return elementwise(op)


@register("aten.zeros_like.default")
def zeros_like(op: Op) -> Spec:
    return elementwise(op, linear="sum")


@register("aten.lift_fresh_copy.default")
def lift_fresh_copy(op: Op) -> Spec:
    return elementwise(op, linear="sum")        # a copy of a traced constant
