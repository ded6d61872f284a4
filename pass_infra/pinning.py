"""Pinning a value's placement, the one way the annotation passes (``settle_mesh``,
``pin_annotations``, ``tensor_parallel_plan``, ``sequence_parallel``, ``shard_batch``) place
values: with the reason explain reports, and refusing two annotations that disagree."""
from __future__ import annotations

from ..ir import Value
from ..ir.dist import DistAttr, Replicate
from ..ir.reason import Reason

__all__ = ["AnnotationError", "pin", "trivial_dims_replicated"]


class AnnotationError(ValueError):
    """Annotations that contradict each other or the strategy."""


def trivial_dims_replicated(dist: DistAttr) -> DistAttr:
    """On a mesh dim of one rank every placement is the whole value: say R, so nothing
    downstream plans a no-op move."""
    return DistAttr(dist.mesh, tuple(Replicate() if n == 1 else p
                                     for p, n in zip(dist.placements, dist.mesh.shape)))


def pin(value: Value, dist: DistAttr, why: Reason) -> None:
    """Place ``value`` at ``dist`` for good (completion never moves a pinned value)."""
    dist = trivial_dims_replicated(dist)
    if value.dist is not None and value.dist != dist:
        raise AnnotationError(f"{why.text} places a value at {dist}, but it is already "
                              f"placed at {value.dist} by {value.why.text}")
    value.dist, value.why = dist.check(value.type.shape), why
