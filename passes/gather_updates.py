"""ZeRO stages 1 and 2: all-gather the updated parameters a unit at a time, asynchronously,
each unit as soon as its updates are done (DeepSpeed's and FSDP-style ZeRO-1/2 parameter
all-gather after the sharded step).

Each rank updates its piece of every parameter; reshard then all-gathers each new piece
back to the whole (replicated) parameter, one synchronous collective per parameter, all
after the last update. Per-collective latency, not bytes, dominates small parameters, so
here consecutive gathers of one dtype become one collective over their pieces flattened,
layers (``sharding.unit``, as ``prefetch_gathers``) merged up to ``data_parallel.bucket_mb``
(DDP's bucket size):

    %p1, %m1, %v1, %s1 = optim.adam(...)            # the unit's updates
    %h = comm.all_gather_start(%p1, %p2, ...)       # right after the unit's last update
    ...                                              # the next units' updates
    %P1, %P2, ... = comm.wait(%h)                   # where the first of its gathers was

so a unit's gather travels while the next units update. Results keep the old comm ops'
values, so readers (the step's state updates) do not change. Stage 3 keeps its parameters
sharded (nothing to gather after the update); pipelines are left alone.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Value
from ..pass_infra.context import PassContext
from ..reshard.comm import RESHARD_STEP
from ..reshard.steps import AllGather
from .bucket_collectives import bucket_bytes
from .prefetch_gathers import GatherUnit, gather_units, unit_collective
from .zero_sharding import parameter_of, scheduled_axis

__all__ = ["gather_updates"]


def gather_updates(program: Program, ctx: PassContext) -> Program:
    axis = scheduled_axis(ctx, 1)
    if axis is None or ctx.strategy.sharding.stage >= 3:
        return program
    gathers = [op for op in program.ops if _is_update_gather(op, axis)]
    units = _bucketed(gather_units(gathers, by_layer=ctx.strategy.sharding.unit == "layer",
                                   module_of=lambda g: _updated_parameter(g.args[0])),
                      bucket_bytes(ctx))
    position = {op: i for i, op in enumerate(program.ops)}
    after: dict[int, list[Op]] = {}       # starts to place right after position i
    replaced: dict[Op, Op | None] = {}    # a unit's first gather -> its wait; the rest: dropped
    for k, unit in enumerate(units):
        ready = max(position[g.args[0].producer] for g in unit.gathers)
        if ready > position[unit.gathers[0]]:
            continue          # a gather before a later update of its unit: left as it is
        start, wait = unit_collective(unit, f"update gather {k}",
                                      "zero gather of updated {names}", _updated_parameter)
        after.setdefault(ready, []).append(start)
        replaced.update({g: None for g in unit.gathers})
        replaced[unit.gathers[0]] = wait
    out: list[Op] = []
    for i, op in enumerate(program.ops):
        new = replaced.get(op, op)
        if new is not None:
            out.append(new)
        out += after.get(i, [])
    program.ops = out
    return program


def _bucketed(units: list[GatherUnit], limit: float) -> list[GatherUnit]:
    """Consecutive units of one dtype merged up to ``data_parallel.bucket_mb`` (as DDP's
    buckets: per-collective latency dominates small layers)."""
    merged: list[GatherUnit] = []
    for unit in units:
        first = unit.gathers[0]
        if (merged and merged[-1].gathers[0].args[0].type.dtype == first.args[0].type.dtype
                and _bytes(merged[-1]) + _bytes(unit) <= limit):
            merged[-1].gathers += unit.gathers
        else:
            merged.append(GatherUnit(list(unit.gathers)))
    return merged


def _bytes(unit: GatherUnit) -> int:
    return sum(g.result.type.numel * g.result.type.dtype.itemsize for g in unit.gathers)


def _is_update_gather(op: Op, axis: int) -> bool:
    """An all-gather over the sharding axis of a parameter's piece an update just wrote."""
    if op.kind is not OpKind.COMM or len(op.args) != 1:
        return False
    step = op.attrs.get(RESHARD_STEP)
    return (isinstance(step, AllGather) and step.mesh_dim == axis
            and _updated_parameter(op.args[0]) is not None)


def _updated_parameter(value: Value) -> str | None:
    """The parameter whose new piece ``value`` is (an update's first result), else None."""
    update = value.producer
    if (update is None or update.kind is not OpKind.CALL or not update.target.startswith("optim.")
            or value.index != 0 or not update.args or not isinstance(update.args[0], Value)):
        return None
    read = update.args[0]
    if read.producer is not None and read.producer.kind is OpKind.COMM:
        read = read.producer.args[0]            # the piece the rank cut from its parameter
    return parameter_of(read)
