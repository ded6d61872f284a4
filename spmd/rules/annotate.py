"""``autopar.annotate``: a user's ``shard_tensor`` inside forward, or an activation placement
the annotate pass adds (sequence parallelism). Its output is pinned to the annotation; its
input needs the same placement, so reshard moves the producer's value there if they differ.
An annotation may pin only some mesh dims (``attrs[PINNED_DIMS]``): on the others the value
keeps its producer's placement (sequence parallelism fixes tp and leaves dp to the batch)."""
from __future__ import annotations

from ...ir.attrs import DIST, ORIGIN, PINNED_DIMS
from ...ir.dist import DistAttr, Replicate
from ..einsum import Decision, MeshDimChoice, Option
from ..rule_registry import register


def _placed(op, given: DistAttr | None) -> DistAttr:
    dist = op.attrs[DIST]
    pinned = op.attrs.get(PINNED_DIMS)
    if pinned is None:
        return dist
    return DistAttr(dist.mesh, tuple(
        p if m in pinned else (Replicate() if given is None else given.placements[m])
        for m, p in enumerate(dist.placements)))


class Pinned:
    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        dist = _placed(op, in_dists[0])
        origin = Option("annotation", op.attrs.get(ORIGIN, "shard_tensor"))
        choices = tuple(MeshDimChoice(m, origin, 0.0, ())
                        for m in op.attrs.get(PINNED_DIMS, range(mesh.ndim)))
        return Decision((dist,), (dist,), choices)

    def reverse(self, op, out_hints, mesh):
        return (_placed(op, out_hints[0]),)


register("autopar.annotate")(Pinned())
