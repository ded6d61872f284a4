"""What each comm op of a process's program runs, and the way back from a state piece to the
whole tensor: worked out from the global program's types and placements at the process's
coordinate, so the runtime does no shape arithmetic and no planning."""
from __future__ import annotations

from typing import Sequence

from ..ir import Op, OpKind, Role
from ..ir.attrs import CONST, FILL, ON_HOST, STATE, StateKind
from ..ir.dist import DistAttr, ProcessMesh, Replicate, local_shape
from ..reshard import plan_reshard
from ..reshard.comm import BUCKET_STEPS, FOR_ROLE, RESHARD_STEP
from .executable import (
    GATHERED_REDUCE_BYTES,
    BucketStart,
    BucketWait,
    Comm,
    GatherStart,
    GatherWait,
    ScatterStart,
    ScatterWait,
    StatePiece,
    StepComm,
)

__all__ = ["comm_spec", "step_comm", "state_piece", "member_shapes", "by_gather"]


def member_shapes(shape: Sequence[int], mesh: ProcessMesh, placements: Sequence,
                  coordinate: Sequence[int], mesh_dim: int) -> tuple[tuple[int, ...], ...]:
    """The piece each member of a process's group along ``mesh_dim`` holds, by index."""
    return tuple(local_shape(shape, mesh, placements,
                             tuple(coordinate[:mesh_dim]) + (j,) + tuple(coordinate[mesh_dim + 1:]))
                 for j in range(mesh.shape[mesh_dim]))


def step_comm(step, shape: Sequence[int], dist: DistAttr, coordinate: Sequence[int]) -> StepComm:
    return StepComm(step, member_shapes(shape, dist.mesh, dist.placements, coordinate,
                                        step.mesh_dim))


def by_gather(start: Op) -> bool:
    """Whether a bucket's all-reduce (``comm.all_reduce_start``) runs, on gloo, as one
    all-gather of both terms and a local sum (``GATHERED_REDUCE_BYTES``): over a pair of
    processes, small, and not of gradients (a tensor-parallel backward's activation
    gradient): gradient buckets stay in place, as DDP's, the gathered form would hold three
    times their bytes until the wait."""
    step = start.attrs[BUCKET_STEPS][0]
    return (start.args[0].dist.mesh.shape[step.mesh_dim] == 2
            and start.attrs.get(FOR_ROLE) is not Role.OPTIMIZER
            and sum(v.type.numel * v.type.dtype.itemsize for v in start.args)
            <= GATHERED_REDUCE_BYTES)


def comm_spec(op: Op, coordinate: Sequence[int]) -> Comm:
    """What comm ``op`` of the *global* program runs on the process at ``coordinate``."""
    if op.target == "comm.all_reduce_start":
        steps = op.attrs[BUCKET_STEPS]
        if len({(s.mesh_dim, s.op) for s in steps}) != 1:
            raise ValueError(f"{op.target}: a bucket mixes mesh dims or reduce ops: {steps}")
        return BucketStart(steps, tuple(local_shape(v.type.shape, v.dist.mesh,
                                                    v.dist.placements, coordinate)
                                        for v in op.args), by_gather(op))
    if op.target == "comm.all_gather_start":
        return GatherStart(*_unit(op, coordinate, "a unit", pieces_after=False))
    if op.target == "comm.reduce_scatter_start":
        return ScatterStart(*_unit(op, coordinate, "a unit of gradients", pieces_after=True))
    if op.target == "comm.wait":
        started = op.args[0].producer.target
        return {"comm.all_gather_start": GatherWait(),
                "comm.reduce_scatter_start": ScatterWait()}.get(started, BucketWait())
    value = op.args[0]
    return step_comm(op.attrs[RESHARD_STEP], value.type.shape, value.dist, coordinate)


def _unit(op: Op, coordinate: Sequence[int], what: str, pieces_after: bool) -> tuple:
    """(steps, each input's member pieces) of a unit's start: one collective over its inputs
    flattened, so one mesh dim, one reduce op and one dtype. The pieces are the inputs' (a
    gather) or its step's results (a reduce-scatter)."""
    steps = op.attrs[BUCKET_STEPS]
    if len({(s.mesh_dim, getattr(s, "op", None), v.type.dtype)
            for s, v in zip(steps, op.args)}) != 1:
        raise ValueError(f"{op.target} ({op.module or 'top level'}): {what} mixes mesh dims, "
                         f"reduce ops or dtypes: {steps}")
    return steps, tuple(member_shapes(v.type.shape, v.dist.mesh,
                                      s.advance(tuple(v.dist.placements)) if pieces_after
                                      else v.dist.placements, coordinate, s.mesh_dim)
                        for s, v in zip(steps, op.args))


def _gather_steps(shape: tuple[int, ...], dist: DistAttr, itemsize: int,
                  coordinate: Sequence[int]) -> tuple[StepComm, ...]:
    """The reshard planner's cheapest path from ``dist`` to replicated, as steps."""
    target = DistAttr(dist.mesh, tuple(Replicate() for _ in dist.placements))
    placements, out = tuple(dist.placements), []
    for step in plan_reshard(shape, dist, target, itemsize):
        out.append(step_comm(step, shape, DistAttr(dist.mesh, placements), coordinate))
        placements = step.advance(placements)
    return tuple(out)


def state_piece(op: Op, coordinate: Sequence[int], owner: int | None = None) -> StatePiece:
    """The piece of state ``op`` (a STATE op of the global program) a process at
    ``coordinate`` holds, and how to gather it whole."""
    if op.kind is not OpKind.STATE:
        raise ValueError(f"{op.target}: not a state op")
    value, key = op.result, op.attrs[STATE]
    const = op.attrs.get(CONST) if key.kind is StateKind.CONST else None
    shape = tuple(value.type.shape)
    gather = () if value.dist is None else _gather_steps(
        shape, value.dist, value.type.dtype.itemsize, coordinate)
    return StatePiece(key, shape, value.type.dtype, value.dist, tuple(coordinate), const,
                      gather, owner, op.attrs.get(FILL), op.attrs.get(ON_HOST, False))
