"""Settle the mesh the program runs on, and its pipeline: the strategy's, or the one the
user's ``shard_tensor`` annotations use.

* Traced annotations (``autopar::annotate(x, "<json>")``) become ``autopar.annotate(x)``
  with the placement as a typed attribute (``DIST``).
* Without a pipeline the mesh is the strategy's, else the one every annotation uses (two
  meshes are refused: placements across several meshes are pipeline stages).
* A pipeline runs on its logical mesh (the stage mesh's dims plus ``mb``). Layers annotated
  on several meshes of one shape, with no strategy mesh, are stages (semi-auto), in the
  order the forward first uses each mesh. Annotations made on the strategy mesh or on a
  stage's mesh are moved onto the logical mesh; a stage's mesh also ties the value to that
  stage (``STAGE_HINT`` on an annotation op, ``param_stages`` for a parameter), which
  ``split_stages`` reads.

Makes ``PlanState.mesh``, ``pipeline``, ``param_placements`` and ``param_stages``.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.annotation import ANNOTATE_TARGET, decode
from ..ir.attrs import DIST, NAME
from ..ir.dist import DistAttr, ProcessMesh
from ..pass_infra.context import PassContext
from ..pass_infra.parallel_layout import pipeline_layout
from ..pass_infra.pinning import AnnotationError, trivial_dims_replicated
from ..pipeline.layout import PipelineLayout
from ..pipeline.phases import STAGE_HINT
from ..pipeline.schedules import check_schedule_args

__all__ = ["settle_mesh"]


def settle_mesh(program: Program, ctx: PassContext) -> Program:
    traced = _lower_traced_annotations(program)
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    pipeline = _settle_pipeline(ctx, traced, program, params)
    placements, stages = dict(ctx.inputs.param_annotations), {}
    if pipeline is not None:
        mesh = pipeline.logical_mesh
        placements, stages = _to_logical(ctx, pipeline, traced, placements)
    else:
        mesh = _settle_mesh(ctx, traced)
    ctx.state.settle_mesh(mesh, pipeline, placements, stages)
    return program


def _lower_traced_annotations(program: Program) -> list[Op]:
    """``autopar::annotate(x, "<json>")`` from the trace -> ``autopar.annotate(x)`` with the
    placement as a typed attribute."""
    found = []
    for op in program.ops:
        if op.kind is OpKind.CALL and op.target == ANNOTATE_TARGET:
            op.target = "autopar.annotate"
            op.attrs[DIST] = trivial_dims_replicated(decode(op.args[1]))
            op.args = op.args[:1]
            found.append(op)
    return found


def _annotated_meshes(ctx: PassContext, traced: list[Op]) -> list[tuple[str, ProcessMesh]]:
    meshes = [(f"shard_tensor on {n!r}", d.mesh) for n, d in ctx.inputs.param_annotations.items()]
    meshes += [(f"shard_tensor in {op.module or 'forward'}", op.attrs[DIST].mesh)
               for op in traced]
    return meshes


def _settle_mesh(ctx: PassContext, traced: list[Op]) -> ProcessMesh | None:
    meshes = _annotated_meshes(ctx, traced)
    if ctx.inputs.mesh is not None:
        meshes.insert(0, ("the strategy", ctx.inputs.mesh))
    if not meshes:
        return None
    first_where, first = meshes[0]
    for where, other in meshes[1:]:
        if other != first:
            raise AnnotationError(
                f"{where} uses {other}, but {first_where} uses {first}: a program runs on one "
                "mesh (placements across several meshes are pipeline stages)")
    return first


def _settle_pipeline(ctx: PassContext, traced: list[Op], program: Program,
                     params: dict[str, Value]) -> PipelineLayout | None:
    strategy = ctx.strategy
    pipeline = pipeline_layout(strategy, ctx.inputs.micro_batches)
    if pipeline is None and strategy.mesh is None and (
            strategy.pipeline is not None
            or len({m for _, m in _annotated_meshes(ctx, traced)}) > 1):
        pipeline = _stages_from_meshes(ctx, traced, program, params)
    return pipeline


def _stages_from_meshes(ctx: PassContext, traced: list[Op], program: Program,
                        params: dict[str, Value]) -> PipelineLayout:
    """Semi-auto pipelines: layers annotated on several meshes of one shape are stages, in
    the order the forward first uses each mesh."""
    position = {op: i for i, op in enumerate(program.ops)}
    users = program.users()
    first: dict[ProcessMesh, int] = {}
    for op in traced:
        first.setdefault(op.attrs[DIST].mesh, position[op])
    for name, dist in ctx.inputs.param_annotations.items():
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
    micro_batches = ctx.inputs.micro_batches
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


def _to_logical(ctx: PassContext, pipeline: PipelineLayout, traced: list[Op],
                annotations: dict[str, DistAttr]) -> tuple[dict[str, DistAttr], dict[str, int]]:
    """Annotations on the strategy mesh or a stage's mesh, moved onto the logical mesh; a
    stage's mesh also ties the value to that stage."""
    moved, stages = {}, {}
    for op in traced:
        op.attrs[DIST], hint = _translated(ctx, pipeline, op.attrs[DIST],
                                           f"shard_tensor in {op.module or 'forward'}")
        if hint is not None:
            op.attrs[STAGE_HINT] = hint
    for name, dist in annotations.items():
        moved[name], hint = _translated(ctx, pipeline, dist, f"shard_tensor on {name!r}")
        if hint is not None:
            stages[name] = hint
    return moved, stages


def _translated(ctx: PassContext, pipeline: PipelineLayout, dist: DistAttr,
                where: str) -> tuple[DistAttr, int | None]:
    try:
        moved, hint = pipeline.to_logical(dist, ctx.inputs.mesh)
    except ValueError as err:
        raise AnnotationError(f"{where}: {err}") from None
    return trivial_dims_replicated(moved), hint
