"""Split the program into pipeline stages: which stage computes each forward, loss and
backward op (``op.attrs[STAGE]``).

The forward is cut, in program order, at the op where each stage begins:

* ``pipeline.split: [blocks.2, ...]`` — the first op of each named module;
* ``split: auto`` — between layers (the items of the model's ``ModuleList`` or
  ``Sequential`` such as ``blocks.3``; with fewer layers than stages, or none, also between
  its top-level child modules), choosing the cuts that make the costliest stage cheapest, a
  stage's cost being the FLOPs of its forward ops and of the backward ops that
  differentiate them;
* layers annotated on several meshes (semi-auto) — where the forward first uses the next
  stage's mesh.

Forward ops that compute from the state alone (amp O2's half casts of the parameters, at
the top of the step) are no point of the forward's order: each runs on the first stage that
reads it, so a stage casts its own weights instead of receiving them. The loss runs on the
last stage; a backward op runs on the stage of the forward op it differentiates. Every
other op (comm, optimizer, state, gradient sums) is placed later, by
``assign_phases``, near the values it reads or the ops that need it.
"""
from __future__ import annotations

import re

from ..ir import Op, OpKind, Program, Role
from ..ir.attrs import NAME
from ..pass_infra.context import PassContext
from ..pipeline.flops import op_flops
from ..pipeline.phases import STAGE, STAGE_HINT

_LAYER = re.compile(r"^(.*\.)?\d+$")


class StageSplitError(ValueError):
    """The model cannot be cut into the stages the strategy asks for."""


def split_stages(program: Program, ctx: PassContext) -> Program:
    layout = ctx.state.pipeline
    if layout is None:
        return program
    of_state = _state_only(program)
    forward = [op for op in program.ops if op.kind is OpKind.CALL and op.role is Role.FORWARD
               and op not in of_state]
    if not forward:
        raise StageSplitError("pipeline: the program has no forward ops to cut into stages")
    if layout.split == "meshes":
        starts = _starts_from_meshes(forward, ctx)
    elif layout.split == "auto":
        starts = _balanced_starts(program, forward, layout.stages)
    else:
        starts = _starts_from_names(forward, layout.split)
    _check_starts(starts, forward, layout.stages)
    stage = 0
    for i, op in enumerate(forward):
        while stage < len(starts) and starts[stage] <= i:
            stage += 1
        op.attrs[STAGE] = stage
    last = layout.stages - 1
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role is Role.LOSS:
            op.attrs[STAGE] = last
    _with_first_reader(of_state, program)
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role is Role.BACKWARD and op.forward_op is not None \
                and STAGE in op.forward_op.attrs:
            op.attrs[STAGE] = op.forward_op.attrs[STAGE]
    return program


def _state_only(program: Program) -> list[Op]:
    """The forward calls whose tensor inputs all come from the state, directly or through
    other such calls (a parameter's half cast), in program order."""
    derived: set = set()
    found = []
    for op in program.ops:
        if op.kind is OpKind.STATE:
            derived.update(op.outputs)
        elif op.kind is OpKind.CALL and op.role is Role.FORWARD:
            tensors = [v for v in op.inputs if v.is_tensor]
            if tensors and all(v in derived for v in tensors):
                derived.update(op.outputs)
                found.append(op)
    return found


def _with_first_reader(ops: list[Op], program: Program) -> None:
    """Each of ``ops`` on the lowest stage among its forward and loss readers (last op
    first, so a chain of casts follows its end); one with none stays on stage 0."""
    readers: dict = {}
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role in (Role.FORWARD, Role.LOSS):
            for v in op.inputs:
                readers.setdefault(v, []).append(op)
    for op in reversed(ops):
        stages = [r.attrs[STAGE] for v in op.outputs for r in readers.get(v, ())
                  if STAGE in r.attrs]
        op.attrs[STAGE] = min(stages, default=0)


def _check_starts(starts: list[int], forward: list[Op], stages: int) -> None:
    if len(starts) != stages - 1:
        raise StageSplitError(f"pipeline: {stages} stages need {stages - 1} cut points, "
                              f"found {len(starts)}")
    if starts and starts[0] == 0:
        raise StageSplitError(f"pipeline: stage 0 would hold no forward op (stage 1 begins "
                              f"at the first op, {_where(forward[0])})")
    for a, b in zip(starts, starts[1:]):
        if b <= a:
            raise StageSplitError(f"pipeline: stage boundaries must follow the forward's "
                                  f"order; {_where(forward[b])} does not come after "
                                  f"{_where(forward[a])}")


def _where(op: Op) -> str:
    return f"{op.target.removesuffix('.default')} in {op.module or 'the top-level module'}"


def _inside(op: Op, module: str) -> bool:
    return op.module == module or op.module.startswith(module + ".")


# -- pipeline.split: module names --------------------------------------------------------

def _starts_from_names(forward: list[Op], names: tuple[str, ...]) -> list[int]:
    starts = []
    for name in names:
        found = next((i for i, op in enumerate(forward) if _inside(op, name)), None)
        if found is None:
            modules = sorted({op.module for op in forward if op.module})
            raise StageSplitError(
                f"pipeline.split module {name!r} runs no op in the forward; modules that do "
                f"are: {', '.join(_layers_or_all(modules)[:40])}")
        starts.append(found)
    return starts


def _layers_or_all(modules: list[str]) -> list[str]:
    tops = sorted({_layer_of(m) for m in modules if _layer_of(m)})
    return tops or modules


# -- split by annotated meshes ---------------------------------------------------------------

def _starts_from_meshes(forward: list[Op], ctx: PassContext) -> list[int]:
    """The first forward op tied to each stage: an op of a module whose parameter is
    annotated on that stage's mesh (a tied weight read by another module, the output head,
    ties only its own module), or an annotation on it. Stages come in the forward's order."""
    hints: list[tuple[int, int, Op]] = []
    for i, op in enumerate(forward):
        hint = op.attrs.get(STAGE_HINT)
        if hint is None:
            hint = next((ctx.state.param_stages[name] for v in op.inputs
                         if v.producer is not None and v.producer.kind is OpKind.STATE
                         and (name := v.producer.attrs[NAME]) in ctx.state.param_stages
                         and _inside(op, name.rpartition(".")[0])), None)
        if hint is not None:
            hints.append((i, hint, op))
    starts, current, last_op = [], 0, None
    for i, hint, op in hints:
        if hint < current:
            raise StageSplitError(
                f"pipeline stages from annotated meshes: {_where(op)} is on stage {hint}'s "
                f"mesh but runs after {_where(last_op)} on stage {current}'s; a pipeline's "
                "stages run in the forward's order")
        while current < hint:
            current += 1
            starts.append(i)
        last_op = op
    return starts


# -- split: auto ---------------------------------------------------------------------------

def _layer_of(module: str) -> str:
    """The outermost ``ModuleList``/``Sequential`` item a module path is inside ('' if none)."""
    parts = module.split(".")
    for k in range(1, len(parts) + 1):
        prefix = ".".join(parts[:k])
        if _LAYER.match(prefix):
            return prefix
    return ""


def _starts(forward: list[Op], unit) -> dict[str, int]:
    """The first forward op of each unit (a layer, a top-level child), by unit name."""
    seen: dict[str, int] = {}
    for i, op in enumerate(forward):
        name = unit(op.module)
        if name and name not in seen:
            seen[name] = i
    return seen


def _candidates(forward: list[Op], stages: int) -> tuple[list[int], list[str]]:
    """Where a cut may go: the first op of every layer but the first; with too few layers
    for the stages (or none), also of every top-level child module (the embedding, the
    head, a layer that is not in a list)."""
    layers = _starts(forward, _layer_of)
    if len(layers) >= stages:
        return sorted(layers.values())[1:], list(layers)
    children = _starts(forward, lambda m: m.split(".")[0] if m else "")
    units = {**children, **layers}
    starts = sorted(set(units.values()))
    return starts[1:], sorted(units, key=units.get)


def _balanced_starts(program: Program, forward: list[Op], stages: int) -> list[int]:
    if stages == 1:
        return []
    candidates, units = _candidates(forward, stages)
    if len(candidates) < stages - 1:
        raise StageSplitError(
            f"pipeline: {stages} stages but the model has {len(units) or 'no'} layers and "
            f"top-level modules to cut between "
            f"({', '.join(units[:12]) or 'no ModuleList items or child modules'}); "
            "use fewer stages (ranks x vpp_chunks), or list where stages begin in "
            "pipeline.split")
    costs = _forward_costs(program, forward)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # the loss (and its backward) runs on the last stage
    tail = sum(op_flops(op) for op in program.ops
               if op.kind is OpKind.CALL and op.role is Role.LOSS) * 3
    return _linear_partition(candidates, prefix, stages, tail)


def _forward_costs(program: Program, forward: list[Op]) -> list[float]:
    """Each forward op's FLOPs plus those of the backward ops that differentiate it."""
    cost = {op: op_flops(op) for op in forward}
    for op in program.ops:
        if op.role is Role.BACKWARD and op.forward_op in cost:
            cost[op.forward_op] += op_flops(op)
    return [cost[op] for op in forward]


def _linear_partition(candidates: list[int], prefix: list[float], stages: int,
                      tail: float) -> list[int]:
    """The ``stages - 1`` cuts among ``candidates`` (forward op indices) that minimise the
    costliest stage; ``prefix[i]`` is the cost of forward ops before ``i``."""
    points = [0] + candidates + [len(prefix) - 1]
    n = len(points)

    def cost(a: int, b: int) -> float:   # stage from point a to point b
        extra = tail if b == n - 1 else 0.0
        return prefix[points[b]] - prefix[points[a]] + extra

    inf = float("inf")
    # best[s][b]: the costliest of s stages covering points[0]..points[b]
    best = [[inf] * n for _ in range(stages + 1)]
    back = [[0] * n for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for b in range(1, n):
            for a in range(s - 1, b):
                value = max(best[s - 1][a], cost(a, b))
                if value < best[s][b]:
                    best[s][b], back[s][b] = value, a
    cuts, b = [], n - 1
    for s in range(stages, 0, -1):
        b = back[s][b]
        cuts.append(points[b])
    return sorted(cuts)[1:]
