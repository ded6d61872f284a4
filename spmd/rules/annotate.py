"""``autopar.annotate``: a user's ``shard_tensor`` inside forward. Its output is pinned to
the annotation; its input needs the same placement, so reshard moves the producer's value
there if they differ."""
from __future__ import annotations

from ..einsum import Decision, MeshDimChoice, Option
from ..registry import register


class Pinned:
    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        dist = op.attrs["dist"]
        choices = tuple(MeshDimChoice(m, Option("annotation", "shard_tensor"), 0.0, ())
                        for m in range(mesh.ndim))
        return Decision((dist,), (dist,), choices)

    def reverse(self, op, out_hints, mesh):
        return (op.attrs["dist"],)


register("autopar.annotate")(Pinned())
