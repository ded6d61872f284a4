"""Ring shifts: ring attention's passes of the keys and values (``autopar.ring_shift``,
``capture/ring_attention.py``) become p2p communication where the rolled dim is split over
the ring.

A ``ring_shift(x, dim, pieces, shift)`` whose ``dim`` is sharded over a mesh dim of
``pieces`` ranks (the context-parallel axis), outermost among the mesh dims that shard it,
is a ``comm.shift`` (``reshard.steps.Shift``): each rank sends its piece ``shift`` members
on and receives the one from ``shift`` members back. A rank's sub-piece under a further
split of that dim (an inner mesh dim) moves the same way. A shift whose dim is whole stays
the local roll. Any other split of that dim cannot be one pass and is refused by name.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role
from ..ir.attrs import COMM_TEXT
from ..ir.dist import DistAttr, Shard, format_placements
from ..ir.ops import schema_args
from ..pass_infra.context import PassContext
from ..reshard.comm import FOR_ROLE, FOR_TARGET, RESHARD_STEP
from ..reshard.steps import Shift

SHIFT = "autopar.ring_shift.default"


class RingShiftError(ValueError):
    pass


def ring_shifts(program: Program, ctx: PassContext) -> Program:
    if ctx.state.mesh is None:
        return program
    program.ops = [_as_comm(op) if op.target == SHIFT else op for op in program.ops]
    return program


def _ring_dim(op: Op, dist: DistAttr, dim: int, pieces: int) -> int | None:
    """The mesh dim the shift passes pieces over (None: ``dim`` is whole)."""
    over = [m for m, p in enumerate(dist.placements) if isinstance(p, Shard) and p.dim == dim]
    if not over:
        return None
    m = over[0]
    if dist.placements[m].groups == 1 and dist.mesh.shape[m] == pieces:
        return m
    raise RingShiftError(
        f"{op.target} ({op.module or 'top level'}, {op.role.value}): ring attention passes "
        f"{pieces} pieces of dim {dim} around a ring, but that dim is split "
        f"{format_placements(dist.placements)} on {dist.mesh}: it must be split over the "
        f"context-parallel axis of {pieces} ranks first")


def _as_comm(op: Op) -> Op:
    a = schema_args(op)
    value = op.inputs[0]
    dist = value.dist
    m = None if dist is None else _ring_dim(op, dist, a["dim"], a["pieces"])
    if m is None:
        return op
    step = Shift(m, tensor_dim=a["dim"], shift=a["shift"], axis=dist.mesh.dim_names[m])
    text = f"{step}: {format_placements(dist.placements)} kept, pieces passed on the ring"
    comm = Op(OpKind.COMM, f"comm.{step.kind}", (value,), outputs=list(op.outputs),
              role=Role.COMM, module=op.module,
              attrs={**op.attrs, COMM_TEXT: text, RESHARD_STEP: step, FOR_ROLE: op.role,
                     FOR_TARGET: op.target})
    comm.needs = (dist,)
    for i, out in enumerate(comm.outputs):
        out.producer, out.index = comm, i
    return comm
