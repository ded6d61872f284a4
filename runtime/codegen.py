"""Program -> generated Python function.

One straight-line function per rank program, like fx's GraphModule code: no per-op
interpreter loop, every value a local variable, ``del`` right after its last use so
activations are freed as soon as the backward no longer needs them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..ir import Op, OpKind, Program, Value
from .kernels import resolve


class _Emitter:
    def __init__(self) -> None:
        self.globals: dict[str, Any] = {}
        self.kernel_names: dict[str, str] = {}

    def kernel(self, target: str) -> str:
        if target not in self.kernel_names:
            name = "k_" + "".join(c if c.isalnum() else "_" for c in target)
            self.globals[name] = resolve(target)
            self.kernel_names[target] = name
        return self.kernel_names[target]

    def constant(self, obj: Any) -> str:
        name = f"c{len(self.globals)}"
        self.globals[name] = obj
        return name

    def literal(self, a: Any, names: dict[Value, str]) -> str:
        if isinstance(a, Value):
            return names[a]
        if isinstance(a, (bool, int, str)) or a is None:
            return repr(a)
        if isinstance(a, float):
            return repr(a) if math.isfinite(a) else self.constant(a)
        if isinstance(a, list):
            return "[" + ", ".join(self.literal(x, names) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(self.literal(x, names) + ", " for x in a) + ")"
        return self.constant(a)


def _last_uses(program: Program) -> dict[int, list[Value]]:
    """Index of the op after which each value dies (results never die inside)."""
    last: dict[Value, int] = {}
    for i, op in enumerate(program.ops):
        for v in op.outputs:
            last[v] = i
        for v in op.inputs:
            last[v] = i
    kept = set(program.output_op.inputs)
    dying: dict[int, list[Value]] = {}
    for v, i in last.items():
        if v not in kept:
            dying.setdefault(i, []).append(v)
    return dying


def _emit_op(op: Op, em: _Emitter, names: dict[Value, str]) -> str:
    lhs = ", ".join(names[v] for v in op.outputs)
    if op.kind is OpKind.INPUT:
        return f"{lhs} = feeds[{op.attrs['name']!r}]"
    if op.kind is OpKind.STATE:
        return f"{lhs} = state[{op.attrs['name']!r}]"
    if op.kind is OpKind.OUTPUT:
        return "return (" + "".join(names[v] + ", " for v in op.args) + ")"
    args = [em.literal(a, names) for a in op.args]
    args += [f"{k}={em.literal(v, names)}" for k, v in op.kwargs.items()]
    call = f"{em.kernel(op.target)}({', '.join(args)})"
    if op.attrs.get("_multi") and len(op.outputs) == 1:
        lhs += ","
    return f"{lhs} = {call}"


def generate(program: Program, name: str = "step") -> tuple[Callable, str]:
    """Compile ``program`` to ``fn(feeds: dict, state: dict) -> tuple`` of its results."""
    em = _Emitter()
    names = {v: f"v{i}" for i, v in enumerate(v for op in program.ops for v in op.outputs)}
    dying = _last_uses(program)
    lines = [f"def {name}(feeds, state):"]
    for i, op in enumerate(program.ops):
        lines.append("    " + _emit_op(op, em, names))
        if i in dying and op.kind is not OpKind.OUTPUT:
            lines.append("    del " + ", ".join(names[v] for v in dying[i]))
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<autopar {name}>", "exec")
    namespace = dict(em.globals, torch=torch)
    exec(code, namespace)
    return namespace[name], source
