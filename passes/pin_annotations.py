"""Pin the placements the user gave with ``shard_tensor``: on activations (the annotation
ops ``settle_mesh`` made), on parameters, and where earlier programs of the same engine put
a parameter (it keeps one placement: eval and predict programs read the pieces training
updates)."""
from __future__ import annotations

from ..ir import OpKind, Program, StateKind
from ..ir.attrs import DIST, NAME, ORIGIN
from ..ir.dist import DistAttr, ProcessMesh, Replicate, micro_batch_dim
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pass_infra.pinning import pin

__all__ = ["pin_annotations"]


def pin_annotations(program: Program, ctx: PassContext) -> Program:
    mesh = ctx.state.mesh
    if mesh is None:
        return program
    for op in program.ops_of(OpKind.CALL):
        if op.target == "autopar.annotate" and ORIGIN not in op.attrs:   # a traced one
            pin(op.result, op.attrs[DIST], Reason("annotation", "shard_tensor in forward"))
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    for name, dist in ctx.state.param_placements.items():
        if name in params:
            pin(params[name], dist, Reason("annotation", f"shard_tensor on parameter {name!r}"))
    for name, dist in ctx.inputs.kept_placements.items():
        if name in params and params[name].dist is None:
            pin(params[name], _rebased(dist, mesh),
                Reason("annotation", f"parameter {name!r} kept where an earlier program "
                                     "placed it"))
    return program


def _rebased(dist: DistAttr, mesh: ProcessMesh) -> DistAttr:
    """A kept placement made on another program's logical mesh (another micro-batch count)
    on this one: state is replicated over micro-batches, the other dims are the same."""
    if dist.mesh == mesh or micro_batch_dim(dist.mesh) is None or micro_batch_dim(mesh) is None:
        return dist
    return DistAttr(mesh, tuple(dist.placements[:-1]) + (Replicate(),))
