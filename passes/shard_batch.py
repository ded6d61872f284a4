"""Pin the batch: every input and label is ``Shard(0)`` over the data-parallel mesh dim, then
over a pipeline's micro-batches (dp cuts the global batch, each dp piece is cut in turn)."""
from __future__ import annotations

from ..ir import OpKind, Program
from ..ir.attrs import NAME
from ..ir.dist import MICRO_BATCH_DIM, DistAttr, Shard
from ..ir.reason import Reason
from .context import PassContext
from .pinning import pin

__all__ = ["shard_batch"]


def shard_batch(program: Program, ctx: PassContext) -> Program:
    mesh, pipeline = ctx.state.mesh, ctx.state.pipeline
    if mesh is None:
        return program
    dist, why = DistAttr.replicated(mesh), []
    dp = ctx.strategy.data_parallel
    if dp is not None and dp.is_enabled:
        dist = dist.with_placement(dp.axis, Shard(0))
        why.append(f"data_parallel.axis {dp.axis}: batch dim 0")
    if pipeline is not None and pipeline.micro_batches > 1:
        dist = dist.with_placement(MICRO_BATCH_DIM, Shard(0))
        why.append(f"pipeline: {pipeline.micro_batches} micro-batches of each piece")
    if not why:
        return program
    for op in program.ops_of(OpKind.INPUT):
        value = op.outputs[0]
        if value.is_tensor and op.attrs[NAME].startswith("batch/") and value.type.shape:
            if value.dist is None:
                pin(value, dist, Reason("data_parallel", "; ".join(why)))
    return program
