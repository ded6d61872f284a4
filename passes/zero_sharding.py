"""ZeRO as placements: pin each optimizer state that is shaped like its parameter ``Shard(0)``
over the sharding axis (stage >= 1), and for stage 3 the parameters too.

Nothing else changes: the update rule (``spmd/rules/optimizer.py``) runs where its most
sharded operand lives, so each rank updates its piece; completion asks the gradient for that
placement (Partial -> reduce-scatter) and the updated parameter for the parameter's own
placement (replicated -> all-gather; stage 3 keeps it sharded and reshard gathers it before
each use). A static plan never needs the whole gradient once the update is sharded, so
stages 1 and 2 plan the same program: both reduce-scatter.

Uneven first dims are allowed (``torch.chunk`` pieces); a state that already shards dim 0 on
another mesh dim (tensor parallelism) is cut further, nested as in DTensor.
"""
from __future__ import annotations

from ..ir import Program, StateKind, Value
from ..ir.attrs import NAME
from ..ir.dist import DistAttr, ProcessMesh, Shard
from ..ir.reason import Reason
from .context import PassContext
from .pinning import AnnotationError, pin, trivial_dims_replicated

__all__ = ["zero_sharding"]


def zero_sharding(program: Program, ctx: PassContext) -> Program:
    sharding, mesh = ctx.strategy.sharding, ctx.state.mesh
    if sharding is None or not sharding.is_enabled or mesh is None:
        return program
    if sharding.axis not in mesh.dim_names:
        raise AnnotationError(
            f"sharding stage {sharding.stage} over {sharding.axis!r}: the mesh "
            f"{list(mesh.shape)} ({', '.join(mesh.dim_names)}) has no such axis")
    if sharding.stage >= 3:
        raise NotImplementedError(
            f"sharding stage 3 over {sharding.axis!r} (mesh {list(mesh.shape)}): parameters "
            "held Shard(0) between steps are not planned yet; stages 1 and 2 are")
    axis = mesh.dim_index(sharding.axis)
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    for op in program.states(StateKind.OPTIM):
        name = op.attrs[NAME]
        param = params.get(name.rpartition("/")[0])
        if param is not None and op.result.type.shape == param.type.shape:
            _pin_shard0(op.result, param, mesh, axis, sharding.stage, f"optimizer state {name!r}")
    if sharding.stage >= 3:
        for name, param in params.items():
            _pin_shard0(param, param, mesh, axis, sharding.stage, f"parameter {name!r}")
    return program


def _pin_shard0(value: Value, param: Value, mesh: ProcessMesh, axis: int, stage: int,
               what: str) -> None:
    """Shard(0) on ``axis`` on top of the parameter's pinned placement (tp), if any."""
    if not value.type.shape:
        return                       # a scalar (Adam's step) stays replicated
    base = param.dist if param.dist is not None else DistAttr.replicated(mesh)
    if base.placements[axis].is_shard():
        return                       # already cut on the axis (experts on the dp axis)
    dist = trivial_dims_replicated(base.with_placement(axis, Shard(0)))
    why = Reason("plan", f"sharding stage {stage}: {what} dim 0 sharded on "
                         f"{mesh.dim_names[axis]}")
    if value is param and value.dist is not None:
        # a tensor-parallel pin says where the whole parameter lives; ZeRO cuts it further
        value.dist, value.why = dist.check(value.type.shape), why
    else:
        pin(value, dist, why)
