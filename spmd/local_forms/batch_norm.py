"""Batch norm by a micro-batch's own statistics: the kernel is told which micro-batch of
how many it runs, for its share of the running statistics (``ir/kernels/pipeline.py``)."""
from __future__ import annotations

from ...ir.core import Op
from ...ir.dist import micro_batch_dim
from .form_registry import register_local_form
from .guards import empty_guard
from .local_call import LocalCall, LocalContext


@register_local_form("autopar.micro_batch_norm")
def _micro_batch_norm(op: Op, ctx: LocalContext) -> LocalCall | None:
    empty = empty_guard(op, ctx)      # no channels here: the kernel refuses an empty input
    mb = micro_batch_dim(ctx.mesh)
    if empty is not None or mb is None:
        return empty
    k, m = ctx.coordinate[mb], ctx.mesh.shape[mb]
    return LocalCall(op.target, tuple(op.args[:5]) + (k, m), {},
                     f"statistics of micro-batch {k} of {m}")
