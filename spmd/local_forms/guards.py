"""Guards for kernels that crash on the empty pieces uneven shards leave."""
from __future__ import annotations

import math

from ...ir.attrs import MULTI
from ...ir.core import Op
from ...ir.ops import draws_random
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext, UnsupportedLocalForm

# ----------------------------------------------------------------------------------------
# kernels that crash on empty pieces (uneven shards leave trailing ranks empty)
# ----------------------------------------------------------------------------------------
# Kernels that refuse (or crash on) an empty piece: the CPU flash-attention kernels divide
# by the head count; convolution, pooling and batch norm kernels check their input is
# non-empty (a batch norm backward of no channels divides by zero).
# (The CPU flash-attention kernels' form, ``attention.py``, calls ``empty_guard`` first.)
_EMPTY_UNSAFE = (
    "aten.convolution.default",
    "aten.convolution_backward.default",
    "aten.max_pool2d_with_indices.default",
    "aten.max_pool2d_with_indices_backward.default",
    "autopar.micro_batch_norm_backward",    # (its forward's form, ``batch_norm.py``, too)
)


@register_local_form(*_EMPTY_UNSAFE)
def empty_guard(op: Op, ctx: LocalContext) -> LocalCall | None:
    if draws_random(op) and any(ctx.out_sharded(i) for i in range(len(op.outputs))):
        raise UnsupportedLocalForm(f"{op.target} with dropout and sharded outputs: its "
                                   "dropout mask cannot be sliced from a global one")
    shapes = [ctx.out_shape(op, i) if v.is_tensor else None for i, v in enumerate(op.outputs)]
    if not all(math.prod(s) == 0 for s in shapes if s is not None):
        return None
    single = len(op.outputs) == 1 and MULTI not in op.attrs    # the kernel returns a tensor
    return LocalCall("autopar.empty_outputs",
                     ([None if s is None else list(s) for s in shapes],
                      [v.type.dtype if v.is_tensor else None for v in op.outputs], single), {},
                     "every output is empty on this rank")
