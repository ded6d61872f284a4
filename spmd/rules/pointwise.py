"""Elementwise ops: every output dim is one letter, inputs broadcast right-aligned (a size-1
dim under a larger one is the unshardable ``1``). Any ATen op tagged pointwise without an
entry gets the nonlinear spec through ``POINTWISE_FALLBACK``; the entries here are the ops
through which Partial inputs pass exactly.

Also the small helpers the other rule modules share: schema-named arguments and lettering
inputs in ``op.inputs`` order.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable, Mapping

import torch

from ...ir.core import Op, Value
from ..registry import POINTWISE_FALLBACK, EinsumRule, output_types, register, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters, pointwise_letters

# -- helpers shared by the rule modules ------------------------------------------------


@lru_cache(maxsize=None)
def _schema(target: str) -> torch.FunctionSchema:
    _, _, rest = target.partition(".")
    name, _, overload = rest.rpartition(".")
    return getattr(getattr(torch.ops.aten, name), overload)._schema


def _named(op: Op) -> list[tuple[str, Any]]:
    """(schema name, argument) for what the op was called with, in ``op.inputs`` order."""
    positional = [a.name for a in _schema(op.target).arguments if not a.kwarg_only]
    return list(zip(positional, op.args)) + list(op.kwargs.items())


def schema_args(op: Op) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (ATen targets only)."""
    given = dict(_named(op))
    return {a.name: given[a.name] if a.name in given
            else a.default_value if a.has_default_value() else None
            for a in _schema(op.target).arguments}


def is_tensor(x: Any) -> bool:
    return isinstance(x, Value) and x.is_tensor


def shape(x: Value) -> tuple[int, ...]:
    return x.type.shape


def input_letters(op: Op, by_name: Mapping[str, str]) -> tuple[str, ...]:
    """Letters of the tensor inputs in ``op.inputs`` order, given per schema argument name
    (a name may hold a list of tensors only if it is not lettered)."""
    result = []
    for name, arg in _named(op):
        if is_tensor(arg):
            result.append(by_name[name])
    if len(result) != len(tensor_inputs(op)):
        raise ValueError(f"{op.target}: cannot letter tensor inputs nested in lists")
    return tuple(result)


def broadcast_letters(shape_: tuple[int, ...], target: str, target_shape: tuple[int, ...]
                      ) -> str:
    """Letters of a tensor broadcast right-aligned against ``target_shape`` lettered
    ``target`` (a size-1 dim under a larger one is unshardable)."""
    offset = len(target_shape) - len(shape_)
    return "".join(UNSHARDABLE if n == 1 and target_shape[offset + i] != 1 else target[offset + i]
                   for i, n in enumerate(shape_))


def elementwise(op: Op, linear: str = "none", linear_inputs: Iterable[int] | None = None,
                **flags) -> Spec:
    """The pointwise spec of ``op``: outputs lettered ``abc..``, inputs right-aligned."""
    outs = output_types(op)
    out_shape = next(t.shape for t in outs if t is not None)
    ins = pointwise_letters([shape(v) for v in tensor_inputs(op)], out_shape)
    return Spec(tuple(ins), tuple(None if t is None else letters(len(t.shape)) for t in outs),
                linear=linear, linear_inputs=linear_inputs, **flags)


def same_dtype(op: Op, index: int = 0) -> bool:
    """Whether the op keeps the dtype of tensor input ``index`` (a cast rounds, so a sum of
    cast terms is not the cast of the sum)."""
    return tensor_inputs(op)[index].type.dtype == op.outputs[0].type.dtype


# -- rules ---------------------------------------------------------------------------------

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
          "aten.sigmoid_backward.default", "aten.native_dropout_backward.default")
def grad_times_local(op: Op) -> Spec:
    # grad_input = grad_output * f(saved): linear in the incoming gradient.
    return elementwise(op, linear="each", linear_inputs={0})


@register("aten.bernoulli_.float", "aten.native_dropout.default")
def random_mask(op: Op) -> Spec:
    # Elementwise; that every rank draws the same mask as the global op is the local forms'
    # business (RNG offsets), not the spec's.
    return elementwise(op)
