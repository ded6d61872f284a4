"""Elementwise ops: every output dim is one letter, inputs broadcast right-aligned (a size-1
dim under a larger one is the unshardable ``1``). Any ATen op tagged pointwise without an
entry gets the nonlinear spec through ``POINTWISE_FALLBACK``; the entries here are the ops
through which Partial inputs pass exactly.
"""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import POINTWISE_FALLBACK, EinsumRule, register, tensor_inputs
from ..spec import Spec
from .common import elementwise, same_dtype, schema_args

# Nonlinear elementwise ops (gelu, exp, le, bitwise_not, ...): partial inputs are reduced first.
POINTWISE_FALLBACK.append(EinsumRule(lambda op: elementwise(op)))


@register("aten.add.Tensor", "aten.sub.Tensor", "aten.rsub.Tensor",
          "aten.add_.Tensor", "aten.sub_.Tensor")
def add(op: Op) -> Spec:
    # a + alpha*b is jointly linear only when both are tensors: x + 1 with x partial would
    # add the constant once per rank.
    both = len(tensor_inputs(op)) == 2
    return elementwise(op, linear="sum" if both else "none")


@register("aten.mul.Tensor", "aten.mul_.Tensor", "aten.mul.Scalar", "aten.mul_.Scalar",
          "aten.neg.default", "aten.div.Scalar", "aten.div_.Scalar")
def scale(op: Op) -> Spec:
    return elementwise(op, linear="each")


@register("aten.div.Tensor", "aten.div_.Tensor")
def div(op: Op) -> Spec:
    return elementwise(op, linear="each", linear_inputs={0})   # linear in the dividend only


@register("aten.where.self")
def where(op: Op) -> Spec:
    # where(c, a, b) picks a term of a or of b per element: jointly linear in (a, b).
    return elementwise(op, linear="sum", linear_inputs={1, 2})


@register("aten.masked_fill.Scalar", "aten.masked_fill_.Scalar")
def masked_fill(op: Op) -> Spec:
    zero = schema_args(op)["value"] == 0     # filling with 0 keeps a sum of terms a sum
    return elementwise(op, linear="each" if zero else "none", linear_inputs={0})


@register("aten.masked_fill.Tensor")
def masked_fill_tensor(op: Op) -> Spec:
    return elementwise(op, linear="sum", linear_inputs={0, 2})    # where(mask, value, self)


@register("aten._to_copy.default")
def to_copy(op: Op) -> Spec:
    return elementwise(op, linear="sum" if same_dtype(op) else "none")


@register("aten.threshold_backward.default", "aten.gelu_backward.default",
          "aten.silu_backward.default", "aten.tanh_backward.default",
          "aten.sigmoid_backward.default", "aten.native_dropout_backward.default",
          # activation backwards torch does not tag pointwise (so no fallback finds them)
          "aten.softplus_backward.default", "aten.elu_backward.default",
          "aten.hardtanh_backward.default", "aten.hardsigmoid_backward.default",
          "aten.hardswish_backward.default", "aten.leaky_relu_backward.default",
          "aten.mish_backward.default", "aten.softshrink_backward.default",
          "aten.hardshrink_backward.default", "aten.logit_backward.default")
def grad_times_local(op: Op) -> Spec:
    # grad_input = grad_output * f(saved): linear in the incoming gradient.
    return elementwise(op, linear="each", linear_inputs={0})


@register("aten.hardswish.default")
def untagged(op: Op) -> Spec:
    # elementwise and nonlinear, but not tagged pointwise (so the fallback misses it)
    return elementwise(op)


@register("aten.bernoulli_.float", "aten.native_dropout.default")
def random_mask(op: Op) -> Spec:
    # Elementwise; that every rank draws the same mask as the global op is the local forms'
    # business (RNG offsets), not the spec's.
    return elementwise(op)
