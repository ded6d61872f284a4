"""Partition: the local program one rank runs, cut from the planned global program.

After reshard every op reads exactly the placements it needs, so a rank's program is the
global one with two changes and no new ops:

* every tensor value's type becomes the shape of the piece this rank holds
  (``local_shape`` of its global shape under its dist, at the rank's coordinate);
* every CALL op makes the call its local form gives (``spmd.local_forms.local_call``):
  shape arguments, global means, sharded embeddings, random slices... are rewritten to
  act on local pieces. The op keeps its input and output Values.

COMM ops stay as they are; lowering says what each runs on this rank (``comms``), and a
runtime (the in-process simulator, c10d) executes it across the ranks of its group.
Ranks' programs have the same ops in the same order, so collectives line up. This is the
one place a rank's program is made.

Local forms read the *global* types (offsets of a piece in the global tensor), so every
call is rewritten first and types are localized afterwards. A program with no mesh
(serial) is returned unchanged.
"""
from __future__ import annotations

from typing import Sequence

from ..ir.attrs import LOCAL_NOTE
from ..ir.core import Op, OpKind, Program, TensorType, Value
from ..ir.dist import ProcessMesh, local_shape
from ..spmd.local_forms import LocalCall, LocalContext, local_call

__all__ = ["partition", "local_form", "local_type"]


def partition(program: Program, mesh: ProcessMesh | None, coordinate: Sequence[int]) -> Program:
    """The local program of the rank at ``coordinate`` of ``mesh``, the program's mesh (the
    planned ``PlanState.mesh``; None: serial, the program itself)."""
    if mesh is None:
        return program
    coordinate = tuple(coordinate)
    if len(coordinate) != mesh.ndim or not all(0 <= c < n for c, n in zip(coordinate, mesh.shape)):
        raise ValueError(f"partition: coordinate {coordinate} is not on {mesh}")
    local = program.copy()
    # 1. rewrite calls while every type is still global
    for op in local.ops:
        if op.kind is not OpKind.CALL:
            continue
        call = local_form(op, mesh, coordinate)
        if call is not None:
            op.target, op.args, op.kwargs = call.target, tuple(call.args), dict(call.kwargs)
            if call.note:
                op.attrs[LOCAL_NOTE] = call.note
    # 2. localize the types
    for op in local.ops:
        for v in op.outputs:
            if v.is_tensor:
                v.type = local_type(op, v, mesh, coordinate)
    return local


def local_form(op: Op, mesh: ProcessMesh, coordinate: tuple[int, ...]) -> LocalCall | None:
    """The call CALL ``op`` (its values' types still global) makes on the rank at
    ``coordinate``; None: the op's own."""
    call = local_call(op, LocalContext.of(op, mesh, coordinate))
    if call.target != op.target or call.args is not op.args or call.kwargs != op.kwargs:
        return call
    return None


def local_type(op: Op, v: Value, mesh: ProcessMesh, coordinate: tuple[int, ...]
               ) -> TensorType:
    """The type of the piece of ``op``'s tensor result ``v`` (global type) the rank at
    ``coordinate`` holds."""
    if v.dist is None:
        raise ValueError(f"partition: {op.target} ({op.module or 'top level'}) has an "
                         "unplaced tensor result; run completion first")
    if v.dist.mesh != mesh:
        raise ValueError(f"partition: {op.target} is placed on {v.dist.mesh}, the "
                         f"program on {mesh}; one mesh per program is supported")
    shape = local_shape(v.type.shape, mesh, v.dist.placements, coordinate)
    return v.type if shape == tuple(v.type.shape) else TensorType(shape, v.type.dtype)
