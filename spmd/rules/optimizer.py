"""Optimizer updates run where their most sharded parameter-shaped operand lives: without
ZeRO that is the parameter's placement (the gradient and every state shaped like the
parameter are placed as the parameter is; a Partial gradient is reduced first, which is
where data parallelism's all-reduce comes from). With ZeRO (``passes/zero_sharding.py``) the
states are pinned ``Shard(0)`` over the sharding axis, so the update follows them: the
parameter is sliced (free), the Partial gradient reduce-scattered, and each rank updates its
piece; the updated parameter goes back where the parameter lives (completion's outputs).
Scalar states (Adam's step) are replicated."""
from __future__ import annotations

from ...ir.dist import DistAttr, ProcessMesh, Replicate
from ..einsum import Decision, MeshDimChoice, Option
from ..rule_registry import register, tensor_inputs


class FollowParam:
    def _like_param(self, op, target: DistAttr | None, mesh: ProcessMesh, values):
        target = _without_partials(target or DistAttr.replicated(mesh))
        shape = op.args[0].type.shape
        return tuple(target if v.type.shape == shape else DistAttr.replicated(mesh)
                     for v in values)

    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        target = _most_sharded(op, in_dists)
        needs = self._like_param(op, target, mesh, tensor_inputs(op))
        outputs = self._like_param(op, target, mesh, op.outputs)
        choices = tuple(MeshDimChoice(m, Option("follow", "parameter"), 0.0, ())
                        for m in range(mesh.ndim))
        return Decision(needs, outputs, choices)

    def reverse(self, op, out_hints, mesh):
        return self._like_param(op, out_hints[0], mesh, tensor_inputs(op))


def _most_sharded(op, in_dists) -> DistAttr | None:
    """The parameter's placement, or a state's that cuts it further (ZeRO): the state refines
    the parameter on every mesh dim the parameter shards, so the most shards wins."""
    shape = op.args[0].type.shape
    best = in_dists[0]
    for value, dist in zip(tensor_inputs(op)[2:], in_dists[2:]):
        if dist is None or value.type.shape != shape:
            continue
        if best is None or _shards(dist) > _shards(best):
            best = dist
    return best


def _shards(dist: DistAttr) -> int:
    return sum(p.is_shard() for p in dist.placements)


def _without_partials(dist: DistAttr) -> DistAttr:
    """An update is not linear: a Partial parameter is reduced before it is updated."""
    return DistAttr(dist.mesh, tuple(Replicate() if p.is_partial() else p
                                     for p in dist.placements))


register("optim.sgd", "optim.adam")(FollowParam())
