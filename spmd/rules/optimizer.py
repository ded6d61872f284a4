"""Optimizer updates follow their parameter: the gradient and every state shaped like the
parameter must be placed as the parameter is (a Partial gradient is reduced first; this is
where data parallelism's all-reduce comes from); scalar states (Adam's step) are replicated.
ZeRO (later) changes what the parameter's state placement is, not this rule."""
from __future__ import annotations

from ...ir.dist import DistAttr, ProcessMesh, Replicate
from ..einsum import Decision, MeshDimChoice, Option
from ..registry import register, tensor_inputs


class FollowParam:
    def _like_param(self, op, param_dist: DistAttr | None, mesh: ProcessMesh, values):
        param_dist = _without_partials(param_dist or DistAttr.replicated(mesh))
        shape = op.args[0].type.shape
        return tuple(param_dist if v.type.shape == shape else DistAttr.replicated(mesh)
                     for v in values)

    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        needs = self._like_param(op, in_dists[0], mesh, tensor_inputs(op))
        outputs = self._like_param(op, in_dists[0], mesh, op.outputs)
        choices = tuple(MeshDimChoice(m, Option("follow", "parameter"), 0.0, ())
                        for m in range(mesh.ndim))
        return Decision(needs, outputs, choices)

    def reverse(self, op, out_hints, mesh):
        return self._like_param(op, out_hints[0], mesh, tensor_inputs(op))


def _without_partials(dist: DistAttr) -> DistAttr:
    """An update is not linear: a Partial parameter is reduced before it is updated."""
    return DistAttr(dist.mesh, tuple(Replicate() if p.is_partial() else p
                                     for p in dist.placements))


register("optim.sgd", "optim.adam")(FollowParam())
