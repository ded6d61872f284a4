"""Turn every way a user places tensors into pinned placements on the program's values:
``shard_tensor`` on parameters and inside forward, ``data_parallel.axis`` (inputs' batch
dim) and ``tensor_parallel.plan`` (module glob -> colwise / rowwise / vocab).

A plan style is resolved by what the captured graph does with the weight, not by its module
class: each dim of the weight is tried as the sharded one and pushed through the weight's
first forward use (through transposes and views, by the SPMD rules) to the op that consumes
it. Colwise is the dim that shards that op's last output dim; rowwise and vocab the dim that
makes it Partial. So a Conv1D that stores ``[in, out]`` gets the right dim, as does
``nn.Linear`` with ``[out, in]``.
"""
from __future__ import annotations

import fnmatch

from ..annotations import ANNOTATE_TARGET, decode
from ..ir import Op, OpKind, Program, StateKind, Value
from ..ir.dist import DistAttr, Partial, Placement, ProcessMesh, Replicate, Shard
from ..spmd import lookup
from ..spmd.registry import tensor_inputs
from .context import PassContext
from .explain import Reason


class AnnotationError(ValueError):
    """Annotations that contradict each other or the strategy."""


def annotate(program: Program, ctx: PassContext) -> Program:
    traced = _lower_traced_annotations(program)
    ctx.mesh = _settle_mesh(ctx, traced)
    if ctx.mesh is None:
        return program
    params = {op.attrs["name"]: op.result for op in program.states(StateKind.PARAM)}
    for op in traced:
        _pin(op.result, op.attrs["dist"], Reason("annotation", "shard_tensor in forward"))
    for name, dist in ctx.param_annotations.items():
        if name in params:
            _pin(params[name], dist, Reason("annotation", f"shard_tensor on parameter {name!r}"))
    _apply_plan(program, ctx, params)
    _apply_data_parallel(program, ctx)
    return program


def _trivial_dims_replicated(dist: DistAttr) -> DistAttr:
    """On a mesh dim of one rank every placement is the whole value: say R, so nothing
    downstream plans a no-op move."""
    return DistAttr(dist.mesh, tuple(Replicate() if n == 1 else p
                                     for p, n in zip(dist.placements, dist.mesh.shape)))


def _pin(value: Value, dist: DistAttr, why: Reason) -> None:
    dist = _trivial_dims_replicated(dist)
    if value.dist is not None and value.dist != dist:
        raise AnnotationError(f"{why.text} places a value at {dist}, but it is already "
                              f"placed at {value.dist} by {value.why.text}")
    value.dist, value.why = dist.check(value.type.shape), why


def _lower_traced_annotations(program: Program) -> list[Op]:
    """``autopar::annotate(x, "<json>")`` from the trace -> ``autopar.annotate(x)`` with the
    placement as a typed attribute."""
    found = []
    for op in program.ops:
        if op.kind is OpKind.CALL and op.target == ANNOTATE_TARGET:
            op.target = "autopar.annotate"
            op.attrs["dist"] = _trivial_dims_replicated(decode(op.args[1]))
            op.args = op.args[:1]
            found.append(op)
    return found


def _settle_mesh(ctx: PassContext, traced: list[Op]) -> ProcessMesh | None:
    meshes = [(f"shard_tensor on {n!r}", d.mesh) for n, d in ctx.param_annotations.items()]
    meshes += [(f"shard_tensor in {op.module or 'forward'}", op.attrs["dist"].mesh)
               for op in traced]
    mesh = ctx.strategy.process_mesh()
    if mesh is not None:
        meshes.insert(0, ("the strategy", mesh))
    if not meshes:
        return None
    first_where, first = meshes[0]
    for where, other in meshes[1:]:
        if other != first:
            raise AnnotationError(
                f"{where} uses {other}, but {first_where} uses {first}: a program runs on one "
                "mesh (placements across several meshes are pipeline stages)")
    return first


# -- tensor_parallel.plan -----------------------------------------------------------------

def _apply_plan(program: Program, ctx: PassContext, params: dict[str, Value]) -> None:
    tp = ctx.strategy.tensor_parallel
    if tp is None or not tp.plan:
        return
    axis = ctx.mesh.dim_index(tp.axis)
    users = program.users()
    for pattern, style in tp.plan.items():
        matched = {n: v for n, v in params.items()
                   if fnmatch.fnmatchcase(n.rpartition(".")[0], pattern)}
        if not matched:
            modules = sorted({n.rpartition(".")[0] for n in params})
            raise AnnotationError(
                f"tensor_parallel.plan entry {pattern!r} ({style}) matches no module with "
                f"parameters (a tied weight belongs to the module that registered it "
                f"first); modules are: {', '.join(modules[:40])}")
        for name, value in matched.items():
            if value.dist is not None:
                continue   # an explicit shard_tensor wins over the plan
            dim = _plan_dim(value, style, axis, ctx.mesh, users, name, pattern)
            placement = Replicate() if dim is None else Shard(dim)
            dist = DistAttr.replicated(ctx.mesh).with_placement(axis, placement)
            what = "replicated" if dim is None else f"dim {dim} sharded"
            _pin(value, dist, Reason("plan", f"tensor_parallel.plan {pattern!r}: {style}, "
                                             f"{what} on {tp.axis}"))


def _plan_dim(value: Value, style: str, axis: int, mesh: ProcessMesh,
              users: dict[Value, list[Op]], name: str, pattern: str) -> int | None:
    tried = []
    for dim in range(len(value.type.shape)):
        dist = DistAttr.replicated(mesh).with_placement(axis, Shard(dim))
        consumer, placed = _probe(value, dist, users)
        if consumer is None:
            break
        tried.append(f"dim {dim} -> {consumer.target} output {placed}")
        out_rank = len(consumer.outputs[0].type.shape)
        if style == "colwise" and placed == Shard(out_rank - 1):
            return dim
        if style in ("rowwise", "vocab") and isinstance(placed, Partial):
            return dim
    if style == "rowwise" and len(value.type.shape) == 1:
        return None   # a row-parallel bias is added once, after the reduction: replicated
    raise AnnotationError(
        f"tensor_parallel.plan {pattern!r}: cannot apply {style} to parameter {name!r} "
        f"{list(value.type.shape)}: no dim gives a {'sharded last output dim' if style == 'colwise' else 'partial output'} "
        f"at its first use ({'; '.join(tried) or 'it has no forward use'})")


def _probe(value: Value, dist: DistAttr, users: dict[Value, list[Op]]
           ) -> tuple[Op | None, Placement | None]:
    """Where sharding ``value`` as ``dist`` lands: follow its first forward use through
    single-input ops (transposes, views, casts) to the op that combines it with something
    else, and read from that op's spec what becomes of the sharded dim (an output dim, or
    a contracted one: Partial). Costs play no part: this asks what the graph does."""
    axis = next(i for i, p in enumerate(dist.placements) if not p.is_replicate())
    while True:
        consumer = next((op for op in users.get(value, ()) if op.kind is OpKind.CALL
                         and op.role.value == "fwd"), None)
        rule = lookup(consumer) if consumer is not None else None
        if rule is None:
            return None, None
        ins = tensor_inputs(consumer)
        if len(ins) == 1 and len(consumer.outputs) == 1:
            value, dist = consumer.outputs[0], rule.forward(consumer, [dist], dist.mesh).outputs[0]
            continue
        return consumer, _landing(consumer, rule, ins.index(value), dist, axis)


def _landing(op: Op, rule, index: int, dist: DistAttr, axis: int) -> Placement:
    placement = dist.placements[axis]
    if not isinstance(placement, Shard):
        return placement
    if hasattr(rule, "spec"):
        spec = rule.spec(op)
        letter = spec.inputs[index][placement.dim]
        out = spec.outputs[0]
        if letter in out:
            return Shard(out.index(letter))
        return Partial(spec.reduce[0]) if spec.shardable(letter) else Replicate()
    others = [dist if i == index else None for i in range(len(tensor_inputs(op)))]
    return rule.forward(op, others, dist.mesh).outputs[0].placements[axis]


# -- data_parallel ---------------------------------------------------------------------

def _apply_data_parallel(program: Program, ctx: PassContext) -> None:
    dp = ctx.strategy.data_parallel
    if dp is None or not dp.is_enabled:
        return
    axis = ctx.mesh.dim_index(dp.axis)
    for op in program.ops_of(OpKind.INPUT):
        value = op.outputs[0]
        if value.is_tensor and op.attrs["name"].startswith("batch/") and value.type.shape:
            if value.dist is None:
                _pin(value, DistAttr.replicated(ctx.mesh).with_placement(axis, Shard(0)),
                     Reason("data_parallel", f"data_parallel.axis {dp.axis}: batch dim 0"))
