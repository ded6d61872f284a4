"""Say on which mesh dims a reshape may keep a merged shard as a grouped shard.

A reshape that merges a sharded dim into the dims before it (``[T, B, E] -> [T*B, E]`` with
the batch sharded, the rows a seq-first ``nn.Linear`` multiplies) can keep the shard as a
grouped one, ``S(0)xT``: each rank holds its batch chunk of every position, which the
matmul and the reshape back to ``[T, B, F]`` keep, so nothing moves. Otherwise the view rule
gathers the merged dim.

Keeping it is right only on mesh dims that shard no parameter. There a consumer's weight
is whole, so it can only keep the grouped rows. On a dim that shards a weight (tensor
parallelism) the matmul would choose by bytes between gathering the activation and
gathering the weight, and could move the weight, which Megatron's plans never do (a cost
model that sees the whole step may choose otherwise). So this pass lists, on every
reshape, the mesh dims of more than one rank on which no parameter is pinned sharded (the
data-parallel axis, the pipeline's micro-batches), and the view rule
(``spmd/rules/views.py``) regroups only there.
"""
from __future__ import annotations

from ..ir import OpKind, Program, StateKind
from ..ir.attrs import REGROUP_DIMS
from ..planning.context import PassContext
from ..spmd.rules.views import RESHAPES

__all__ = ["regroup_flattens"]



def regroup_flattens(program: Program, ctx: PassContext) -> Program:
    mesh = ctx.state.mesh
    if mesh is None:
        return program
    weight_axes = {dist.mesh.dim_names[m]
                   for op in program.states(StateKind.PARAM) if (dist := op.result.dist)
                   for m, p in enumerate(dist.placements) if p.is_shard()}
    dims = tuple(m for m, name in enumerate(mesh.dim_names)
                 if mesh.shape[m] > 1 and name not in weight_axes)
    if dims:
        for op in program.ops:
            if op.kind is OpKind.CALL and op.target in RESHAPES:
                op.attrs[REGROUP_DIMS] = dims
    return program
