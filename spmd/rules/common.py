"""Helpers the rule modules share: arguments by schema name, and lettering the tensor
inputs in ``op.inputs`` order (the order a Spec's inputs follow)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from ...ir.core import Op, Value
from ...ir.ops import given_args, schema_args  # noqa: F401  (schema_args: for the rules)
from ..rule_registry import output_types, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters, pointwise_letters


def is_tensor(x: Any) -> bool:
    return isinstance(x, Value) and x.is_tensor


def shape(x: Value) -> tuple[int, ...]:
    return x.type.shape


def input_letters(op: Op, by_name: Mapping[str, str]) -> tuple[str, ...]:
    """Letters of the tensor inputs in ``op.inputs`` order, given per schema argument name
    (a name may hold a list of tensors only if it is not lettered)."""
    result = []
    for name, arg in given_args(op):
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
