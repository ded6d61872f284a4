"""Clip gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does.

The clipping math is traced from a small torch function, so it is the same ATen ops in the
same order as eager (per-gradient norms, the norm of their stack, ``max_norm /
(total + 1e-6)`` clamped at 1, a multiply per gradient) and later passes shard it like any
other ops.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir import Program, Role
from ..ir.from_fx import append_graph
from ..pass_infra.context import PassContext


def _clip(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> list[torch.Tensor]:
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coef for g in grads]


def clip_grad(program: Program, ctx: PassContext) -> Program:
    clip = ctx.strategy.grad_clip
    results = program.results()
    grads = [(slot, v) for slot, v in results if slot.kind == "grad"]
    if clip.max_norm is None or ctx.mode != "train" or not grads:
        return program
    examples = [torch.empty(v.type.shape, dtype=v.type.dtype) for _, v in grads]
    gm = make_fx(lambda gs: _clip(gs, clip.max_norm, clip.norm_type), tracing_mode="fake")(examples)
    clipped = append_graph(program, gm, [v for _, v in grads], Role.OPTIMIZER)
    new = dict(zip([s for s, _ in grads], clipped))
    program.set_results([(slot, new.get(slot, v)) for slot, v in results])
    return program
