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
from ..ir.attrs import MULTI, NAME
from ..ir.ops import op_info, resolve


class _Emitter:
    def __init__(self, traceable: bool = False) -> None:
        self.globals: dict[str, Any] = {}
        self.kernel_names: dict[str, str] = {}
        self.traceable = traceable

    def kernel(self, target: str, batched: bool = False) -> str:
        key = target + ("[batched]" if batched else "")
        if key not in self.kernel_names:
            name = "k_" + "".join(c if c.isalnum() else "_" for c in key)
            fn = op_info(target).batched.kernel if batched else resolve(target)
            # an OpOverload's __call__ only forwards to its C++ builtin: call that directly,
            # unless the code is to be traced (torch.compile follows OpOverloads)
            self.globals[name] = fn if self.traceable else getattr(fn, "_op", fn)
            self.kernel_names[key] = name
        return self.kernel_names[key]

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


def _emit_op(op: Op, em: _Emitter, names: dict[Value, str],
             comm: dict[Op, Callable] | None = None) -> str:
    lhs = ", ".join(names[v] for v in op.outputs)
    if op.kind is OpKind.COMM:
        if comm is None or op not in comm:
            raise ValueError(f"codegen: {op.target} ({op.module or 'top level'}) has no bound "
                             "collective; a rank program needs its process groups")
        if op.attrs.get(MULTI):
            lhs += ","
        call = f"{em.constant(comm[op])}({', '.join(names[v] for v in op.args)})"
        return f"{lhs} = {call}" if op.outputs else call
    if op.kind is OpKind.INPUT:
        return f"{lhs} = feeds[{op.attrs[NAME]!r}]"
    if op.kind is OpKind.STATE:
        return f"{lhs} = state[{op.attrs[NAME]!r}]"
    if op.kind is OpKind.OUTPUT:
        return "return (" + "".join(names[v] + ", " for v in op.args) + ")"
    args = [em.literal(a, names) for a in op.args]
    args += [f"{k}={em.literal(v, names)}" for k, v in op.kwargs.items()]
    call = f"{em.kernel(op.target)}({', '.join(args)})"
    if not op.outputs:
        return call
    if op.attrs.get(MULTI) and len(op.outputs) == 1:
        lhs += ","
    return f"{lhs} = {call}"


def _batch_run(ops: list[Op], start: int) -> int:
    """End index of the run of ops from ``start`` that one batched kernel call can take
    (keyword arguments are shared: the same values in every op of the run)."""
    first = ops[start]
    if first.kind is not OpKind.CALL or op_info(first.target).batched is None:
        return start + 1
    shared = op_info(first.target).batched.shared
    produced: set[Value] = set()
    end = start
    while end < len(ops):
        op = ops[end]
        if (op.kind is not OpKind.CALL or op.target != first.target
                or len(op.args) != len(first.args) or not _same_kwargs(op, first)
                or any(op.args[i] is not first.args[i] for i in shared)
                or any(v in produced for v in op.inputs)):
            break
        produced.update(op.outputs)
        end += 1
    return end


def _same_kwargs(op: Op, first: Op) -> bool:
    return op.kwargs.keys() == first.kwargs.keys() and all(
        op.kwargs[k] is first.kwargs[k] for k in first.kwargs)


def _emit_batched(run: list[Op], em: _Emitter, names: dict[Value, str]) -> str:
    shared = op_info(run[0].target).batched.shared
    args = []
    for i, a in enumerate(run[0].args):
        column = [op.args[i] for op in run]
        args.append(em.literal(a, names) if i in shared else em.literal(column, names))
    args += [f"{k}={em.literal(v, names)}" for k, v in run[0].kwargs.items()]
    lhs = "".join("(" + "".join(names[v] + ", " for v in op.outputs) + "), " for op in run)
    return f"{lhs}= {em.kernel(run[0].target, batched=True)}({', '.join(args)})"


def generate(program: Program, name: str = "step",
             comm: dict[Op, Callable] | None = None,
             traceable: bool = False) -> tuple[Callable, str]:
    """Compile ``program`` to ``fn(feeds: dict, state: dict) -> tuple`` of its results.
    ``comm`` binds each COMM op to the collective that runs it on this rank; ``traceable``:
    calls that ``torch.compile`` can trace (each op's ``OpOverload``)."""
    em = _Emitter(traceable)
    names = {v: f"v{i}" for i, v in enumerate(v for op in program.ops for v in op.outputs)}
    dying = _last_uses(program)
    lines = [f"def {name}(feeds, state):"]
    ops, i = program.ops, 0
    while i < len(ops):
        end = _batch_run(ops, i)
        line = (_emit_batched(ops[i:end], em, names) if end - i > 1
                else _emit_op(ops[i], em, names, comm))
        lines.append("    " + line)
        dead = [names[v] for j in range(i, end) if ops[j].kind is not OpKind.OUTPUT
                for v in dying.get(j, ())]
        if dead:
            lines.append("    del " + ", ".join(dead))
        i = end
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<autopar {name}>", "exec")
    namespace = dict(em.globals, torch=torch)
    exec(code, namespace)
    return namespace[name], source
