"""Convolutions and max pooling. Letters: ``n`` batch, ``c`` input channels, ``o`` output
channels; spatial and kernel dims change size through the op, so they never shard (``1``).

A convolution is a product over input channels: sharded ``c`` (input and weight alike)
makes the output Partial(sum), and its bias then joins as a Partial term too, as in
``addmm`` (``BiasedProduct``). Sharded ``o`` (the weight's output channels) gives an
output sharded on channels: the colwise dim of a conv. Grouped convolutions keep channels
whole (a group's channels must meet). The backward is linear in the output gradient.
"""
from __future__ import annotations

from ...ir.core import Op
from ...ir.dist import DistAttr, Partial, ProcessMesh, Replicate, Shard
from ..einsum import Decision, infer_forward, infer_reverse
from ..rule_registry import describe, output_types, register, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters
from .common import schema_args
from .matmul import BiasedProduct


class Convolution(BiasedProduct):
    """``aten.convolution``: input [N, C, *s], weight [O, C/g, *k] ([C, O/g, *k] transposed),
    optional bias [O]."""

    def spec(self, op: Op) -> Spec:
        a = schema_args(op)
        spatial = len(a["input"].type.shape) - 2
        s = UNSHARDABLE * spatial
        grouped = a["groups"] != 1
        weight = _weight_letters(a["transposed"], grouped, s)
        ins = ["nc" + s, weight] + (["o"] if a["bias"] is not None else [])
        return Spec(tuple(ins), ("no" + s,), replicated={"c", "o", "d"} if grouped else set(),
                    linear="each", linear_inputs={0, 1})

    def bias_index(self, op: Op) -> int | None:
        return 2 if len(tensor_inputs(op)) == 3 else None


register("aten.convolution.default")(Convolution())


class ConvolutionBackward:
    """(grad_input, grad_weight, grad_bias) from grad_output, input and weight: grad_input
    sums over output channels, grad_weight and grad_bias over the batch. Linear in the
    output gradient only (the others give the shapes or the other factor).

    The spec letters every output from every input, but grad_bias reads only grad_output:
    a sharded input channel is no contraction for it. Its placement is grad_output's, summed
    over the batch (a batch shard makes it Partial, an output-channel shard shards it)."""

    def spec(self, op: Op) -> Spec:
        a = schema_args(op)
        s = UNSHARDABLE * (len(a["input"].type.shape) - 2)
        grouped = a["groups"] != 1
        weight = _weight_letters(a["transposed"], grouped, s)
        outs = tuple(None if t is None else letters_
                     for t, letters_ in zip(output_types(op), ("nc" + s, weight, "o")))
        return Spec(("no" + s, "nc" + s, weight), outs,
                    replicated={"c", "o", "d"} if grouped else set(), linear="each",
                    linear_inputs={0})

    def _with_bias_grad(self, op: Op, decision: Decision, mesh: ProcessMesh) -> Decision:
        if op.outputs[2].is_tensor is False or decision.outputs[2] is None:
            return decision
        grad = decision.needs[0].placements
        bias = tuple(Partial("sum") if p == Shard(0) else Shard(0) if p == Shard(1) else
                     p if isinstance(p, Partial) else Replicate() for p in grad)
        outputs = (*decision.outputs[:2], DistAttr(mesh, bias))
        return Decision(decision.needs, outputs, decision.choices)

    def forward(self, op: Op, in_dists, mesh: ProcessMesh, available=None) -> Decision:
        types = [v.type for v in tensor_inputs(op)], output_types(op)
        decision = infer_forward(self.spec(op), mesh, *types, in_dists, describe(op), available)
        return self._with_bias_grad(op, decision, mesh)

    def reverse(self, op: Op, out_hints, mesh: ProcessMesh) -> tuple[DistAttr, ...]:
        hints = list(out_hints) + [None] * (3 - len(out_hints))
        hints[2] = None    # grad_bias follows grad_output; it asks nothing of the others
        types = [v.type for v in tensor_inputs(op)], output_types(op)
        return infer_reverse(self.spec(op), mesh, *types, hints, describe(op))


register("aten.convolution_backward.default")(ConvolutionBackward())


def _weight_letters(transposed: bool, grouped: bool, s: str) -> str:
    """[O, C/g, *k], or [C, O/g, *k] transposed; grouped: dim 1 is a group's share (d)."""
    if grouped:
        return ("c" if transposed else "o") + "d" + s
    return ("co" if transposed else "oc") + s


def _pool_letters(rank: int) -> str:
    """Batch and channel dims pass through; the two pooled dims never shard."""
    return letters(rank - 2) + UNSHARDABLE * 2


@register("aten.max_pool2d_with_indices.default")
def max_pool2d(op: Op) -> Spec:
    x = _pool_letters(len(schema_args(op)["self"].type.shape))
    return Spec((x,), (x, x))


@register("aten.max_pool2d_with_indices_backward.default")
def max_pool2d_backward(op: Op) -> Spec:
    # the gradient goes back to where each max came from: linear in the output gradient
    x = _pool_letters(len(schema_args(op)["self"].type.shape))
    return Spec((x, x, x), (x,), linear="each", linear_inputs={0})
