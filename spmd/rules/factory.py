"""Tensor factories. Ops with no tensor input (arange, zeros, full, ...) are born replicated:
the engine has nothing to follow. ``*_like`` ops take their input's shape and so follow its
shards and ignore its values."""
from __future__ import annotations

from typing import Sequence

from ...ir.core import Op
from ...ir.dist import DistAttr, ProcessMesh, Replicate, Shard
from ..einsum import Decision, MeshDimChoice, Option
from ..rule_registry import output_types, register
from ..spec import Spec, letters
from .common import elementwise


@register("aten.arange.default", "aten.arange.start", "aten.arange.start_step",
          "aten.ones.default", "aten.zeros.default", "aten.full.default",
          "aten.empty.memory_format", "aten.scalar_tensor.default")
def factory(op: Op) -> Spec:
    return Spec((), tuple(None if t is None else letters(len(t.shape)) for t in output_types(op)))


class ShapeOnly:
    """``*_like``: only the input's local shape matters, never its values. The output takes
    the input's shards; a Partial input is used as it is (its local piece has the right
    shape) and the output, made from scratch on every rank, is Replicate. So the seed
    gradient ``ones_like(loss)`` costs no all-reduce of the loss."""

    def _follow(self, placements, mesh: ProcessMesh) -> DistAttr:
        return DistAttr(mesh, tuple(p if isinstance(p, Shard) else Replicate()
                                    for p in placements))

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available=None) -> Decision:
        need = in_dists[0] or DistAttr.replicated(mesh)
        choices = tuple(MeshDimChoice(m, Option("follow", "input shape"), 0.0, ())
                        for m in range(mesh.ndim))
        return Decision((need,), (self._follow(need.placements, mesh),), choices)

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        hint = out_hints[0] or DistAttr.replicated(mesh)
        return (self._follow(hint.placements, mesh),)


register("aten.empty_like.default", "aten.ones_like.default", "aten.zeros_like.default",
         "aten.full_like.default")(ShapeOnly())


@register("aten.lift_fresh_copy.default")
def lift_fresh_copy(op: Op) -> Spec:
    return elementwise(op, linear="sum")        # a copy of a traced constant


class FromScratch:
    """``new_zeros`` / ``new_ones`` / ``new_empty`` / ``new_full``: a fresh tensor of a given
    size; ``self`` gives only its dtype and device. The input is taken as it is placed (its
    values are never read) and the output is born replicated, like a factory's."""

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available=None) -> Decision:
        need = in_dists[0] or DistAttr.replicated(mesh)
        choices = tuple(MeshDimChoice(m, Option("fresh", "from scratch"), 0.0, ())
                        for m in range(mesh.ndim))
        return Decision((need,), (DistAttr.replicated(mesh),), choices)

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        return (DistAttr.replicated(mesh),)


register("aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default",
         "aten.new_full.default")(FromScratch())
