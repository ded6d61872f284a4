"""Remove computations whose results nobody reads (tracing keeps e.g. a mask a model builds
and never uses). Ops that mutate their inputs or draw random numbers stay: dropping them
would change state or the random stream."""
from __future__ import annotations

import torch

from ..ir import OpKind, Program
from .context import PassContext


def _has_effects(target: str) -> bool:
    if not target.startswith("aten."):
        return True
    from ..runtime.kernels import resolve
    op = resolve(target)
    return op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags


def dead_code(program: Program, ctx: PassContext) -> Program:
    used = set(program.output_op.inputs)
    kept = []
    for op in reversed(program.ops):
        live = op.kind is OpKind.OUTPUT or any(v in used for v in op.outputs)
        if live or (op.kind is OpKind.CALL and _has_effects(op.target)) or op.kind is OpKind.INPUT:
            kept.append(op)
            used.update(op.inputs)
    program.ops = kept[::-1]
    return program
