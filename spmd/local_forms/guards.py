"""Guards for kernels that crash on the empty pieces uneven shards leave."""
from __future__ import annotations

import math

from ...ir.core import Op
from ...ir.ops import draws_random
from .context import LocalCall, LocalContext, UnsupportedLocalForm
from .registry import register_local_form

# ----------------------------------------------------------------------------------------
# kernels that crash on empty pieces (uneven shards leave trailing ranks empty)
# ----------------------------------------------------------------------------------------
# The CPU flash-attention kernels divide by the head count: an empty piece kills the process.
_EMPTY_UNSAFE = (
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
)


@register_local_form(*_EMPTY_UNSAFE)
def _empty_guard(op: Op, ctx: LocalContext) -> LocalCall | None:
    if draws_random(op) and any(ctx.out_sharded(i) for i in range(len(op.outputs))):
        raise UnsupportedLocalForm(f"{op.target} with dropout and sharded outputs: its "
                                   "dropout mask cannot be sliced from a global one")
    shapes = [ctx.out_shape(op, i) for i in range(len(op.outputs))]
    if not all(math.prod(s) == 0 for s in shapes):
        return None
    return LocalCall("autopar.empty_outputs", ([list(s) for s in shapes],
                                               [v.type.dtype for v in op.outputs]), {},
                     "every output is empty on this rank")
