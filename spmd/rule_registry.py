"""The SPMD rule table: op target -> Rule (the JAX lesson: one registry per concern).

Most rules are an ``EinsumRule``: a function from the op (its args and value types) to a
``Spec``. Hand-written rules implement the same two methods. Pointwise ATen ops without an
entry are recognised by their ``torch.Tag.pointwise`` tag. A target with no rule returns
``None`` from ``lookup``; completion decides whether that is a warning or an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

from ..ir.core import Op, TensorType, Value
from ..ir.dist import DistAttr, ProcessMesh
from ..ir.ops import UnknownOpError, op_info
from .einsum import Decision, infer_forward, infer_reverse
from .spec import Spec


class Rule(Protocol):
    """``forward``: from the inputs' placements (None: not placed yet), the placement each
    input needs and each output gets. ``available`` lists, per input, placements the value
    is already being moved to for other consumers (reusing one costs nothing)."""

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available: Sequence[Collection[DistAttr]] | None = None) -> Decision: ...

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]: ...


def tensor_inputs(op: Op) -> list[Value]:
    """The op's tensor operands, in ``op.inputs`` order: what a Spec's inputs letter."""
    return [v for v in op.inputs if v.is_tensor]


def output_types(op: Op) -> list[TensorType | None]:
    return [v.type if v.is_tensor else None for v in op.outputs]


def describe(op: Op) -> str:
    return f"{op.target} ({op.module or 'top level'}, {op.role.value})"


@dataclass(frozen=True)
class EinsumRule:
    """A rule given by a Spec computed from the op."""

    spec_of: Callable[[Op], Spec]

    def spec(self, op: Op) -> Spec:
        return self.spec_of(op)

    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        return infer_forward(self.spec_of(op), mesh, [v.type for v in tensor_inputs(op)],
                             output_types(op), in_dists, describe(op), available)

    def reverse(self, op, out_hints, mesh) -> tuple[DistAttr, ...]:
        return infer_reverse(self.spec_of(op), mesh, [v.type for v in tensor_inputs(op)],
                             output_types(op), out_hints, describe(op))


RULES: dict[str, Rule] = {}
# Filled by rules/pointwise.py: a Spec for any op tagged pointwise that has no entry.
POINTWISE_FALLBACK: list[EinsumRule] = []


def register(*targets: str) -> Callable:
    """Register a spec function (``op -> Spec``) or a Rule object for ``targets``."""
    def add(rule_or_fn):
        rule = rule_or_fn if hasattr(rule_or_fn, "forward") else EinsumRule(rule_or_fn)
        for target in targets:
            if target in RULES:
                raise ValueError(f"SPMD rule for {target!r} registered twice")
            RULES[target] = rule
        return rule_or_fn
    return add


def lookup(op: Op) -> Rule | None:
    rule = RULES.get(op.target)
    if rule is None and POINTWISE_FALLBACK and _is_pointwise(op.target):
        rule = POINTWISE_FALLBACK[0]
    return rule


def _is_pointwise(target: str) -> bool:
    if not target.startswith("aten."):
        return False
    try:
        return op_info(target).pointwise
    except UnknownOpError:
        return False


__all__ = ["Rule", "EinsumRule", "RULES", "register", "lookup", "tensor_inputs",
           "output_types", "describe", "POINTWISE_FALLBACK"]
