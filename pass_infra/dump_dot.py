"""A program as a Graphviz graph (``debug.dump_format: [dot]``): one node per op, an edge per
value it reads, each node coloured by how its results are placed and every collective drawn
as a red hexagon, so where communication happens and why (which placements meet) shows at a
glance. Plain DOT text (no graphviz package needed): ``dot -Tsvg 21_completion.dot``.
"""
from __future__ import annotations

from ..ir import OpKind, Program, Value
from ..ir.attrs import NAME
from ..ir.printer import value_names

__all__ = ["PLACEMENT_COLORS", "COMM_COLOR", "op_placement", "value_placement", "program_dot"]

# what a value's placement amounts to, and how the graph and the HTML page colour it
PLACEMENT_COLORS = {"replicated": "#e9ecef", "sharded": "#9ec5fe", "partial": "#ffda6a",
                    "unplaced": "#ffffff"}
COMM_COLOR = "#f1aeb5"
_SHAPES = {OpKind.INPUT: "parallelogram", OpKind.STATE: "cylinder", OpKind.OUTPUT: "house",
           OpKind.COMM: "hexagon"}


def value_placement(v: Value) -> str:
    """``partial`` (some mesh dim holds terms still to be reduced), ``sharded``,
    ``replicated`` or ``unplaced`` (not a placed tensor: before completion, or serial)."""
    if v.dist is None:
        return "unplaced"
    if any(p.is_partial() for p in v.dist.placements):
        return "partial"
    return "replicated" if v.dist.is_replicated else "sharded"


def op_placement(op) -> str:
    """``comm`` for a collective, else the most telling placement of the op's tensor
    results (partial over sharded over replicated)."""
    if op.kind is OpKind.COMM:
        return "comm"
    kinds = {value_placement(v) for v in op.outputs if v.is_tensor}
    for kind in ("partial", "sharded", "replicated"):
        if kind in kinds:
            return kind
    return "unplaced"


def program_dot(program: Program, title: str) -> str:
    """The DOT text of ``program``: nodes ``op<i>`` in op order, labelled as the text dump
    names them, and a legend of the colours."""
    names = value_names(program)
    index = {id(op): i for i, op in enumerate(program.ops)}
    lines = [f"digraph {_quote(title)} {{",
             f"  graph [rankdir=TB, fontname=Helvetica, label={_quote(title)}, labelloc=t];",
             '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
             "  edge [color=\"#6c757d\", arrowsize=0.6];"]
    lines += _legend()
    for i, op in enumerate(program.ops):
        lines.append(f"  op{i} [{_node_attrs(op, names)}];")
    for i, op in enumerate(program.ops):
        sources = sorted({index[id(v.producer)] for v in op.inputs
                          if v.producer is not None and id(v.producer) in index})
        lines += [f"  op{s} -> op{i};" for s in sources]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_attrs(op, names: dict[Value, str]) -> str:
    kind = op_placement(op)
    attrs = {"label": _label(op, names), "class": kind,
             "shape": _SHAPES.get(op.kind, "box"),
             "fillcolor": COMM_COLOR if kind == "comm" else PLACEMENT_COLORS[kind]}
    if kind == "comm":
        attrs.update(color="#dc3545", penwidth="2", style="filled")
        if op.outputs and op.outputs[0].why is not None:
            attrs["tooltip"] = op.outputs[0].why.text
    elif kind == "unplaced":
        attrs["style"] = "rounded,filled,dashed"
    return ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items())


def _label(op, names: dict[Value, str]) -> str:
    """What the op is, then each result's name, type and placement, then where it is."""
    if op.kind in (OpKind.INPUT, OpKind.STATE):
        head = f"{op.kind.value} {op.attrs.get(NAME, '')!r}"
    else:
        head = op.target.removesuffix(".default")
    results = [f"{names.get(v, '%?')}: {v.type}"
               + (f" {_placements(v)}" if v.dist is not None else "") for v in op.outputs]
    where = f"{op.module or '-'} {op.role.value}"
    return "\n".join([head, *results[:3], *(["..."] if len(results) > 3 else []), where])


def _placements(v: Value) -> str:
    return "{" + ",".join(str(p) for p in v.dist.placements) + "}"


def _legend() -> list[str]:
    """A cluster of one node per colour, so a rendered graph explains itself."""
    lines = ["  subgraph cluster_legend {", '    label="placement"; style=dashed;']
    for kind, color in PLACEMENT_COLORS.items():
        lines.append(f"    legend_{kind} [label={_quote(kind)}, fillcolor={_quote(color)}, "
                     f"class={_quote(kind)}];")
    lines.append(f"    legend_comm [label=\"collective\", shape=hexagon, style=filled, "
                 f"fillcolor={_quote(COMM_COLOR)}, color=\"#dc3545\", penwidth=2, "
                 "class=\"comm\"];")
    lines.append("  }")
    return lines


def _quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as ``\\n``
    (centred lines), so no text of a program can end the string or inject attributes."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\r", "").replace("\n", "\\n")
    return f'"{escaped}"'
