"""Helpers for rule tests: build one IR op from a target and example argument types, and
write placements as text (``"S(0),R"``)."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autopar.ir.core import Op, OpKind, TensorType, Value
from autopar.ir.dist import DistAttr, ProcessMesh, parse_placements
from autopar.ir.from_fx import value_type
from autopar.ir.ops import resolve
from autopar.spmd import lookup

F32 = torch.float32
MESH1 = ProcessMesh([0, 1, 2, 3], dim_names=["x"])
MESH2 = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


def T(*shape: int, dtype: torch.dtype = F32) -> TensorType:
    return TensorType(tuple(shape), dtype)


def make_op(target: str, *args, **kwargs) -> Op:
    """An IR call op of ``target``; TensorType arguments become Values. Output types come
    from running the ATen overload on meta tensors; outputs that are not tensors (None, an
    int) stay in the op as non-tensor values, as lowering makes them."""
    to_value = lambda a: Value(a) if isinstance(a, TensorType) else a  # noqa: E731
    args, kwargs = pytree.tree_map(to_value, (args, kwargs))
    to_meta = lambda a: torch.empty(a.type.shape, dtype=a.type.dtype, device="meta") \
        if isinstance(a, Value) else a  # noqa: E731
    margs, mkwargs = pytree.tree_map(to_meta, (args, kwargs))
    out = resolve(target)(*margs, **mkwargs)
    leaves = list(out) if isinstance(out, (tuple, list)) else [out]
    return Op(OpKind.CALL, target, args, kwargs, [Value(value_type(t)) for t in leaves])


def dist(mesh: ProcessMesh, text: str | None) -> DistAttr | None:
    return None if text is None else DistAttr(mesh, parse_placements(text))


def text(d: DistAttr | None) -> str | None:
    return None if d is None else ",".join(str(p) for p in d.placements)


def forward(op: Op, mesh: ProcessMesh, *placements: str | None) -> tuple[list, list]:
    """(needs, outputs) as placement text for the given input placement texts."""
    rule = lookup(op)
    assert rule is not None, f"no rule for {op.target}"
    d = rule.forward(op, [dist(mesh, p) for p in placements], mesh)
    return [text(x) for x in d.needs], [text(x) for x in d.outputs]


def reverse(op: Op, mesh: ProcessMesh, *out_placements: str | None) -> list:
    rule = lookup(op)
    assert rule is not None, f"no rule for {op.target}"
    return [text(x) for x in rule.reverse(op, [dist(mesh, p) for p in out_placements], mesh)]
