"""ZeRO stages 1, 2 and 3: reduce-scatter gradients as soon as the backward has made them, a
unit at a time and asynchronously, so no whole gradient waits for the optimizer (FSDP's
post-backward reduce-scatter; stage 1 plans the same reduce-scatters as stage 2,
``zero_sharding``).

Reshard puts the reduce-scatter that takes a ``Partial`` gradient to the piece its update
writes just before that update, after the whole backward: every layer's whole gradient is
then alive at once at the end of the backward, the peak of a stage-3 step. Here:

1. each such reduce-scatter moves to right after the op that completes its gradient (the
   last accumulation of a tied weight's terms); nothing reads a moved value before its old
   position, so the move changes no result;
2. consecutive ones of a unit (``sharding.unit``: a repeated layer, as the gathers of
   ``prefetch_gathers``; or a module) and of one mesh dim, reduce op and dtype become one
   collective over the gradients flattened:

       %h3 = comm.reduce_scatter_start(%g1, %g2, ...)   # after the unit's last gradient
       ...                                               # the next unit's backward
       %p1, %p2, ... = comm.wait(%h3)                   # before the next unit's start

   so a unit's reduce-scatter travels while the backward computes the next, with at most
   one in flight (its flat buffer is the memory bound). Stages 1 and 2 merge consecutive
   units up to ``data_parallel.bucket_mb`` (``_bucketed``). Norm partials (clipping's) and
   single gradients keep their synchronous reduce-scatter.

Under HSDP (data parallel over the sharding dim and others) a unit's pieces are then
summed over the replicas by one asynchronous all-reduce too (``_reduce_replicas``).

Pipelines are left alone: there a gradient is summed over micro-batches first, once a step.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.attrs import COMM_TEXT, MULTI
from ..ir.core import OpaqueType
from ..pass_infra.context import PassContext
from ..reshard.comm import BUCKET_STEPS, FOR_ROLE, RESHARD_STEP
from ..reshard.steps import AllReduce, ReduceScatter
from .bucket_collectives import FIRST_BUCKET, bucket_bytes
from .prefetch_gathers import layer_of
from .zero_sharding import scheduled_axis

__all__ = ["scatter_gradients_early"]

HANDLE = OpaqueType("!comm.handle")
BUCKETED_OPS = ("sum", "avg")


def scatter_gradients_early(program: Program, ctx: PassContext) -> Program:
    axis = scheduled_axis(ctx, 1)
    if axis is None:
        return program
    after: dict[Op, list[Op]] = {}      # the op that makes a gradient -> its scatters
    for op in program.ops:
        if _is_gradient_scatter(op, axis):
            after.setdefault(op.args[0].producer, []).append(op)
    if not after:
        return program
    movers = {op for scatters in after.values() for op in scatters}
    program.ops = [new for op in program.ops
                   for new in ([] if op in movers else [op]) + after.get(op, [])]
    by_layer = ctx.strategy.sharding.unit == "layer"
    units = _units([op for op in program.ops if op in movers], by_layer)
    if ctx.strategy.sharding.stage < 3:
        units = _bucketed(units, bucket_bytes(ctx), by_layer)
    units = [u for u in units if len(u) > 1]
    if units:
        program.ops = _rewrite(program, units)
        _reduce_replicas(program)
    return program


def _reduce_replicas(program: Program) -> None:
    """HSDP (data parallel over more mesh dims than the sharding one): each scattered
    piece is then summed over the replicas by an all-reduce of its own, synchronous, just
    before its update. A unit's pieces so summed become one asynchronous all-reduce started
    right after the unit's wait and waited for where the first of them was (FSDP2's HSDP:
    reduce-scatter in the shard group, then all-reduce across the replicas)."""
    users = program.users()
    position = {op: i for i, op in enumerate(program.ops)}
    moves: list[tuple[Op, list[Op]]] = []
    for wait in program.ops:
        if wait.target != "comm.wait" or not str(wait.attrs.get(COMM_TEXT, "")).startswith(
                "reduce-scatter unit"):
            continue
        sums = [users.get(v, []) for v in wait.outputs]
        if not all(len(u) == 1 and _is_replica_sum(u[0]) for u in sums):
            continue
        comms = [u[0] for u in sums]
        if len({(c.attrs[RESHARD_STEP].mesh_dim, c.attrs[RESHARD_STEP].op) for c in comms}) == 1:
            moves.append((wait, comms))
    if not moves:
        return
    placed: dict[Op, list[Op]] = {}     # the op a start goes after -> starts
    waits_at: dict[Op, Op] = {}         # the first old all-reduce -> its bucket's wait
    for k, (wait, comms) in enumerate(moves):
        start, done = _replica_pair(comms, wait.attrs[COMM_TEXT], k)
        placed.setdefault(wait, []).append(start)
        waits_at[min(comms, key=position.__getitem__)] = done
    dropped = {c for _, comms in moves for c in comms}
    program.ops = [new for op in program.ops
                   for new in ([waits_at[op]] if op in waits_at else [])
                   + ([] if op in dropped else [op]) + placed.get(op, [])]


def _is_replica_sum(op: Op) -> bool:
    step = op.attrs.get(RESHARD_STEP)
    return op.kind is OpKind.COMM and isinstance(step, AllReduce) and step.op in BUCKETED_OPS


def _replica_pair(comms: list[Op], unit: str, number: int) -> tuple[Op, Op]:
    inputs = tuple(c.args[0] for c in comms)
    steps = tuple(c.attrs[RESHARD_STEP] for c in comms)
    label = f"replica sum {number}"
    text = f"{label}: {unit}'s {len(comms)} pieces, {_kib(inputs):.1f} KiB, {steps[0]}"
    return _start_and_wait("comm.all_reduce_start", comms, steps, text, label)


def _is_gradient_scatter(op: Op, axis: int) -> bool:
    """A reduce-scatter over the sharding axis, for the optimizer, of a value a backward call
    makes."""
    step = op.attrs.get(RESHARD_STEP)
    made = op.args[0].producer if op.kind is OpKind.COMM and op.args else None
    return (isinstance(step, ReduceScatter) and step.mesh_dim == axis
            and op.attrs.get(FOR_ROLE) is Role.OPTIMIZER and made is not None
            and made.kind is OpKind.CALL and made.role is Role.BACKWARD)


def _key(op: Op, by_layer: bool) -> tuple | None:
    step = op.attrs[RESHARD_STEP]
    if step.op not in BUCKETED_OPS:
        return None                      # a norm partial: its kernel transforms the values
    module = op.args[0].producer.module
    return (layer_of(module) if by_layer else module), step.op, op.args[0].type.dtype


def _units(scatters: list[Op], by_layer: bool) -> list[list[Op]]:
    units: list[list[Op]] = []
    for op in scatters:
        key = _key(op, by_layer)
        if key is not None and units and _key(units[-1][-1], by_layer) == key:
            units[-1].append(op)
        else:
            units.append([op])
    return units


def _bucketed(units: list[list[Op]], limit: float, by_layer: bool) -> list[list[Op]]:
    """Stages 1 and 2: consecutive units of one reduce op and dtype merged up to
    ``data_parallel.bucket_mb`` (DeepSpeed's reduce bucket; DDP's bucket size): nothing waits
    for these gradients before the optimizer, so per-collective latency, not the flat
    buffer, is what small layers cost; the first bucket at most ``FIRST_BUCKET`` (DDP's 1 MiB), so
    the last layers' gradients leave early. Stage 3 keeps one unit per layer (its gradients are
    freed unit by unit: FSDP's memory bound)."""
    merged: list[list[Op]] = []
    for unit in units:
        kind = _kind(unit[0], by_layer)
        cap = min(limit, FIRST_BUCKET) if len(merged) == 1 else limit
        if (merged and kind is not None and _kind(merged[-1][0], by_layer) == kind
                and _bytes(merged[-1]) + _bytes(unit) <= cap):
            merged[-1] += unit
        else:
            merged.append(list(unit))
    return merged


def _kind(op: Op, by_layer: bool) -> tuple | None:
    """A scatter's reduce op and dtype (None: a norm partial, never merged)."""
    key = _key(op, by_layer)
    return None if key is None else key[1:]


def _bytes(unit: list[Op]) -> int:
    return sum(op.args[0].type.numel * op.args[0].type.dtype.itemsize for op in unit)


def _rewrite(program: Program, units: list[list[Op]]) -> list[Op]:
    """Each unit's scatters -> a start where its last one was and a wait before the next
    unit's start (or its results' first reader, if earlier)."""
    starts, waits = zip(*(_pair(unit, k) for k, unit in enumerate(units)))
    dropped = {op for unit in units for op in unit}
    at_last = {unit[-1]: start for unit, start in zip(units, starts)}
    ops: list[Op] = []
    for op in program.ops:
        if op in dropped:
            if op in at_last:
                ops.append(at_last[op])
            continue
        ops.append(op)
    for k, wait in enumerate(waits):
        ops.insert(_wait_position(ops, wait, starts[k + 1] if k + 1 < len(starts) else None),
                   wait)
    return ops


def _wait_position(ops: list[Op], wait: Op, next_start: Op | None) -> int:
    results = set(wait.outputs)
    begin = ops.index(wait.args[0].producer) + 1
    for i in range(begin, len(ops)):
        if ops[i] is next_start or any(v in results for v in ops[i].inputs):
            return i
    return len(ops) - 1 if ops[-1].kind is OpKind.OUTPUT else len(ops)


def _pair(unit: list[Op], number: int) -> tuple[Op, Op]:
    inputs = tuple(op.args[0] for op in unit)
    steps = tuple(op.attrs[RESHARD_STEP] for op in unit)
    text = (f"reduce-scatter unit {number}: {len(unit)} gradients "
            f"({unit[0].args[0].producer.module or 'top level'}...), {_kib(inputs):.1f} KiB, "
            f"{steps[0]}")
    return _start_and_wait("comm.reduce_scatter_start", unit, steps, text,
                           f"reduce-scatter unit {number}")


def _kib(values: tuple[Value, ...]) -> float:
    return sum(v.type.numel * v.type.dtype.itemsize for v in values) / 1024


def _start_and_wait(target: str, comms: list[Op], steps: tuple, text: str, label: str
                    ) -> tuple[Op, Op]:
    """One asynchronous collective over ``comms``' inputs: its start and its wait, which
    makes the old ops' results (so their readers do not change)."""
    inputs = tuple(c.args[0] for c in comms)
    handle = Value(HANDLE)
    start = Op(OpKind.COMM, target, inputs, outputs=[handle], role=Role.COMM,
               module=comms[0].module,
               attrs={COMM_TEXT: text, FOR_ROLE: Role.OPTIMIZER, BUCKET_STEPS: steps})
    start.needs = tuple(v.dist for v in inputs)
    handle.producer, handle.index = start, 0
    results = [c.result for c in comms]
    wait = Op(OpKind.COMM, "comm.wait", (handle,), outputs=results, role=Role.COMM,
              module=comms[0].module,
              attrs={COMM_TEXT: label, MULTI: True, FOR_ROLE: Role.OPTIMIZER})
    for index, v in enumerate(results):
        v.producer, v.index = wait, index
    return start, wait
