"""Turn every way a user places tensors into pinned placements on the program's values:
``shard_tensor`` on parameters and inside forward, ``data_parallel.axis`` (inputs' batch
dim) and ``tensor_parallel.plan`` (module glob -> colwise / rowwise / vocab).

A plan style is resolved by what the captured graph does with the weight, not by its module
class: each dim of the weight is tried as the sharded one and pushed through the weight's
first forward use (through transposes and views, by the SPMD rules) to the op that consumes
it. Colwise is the dim that shards that op's last output dim; rowwise and vocab the dim that
makes it Partial. So a Conv1D that stores ``[in, out]`` gets the right dim, as does
``nn.Linear`` with ``[out, in]``.

A fused colwise projection (one linear computing q, k and v, then ``split`` into equal
pieces along the sharded dim) is found the same way: when the op's output, followed through
single-input ops, is split along that dim into k equal pieces, the weight (and bias) is
sharded ``Shard(dim, groups=k)``, Megatron's interleaved layout: every rank holds its chunk
of each piece, so q, k and v come out of the split sharded by heads with no communication.

``tensor_parallel.sequence_parallel`` (Megatron-SP) adds activation annotations: each output
of a rowwise or vocab module (the value the module hands to the rest of the forward) is
pinned ``Shard(sequence_dim)`` on the tp mesh dim, other mesh dims left to the producer.
Those outputs are Partial(sum), so reshard writes a reduce-scatter where TP alone would
all-reduce later; completion carries the sequence shard through the residual adds, dropout
and LayerNorm (their rules shard token dims), and the next colwise matmul, whose flattened
input may not keep the sequence dim sharded, gathers it. The backward follows by the same
rules: the gather's gradient is a reduce-scatter and the reduce-scatter's a gather.
"""
from __future__ import annotations

import fnmatch

from ..ir.annotation import ANNOTATE_TARGET, decode
from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.dist import (MICRO_BATCH_DIM, DistAttr, Partial, Placement, ProcessMesh, Replicate,
                       Shard, micro_batch_dim)
from ..pipeline.layout import PipelineLayout
from ..pipeline.schedules import check_schedule_args
from ..spmd import lookup
from ..spmd.registry import tensor_inputs
from .context import PassContext
from ..ir.reason import Reason
from ..ir.attrs import DIST, NAME, ORIGIN, PINNED_DIMS
from ..pipeline.phases import STAGE_HINT


class AnnotationError(ValueError):
    """Annotations that contradict each other or the strategy."""


def annotate(program: Program, ctx: PassContext) -> Program:
    traced = _lower_traced_annotations(program)
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    ctx.mesh = _settle_mesh(ctx, traced, program, params)
    if ctx.mesh is None:
        return program
    annotations = dict(ctx.param_annotations)
    if ctx.pipeline is not None:
        annotations = _to_logical(ctx, traced, annotations)
    for op in traced:
        _pin(op.result, op.attrs[DIST], Reason("annotation", "shard_tensor in forward"))
    for name, dist in annotations.items():
        if name in params:
            _pin(params[name], dist, Reason("annotation", f"shard_tensor on parameter {name!r}"))
    for name, dist in ctx.kept_placements.items():
        if name in params and params[name].dist is None:
            _pin(params[name], _rebased(dist, ctx.mesh),
                 Reason("annotation", f"parameter {name!r} kept where an earlier program "
                                      "placed it"))
    _apply_plan(program, ctx, params)
    _apply_sequence_parallel(program, ctx, params)
    _apply_batch_sharding(program, ctx)
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
            op.attrs[DIST] = _trivial_dims_replicated(decode(op.args[1]))
            op.args = op.args[:1]
            found.append(op)
    return found


def _settle_mesh(ctx: PassContext, traced: list[Op], program: Program,
                 params: dict[str, Value]) -> ProcessMesh | None:
    meshes = [(f"shard_tensor on {n!r}", d.mesh) for n, d in ctx.param_annotations.items()]
    meshes += [(f"shard_tensor in {op.module or 'forward'}", op.attrs[DIST].mesh)
               for op in traced]
    if ctx.pipeline is None and ctx.strategy.mesh is None and (
            ctx.strategy.pipeline is not None or len({m for _, m in meshes}) > 1):
        ctx.pipeline = _stages_from_meshes(ctx, traced, program, params)
    if ctx.pipeline is not None:
        if ctx.micro_batches is not None:
            ctx.pipeline = ctx.pipeline.with_micro_batches(ctx.micro_batches)
        return ctx.pipeline.logical_mesh
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


# -- pipelines ------------------------------------------------------------------------------

def _stages_from_meshes(ctx: PassContext, traced: list[Op], program: Program,
                        params: dict[str, Value]) -> PipelineLayout:
    """Semi-auto pipelines: layers annotated on several meshes of one shape are stages, in
    the order the forward first uses each mesh."""
    position = {op: i for i, op in enumerate(program.ops)}
    users = program.users()
    first: dict[ProcessMesh, int] = {}
    for op in traced:
        first.setdefault(op.attrs[DIST].mesh, position[op])
    for name, dist in ctx.param_annotations.items():
        uses = [position[u] for u in users.get(params.get(name), ()) if u.role is Role.FORWARD]
        if uses:
            first[dist.mesh] = min(first.get(dist.mesh, uses[0]), min(uses))
    pipe = ctx.strategy.pipeline
    if len(first) < 2:
        raise AnnotationError(
            f"the strategy has a pipeline section ({pipe.describe() if pipe else ''}) but no "
            "mesh: its stages come from the meshes layers are annotated on, and "
            f"{'only one mesh is' if first else 'no mesh is'} used; annotate each stage's "
            "layers with shard_tensor on its own mesh, or give the strategy a mesh with the "
            "pipeline axis")
    meshes = sorted(first, key=first.get)
    micro_batches = pipe.micro_batches if pipe is not None else 1
    schedule = pipe.schedule if pipe is not None else "FThenB"
    if pipe is not None and pipe.vpp_chunks > 1:
        raise AnnotationError("pipeline schedule VPP needs a strategy mesh with the pipeline "
                              "axis: stages annotated on meshes are one chunk per rank")
    try:
        layout = PipelineLayout.from_stage_meshes(meshes, micro_batches, schedule)
        check_schedule_args(schedule, layout.ranks, micro_batches, 1)
    except ValueError as err:
        raise AnnotationError(f"pipeline stages from annotated meshes: {err}") from None
    return layout


def _to_logical(ctx: PassContext, traced: list[Op],
                annotations: dict[str, DistAttr]) -> dict[str, DistAttr]:
    """Annotations on the strategy mesh or a stage's mesh, moved onto the logical mesh; a
    stage's mesh also ties the value to that stage (``_stage_hint``, ``ctx.param_stages``)."""
    strategy_mesh = ctx.strategy.process_mesh()
    moved = {}
    for op in traced:
        op.attrs[DIST], hint = _translated(ctx, op.attrs[DIST], strategy_mesh,
                                             f"shard_tensor in {op.module or 'forward'}")
        if hint is not None:
            op.attrs[STAGE_HINT] = hint
    for name, dist in annotations.items():
        moved[name], hint = _translated(ctx, dist, strategy_mesh, f"shard_tensor on {name!r}")
        if hint is not None:
            ctx.param_stages[name] = hint
    return moved


def _translated(ctx: PassContext, dist: DistAttr, strategy_mesh: ProcessMesh | None,
                where: str) -> tuple[DistAttr, int | None]:
    try:
        moved, hint = ctx.pipeline.to_logical(dist, strategy_mesh)
    except ValueError as err:
        raise AnnotationError(f"{where}: {err}") from None
    return _trivial_dims_replicated(moved), hint


def _rebased(dist: DistAttr, mesh: ProcessMesh) -> DistAttr:
    """A kept placement made on another program's logical mesh (another micro-batch count)
    on this one: state is replicated over micro-batches, the other dims are the same."""
    if dist.mesh == mesh or micro_batch_dim(dist.mesh) is None or micro_batch_dim(mesh) is None:
        return dist
    return DistAttr(mesh, tuple(dist.placements[:-1]) + (Replicate(),))


# -- tensor_parallel.plan -----------------------------------------------------------------

def _apply_plan(program: Program, ctx: PassContext, params: dict[str, Value]) -> None:
    tp = ctx.strategy.tensor_parallel
    if tp is None or not tp.plan:
        return
    axis = ctx.mesh.dim_index(tp.axis)
    users = program.users()
    for pattern, style, matched in _plan_entries(tp.plan, params):
        for name, value in matched.items():
            if value.dist is not None:
                continue   # an explicit shard_tensor wins over the plan
            dim, groups = _plan_dim(value, style, axis, ctx.mesh, users, name, pattern)
            placement = Replicate() if dim is None else Shard(dim, groups)
            dist = DistAttr.replicated(ctx.mesh).with_placement(axis, placement)
            what = ("replicated" if dim is None else f"dim {dim} sharded" + (
                f" in {groups} groups (its output is split in {groups} equal pieces)"
                if groups > 1 else ""))
            _pin(value, dist, Reason("plan", f"tensor_parallel.plan {pattern!r}: {style}, "
                                             f"{what} on {tp.axis}"))


def _plan_entries(plan: dict[str, str], params: dict[str, Value]
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
        tried.append(f"dim {dim} -> {consumer.target} output {placed}")
        out_rank = len(consumer.outputs[0].type.shape)
        if style == "colwise" and placed == Shard(out_rank - 1):
            return dim, _fused_pieces(consumer, placed, axis, mesh, users)
        if style in ("rowwise", "vocab") and isinstance(placed, Partial):
            return dim, 1
    if style == "rowwise" and len(value.type.shape) == 1:
        return None, 1   # a row-parallel bias is added once, after the reduction: replicated
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
    d = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)
    return d % ndim


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


# -- tensor_parallel.sequence_parallel -------------------------------------------------

# Roles of the ops that make a value a module's output when they read it from outside the
# module; a backward op reading it uses a saved activation, which is not what it returns.
_FORWARD_ROLES = (Role.FORWARD, Role.LOSS)


def _apply_sequence_parallel(program: Program, ctx: PassContext,
                             params: dict[str, Value]) -> None:
    tp = ctx.strategy.tensor_parallel
    if tp is None or not tp.sequence_parallel:
        return
    axis = ctx.mesh.dim_index(tp.axis)
    if ctx.mesh.shape[axis] == 1:
        return   # one rank on tp: every shard is the whole value
    modules = {n.rpartition(".")[0]: (pattern, style)
               for pattern, style, matched in _plan_entries(tp.plan, params)
               if style in ("rowwise", "vocab") for n in matched}
    if not modules:
        raise AnnotationError(
            f"tensor_parallel.sequence_parallel on {tp.axis} of {ctx.mesh}: the plan has no "
            f"rowwise or vocab entry, so no activation leaves a parallel region to be "
            f"sequence-sharded (plan: {dict(tp.plan)})")
    dist = DistAttr.replicated(ctx.mesh).with_placement(axis, Shard(tp.sequence_dim))
    users = program.users()
    for module, (pattern, style) in sorted(modules.items()):
        exits = _module_outputs(program, module, users)
        if not exits:
            raise AnnotationError(
                f"tensor_parallel.sequence_parallel: {style} module {module!r} (plan "
                f"{pattern!r}) hands no tensor to the rest of the forward")
        for value in exits:
            _check_sequence_dim(value, module, tp.sequence_dim, tp.axis, ctx.mesh, axis)
            _annotate_activation(program, value, dist, axis, module, users)


def _inside(op: Op, module: str) -> bool:
    return op.module == module or op.module.startswith(module + ".")


def _module_outputs(program: Program, module: str, users: dict[Value, list[Op]]
                    ) -> list[Value]:
    """The forward tensors ``module`` computes that forward ops outside it (or the program
    results) read: what the module returns, in program order."""
    found = []
    for op in program.ops:
        if op.kind is not OpKind.CALL or op.role is not Role.FORWARD or not _inside(op, module):
            continue
        for v in op.outputs:
            if v.is_tensor and any(
                    u.kind is OpKind.OUTPUT
                    or (u.role in _FORWARD_ROLES and not _inside(u, module))
                    for u in users.get(v, ())):
                found.append(v)
    return found


def _check_sequence_dim(value: Value, module: str, dim: int, axis_name: str,
                        mesh: ProcessMesh, axis: int) -> None:
    shape, ranks = list(value.type.shape), mesh.shape[axis]
    where = (f"tensor_parallel.sequence_parallel: the output of {module!r} {value.type} "
             f"on {mesh}")
    if dim >= len(shape):
        raise AnnotationError(
            f"{where} has no sequence_dim {dim} to shard over {axis_name} (rank "
            f"{len(shape)}); set tensor_parallel.sequence_dim to the sequence dim of the "
            f"activations, or leave this module out of the plan's rowwise/vocab entries")
    if shape[dim] % ranks:
        raise AnnotationError(
            f"{where}: sequence length {shape[dim]} (dim {dim}) is not divisible by the "
            f"{ranks} ranks of {axis_name}; sequence parallelism needs equal sequence "
            f"shards (pad the sequence to a multiple of {ranks})")


def _annotate_activation(program: Program, value: Value, dist: DistAttr, axis: int,
                         module: str, users: dict[Value, list[Op]]) -> None:
    """Route every reader of ``value`` through an ``autopar.annotate`` that pins the tp mesh
    dim: the forward's next layer and the backward ops that saved it alike, so the
    activation is held sequence-sharded (Megatron-SP's memory saving)."""
    readers = list(users.get(value, ()))
    note = Op(OpKind.CALL, "autopar.annotate", (value,), outputs=[Value(value.type)],
              role=Role.FORWARD, module=module,
              attrs={DIST: dist, PINNED_DIMS: (axis,), ORIGIN: "sequence_parallel"})
    program.insert_after(value.producer, note)
    pinned = note.result
    for op in readers:
        op.map_inputs(lambda v: pinned if v is value else v)
    users[pinned] = readers
    users[value] = [note]


# -- data_parallel ---------------------------------------------------------------------

def _apply_batch_sharding(program: Program, ctx: PassContext) -> None:
    """The batch dim of every input and label: Shard(0) over data parallel ranks, then over a
    pipeline's micro-batches (dp cuts the global batch, each dp piece is cut in turn)."""
    dist, why = DistAttr.replicated(ctx.mesh), []
    dp = ctx.strategy.data_parallel
    if dp is not None and dp.is_enabled:
        dist = dist.with_placement(dp.axis, Shard(0))
        why.append(f"data_parallel.axis {dp.axis}: batch dim 0")
    if ctx.pipeline is not None and ctx.pipeline.micro_batches > 1:
        dist = dist.with_placement(MICRO_BATCH_DIM, Shard(0))
        why.append(f"pipeline: {ctx.pipeline.micro_batches} micro-batches of each piece")
    if not why:
        return
    for op in program.ops_of(OpKind.INPUT):
        value = op.outputs[0]
        if value.is_tensor and op.attrs[NAME].startswith("batch/") and value.type.shape:
            if value.dist is None:
                _pin(value, dist, Reason("data_parallel", "; ".join(why)))
