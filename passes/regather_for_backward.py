"""ZeRO stage 3: the backward gathers each parameter again, so the forward's gathered copy
dies after its last forward use (FSDP's reshard-after-forward).

After reshard, a stage-3 parameter's gather (its comm ops from the piece, then cheap views
of the whole: an annotation, ``t``, ``view``, ``transpose``, ``expand``...) is shared by
every reader: reshard moves a value once per placement, and the backward reads the very
copy the forward gathered (the input gradient of ``x @ t(W)`` reads ``W``; that of
``h * s[0:1].expand(...)`` reads the forward's saved view). That copy then lives from the
forward to the backward, the whole model at once.

Here, for each such parameter, the backward readers of the gathered family get their own
clone of the chain from the piece (the comm ops and the views, annotations looked through),
inserted just before the first backward reader, so the forward's copy is freed after its
last forward reader and the backward's after its last backward reader: one more gather
per such parameter (FSDP's three collectives per step: gather, gather again, reduce-
scatter), even for a language model's head, read again right after the loss, because the
loss's logits are where the activations peak. Pipelines are left alone: there a gathered
parameter is a once-a-step value every micro-batch's forward and backward read, so freeing
it after a forward would mean one gather per micro-batch and phase (torchtitan turns FSDP's
reshard-after-forward off under pipeline parallelism for the same reason).

The gathers' texts and ``why`` say which is which: "zero-3 gather of X for forward" and
"... for backward".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import COMM_TEXT, NAME
from ..ir.ops import op_info
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..reshard.comm import FOR_ROLE, RESHARD_STEP
from .zero_sharding import half_copy, scheduled_axis

__all__ = ["regather_for_backward", "gathered_families", "Family"]

ANNOTATE = "autopar.annotate"


@dataclass
class Family:
    """A parameter's gathered copy in the forward: the ops from its piece (comm steps, then
    views of the result) and who reads their values."""

    name: str
    piece: Value                                   # the parameter's state value
    ops: list[Op] = field(default_factory=list)    # the family's ops, in program order
    forward: list[Op] = field(default_factory=list)   # other readers outside the backward
    backward: list[Op] = field(default_factory=list)  # readers in the backward

    @property
    def values(self) -> set[Value]:
        return {v for op in self.ops for v in op.outputs}


def regather_for_backward(program: Program, ctx: PassContext) -> Program:
    if scheduled_axis(ctx, 3) is None:
        return program
    position = {op: i for i, op in enumerate(program.ops)}
    inserted: dict[Op, list[Op]] = {}
    for family in gathered_families(program):
        _label(family, "forward")
        if family.forward and family.backward:
            first = min(family.backward, key=position.__getitem__)
            inserted.setdefault(first, []).extend(_regather(family, first))
    if inserted:
        program.ops = [new for op in program.ops for new in inserted.get(op, []) + [op]]
    return program


def _is_backward(op: Op) -> bool:
    return op.role is Role.BACKWARD or (op.kind is OpKind.COMM
                                        and op.attrs.get(FOR_ROLE) is Role.BACKWARD)


def _carries(op: Op, family: set[Value]) -> bool:
    """Whether ``op`` is a cheap step of a parameter's gathered copy outside the backward:
    a reshard step, an annotation or a view, reading nothing but the copy."""
    if _is_backward(op) or Role.OPTIMIZER in (op.role, op.attrs.get(FOR_ROLE)) \
            or len(op.outputs) != 1:
        return False
    if not all(v in family for v in op.inputs if v.is_tensor):
        return False
    if op.kind is OpKind.COMM:
        return RESHARD_STEP in op.attrs
    return op.kind is OpKind.CALL and (op.target == ANNOTATE or op_info(op.target).view)


def gathered_families(program: Program) -> list[Family]:
    """Each parameter whose piece is moved by a reshard step: its gathered family."""
    users = program.users()
    found = []
    for state in program.states(StateKind.PARAM):
        # under amp the gathered piece may be the parameter's half copy (zero_sharding)
        piece = half_copy(state.result, users) or state.result
        family = Family(state.attrs[NAME], piece)
        members: set[Value] = {piece}
        todo = [op for op in users.get(piece, ()) if op.kind is OpKind.COMM]
        seen: set[Op] = set()
        while todo:
            op = todo.pop()
            if op in seen or not _carries(op, members):
                continue
            seen.add(op)
            members.update(op.outputs)
            todo.extend(u for u in users.get(op.result, ()))
        if not seen:
            continue
        family.ops = [op for op in program.ops if op in seen]
        for v in family.values:
            for reader in users.get(v, ()):
                if reader in seen:
                    continue
                (family.backward if _is_backward(reader) else family.forward).append(reader)
        found.append(family)
    return found


def _label(family: Family, phase: str) -> None:
    """Say in the comm text and the value's reason which phase a gather is for."""
    for op in family.ops:
        if op.kind is OpKind.COMM:
            _say(op, f"zero-3 gather of {family.name} for {phase}")


def _say(op: Op, what: str) -> None:
    op.attrs[COMM_TEXT] = f"{what}: {op.attrs[COMM_TEXT]}"
    v = op.result
    if v.why is not None:
        v.why = Reason(v.why.kind, f"{what}; {v.why.text}", v.why.op, v.why.sources,
                       v.why.choices)


def _regather(family: Family, first: Op) -> list[Op]:
    """Clone the family's chain for its backward readers (annotations looked through) and
    make them read the clones; returns the clones, in order, to run before ``first``."""
    made: list[Op] = []
    clones: dict[Value, Value] = {family.piece: family.piece}
    values = family.values

    def clone(v: Value) -> Value:
        if v in clones:
            return clones[v]
        op = v.producer
        if op.target == ANNOTATE:
            clones[v] = clone(op.args[0])
            return clones[v]
        new = Op(op.kind, op.target, op.args, dict(op.kwargs), [Value(v.type)],
                 Role.COMM if op.kind is OpKind.COMM else Role.BACKWARD, first.module,
                 first.forward_op, dict(op.attrs))
        new.map_inputs(clone)
        new.needs = op.needs
        out = new.result
        out.producer, out.index, out.dist = new, 0, v.dist
        out.why = Reason("reshard", f"zero-3 gather of {family.name} for backward: the "
                                    "forward's copy is freed after its last forward reader",
                         first, tuple(new.inputs))
        if op.kind is OpKind.COMM:
            new.attrs[FOR_ROLE] = Role.BACKWARD
            text = op.attrs[COMM_TEXT].replace(" for forward", " for backward", 1)
            new.attrs[COMM_TEXT] = text
        made.append(new)
        clones[v] = out
        return out

    for reader in family.backward:
        reader.map_inputs(lambda v: clone(v) if v in values else v)
    return made
