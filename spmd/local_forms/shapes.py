"""Shape-carrying ops (the shape argument is global) and position-dependent ones
(``arange``, ``tril``/``triu``)."""
from __future__ import annotations

from typing import Any

from ...ir.core import Op
from ...ir.dist import Shard, local_runs
from ...ir.ops import schema_args
from .form_registry import register_local_form
from .local_call import LocalCall, LocalContext


def _replace(seq: tuple, index: int, value: Any) -> tuple:
    return seq[:index] + (value,) + seq[index + 1:]


# ----------------------------------------------------------------------------------------
# shape-carrying ops: the shape argument becomes the rank's local output shape
# ----------------------------------------------------------------------------------------
# target -> (position of the shape argument, its keyword name)
SHAPE_ARGS: dict[str, tuple[int, str]] = {
    "aten.view.default": (1, "size"),
    "aten._unsafe_view.default": (1, "size"),
    "aten.reshape.default": (1, "shape"),
    "aten._reshape_alias.default": (1, "size"),
    "aten.expand.default": (1, "size"),
    "aten.new_zeros.default": (1, "size"),
    "aten.new_ones.default": (1, "size"),
    "aten.new_empty.default": (1, "size"),
    "aten.new_full.default": (1, "size"),
    "aten.zeros.default": (0, "size"),
    "aten.ones.default": (0, "size"),
    "aten.empty.memory_format": (0, "size"),
    "aten.full.default": (0, "size"),
    "aten.slice_backward.default": (1, "input_sizes"),
    "aten.select_backward.default": (1, "input_sizes"),
}


# A rank's pieces need not be laid out in memory as the traced values were (a collective
# returns a contiguous tensor where eager had a transposed view, and layout-keeping kernels
# such as CPU flash attention pass that on), so a view the trace could take may not exist.
# reshape is that same view whenever it exists, and a copy only where view would fail.
AS_RESHAPE = {"aten.view.default": "aten.reshape.default",
              "aten._unsafe_view.default": "aten.reshape.default"}


@register_local_form(*(t for t in SHAPE_ARGS if t != "aten.slice_backward.default"))
def _shape_arg(op: Op, ctx: LocalContext) -> LocalCall | None:
    """A shape argument is the global output shape; a rank makes its piece's shape. Only
    sharded outputs change (a Partial's terms have the global shape). Views become
    reshapes (see ``AS_RESHAPE``)."""
    target = AS_RESHAPE.get(op.target, op.target)
    if not ctx.out_sharded(0):
        if target == op.target:
            return None
        kwargs = {("shape" if k == "size" else k): v for k, v in op.kwargs.items()}
        return LocalCall(target, op.args, kwargs, "a view of any local layout")
    pos, name = SHAPE_ARGS[op.target]
    local = list(ctx.out_shape(op, 0))
    if op.target == "aten._reshape_alias.default":
        # its stride argument is global too: a fresh local view is contiguous
        return LocalCall("aten.view.default", (op.args[0], local), {},
                         "reshape to the local shape")
    if name in op.kwargs:
        kwargs = {k: v for k, v in op.kwargs.items() if k != name}
        kwargs[SHAPE_ARGS[target][1]] = local
        return LocalCall(target, op.args, kwargs, "local shape")
    return LocalCall(target, _replace(tuple(op.args), pos, local), dict(op.kwargs),
                     "local shape")


@register_local_form("aten.split.Tensor", "aten.split_with_sizes.default")
def _split(op: Op, ctx: LocalContext) -> LocalCall | None:
    """A split along a sharded dim (only along a grouped shard's group boundaries, see
    spmd/rules/views.py) cuts the rank's piece into the outputs' local pieces: the global
    split sizes become the local ones."""
    shape = [v for v in op.inputs if v.is_tensor][0].type.shape
    d = schema_args(op)["dim"] % len(shape)
    if not ctx.in_shard_mesh_dims(0, d):
        return None
    sizes = [ctx.out_shape(op, i)[d] for i in range(len(op.outputs))]
    return LocalCall("aten.split_with_sizes.default", (op.args[0], sizes, d), {},
                     "split into the local pieces")


def _local_bounds(shape, placements, ctx: LocalContext, d: int, start: int | None,
                  width: int) -> tuple[int, int]:
    """Where the global run ``[start, start + width)`` of dim ``d`` lies in the rank's piece
    of a tensor of ``shape`` placed ``placements``: how many of the piece's indices (its
    global runs, in order) lie below each bound."""
    size = shape[d]
    start = start or 0
    start = min(max(start + size if start < 0 else start, 0), size)
    runs = local_runs(shape, ctx.mesh, placements, ctx.coordinate)[d]
    below = lambda i: sum(max(0, min(b, i) - a) for a, b in runs)  # noqa: E731
    return below(start), below(start + width)


def _grouped_dim(placements, d: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == d and p.grouped for p in placements)


@register_local_form("aten.slice.Tensor")
def _slice(op: Op, ctx: LocalContext) -> LocalCall | None:
    """A slice of whole groups of a grouped shard (spmd/rules/views.py) is the slice of the
    rank's blocks of those groups: global bounds become positions in the piece."""
    value = [v for v in op.inputs if v.is_tensor][0]
    a = schema_args(op)
    d = a["dim"] % len(value.type.shape)
    if not _grouped_dim(ctx.needs[0].placements, d):
        return None
    lo, hi = _local_bounds(value.type.shape, ctx.needs[0].placements, ctx, d, a["start"],
                           op.outputs[0].type.shape[d])
    return LocalCall(op.target, (op.args[0], d, lo, hi, 1), {},
                     "slice of the local blocks of whole groups")


@register_local_form("aten.slice_backward.default")
def _slice_backward(op: Op, ctx: LocalContext) -> LocalCall | None:
    """Local input sizes (a shape argument); into a grouped shard (the gradient of a slice
    of whole groups) the bounds become positions in the rank's piece too."""
    a = schema_args(op)
    shape = op.outputs[0].type.shape
    d = a["dim"] % len(shape)
    if not _grouped_dim(ctx.out_placements(0), d):
        return _shape_arg(op, ctx)
    lo, hi = _local_bounds(shape, ctx.out_placements(0), ctx, d, a["start"],
                           [v for v in op.inputs if v.is_tensor][0].type.shape[d])
    return LocalCall(op.target, (op.args[0], list(ctx.out_shape(op, 0)), d, lo, hi, 1), {},
                     "gradient of a slice into the local blocks of its groups")


# ----------------------------------------------------------------------------------------
# position-dependent ops
# ----------------------------------------------------------------------------------------
_ARANGE = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


@register_local_form(*_ARANGE)
def _arange(op: Op, ctx: LocalContext) -> LocalCall | None:
    """A sharded range is the range of the piece: ``start + offset*step`` on."""
    if not ctx.out_sharded(0):
        return None
    a = schema_args(op)
    start, step = a.get("start") or 0, a.get("step") or 1
    (size,), (offset,) = ctx.out_offsets(op, 0)
    kwargs = {k: v for k, v in op.kwargs.items() if k not in ("start", "end", "step")}
    if "dtype" not in kwargs:
        # the global call infers its dtype from all of start/end/step; keep it
        kwargs["dtype"] = op.outputs[0].type.dtype
    return LocalCall("aten.arange.start_step",
                     (start + offset * step, start + (offset + size) * step, step), kwargs,
                     f"local range from offset {offset}")


@register_local_form("aten.tril.default", "aten.triu.default")
def _tril(op: Op, ctx: LocalContext) -> LocalCall | None:
    """The diagonal is global: a piece at (row r0, col c0) keeps ``j - i <= k + r0 - c0``."""
    if not ctx.out_sharded(0):
        return None
    _, offset = ctx.out_offsets(op, 0)
    row, col = offset[-2], offset[-1]
    if row == col:
        return None
    diagonal = schema_args(op)["diagonal"]
    return LocalCall(op.target, (op.args[0], diagonal + row - col), {},
                     f"diagonal shifted by {row - col}")
