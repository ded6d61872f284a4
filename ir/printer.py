"""A deterministic, MLIR-like text form of a Program.

Names are assigned at print time in op order, so two dumps of equal programs are equal
text and a pass's effect is a plain diff. One op per line:

    %12: f32[4,64,128] = aten.mm(%10, %11)  # blocks.0.fc1 fwd
"""
from __future__ import annotations

import torch

from .attrs import NAME, ON_HOST, SLOTS, STATE
from .core import Op, OpKind, Program, Value


def _target_name(target: str) -> str:
    return target.removesuffix(".default")


class _Namer:
    def __init__(self) -> None:
        self.names: dict[Value, str] = {}

    def define(self, v: Value) -> str:
        self.names[v] = f"%{len(self.names)}"
        return self.names[v]

    def __call__(self, v: Value) -> str:
        return self.names.get(v, "%<undefined>")


def _format_arg(a, name: _Namer) -> str:
    if isinstance(a, Value):
        return name(a)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_format_arg(x, name) for x in a)
        return f"[{inner}]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}={_format_arg(v, name)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    if isinstance(a, torch.Tensor):
        return f"tensor<{list(a.shape)}>"
    if isinstance(a, (torch.device, torch.layout, torch.memory_format)):
        return str(a)
    return repr(a)


def _format_result(v: Value, name: _Namer) -> str:
    text = f"{name.define(v)}: {v.type}"
    if v.dist is not None:
        text += f" {v.dist}"
    return text


def _format_op(op: Op, name: _Namer) -> str:
    if op.kind is OpKind.OUTPUT:
        pairs = ", ".join(f"{s}={name(v)}" for s, v in zip(op.attrs[SLOTS], op.args))
        return f"output {pairs}{_reshards(op, name)}"
    lhs = ", ".join(_format_result(v, name) for v in op.outputs)
    if op.kind is OpKind.INPUT:
        return f"{lhs} = input {op.attrs[NAME]!r}"
    if op.kind is OpKind.STATE:
        home = " {on_host}" if op.attrs.get(ON_HOST) else ""
        return f"{lhs} = state {op.attrs[STATE].kind.value} {op.attrs[NAME]!r}{home}"
    lhs = f"{lhs} = " if lhs else ""      # a send, an RNG restore: no results
    args = [_format_arg(a, name) for a in op.args]
    args += [f"{k}={_format_arg(v, name)}" for k, v in op.kwargs.items()]
    shown_attrs = {k.name: v for k, v in op.attrs.items() if k.shown}
    attrs = f" {_format_arg(shown_attrs, name)}" if shown_attrs else ""
    text = f"{lhs}{_target_name(op.target)}({', '.join(args)}){attrs}"
    note = [op.module or "-", op.role.value]
    if op.forward_op is not None and op.forward_op.outputs:
        note.append(f"of {name(op.forward_op.outputs[0])}")
    if op.recomputes is not None and op.recomputes.outputs:
        note.append(f"again of {name(op.recomputes.outputs[0])}")
    replaced = {n for k in op.attrs for n in k.replaces}
    note += [k.note(v) for k, v in op.attrs.items() if k.note is not None
             and k.name not in replaced]     # e.g. where a pipeline runs the op
    return f"{text}  # {' '.join(note)}{_reshards(op, name, '; ')}"


def _reshards(op: Op, name: _Namer, sep: str = "  # ") -> str:
    """Inputs whose placement differs from what the op needs: where reshard will act."""
    moves = [f"{name(v)} {_bare(v.dist)} -> {_bare(need)}"
             for v, need in zip((v for v in op.inputs if v.is_tensor), op.needs)
             if need is not None and v.dist is not None and need != v.dist]
    return f"{sep}reshard {', '.join(moves)}" if moves else ""


def _bare(dist) -> str:
    return "{" + ",".join(str(p) for p in dist.placements) + "}"


def format_program(program: Program) -> str:
    name = _Namer()
    return "\n".join(_format_op(op, name) for op in program.ops) + "\n"


def value_names(program: Program) -> dict[Value, str]:
    """The names ``format_program`` gives each value."""
    name = _Namer()
    for op in program.ops:
        for v in op.outputs:
            name.define(v)
    return name.names
