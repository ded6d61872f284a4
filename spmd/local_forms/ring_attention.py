"""Ring attention's blocks on a rank's rows (``ir/kernels/ring.py``): a causal block must
know which global chunk a rank's rows are (chunk ``i`` sees the keys of ring step ``j``
only when ``i >= j``), so the local call passes ``first``, the global index of the rank's
first chunk. A rank must hold whole chunks: rows that cut a chunk would need keys that
another rank holds."""
from __future__ import annotations

from ...ir.core import Op
from ...ir.dist import format_placements
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext, UnsupportedLocalForm

R = "autopar.ring_"


@register_local_form(R + "block.default", R + "block_backward.default")
def _rows(op: Op, ctx: LocalContext) -> LocalCall | None:
    chunk = schema_args(op)["chunk"]
    start, stop = ctx.out_bounds(op, 0)[2]
    if (start, stop) == (0, op.outputs[0].type.shape[2]):
        return None
    if start % chunk or (stop - start) % chunk:
        raise UnsupportedLocalForm(
            f"{op.target} ({op.module or 'top level'}): rows {start}..{stop} of the sequence "
            f"cut its ring chunks of {chunk} (placements "
            f"{format_placements(ctx.out_placements(0))} on {ctx.mesh}): ring attention "
            "needs the sequence split over the context-parallel axis alone")
    first = start // chunk
    return LocalCall(op.target, op.args, {**op.kwargs, "first": first},
                     f"ring chunks {first}..{stop // chunk - 1} of the sequence")
