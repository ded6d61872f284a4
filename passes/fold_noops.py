"""Fold ops that only re-label a value: ``detach`` (the runtime never records autograd) and
``t(t(x))`` (the transpose of a transpose is ``x`` itself, same strides). Backward graphs
are full of both; each costs a dispatch per step and nothing else."""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Value
from ..pass_infra.context import PassContext

_IDENTITIES = {"aten.detach.default", "aten.alias.default"}
_TRANSPOSE = "aten.t.default"


def _folded_source(op: Op, replaced: dict[Value, Value]) -> Value | None:
    if op.kind is not OpKind.CALL:
        return None
    if op.target in _IDENTITIES:
        return op.args[0]
    if op.target == _TRANSPOSE:
        inner = op.args[0].producer
        if inner is not None and inner.kind is OpKind.CALL and inner.target == _TRANSPOSE:
            return inner.args[0]
    return None


def fold_noops(program: Program, ctx: PassContext) -> Program:
    replaced: dict[Value, Value] = {}
    kept = []
    for op in program.ops:
        op.map_inputs(lambda v: replaced.get(v, v))
        source = _folded_source(op, replaced)
        if source is not None and op.outputs[0].type == source.type:
            replaced[op.outputs[0]] = source
            continue
        kept.append(op)
    program.ops = kept
    return program
