"""Attention on a rank's rows of the query (context parallelism): a causal mask must know
where the rows start. The fused kernels' ``is_causal`` aligns the mask to the rank's own
query rows (row 0 of its piece would see key 0 only), so a rank whose rows start at ``r0``
calls the kernel without ``is_causal`` and with the explicit mask of global rows
``r0 .. r1`` (``autopar.causal_rows_attention``, ``ir/kernels/sharded.py``)."""
from __future__ import annotations

from ...ir.core import Op
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .guards import empty_guard
from .local_call import LocalCall, LocalContext, UnsupportedLocalForm

A = "aten._scaled_dot_product_"
CPU_FLASH = A + "flash_attention_for_cpu.default"
CPU_FLASH_BACKWARD = A + "flash_attention_for_cpu_backward.default"
OTHERS = (A + "flash_attention.default", A + "efficient_attention.default",
          A + "cudnn_attention.default", A + "flash_attention_backward.default",
          A + "efficient_attention_backward.default", A + "cudnn_attention_backward.default")


def _rows(op: Op, ctx: LocalContext, index: int) -> tuple[int, int] | None:
    """The global query rows of this rank's piece (None: all of them, nothing to offset)."""
    length = op.outputs[index].type.shape[2]
    start, stop = ctx.out_bounds(op, index)[2]
    return None if (start, stop) == (0, length) else (start, stop)


@register_local_form(CPU_FLASH, CPU_FLASH_BACKWARD)
def _causal_rows(op: Op, ctx: LocalContext) -> LocalCall | None:
    empty = empty_guard(op, ctx)           # these kernels crash on an empty piece
    if empty is not None:
        return empty
    a = schema_args(op)
    index = 0     # the output (forward) or the query's gradient (backward): rows bhl.
    rows = _rows(op, ctx, index)
    if not a.get("is_causal") or rows is None:
        return None
    if a.get("dropout_p", 0.0):
        raise UnsupportedLocalForm(f"{op.target} ({op.module or 'top level'}): attention "
                                   "dropout with the query's sequence split is not supported")
    if a.get("attn_mask") is not None:
        raise UnsupportedLocalForm(f"{op.target} ({op.module or 'top level'}): is_causal with "
                                   "an attn_mask as well")
    key_length = a["key"].type.shape[2]
    return LocalCall("autopar.causal_rows_attention",
                     (op.target, rows, key_length, *op.args), dict(op.kwargs),
                     f"causal rows {rows[0]}..{rows[1]} of the sequence")


@register_local_form(*OTHERS)
def _unsupported(op: Op, ctx: LocalContext) -> LocalCall | None:
    a = schema_args(op)
    if a.get("is_causal") and _rows(op, ctx, 0) is not None:
        raise UnsupportedLocalForm(
            f"{op.target} ({op.module or 'top level'}): a causal attention with the query's "
            "sequence split (context parallelism) runs on the CPU flash kernel only so far; "
            "this kernel takes no explicit mask to offset")
    return None
