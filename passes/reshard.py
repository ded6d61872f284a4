"""Reshard: where an op needs an input placed otherwise than its producer made it, insert
the communication that moves it, as real IR ops.

Completion recorded, per op, the placement each input needs (``op.needs``). For each input
that differs, the pure planner (``reshard.plan_reshard``) picks the cheapest sequence of
1-D steps (all-reduce, reduce-scatter, all-gather, slice, all-to-all, make-partial), and this
pass writes one ``comm.<kind>`` op per step just before the first consumer. A value wanted
in one placement by several consumers moves once. Afterwards every consumer reads exactly
the placement it needs (``check_resharded``). The program stays global (global shapes);
partition makes each rank's local form of these ops.
"""
from __future__ import annotations

import dataclasses

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.attrs import COMM_TEXT
from ..ir.dist import DistAttr
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..reshard import plan_reshard
from ..reshard.comm import FOR_ROLE, FOR_TARGET, RESHARD_STEP


def reshard(program: Program, ctx: PassContext) -> Program:
    if ctx.state.mesh is None:
        return program
    moved: dict[tuple[Value, DistAttr], Value] = {}
    plans: dict[tuple, list] = {}    # identical layers move identical tensors: plan once
    ops: list[Op] = []
    for op in program.ops:
        if op.needs:
            ops += _feed(op, moved, plans)
        ops.append(op)
    program.ops = ops
    check_resharded(program)
    return program


def _feed(op: Op, moved: dict, plans: dict) -> list[Op]:
    """Give ``op`` its inputs as it needs them, moving each that is placed otherwise;
    returns the comm ops to run just before it."""
    comms: list[Op] = []
    wanted = iter(op.needs)
    swap: dict[int, Value] = {}
    for position, v in enumerate(op.inputs):
        if not v.is_tensor:
            continue
        need = next(wanted)
        if need is None or v.dist is None or need == v.dist:
            continue
        if (v, need) not in moved:
            key = (v.type, v.dist, need)
            if key not in plans:
                plans[key] = _plan(op, v, need)
            moved[(v, need)] = _move(comms, op, v, need, plans[key])
        swap[position] = moved[(v, need)]
    if swap:
        counter = iter(range(len(op.inputs)))
        op.map_inputs(lambda v: swap.get(next(counter), v))
    return comms


def _move(comms: list[Op], consumer: Op, value: Value, need: DistAttr, steps: list) -> Value:
    placements, current = tuple(value.dist.placements), value
    names = need.mesh.dim_names
    for step in steps:
        step = dataclasses.replace(step, axis=names[step.mesh_dim])
        before, placements = placements, step.advance(placements)
        comm = Op(OpKind.COMM, f"comm.{step.kind}", (current,), outputs=[Value(value.type)],
                  role=Role.COMM, module=consumer.module,
                  attrs={COMM_TEXT: f"{step}: {_text(before)} -> {_text(placements)}",
                         RESHARD_STEP: step, FOR_ROLE: consumer.role,
                         FOR_TARGET: consumer.target})
        out = comm.outputs[0]
        out.dist = DistAttr(need.mesh, placements)
        out.why = Reason("reshard", f"{step}: {_text(before)} -> {_text(placements)} for "
                                    f"{consumer.target.removesuffix('.default')} "
                                    f"({consumer.module or '-'} {consumer.role.value})",
                         consumer, (current,))
        comm.needs = (current.dist,)
        out.producer, out.index = comm, 0
        comms.append(comm)
        current = out
    return current


def _text(placements) -> str:
    return "{" + ",".join(str(p) for p in placements) + "}"


def check_resharded(program: Program) -> None:
    """After reshard, every op reads each input exactly as it needs it."""
    for op in program.ops:
        tensors = [v for v in op.inputs if v.is_tensor]
        for v, need in zip(tensors, op.needs):
            if need is not None and v.dist is not None and need != v.dist:
                raise AssertionError(f"reshard left {op.target} ({op.module or '-'}) reading "
                                     f"{v.dist} where it needs {need}")


def _plan(op: Op, v: Value, need: DistAttr) -> list:
    """The steps that move ``v`` to what ``op`` needs; a failure names the op."""
    try:
        return plan_reshard(v.type.shape, v.dist, need, v.type.dtype.itemsize)
    except RuntimeError as e:
        raise RuntimeError(f"{op.target} ({op.module or 'top level'}, {op.role.value}) reads "
                           f"a value it needs moved: {e}") from e
