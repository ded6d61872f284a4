"""Pin the batch: every input and label is ``Shard(batch dim)`` over the data-parallel mesh
dim, then over a pipeline's micro-batches (dp cuts the global batch, each dp piece is cut
in turn), and ``Shard(seq dim)`` over the context-parallel one. The batch dim is 0 unless
the strategy's ``batch_dim`` says otherwise, for all fed tensors or per tensor by its path
in the batch (``inputs.input_ids``, ``labels``)."""
from __future__ import annotations

from ..capture import BatchDimError, batch_dim_of
from ..ir import OpKind, Program
from ..ir.attrs import BATCH_PATH, NAME
from ..ir.dist import MICRO_BATCH_DIM, DistAttr, Shard
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pass_infra.pinning import pin

__all__ = ["shard_batch"]


def _check_paths(spec: int | dict[str, int], paths: list[str]) -> None:
    if not isinstance(spec, dict):
        return
    unknown = [p for p in spec if not any(q == p or q.startswith(p + ".") for q in paths)]
    if unknown:
        raise BatchDimError(f"batch_dim names {unknown}, which are not in the batch; its "
                            f"tensors are {paths}")


def shard_batch(program: Program, ctx: PassContext) -> Program:
    mesh, pipeline = ctx.state.mesh, ctx.state.pipeline
    if mesh is None:
        return program
    axes = []          # (mesh dim, why), dp first: it cuts the global batch
    dp = ctx.strategy.data_parallel
    if dp is not None and dp.is_enabled:       # several: each cuts the pieces of the one before
        axes += [(axis, f"data_parallel.axis {axis}") for axis in dp.mesh_axes]
    if pipeline is not None and pipeline.micro_batches > 1:
        axes.append((MICRO_BATCH_DIM, f"pipeline: {pipeline.micro_batches} micro-batches "
                                      "of each piece"))
    cp = ctx.strategy.context_parallel
    if not axes and cp is None:
        return program
    spec = ctx.strategy.batch_dim
    fed = [op for op in program.ops_of(OpKind.INPUT) if op.attrs[NAME].startswith("batch/")]
    _check_paths(spec, [op.attrs.get(BATCH_PATH, "") for op in fed])
    for op in fed:
        value = op.outputs[0]
        if not value.is_tensor or not value.type.shape or value.dist is not None:
            continue
        dim = batch_dim_of(spec, op.attrs.get(BATCH_PATH, ""), value.type.shape)
        dist = DistAttr.replicated(mesh)
        for axis, _ in axes:
            dist = dist.with_placement(axis, Shard(dim))
        why = "; ".join(f"{text}: batch dim {dim}" for _, text in axes)
        if cp is not None and len(value.type.shape) > cp.seq_dim != dim:
            dist = dist.with_placement(cp.axis, Shard(cp.seq_dim))
            why += ("; " if why else "") + f"context_parallel.axis {cp.axis}: seq dim " \
                f"{cp.seq_dim}"
        pin(value, dist, Reason("data_parallel", why))
    return program
