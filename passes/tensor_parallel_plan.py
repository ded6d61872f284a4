"""Pin the parameters a ``tensor_parallel.plan`` names (module glob -> colwise / rowwise /
vocab) on the tp mesh dim.

A plan style is resolved by what the captured graph does with the weight, not by its module
class: each dim of the weight is tried as the sharded one and pushed through the weight's
first forward use (through transposes and views, by the SPMD rules) to the op that consumes
it. Colwise is the dim that shards one of that op's output dims (a linear's last, a
convolution's channels); rowwise and vocab the dim that makes it Partial. So a Conv1D that
stores ``[in, out]`` gets the right dim, as does ``nn.Linear`` with ``[out, in]``, and a
``Conv2d`` weight ``[out, in, kh, kw]`` dim 0 for colwise, dim 1 for rowwise.

A fused colwise projection (one linear computing q, k and v, then ``split`` into equal
pieces along the sharded dim) is found the same way: when the op's output, followed through
single-input ops, is split along that dim into k equal pieces, the weight (and bias) is
sharded ``Shard(dim, groups=k)``, Megatron's interleaved layout: every rank holds its chunk
of each piece, so q, k and v come out of the split sharded by heads with no communication.
An explicit ``shard_tensor`` on a parameter wins over the plan.
"""
from __future__ import annotations

import fnmatch

from ..ir import Op, OpKind, Program, StateKind, Value
from ..ir.attrs import NAME
from ..ir.dist import DistAttr, Partial, Placement, ProcessMesh, Replicate, Shard
from ..ir.ops import schema_args
from ..ir.reason import Reason
from ..spmd import lookup
from ..spmd.registry import tensor_inputs
from ..spmd.spec import UNSHARDABLE
from .context import PassContext
from .pinning import AnnotationError, pin

__all__ = ["tensor_parallel_plan", "plan_entries"]


def tensor_parallel_plan(program: Program, ctx: PassContext) -> Program:
    tp = ctx.strategy.tensor_parallel
    mesh = ctx.state.mesh
    if mesh is None or tp is None or not tp.plan:
        return program
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    axis = mesh.dim_index(tp.axis)
    users = program.users()
    for pattern, style, matched in plan_entries(tp.plan, params):
        for name, value in matched.items():
            if value.dist is not None:
                continue   # an explicit shard_tensor wins over the plan
            dim, groups = _plan_dim(value, style, axis, mesh, users, name, pattern)
            placement = Replicate() if dim is None else Shard(dim, groups)
            dist = DistAttr.replicated(mesh).with_placement(axis, placement)
            what = ("replicated" if dim is None else f"dim {dim} sharded" + (
                f" in {groups} groups (its output is split in {groups} equal pieces)"
                if groups > 1 else ""))
            pin(value, dist, Reason("plan", f"tensor_parallel.plan {pattern!r}: {style}, "
                                            f"{what} on {tp.axis}"))
    return program


def plan_entries(plan: dict[str, str], params: dict[str, Value]
                  ) -> list[tuple[str, str, dict[str, Value]]]:
    """(pattern, style, the parameters of the modules it matches) per plan entry."""
    entries = []
    for pattern, style in plan.items():
        matched = {n: v for n, v in params.items()
                   if fnmatch.fnmatchcase(n.rpartition(".")[0], pattern)}
        if not matched:
            modules = sorted({n.rpartition(".")[0] for n in params})
            raise AnnotationError(
                f"tensor_parallel.plan entry {pattern!r} ({style}) matches no module with "
                f"parameters (a tied weight belongs to the module that registered it "
                f"first); modules are: {', '.join(modules[:40])}")
        entries.append((pattern, style, matched))
    return entries


def _plan_dim(value: Value, style: str, axis: int, mesh: ProcessMesh,
              users: dict[Value, list[Op]], name: str, pattern: str
              ) -> tuple[int | None, int]:
    """(the weight dim the style shards or None: replicated, its groups)."""
    tried = []
    for dim in range(len(value.type.shape)):
        dist = DistAttr.replicated(mesh).with_placement(axis, Shard(dim))
        consumer, placed = _probe(value, dist, users)
        if consumer is None:
            break
        if placed is None:
            tried.append(f"its first forward use, {consumer.target} "
                         f"({consumer.module or 'top level'}), has no SPMD rule")
            break
        tried.append(f"dim {dim} -> {consumer.target} output {placed}")
        if style == "colwise" and isinstance(placed, Shard):
            return dim, _fused_pieces(consumer, placed, axis, mesh, users)
        if style in ("rowwise", "vocab") and isinstance(placed, Partial):
            return dim, 1
    if style == "rowwise" and len(value.type.shape) == 1:
        return None, 1   # a row-parallel bias is added once, after the reduction: replicated
    raise AnnotationError(
        f"tensor_parallel.plan {pattern!r}: cannot apply {style} to parameter {name!r} "
        f"{list(value.type.shape)}: no dim gives a "
        f"{'sharded output dim' if style == 'colwise' else 'partial output'} "
        f"at its first use ({'; '.join(tried) or 'it has no forward use'})")


def _probe(value: Value, dist: DistAttr, users: dict[Value, list[Op]]
           ) -> tuple[Op | None, Placement | None]:
    """Where sharding ``value`` as ``dist`` lands: follow its first forward use through
    single-input ops (transposes, views, casts) to the op that combines it with something
    else, and read from that op's spec what becomes of the sharded dim (an output dim, or
    a contracted one: Partial). Costs play no part: this asks what the graph does. A consumer
    without an SPMD rule comes back with no placement."""
    axis = next(i for i, p in enumerate(dist.placements) if not p.is_replicate())
    while True:
        consumer = next((op for op in users.get(value, ()) if op.kind is OpKind.CALL
                         and op.role.value == "fwd"), None)
        if consumer is None:
            return None, None
        rule = lookup(consumer)
        if rule is None:
            return consumer, None
        ins = tensor_inputs(consumer)
        if len(ins) == 1 and len(consumer.outputs) == 1:
            value, dist = consumer.outputs[0], rule.forward(consumer, [dist], dist.mesh).outputs[0]
            continue
        return consumer, _landing(consumer, rule, ins.index(value), dist, axis)


_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default")


def _fused_pieces(consumer: Op, placed: Shard, axis: int, mesh: ProcessMesh,
                  users: dict[Value, list[Op]]) -> int:
    """k when the colwise op's output, followed through single-input ops, is split along
    its sharded dim into k > 1 equal pieces (a fused qkv projection); else 1. Only the
    first forward use is followed, as the style probe does."""
    value = consumer.outputs[0]
    dist = DistAttr.replicated(mesh).with_placement(axis, placed)
    while True:
        op = next((u for u in users.get(value, ()) if u.kind is OpKind.CALL
                   and u.role.value == "fwd"), None)
        rule = lookup(op) if op is not None else None
        if rule is None or len(tensor_inputs(op)) != 1:
            return 1
        shard = dist.placements[axis]
        if op.target in _SPLITS:
            d = _dim_arg(op, len(value.type.shape))
            pieces = {o.type.shape[d] for o in op.outputs}
            return (len(op.outputs) if isinstance(shard, Shard) and shard.dim == d
                    and len(op.outputs) > 1 and len(pieces) == 1 else 1)
        if len(op.outputs) != 1:
            return 1
        value, dist = op.outputs[0], rule.forward(op, [dist], mesh).outputs[0]
        if not dist.placements[axis].is_shard():
            return 1


def _dim_arg(op: Op, ndim: int) -> int:
    return schema_args(op)["dim"] % ndim


def _landing(op: Op, rule, index: int, dist: DistAttr, axis: int) -> Placement:
    placement = dist.placements[axis]
    if not isinstance(placement, Shard):
        return placement
    if hasattr(rule, "spec"):
        spec = rule.spec(op)
        letter = spec.inputs[index][placement.dim]
        out = spec.outputs[0]
        if letter == UNSHARDABLE:
            return Replicate()
        if letter in out:
            return Shard(out.index(letter))
        return Partial(spec.reduce[0]) if spec.shardable(letter) else Replicate()
    others = [dist if i == index else None for i in range(len(tensor_inputs(op)))]
    return rule.forward(op, others, dist.mesh).outputs[0].placements[axis]
