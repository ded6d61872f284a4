"""How much compute an op is: FLOPs, for balancing pipeline stages (``split: auto``) and for
weighing schedule jobs in a simulated timeline.

One small entry per op family, keyed by target, as a cost table should be: matrix products
count 2 FLOPs per multiply-add, attention its two products; every other op counts one FLOP
per output element (elementwise work is memory-bound, and this only needs to rank stages).
"""
from __future__ import annotations

import math
from typing import Callable

from ..ir.core import Op, OpKind, TensorType

FlopRule = Callable[[Op], float]
FLOPS: dict[str, FlopRule] = {}


def flop_rule(*targets: str) -> Callable[[FlopRule], FlopRule]:
    def register(fn: FlopRule) -> FlopRule:
        for target in targets:
            FLOPS[target] = fn
        return fn
    return register


def _shape(op: Op, index: int) -> tuple[int, ...]:
    tensors = [v for v in op.inputs if v.is_tensor]
    return tuple(tensors[index].type.shape)


def _out_numel(op: Op) -> float:
    return float(sum(v.type.numel for v in op.outputs if isinstance(v.type, TensorType)))


@flop_rule("aten.mm.default")
def _mm(op: Op) -> float:
    (m, k), (_, n) = _shape(op, 0), _shape(op, 1)
    return 2.0 * m * k * n


@flop_rule("aten.addmm.default")
def _addmm(op: Op) -> float:
    (m, k), (_, n) = _shape(op, 1), _shape(op, 2)
    return 2.0 * m * k * n + m * n


@flop_rule("aten.bmm.default", "aten.baddbmm.default")
def _bmm(op: Op) -> float:
    first = 1 if op.target == "aten.baddbmm.default" else 0
    (b, m, k), (_, _, n) = _shape(op, first), _shape(op, first + 1)
    return 2.0 * b * m * k * n


def _attention(q: tuple[int, ...], k: tuple[int, ...]) -> float:
    """QK^T and PV: two products over every query-key pair."""
    *batch, t_q, d = q
    t_k = k[-2]
    return 4.0 * math.prod(batch) * t_q * t_k * d


@flop_rule("aten._scaled_dot_product_flash_attention_for_cpu.default",
           "aten._scaled_dot_product_flash_attention.default",
           "aten._scaled_dot_product_efficient_attention.default",
           "aten._scaled_dot_product_cudnn_attention.default")
def _sdpa(op: Op) -> float:
    return _attention(_shape(op, 0), _shape(op, 1))


@flop_rule("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
           "aten._scaled_dot_product_flash_attention_backward.default",
           "aten._scaled_dot_product_efficient_attention_backward.default",
           "aten._scaled_dot_product_cudnn_attention_backward.default")
def _sdpa_backward(op: Op) -> float:
    # the backward's first tensor is the output's gradient, then q, k, v
    return 2.0 * _attention(_shape(op, 1), _shape(op, 2))


def op_flops(op: Op) -> float:
    """Estimated FLOPs of one call (0 for ops that only enter or leave the program)."""
    if op.kind is not OpKind.CALL:
        return 0.0
    rule = FLOPS.get(op.target)
    return rule(op) if rule is not None else _out_numel(op)


__all__ = ["FLOPS", "flop_rule", "op_flops"]
