"""Structural invariants of a Program, checked between passes in debug mode."""
from __future__ import annotations

import torch

from .attrs import NAME, SLOT_KINDS, SLOTS, STATE, AttrError, check_attrs
from .core import Op, OpKind, Program, Role, TensorType, Value


class VerificationError(ValueError):
    pass


def _fail(op: Op, message: str) -> None:
    raise VerificationError(f"{message} (op {op.target!r}, module {op.module or '-'}, "
                            f"role {op.role.value})")


def _check_types(op: Op) -> None:
    for v in op.outputs:
        if isinstance(v.type, TensorType) and not isinstance(v.type.dtype, torch.dtype):
            _fail(op, f"result has no torch dtype ({v.type.dtype!r})")
        if isinstance(v.type, TensorType) and any((not isinstance(d, int)) or d < 0
                                                  for d in v.type.shape):
            _fail(op, f"result has a non-static shape {v.type.shape}")


def _check_roles(op: Op, defined: dict[Value, Op]) -> None:
    if op.role in (Role.FORWARD, Role.LOSS) and op.kind is not OpKind.OUTPUT:
        for v in op.inputs:
            producer = defined[v]
            if producer.role in (Role.BACKWARD, Role.OPTIMIZER) and producer.kind is OpKind.CALL:
                _fail(op, f"forward op reads a {producer.role.value} value of {producer.target!r}")
    if op.role is Role.BACKWARD and op.forward_op is not None:
        if op.forward_op.role not in (Role.FORWARD, Role.LOSS):
            _fail(op, f"backward op is linked to a {op.forward_op.role.value} op")


def verify(program: Program) -> None:
    """SSA (each value defined once, before its uses), one final output op with valid
    slots, static shapes, role ordering (forward never reads backward values) and typed
    op attributes (every key a declared ``Attr``, every value of its type)."""
    defined: dict[Value, Op] = {}
    names: set[str] = set()
    if not program.ops or program.ops[-1].kind is not OpKind.OUTPUT:
        raise VerificationError("program must end in exactly one output op")
    for op in program.ops:
        if op.kind is OpKind.OUTPUT and op is not program.ops[-1]:
            _fail(op, "output op before the end of the program")
        for v in op.inputs:
            if v not in defined:
                _fail(op, "reads a value that is not defined before it")
        for v in op.outputs:
            if v in defined:
                _fail(op, "defines a value twice")
            if v.producer is not op:
                _fail(op, "result's producer link points elsewhere")
            defined[v] = op
        if op.kind in (OpKind.INPUT, OpKind.STATE):
            key = f"{op.kind.value}:{op.attrs.get(NAME)}"
            if key in names:
                _fail(op, f"duplicate {op.kind.value} name {op.attrs.get(NAME)!r}")
            names.add(key)
        if op.kind is OpKind.STATE and (STATE not in op.attrs
                                        or op.attrs[STATE].name != op.attrs.get(NAME)):
            _fail(op, f"a state op's NAME {op.attrs.get(NAME)!r} is not its StateKey's "
                      f"({op.attrs.get(STATE)})")
        _check_types(op)
        _check_roles(op, defined)
        try:
            check_attrs(op.attrs)
        except AttrError as err:
            _fail(op, str(err))
    out = program.output_op
    if len(out.attrs.get(SLOTS, ())) != len(out.args):
        _fail(out, "output slots and values differ in number")
    for slot in out.attrs[SLOTS]:
        if slot.kind not in SLOT_KINDS:
            _fail(out, f"unknown result slot kind {slot.kind!r}")
