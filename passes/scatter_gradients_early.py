"""ZeRO stages 2 and 3: reduce-scatter each gradient as soon as the backward has made it, so
no whole gradient waits for the optimizer (FSDP's post-backward reduce-scatter).

Reshard puts the reduce-scatter that takes a ``Partial`` gradient to the piece its update
writes just before that update, after the whole backward: every layer's whole gradient is
then alive at once at the end of the backward, the peak of a stage-3 step (the parameters
are sharded, the gathered copies freed). Here each such reduce-scatter moves to right after
the op that completes its gradient (the last accumulation of a tied weight's terms), so the
whole gradient dies there and only the piece waits for the update. Nothing else reads a
moved value before its old position, so the move changes no result. Pipelines are left
alone: there a gradient is summed over micro-batches first, once a step.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role
from ..reshard.comm import FOR_ROLE, RESHARD_STEP
from ..reshard.steps import ReduceScatter
from .context import PassContext
from .zero_sharding import scheduled_axis

__all__ = ["scatter_gradients_early"]


def scatter_gradients_early(program: Program, ctx: PassContext) -> Program:
    axis = scheduled_axis(ctx, 2)
    if axis is None:
        return program
    after: dict[Op, list[Op]] = {}      # the op that makes a gradient -> its scatters
    for op in program.ops:
        if _is_gradient_scatter(op, axis):
            after.setdefault(op.args[0].producer, []).append(op)
    if after:
        movers = {op for scatters in after.values() for op in scatters}
        program.ops = [new for op in program.ops
                       for new in ([] if op in movers else [op]) + after.get(op, [])]
    return program


def _is_gradient_scatter(op: Op, axis: int) -> bool:
    """A reduce-scatter over the sharding axis, for the optimizer, of a value a backward call
    makes."""
    step = op.attrs.get(RESHARD_STEP)
    made = op.args[0].producer if op.kind is OpKind.COMM and op.args else None
    return (isinstance(step, ReduceScatter) and step.mesh_dim == axis
            and op.attrs.get(FOR_ROLE) is Role.OPTIMIZER and made is not None
            and made.kind is OpKind.CALL and made.role is Role.BACKWARD)
