"""Matrix products: a sharded contracted letter makes the result Partial(sum); each product
is linear in each operand separately, so one Partial operand passes through.

addmm/baddbmm add a bias: ``beta*bias + alpha*(a@b)``. Wherever the product comes out
Partial (a sharded contraction or a Partial operand) the bias must be Partial too, or every
rank would add it once: one rank keeps it, the others add zeros (R -> P is free). The einsum
engine cannot say "this input is Partial because the output is", so ``AffineProduct`` runs
it on the product and then gives the bias the output's Partial on those mesh dims.
"""
from __future__ import annotations

from typing import Sequence

from ...ir.core import Op
from ...ir.dist import DistAttr, Partial, ProcessMesh
from ..einsum import Decision, infer_forward, infer_reverse
from ..rule_registry import describe, output_types, register, tensor_inputs
from ..spec import Spec
from .common import broadcast_letters, input_letters

# Plain products: one spec each, linear in each operand.
_PRODUCTS = {"aten.mm.default": "mk,kn->mn", "aten.bmm.default": "bmk,bkn->bmn",
             "aten.mv.default": "mk,k->m", "aten.dot.default": "k,k->"}
for _target, _text in _PRODUCTS.items():
    register(_target)(lambda op, spec=Spec.parse(_text, linear="each"): spec)


class BiasedProduct:
    """A product plus a broadcast bias (``addmm``, a convolution with bias). Where the product
    comes out Partial (a sharded contracted dim), the bias must join as a Partial term too:
    one rank adds it (a make-partial step), or the sum would count it once per rank."""

    def spec(self, op: Op) -> Spec:
        raise NotImplementedError

    def bias_index(self, op: Op) -> int | None:
        """The bias's position among the tensor inputs (None: no bias)."""
        raise NotImplementedError

    def _types(self, op: Op):
        return [v.type for v in tensor_inputs(op)], output_types(op)

    def _bias_partial(self, op: Op, decision: Decision, mesh: ProcessMesh) -> Decision:
        i = self.bias_index(op)
        if i is None:
            return decision
        out, bias = decision.outputs[0], decision.needs[i]
        placements = tuple(o if isinstance(o, Partial) else p
                           for o, p in zip(out.placements, bias.placements))
        needs = list(decision.needs)
        needs[i] = DistAttr(mesh, placements)
        return Decision(tuple(needs), decision.outputs, decision.choices)

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available=None) -> Decision:
        ins, outs = self._types(op)
        decision = infer_forward(self.spec(op), mesh, ins, outs, in_dists, describe(op),
                                 available)
        return self._bias_partial(op, decision, mesh)

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        ins, outs = self._types(op)
        needs = infer_reverse(self.spec(op), mesh, ins, outs, out_hints, describe(op))
        # Replaying the operands' needs forward tells which mesh dims come out Partial.
        decision = infer_forward(self.spec(op), mesh, ins, outs, needs, describe(op),
                                 owe=False)
        return self._bias_partial(op, decision, mesh).needs


class AffineProduct(BiasedProduct):
    """``bias + a@b`` for a product spec like ``"mk,kn->mn"``; the bias broadcasts."""

    def __init__(self, product: str):
        self.product = Spec.parse(product)

    def spec(self, op: Op) -> Spec:
        a, b = self.product.inputs
        out = self.product.outputs[0]
        bias_shape = tensor_inputs(op)[0].type.shape
        bias = broadcast_letters(bias_shape, out, op.outputs[0].type.shape)
        ins = input_letters(op, {"self": bias, "mat1": a, "mat2": b, "batch1": a, "batch2": b})
        return Spec(ins, (out,), linear="each", linear_inputs={1, 2})

    def bias_index(self, op: Op) -> int | None:
        return 0


register("aten.addmm.default")(AffineProduct("mk,kn->mn"))
register("aten.baddbmm.default")(AffineProduct("bmk,bkn->bmn"))
