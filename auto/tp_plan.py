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
from ..passes.pinning import AnnotationError
from ..passes.tensor_parallel_plan import style_placement

__all__ = ["tensor_parallel_plan_of"]

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


def _reproduces(style, names, params, values, axis, mesh, users) -> bool:
    try:
        return all(style_placement(values[n], style, axis, mesh, users, n) == params[n]
                   for n in names)
    except AnnotationError:
        return False
