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

A batched matmul of activations is the exception: ``q @ k.transpose(-2, -1)`` on
``[B, H, T, hd]`` runs as ``bmm`` on ``[B*H, T, hd]`` views, and with the heads sharded
(tensor parallel attention) the merge would gather every head on every rank (DTensor
does). A ``bmm`` has no weight to move: kept grouped (``S(0)xB``), each rank multiplies its
heads, and the view of the result back to ``[B, H, T, T]`` is its heads again. So a
reshape read only by ``bmm``/``baddbmm``, none of whose operands is a parameter's view,
may regroup on every mesh dim.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, StateKind, Value
from ..ir.attrs import REGROUP_DIMS, STATE
from ..pass_infra.context import PassContext
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
    every = tuple(m for m in range(len(mesh.shape)) if mesh.shape[m] > 1)
    users = program.users()
    for op in program.ops:
        if op.kind is OpKind.CALL and op.target in RESHAPES:
            allowed = every if _feeds_activation_bmm(op, users) else dims
            if allowed:
                op.attrs[REGROUP_DIMS] = allowed
    return program


BATCHED_MATMULS = ("aten.bmm.default", "aten.baddbmm.default")
# ops that pass a value on unchanged in content (what a parameter's view goes through)
_PASS_THROUGH = RESHAPES + ("aten.expand.default", "aten.clone.default",
                            "aten.transpose.int", "aten.t.default", "aten.permute.default",
                            "aten._to_copy.default", "aten.alias.default")


def _feeds_activation_bmm(op: Op, users: dict[Value, list[Op]]) -> bool:
    """Whether ``op``'s result reaches only batched matmuls of activations, directly or
    through views (the backward's transposed copy of a saved operand)."""
    readers = users.get(op.result, [])
    return bool(readers) and all(
        (r.target in BATCHED_MATMULS and not any(_of_parameter(v) for v in r.inputs))
        or (r.target in _PASS_THROUGH and len(r.outputs) == 1
            and _feeds_activation_bmm(r, users))
        for r in readers)


def _of_parameter(value: Value) -> bool:
    """Whether ``value`` is a parameter seen through views, copies and casts."""
    op = value.producer
    while op is not None and op.kind is OpKind.CALL and op.target in _PASS_THROUGH \
            and op.inputs:
        op = op.inputs[0].producer
    return op is not None and op.kind is OpKind.STATE and op.attrs[STATE].kind is StateKind.PARAM
