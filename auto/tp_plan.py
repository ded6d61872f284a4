"""The ILP's parameter placements as a ``tensor_parallel.plan`` (module -> colwise / rowwise /
vocab), when they are expressible so: a user can read, keep and edit that plan in YAML.

Each module with a sharded parameter gets the first style whose placements
(``passes.tensor_parallel_plan.style_placement``: what the plan pass would pin) equal the
ILP's for every one of its parameters; modules left replicated get no entry. Not
expressible: shards on more than one mesh dim, or a module no style reproduces (the reason
names it).
"""
from __future__ import annotations

from collections import defaultdict

from ..ir import Program, StateKind
from ..ir.attrs import NAME
from ..ir.dist import DistAttr, ProcessMesh
from ..pass_infra.pinning import AnnotationError
from ..passes.tensor_parallel_plan import style_placement

__all__ = ["tensor_parallel_plan_of", "nearest_tensor_parallel_plan"]

STYLES = ("colwise", "rowwise", "vocab")


def tensor_parallel_plan_of(program: Program, params: dict[str, DistAttr], mesh: ProcessMesh
                            ) -> tuple[dict[str, str] | None, str]:
    """(plan, "") when ``params`` (name -> placement) is a plan on one mesh dim, else
    (None, why not)."""
    axes = {m for d in params.values() for m, p in enumerate(d.placements)
            if not p.is_replicate()}
    if len(axes) > 1:
        return None, f"parameters are sharded on several mesh dims of {mesh}"
    if not axes:
        return {}, ""
    axis = axes.pop()
    values = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    modules: dict[str, list[str]] = defaultdict(list)
    for name in params:
        modules[name.rpartition(".")[0]].append(name)
    users, plan = program.users(), {}
    for module, names in sorted(modules.items()):
        if all(params[n].placements[axis].is_replicate() for n in names):
            continue
        style = next((s for s in STYLES if _reproduces(s, names, params, values, axis, mesh,
                                                       users)), None)
        if style is None:
            chosen = ", ".join(f"{n} {params[n]}" for n in names)
            return None, f"no plan style gives module {module!r} its placements ({chosen})"
        plan[module] = style
    return plan, ""


def nearest_tensor_parallel_plan(program: Program, params: dict[str, DistAttr],
                                 mesh: ProcessMesh) -> tuple[dict[str, str] | None, list[str]]:
    """The plan closest to ``params`` when no plan is exact: each module with a sharded
    parameter gets the first style that shards the same dims of its parameters over the
    same mesh dim, grouped or not (the ILP's candidates lack the grouped shards a fused qkv
    needs: it picks ``S(0)`` where colwise's ``S(0)x3`` keeps heads whole); failing that, the
    style that cuts the module's largest parameter (its weight) as the ILP did; failing that
    the module is left replicated. (None, why) when the shards span several mesh dims; the
    notes list each module taken inexactly or left out."""
    plan, why = tensor_parallel_plan_of(program, params, mesh)
    if plan is not None or len({m for d in params.values() for m, p in enumerate(d.placements)
                                if not p.is_replicate()}) > 1:
        return plan, [why] if plan is None else []
    axis = next(m for d in params.values() for m, p in enumerate(d.placements)
                if not p.is_replicate())
    values = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    modules: dict[str, list[str]] = defaultdict(list)
    for name in params:
        modules[name.rpartition(".")[0]].append(name)
    users, plan, notes = program.users(), {}, []
    for module, names in sorted(modules.items()):
        if all(params[n].placements[axis].is_replicate() for n in names):
            continue
        exact = next((s for s in STYLES if _reproduces(s, names, params, values, axis, mesh,
                                                       users)), None)
        style = exact or next((s for s in STYLES if _same_dims(s, names, params, values, axis,
                                                               mesh, users)), None)
        # no style cuts all of them so: the one that cuts the largest (the weight) so, the
        # others as the style pins them (a rowwise bias replicated, not the ILP's shard)
        largest = max(names, key=lambda n: values[n].type.numel)
        style = style or next((s for s in STYLES if _same_dims(s, [largest], params, values,
                                                                axis, mesh, users)), None)
        if style is None:
            notes.append(f"{module}: no plan style shards it as the ILP chose "
                         f"({largest} {params[largest]}): left replicated")
            continue
        if exact is None:
            notes.append(f"{module}: the ILP's {_placements(names, params)} taken as {style}")
        plan[module] = style
    return plan, notes


def _placements(names: list[str], params: dict[str, DistAttr]) -> str:
    """``weight S(1), bias S(0)``: the ILP's placements of a module's parameters."""
    return ", ".join(f"{n.rpartition('.')[2]} {','.join(map(str, params[n].placements))}"
                     for n in names)


def _same_dims(style, names, params, values, axis, mesh, users) -> bool:
    def dim(d: DistAttr):
        p = d.placements[axis]
        return None if p.is_replicate() else getattr(p, "dim", "other")
    try:
        return all(dim(style_placement(values[n], style, axis, mesh, users, n)) == dim(params[n])
                   for n in names)
    except AnnotationError:
        return False


def _reproduces(style, names, params, values, axis, mesh, users) -> bool:
    try:
        return all(style_placement(values[n], style, axis, mesh, users, n) == params[n]
                   for n in names)
    except AnnotationError:
        return False
