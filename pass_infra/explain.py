"""Why a value has its placement: the record completion leaves on every value, and the text
forms of it (one line per value for the dump; a chain back to the annotations for one).

Reasons name values by the printer's names, so an explanation reads next to the dump.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import OpKind, Program, Role, Value
from ..ir.attrs import NAME
from ..ir.dist import MICRO_BATCH_DIM, local_shape
from ..ir.printer import value_names
from ..ir.reason import MeshDimChoice, Reason
from ..reshard.comm import BUCKET_STEPS, FOR_ROLE, FOR_TARGET, RESHARD_STEP
from ..reshard.traffic import collective, reshard_bytes
from ..spmd import lookup


def describe_reason(why: Reason, names: dict[Value, str], mesh_dims: tuple[str, ...]) -> str:
    """One line: the reason's sentence, the rule's spec (for a rule's choice), the values it
    was made from and, per contested mesh dim, what was chosen over what at which price."""
    text = why.text
    rule = lookup(why.op) if why.kind == "rule" and why.op is not None else None
    if hasattr(rule, "spec"):   # name the letters the choices below refer to
        text += f" [{rule.spec(why.op)}]"
    if why.sources:
        text += " from " + ", ".join(f"{names.get(v, '?')} {_placements(v)}"
                                     for v in why.sources)
    contested = [c for c in why.choices if c.alternatives]
    if contested:
        text += "; " + "; ".join(_choice(c, mesh_dims) for c in contested)
    return text


def _placements(v: Value) -> str:
    return "{?}" if v.dist is None else "{" + ",".join(str(p) for p in v.dist.placements) + "}"


def _choice(c: MeshDimChoice, mesh_dims: tuple[str, ...]) -> str:
    others = ", ".join(f"{opt} {_bytes(cost)}" for opt, cost in c.alternatives)
    return f"on {mesh_dims[c.mesh_dim]} chose {c.chosen} ({_bytes(c.cost)}) over {others}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _mesh_dims(program: Program) -> tuple[str, ...]:
    for op in program.ops:
        for v in op.outputs:
            if v.dist is not None:
                return v.dist.mesh.dim_names
    return ()


def format_explanations(program: Program) -> str:
    """One line per placed value: ``%12 {S(0),R}: <reason>``."""
    names = value_names(program)
    dims = _mesh_dims(program)
    lines = []
    for op in program.ops:
        for v in op.outputs:
            if v.why is not None:
                lines.append(f"{names[v]} {_placements(v)}: {describe_reason(v.why, names, dims)}")
    return "\n".join(lines) + "\n"


SHORT_LINES = 10        # the most lines of explain's answer without ``depth``
ROOT_KINDS = ("annotation", "plan", "data_parallel")     # the user's decisions
_KIND_TEXT = {"annotation": "an annotation", "plan": "a strategy plan entry",
              "data_parallel": "the data_parallel section", "rule": "the op's SPMD rule",
              "no_rule": "no SPMD rule for the op: the replicate fallback",
              "consumer": "as its consumer wants it", "default": "replicated by default",
              "reshard": "a collective inserted by reshard", "merge": "gradient merge"}


def explain_value(program: Program, what: str, depth: int = 0) -> str:
    """Why one value has its placement. ``what`` is a printed name (``%12``), a result slot
    (``grad[fc1.weight]``, ``loss``) or a state/input name.

    The answer comes first, in at most ``SHORT_LINES`` lines: the placement, the rule or
    step that made it (and the pass that recorded it), what it was made from and the
    annotations and strategy choices it traces back to. ``depth`` > 0 adds the chain of
    reasons behind it, value by value, ``depth`` levels deep. Only sources that are sharded
    or partial are followed: a replicated input constrains nothing, so it is named in its
    consumer's line and not expanded."""
    if depth < 0:
        raise ValueError(f"explain: depth {depth} must be >= 0 (0: the short answer only)")
    names = value_names(program)
    value = _find(program, names, what)
    dims = _mesh_dims(program)
    chain = _chain(value)
    lines = _short_answer(value, what, names, chain)
    if depth > 0:
        lines.append(f"the reasons behind it, value by value ({depth} deep):")
        lines += _chain_lines(value, names, dims, depth)
    return "\n".join(lines) + "\n"


def _chain(value: Value) -> dict[Value, int]:
    """Every value the placement of ``value`` was decided from (itself at 0), with its
    depth, closest first: its sharded or partial sources, theirs, and so on."""
    found, frontier = {value: 0}, [value]
    while frontier:
        nxt = []
        for v in frontier:
            for source in _followed(v):
                if source not in found:
                    found[source] = found[v] + 1
                    nxt.append(source)
        frontier = nxt
    return found


def _followed(v: Value) -> list[Value]:
    sources = v.why.sources if v.why is not None else ()
    return [s for s in sources if s.dist is not None and not s.dist.is_replicated]


def _short_answer(v: Value, what: str, names: dict[Value, str],
                  chain: dict[Value, int]) -> list[str]:
    """At most ``SHORT_LINES`` lines: placement, maker, rule, choice, sources, roots, hint."""
    name = names[v]
    where = f"{v.dist.mesh.short()}" if v.dist is not None else "no mesh"
    head = what if what == name else f"{what} is {name}"
    lines = [f"{head}: {v.type} {_placements(v)} on {where}"]
    if v.why is None:
        return lines + ["  not placed: a serial program, or asked before completion ran"]
    why = v.why
    lines.append(f"  placement: {_in_words(v)}")
    lines.append(f"  made by:   pass '{why.made_by or '?'}' at {_where(v)}")
    lines.append(f"  rule:      {_rule_text(why)} ({_KIND_TEXT.get(why.kind, why.kind)})")
    contested = [c for c in why.choices if c.alternatives]
    if contested:
        dims = v.dist.mesh.dim_names
        lines.append("  choice:    " + "; ".join(_choice(c, dims) for c in contested))
    if why.sources:
        shown = [f"{names.get(s, '?')} {_placements(s)} {_where(s)}" for s in why.sources[:3]]
        more = f" (+{len(why.sources) - 3} more)" if len(why.sources) > 3 else ""
        lines.append("  from:      " + ", ".join(shown) + more)
    room = SHORT_LINES - len(lines) - (1 if len(chain) > 1 else 0)
    lines += _roots(v, chain, room, _subject(v, what))
    if len(chain) > 1:
        lines.append(f"  why each step: depth=N (--depth N) shows the chain behind it "
                     f"({len(chain)} values, {max(chain.values())} deep)")
    return lines


def _rule_text(why: Reason) -> str:
    """The reason's sentence and, for a rule's choice, the rule's spec."""
    rule = lookup(why.op) if why.kind == "rule" and why.op is not None else None
    return why.text + (f" [{rule.spec(why.op)}]" if hasattr(rule, "spec") else "")


def _in_words(v: Value) -> str:
    """Each mesh dim's placement in words: ``dp R (replicated), tp S(0) (dim 0 sharded)``."""
    words = []
    for dim, p in zip(v.dist.mesh.dim_names, v.dist.placements):
        meaning = ("replicated" if p.is_replicate() else
                   f"dim {p.dim} sharded" if p.is_shard() else
                   f"partial {p.op}: each rank holds a term")
        words.append(f"{dim} {p} ({meaning})")
    return ", ".join(words)


def _roots(v: Value, chain: dict[Value, int], room: int, subject: str) -> list[str]:
    """The annotations and strategy choices (plan entries, data_parallel) the placement
    traces back to, in at most ``room`` lines: first the most relevant one for each mesh
    dim (about the same module as ``subject``, then the closest), then the others."""
    best: dict[str, tuple[tuple[int, int], Value]] = {}
    for u in chain:
        if u is not v and u.why is not None and u.why.kind in ROOT_KINDS:
            key = (-_shared_prefix(subject, _subject(u)), chain[u])
            if u.why.text not in best or key < best[u.why.text][0]:
                best[u.why.text] = (key, u)
    ordered = [u for _, u in sorted(best.values(), key=lambda item: item[0])]
    if not ordered or room <= 0:
        return []
    firsts = [next((u for u in ordered if not u.dist.placements[m].is_replicate()), None)
              for m in range(v.dist.mesh.ndim)]
    picked = list(dict.fromkeys([u for u in firsts if u is not None] + ordered))
    items = [f"{u.why.text} (pass '{u.why.made_by or '?'}')" for u in picked]
    shown = items[:room]
    if len(items) > room:
        shown[-1] = f"{shown[-1]} (+{len(items) - room} more: depth=N shows them)"
    return [f"  decided by: {shown[0]}"] + [f"              {item}" for item in shown[1:]]


def _subject(v: Value, what: str = "") -> str:
    """What a value is about, as a dotted module/parameter name: the parameter of a
    ``grad[...]``, a state's or input's name, else the module of the op that made it."""
    if what.startswith("grad[") and what.endswith("]"):
        return what[5:-1]
    op = v.producer
    if op.kind in (OpKind.INPUT, OpKind.STATE):
        return str(op.attrs[NAME])
    return op.module or ""


def _shared_prefix(a: str, b: str) -> int:
    """How many leading dotted components two names share (``blocks.0.fc1`` and
    ``blocks.0.fc1.weight``: 3)."""
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y or not x:
            break
        n += 1
    return n


def _chain_lines(value: Value, names: dict[Value, str], dims: tuple[str, ...],
                 depth: int) -> list[str]:
    """The chain of reasons, one indented line per value, ``depth`` levels deep."""
    lines: list[str] = []
    seen: set[Value] = set()
    cut = False

    def visit(v: Value, level: int) -> None:
        nonlocal cut
        if v in seen:
            return
        if level > depth:
            cut = True
            return
        seen.add(v)
        why = describe_reason(v.why, names, dims) if v.why is not None else "not placed"
        lines.append(f"{'  ' * level}{names[v]} {_placements(v)} = {_where(v)}: {why}")
        for source in _followed(v):
            visit(source, level + 1)

    visit(value, 0)
    if cut:
        lines.append(f"... (deeper reasons cut at depth {depth}; a larger depth shows them)")
    return lines


def _where(v: Value) -> str:
    op = v.producer
    if op.kind in (OpKind.INPUT, OpKind.STATE):
        return f"{op.kind.value} {op.attrs[NAME]!r}"
    return f"{op.target.removesuffix('.default')} ({op.module or '-'} {op.role.value})"


def _find(program: Program, names: dict[Value, str], what: str) -> Value:
    by_name = {n: v for v, n in names.items()}
    if what in by_name:
        return by_name[what]
    for slot, v in program.results():
        if str(slot) == what:
            return v
    states = {}
    for op in program.ops:
        if op.kind in (OpKind.INPUT, OpKind.STATE) and op.attrs.get(NAME) == what:
            return op.outputs[0]
        if op.kind is OpKind.STATE:
            states[op.outputs[0]] = op.attrs[NAME]
        # once the optimizer consumes a gradient it is no result: find it as the update's input
        if op.role is Role.OPTIMIZER and op.kind is OpKind.CALL and op.args \
                and what == f"grad[{states.get(op.args[0])}]":
            return op.args[1]
    raise KeyError(f"explain: no value {what!r}; give a printed name like '%12', a result "
                   f"like 'loss' or 'grad[<param>]', or a parameter/input name")


@dataclass(frozen=True)
class Move:
    """One step of communication: for which consumer (role, module, op), which value, over
    which mesh dim, by which collective, and the bytes one rank sends."""

    role: str
    module: str
    consumer: str
    value: Value
    axis: str
    kind: str
    sent: float


def planned_moves(program: Program) -> list[Move]:
    """The communication of a placed program: its ``comm`` ops once reshard has run, and
    any needs not yet met (before reshard: what completion implies, one step per differing
    mesh dim). A value wanted in one placement by several consumers moves once."""
    moves, seen = [], set()
    for op in program.ops:
        if op.kind is OpKind.COMM:
            # a bucket's start carries one step per gradient; its wait moves nothing
            steps = op.attrs.get(BUCKET_STEPS) or (
                (op.attrs[RESHARD_STEP],) if RESHARD_STEP in op.attrs else ())
            for step, v in zip(steps, op.args):
                moves.append(Move(op.attrs[FOR_ROLE].value, op.module,
                                  op.attrs.get(FOR_TARGET, "optimizer"), v, step.axis,
                                  step.kind, step.cost(v.type.shape, v.dist.mesh,
                                                       v.dist.placements,
                                                       v.type.dtype.itemsize)))
            continue
        for v, need in zip((v for v in op.inputs if v.is_tensor), op.needs):
            if need is None or v.dist is None or need == v.dist or (v, need) in seen:
                continue
            seen.add((v, need))
            mesh = v.dist.mesh
            for m, (src, dst) in enumerate(zip(v.dist.placements, need.placements)):
                if src != dst:
                    size = v.type.numel * v.type.dtype.itemsize
                    moves.append(Move(op.role.value, op.module, op.target, v, mesh.dim_names[m],
                                      collective(src, dst),
                                      reshard_bytes(src, dst, size, mesh.shape[m])))
    return moves


def summarize(program: Program, mesh, pipeline=None) -> str:
    """A plan at a glance: the mesh, how values are placed, and the communication the
    placements imply, grouped by collective, mesh dim and role; for a pipeline also its
    stages, its schedule's bubble and the messages between stages."""
    values = [v for op in program.ops for v in op.outputs if v.is_tensor]
    kinds = {"sharded": 0, "partial": 0, "replicated": 0}
    for v in values:
        if v.dist is None or v.dist.is_replicated:
            kinds["replicated"] += 1
        elif any(p.is_partial() for p in v.dist.placements):
            kinds["partial"] += 1
        else:
            kinds["sharded"] += 1
    lines = [f"mesh: {mesh if mesh is not None else 'none (serial)'}",
             f"ops: {len(program.ops)}; values: " + ", ".join(f"{n} {k}" for k, n in kinds.items())]
    if pipeline is not None:
        lines += _pipeline_summary(pipeline)
    groups: dict[tuple[str, str, str], list[float]] = {}
    for move in planned_moves(program):
        if move.axis == MICRO_BATCH_DIM:    # over time, on one rank: no network
            kind = {"all_reduce": "accumulate", "all_gather": "concatenate"}.get(
                move.kind, move.kind)
            groups.setdefault((f"{kind} (local)", move.axis, move.role), []).append(0.0)
            continue
        groups.setdefault((move.kind, move.axis, move.role), []).append(move.sent)
    if groups:
        lines.append("communication the placements need (" + (
            f"per step, the {pipeline.layout.stages} stages' together: a rank runs its own "
            "stage's; each micro-batch's own counted once" if pipeline
            else "per rank, per step") + "):")
        for (kind, dim, role), sizes in sorted(groups.items()):
            lines.append(f"  {kind:<20} on {dim:<6} {role:<4} x{len(sizes):<4} "
                         f"{_bytes(sum(sizes))}")
    else:
        lines.append("communication the placements need: none")
    return "\n".join(lines)


def _pipeline_summary(pipeline) -> list[str]:
    """The stages, the schedule's bubble (jobs weighed by FLOPs) and the messages a step
    sends between stages."""
    layout, schedule = pipeline.layout, pipeline.schedule
    lines = [layout.describe()]
    if schedule is not None:
        lines.append(f"schedule {schedule.name}: bubble {schedule.timeline.bubble():.1%} of "
                     "the step (jobs weighed by their FLOPs)")
    sent = 0
    for message in pipeline.messages:
        v = pipeline.keys[message.key]
        if v.is_tensor and v.dist is not None:
            coordinate = (0,) * v.dist.mesh.ndim
            shape = local_shape(v.type.shape, v.dist.mesh, v.dist.placements, coordinate)
            sent += math.prod(shape) * v.type.dtype.itemsize
    lines.append(f"messages between stages: {len(pipeline.messages)} per step, "
                 f"{_bytes(sent)} per process of a stage")
    return lines
