"""ZeRO stage 3: prefetch each layer's parameter gathers one layer ahead (FSDP's forward and
backward prefetch), as asynchronous collectives.

After reshard (and ``regather_for_backward``), each stage-3 parameter is all-gathered from
its piece just before its first reader in each phase, and a rank waits for it there. Here
the gathers become *units*: consecutive gathers (in the order of first use) whose first
readers are in the same repeated layer (``layer_of``: a transformer block; the modules
outside the layers are the root's; ``sharding.unit: module``: the same module) and of one
dtype. Each unit is one collective over its
pieces flattened into one buffer:

    %h2 = comm.all_gather_start(%w2, %b2)      # right after the previous unit's wait
    ...                                          # the previous unit's compute
    %W2, %B2 = comm.wait(%h2)                   # where the first of its gathers was

so unit k travels while unit k-1 computes, and at most one unit is in flight ahead of the
compute (the memory bound). The sequence runs over the whole step, forward units then
backward ones, so the backward's first gathers travel during the forward's last layer.
The first unit starts where it waits. Results keep the old comm ops' values, so readers do
not change. Pipelines keep their gathers: there they run once a step, before the schedule
(``regather_for_backward`` says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.attrs import COMM_TEXT, MULTI
from ..ir.core import OpaqueType
from ..pass_infra.context import PassContext
from ..reshard.comm import BUCKET_STEPS, FOR_ROLE, RESHARD_STEP
from ..reshard.steps import AllGather
from .zero_sharding import parameter_of, scheduled_axis

__all__ = ["prefetch_gathers", "GatherUnit", "gather_units", "unit_collective"]

HANDLE = OpaqueType("!comm.handle")
KIB = 1 << 10


@dataclass
class GatherUnit:
    """Consecutive all-gathers that travel as one collective (``gather_units``)."""

    gathers: list[Op] = field(default_factory=list)

    def key(self, by_layer: bool, module_of: Callable[[Op], str | None]) -> tuple:
        first = self.gathers[0]
        module = module_of(first)
        where = layer_of(module) if by_layer else module
        return where, first.args[0].type.dtype, first.attrs.get(FOR_ROLE)


def layer_of(module: str | None) -> str:
    """The repeated layer a module belongs to: its path up to the first index
    (``blocks.3.attn.qkv`` -> ``blocks.3``, ``model.layers.0.mlp`` -> ``model.layers.0``);
    modules outside any (embeddings, the final norm, the head) are the root's. FSDP's usual
    wrapping: one unit per transformer block, one for the rest, so a block's parameters
    travel as one collective (per-collective latency, not bytes, dominates small layers)."""
    parts = (module or "").split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ""


def prefetch_gathers(program: Program, ctx: PassContext) -> Program:
    axis = scheduled_axis(ctx, 3)
    if axis is None:
        return program
    units = gather_units([op for op in program.ops if _is_parameter_gather(op, axis)],
                         by_layer=ctx.strategy.sharding.unit == "layer")
    if units:
        program.ops = _rewrite(program.ops, units)
    return program


def _is_parameter_gather(op: Op, axis: int) -> bool:
    """An all-gather over the sharding axis of a parameter's piece (or of its half copy,
    under amp)."""
    if op.kind is not OpKind.COMM or len(op.args) != 1:
        return False
    step = op.attrs.get(RESHARD_STEP)
    return (isinstance(step, AllGather) and step.mesh_dim == axis
            and parameter_of(op.args[0]) is not None)


def gather_units(gathers: list[Op], by_layer: bool,
                 module_of: Callable[[Op], str | None] = lambda op: op.module
                 ) -> list[GatherUnit]:
    """``gathers`` (in program order) cut into units: consecutive ones of one layer
    (``layer_of``; ``by_layer`` False: of one module; ``module_of`` a gather's module),
    one dtype and one role."""
    units: list[GatherUnit] = []
    for op in gathers:
        if units and (GatherUnit([op]).key(by_layer, module_of)
                      == units[-1].key(by_layer, module_of)):
            units[-1].gathers.append(op)
        else:
            units.append(GatherUnit([op]))
    return units


def _rewrite(ops: list[Op], units: list[GatherUnit]) -> list[Op]:
    position = {op: i for i, op in enumerate(ops)}
    before: dict[int, list[Op]] = {}    # ops to place right before position i
    after: dict[int, list[Op]] = {}     # ops to place right after position i
    replaced: dict[Op, Op | None] = {}  # a unit's first gather -> its wait; the rest: dropped
    anchors = [position[u.gathers[0]] for u in units]
    for k, unit in enumerate(units):
        start, wait = _pair(unit, k)
        ready = max(position[v.producer] for v in start.inputs)
        if k > 0 and anchors[k - 1] > ready:
            after.setdefault(anchors[k - 1], []).append(start)   # one unit ahead
        else:
            before.setdefault(anchors[k], []).append(start)
        replaced.update({g: None for g in unit.gathers})
        replaced[unit.gathers[0]] = wait
    out: list[Op] = []
    for i, op in enumerate(ops):
        out += before.get(i, [])
        new = replaced.get(op, op)
        if new is not None:
            out.append(new)
        out += after.get(i, [])
    return out


def _pair(unit: GatherUnit, number: int) -> tuple[Op, Op]:
    role = unit.gathers[0].attrs.get(FOR_ROLE, Role.FORWARD)
    return unit_collective(unit, f"prefetch {number}",
                           f"zero-3 gather of {{names}} for {role.name.lower()}")


def unit_collective(unit: GatherUnit, label: str, what: str,
                    name_of: Callable[[Value], str | None] = parameter_of) -> tuple[Op, Op]:
    """The unit's gathers as one asynchronous collective: its start (over the pieces
    flattened) and its wait (which makes the old gathers' results, so readers do not
    change). ``label`` names the pair in dumps; ``what`` says what it moves (``{names}``:
    the parameters', ``name_of`` each gathered value's)."""
    gathers = unit.gathers
    inputs = tuple(g.args[0] for g in gathers)
    role = gathers[0].attrs.get(FOR_ROLE, Role.FORWARD)
    size = sum(g.result.type.numel * g.result.type.dtype.itemsize for g in gathers)
    names = ", ".join(str(name_of(g.args[0])) for g in gathers)
    step = gathers[0].attrs[RESHARD_STEP]
    text = f"{label}: {what.format(names=names)}, {size / KIB:.1f} KiB, {step}"
    handle = Value(HANDLE)
    start = Op(OpKind.COMM, "comm.all_gather_start", inputs, outputs=[handle], role=Role.COMM,
               module=gathers[0].module,
               attrs={COMM_TEXT: text, FOR_ROLE: role,
                      BUCKET_STEPS: tuple(g.attrs[RESHARD_STEP] for g in gathers)})
    start.needs = tuple(v.dist for v in inputs)
    handle.producer, handle.index = start, 0
    results = [g.result for g in gathers]
    wait = Op(OpKind.COMM, "comm.wait", (handle,), outputs=results, role=Role.COMM,
              module=gathers[0].module,
              attrs={COMM_TEXT: label, MULTI: True, FOR_ROLE: role})
    for index, v in enumerate(results):
        v.producer, v.index = wait, index
    return start, wait

