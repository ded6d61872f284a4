"""Scaled dot-product attention, the fused ATen kernels (CPU flash, CUDA flash, efficient,
cuDNN) and their backward ops.

Letters: query ``bhle``, key ``bhse``, value ``bhsf``, output ``bhlf``, logsumexp ``bhl``,
mask/bias broadcast against ``bhls``. Batch, heads and the query's sequence shard; the
keys' sequence and the head dims stay whole (the softmax needs whole rows). A query
sequence split over ranks (context parallelism, ``context_parallel: {method: allgather}``)
makes each rank attend its rows to every key (the keys all-gathered); the gradients of the
keys and values are then partial sums over the ranks' rows. When key/value carry fewer heads
than query (grouped-query attention: query head ``i`` reads key head ``i // (H / G)``), the
heads still shard, but only evenly (an ``even`` letter of sizes H and G): piece ``r`` of
``n`` of the query heads then reads exactly piece ``r`` of the key heads, so each rank runs
grouped-query attention on its own heads. A dim whose size does not match its letter (a
padded logsumexp) is unshardable. The backward ops are linear in grad_out.

RNG state outputs (philox seed/offset) and other bookkeeping tensors carry no batch or head
dim; they are the same on every rank, not a Partial, so ``AttentionRule`` infers without
them and gives them Replicate.
"""
from __future__ import annotations

from typing import Sequence

from ...ir.core import Op
from ...ir.dist import DistAttr, ProcessMesh
from ..einsum import Decision, infer_forward, infer_reverse
from ..rule_registry import describe, register, tensor_inputs
from ..spec import UNSHARDABLE, Spec
from .common import broadcast_letters, input_letters, is_tensor, schema_args

AUX = "aux"     # an output that is replicated whatever the inputs' placements
MASK = "mask"   # lettered by broadcasting against bhls
A = "aten._scaled_dot_product_"
# Role letters per output, by target (None: not a tensor, e.g. max_q).
_OUTPUTS: dict[str, tuple[str | None, ...]] = {
    A + "flash_attention_for_cpu.default": ("bhlf", "bhl"),
    A + "flash_attention.default": ("bhlf", "bhl", None, None, None, None, AUX, AUX, "bhl1"),
    A + "efficient_attention.default": ("bhlf", "bhl", AUX, AUX),
    A + "cudnn_attention.default": ("bhlf", "bhl1", None, None, None, None, AUX, AUX, "bhl1"),
    A + "flash_attention_for_cpu_backward.default": ("bhle", "bhse", "bhsf"),
    A + "flash_attention_backward.default": ("bhle", "bhse", "bhsf"),
    A + "efficient_attention_backward.default": ("bhle", "bhse", "bhsf", MASK),
    A + "cudnn_attention_backward.default": ("bhle", "bhse", "bhsf"),
}
_INPUTS = {"query": "bhle", "key": "bhse", "value": "bhsf", "grad_out": "bhlf",
           "grad_out_": "bhlf", "out": "bhlf", "logsumexp": "bhl1"}


def _fit(shape: tuple[int, ...], role: str, sizes: dict[str, set[int]]) -> str:
    """The role's letters for a tensor of ``shape``; a dim of another size is ``1``."""
    return "".join(c if n in sizes.get(c, ()) else UNSHARDABLE for c, n in zip(role, shape))


class AttentionRule:
    def spec(self, op: Op) -> Spec:
        """The spec; aux outputs are lettered None, as if they were not tensors."""
        return self.spec_and_aux(op)[0]

    def spec_and_aux(self, op: Op) -> tuple[Spec, frozenset[int]]:
        """The spec, and the indices of the aux outputs."""
        a = schema_args(op)
        B, H, L, E = a["query"].type.shape
        _, G, S, _ = a["key"].type.shape
        grouped = G != H and G > 0 and H % G == 0
        sizes = dict(b={B}, h={H, G} if grouped else {H}, l={L}, s={S}, e={E},
                     f={a["value"].type.shape[-1]})
        # the query's sequence (l) may shard: each rank's rows attend to every key
        # (context parallelism; a causal mask is then offset by the rows' start:
        # ``local_forms/attention.py``); the keys' (s) stay whole
        whole = {"s", "e", "f"} | ({"h"} if G != H and not grouped else set())
        mask_shape = (B, H, L, S)

        def letter(name: str, t) -> str:
            if name in _INPUTS and len(_INPUTS[name]) >= len(t.type.shape):
                return _fit(t.type.shape, _INPUTS[name], sizes)
            if name in ("attn_mask", "attn_bias"):
                return broadcast_letters(t.type.shape, "bhls", mask_shape)
            return UNSHARDABLE * len(t.type.shape)     # rng state, cumulative lengths

        ins = input_letters(op, {n: letter(n, v) for n, v in a.items() if is_tensor(v)})
        outs, aux = [], set()
        for i, (v, role) in enumerate(zip(op.outputs, _OUTPUTS[op.target])):
            if not v.is_tensor:
                outs.append(None)
            elif role == MASK:
                outs.append(broadcast_letters(v.type.shape, "bhls", mask_shape))
            elif role == AUX or len(role) != len(v.type.shape):
                outs.append(None)                      # e.g. an empty debug mask
                aux.add(i)
            else:
                outs.append(_fit(v.type.shape, role, sizes))
        # (a key's or value's gradient sums over the query rows: rows split -> partial sums,
        # the default reduce)
        linear = "each" if op.target.endswith("_backward.default") else "none"
        spec = Spec(ins, tuple(outs), replicated=whole, even={"h"} if grouped else set(),
                    linear=linear, linear_inputs={0})
        return spec, frozenset(aux)

    def _types(self, op: Op, aux: frozenset[int]):
        outs = [None if i in aux or not v.is_tensor else v.type for i, v in enumerate(op.outputs)]
        return [v.type for v in tensor_inputs(op)], outs

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available=None) -> Decision:
        spec, aux = self.spec_and_aux(op)
        ins, outs = self._types(op, aux)
        d = infer_forward(spec, mesh, ins, outs, in_dists, describe(op), available)
        outputs = tuple(DistAttr.replicated(mesh) if i in aux else o
                        for i, o in enumerate(d.outputs))
        return Decision(d.needs, outputs, d.choices)

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        spec, aux = self.spec_and_aux(op)
        ins, outs = self._types(op, aux)
        hints = [None if i in aux else h for i, h in enumerate(out_hints)]
        return infer_reverse(spec, mesh, ins, outs, hints, describe(op))


register(*_OUTPUTS)(AttentionRule())
