"""Softmax and log-softmax: every element of a row depends on the whole row, so the softmax
letter stays whole; the others pass through. The backward ops are linear in the incoming
gradient (the saved output is a constant there)."""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register, tensor_inputs
from ..spec import Spec, letters
from .common import schema_args


def _row_spec(op: Op, linear: str = "none") -> Spec:
    rank = len(tensor_inputs(op)[0].type.shape)
    abc = letters(rank)
    dim = schema_args(op)["dim"]
    whole = {abc[dim % rank]} if rank else set()
    return Spec((abc,) * len(tensor_inputs(op)), (abc,), replicated=whole, linear=linear,
                linear_inputs={0})


@register("aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default")
def softmax(op: Op) -> Spec:
    return _row_spec(op)


@register("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
def softmax_backward(op: Op) -> Spec:
    # y * (g - sum(g*y)) and g - exp(y) * sum(g): linear in g unless the result is cast.
    cast = tensor_inputs(op)[0].type.dtype != op.outputs[0].type.dtype
    return _row_spec(op, linear="none" if cast else "each")
