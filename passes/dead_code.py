"""Remove computations whose results nobody reads (tracing keeps e.g. a mask a model builds
and never uses). Ops that mutate their inputs or draw random numbers stay: dropping them
would change state or the random stream."""
from __future__ import annotations

from ..ir import OpKind, Program
from ..ir.ops import op_info
from ..pass_infra.context import PassContext


def dead_code(program: Program, ctx: PassContext) -> Program:
    used = set(program.output_op.inputs)
    kept = []
    for op in reversed(program.ops):
        live = op.kind in (OpKind.OUTPUT, OpKind.INPUT) or any(v in used for v in op.outputs)
        if live or (op.kind is OpKind.CALL and op_info(op.target).effectful):
            kept.append(op)
            used.update(op.inputs)
    program.ops = kept[::-1]
    return program
