"""Refuse sequence padding that a real position would read (``data: {seq_buckets |
pad_to_multiple}``).

The engine pads each batch's sequences at their end (``data/padding.py``); the loss
ignores the padded labels, and a position never reads a later one in a causal attention,
nor a masked one. An attention that is neither causal nor given a mask (an SDPA call with
``is_causal=False`` and no ``attn_mask``, ring attention's blocks likewise) lets every real
query read the padded keys: its results would change with the padding, so the plan is
refused, naming the module. (An attention written in plain ops reads the padding unless the
model masks it with the ``attention_mask`` the engine pads with 0: documented, not
detectable.)
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program
from ..ir.ops import schema_args
from ..pass_infra.context import PassContext

ATTENTION = "aten._scaled_dot_product_"
RING_BLOCK = "autopar.ring_block.default"
_MASKS = ("attn_mask", "attn_bias")


class PaddingReadError(ValueError):
    pass


def _reads_padding(op: Op) -> bool:
    if op.kind is not OpKind.CALL or not (op.target.startswith(ATTENTION)
                                          or op.target == RING_BLOCK):
        return False
    if op.target.endswith("_backward.default"):
        return False          # the forward op was checked
    a = schema_args(op)
    return not (a.get("is_causal") or a.get("causal")) and all(a.get(m) is None for m in _MASKS)


def refuse_unmasked_padding(program: Program, ctx: PassContext) -> Program:
    data = ctx.strategy.data
    if not data.pads_sequence:
        return program
    for op in program.ops:
        if _reads_padding(op):
            rule = (f"seq_buckets {list(data.seq_buckets)}" if data.seq_buckets
                    else f"pad_to_multiple {data.pad_to_multiple}")
            raise PaddingReadError(
                f"{op.target} in module '{op.module or 'top level'}': data.{rule} pads the "
                "sequences, and this attention is neither causal nor masked, so every real "
                "query would read the padded keys. Feed an attention_mask (padded with 0) "
                "the model turns into attn_mask, or drop the padding")
    return program
