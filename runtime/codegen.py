"""Program -> generated Python function.

One straight-line function per rank program, like fx's GraphModule code: no per-op
interpreter loop, every value a local variable, ``del`` right after its last use so
activations are freed as soon as the backward no longer needs them.
"""
from __future__ import annotations

import math
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch._prims.rng_prims import run_with_rng_state

from ..ir import Op, OpKind, Program, Value
from ..ir.attrs import MULTI, NAME
from ..ir.kernels.generator_state import functional_target
from ..ir.ops import draws_random, op_info, resolve


@dataclass(frozen=True)
class Outside:
    """A comm op that runs outside the generated function (a pipeline job's message, around
    its compiled body): a receive becomes the feed ``key``; a send's value becomes an extra
    result after the program's own, in program order."""

    key: str


@dataclass(frozen=True)
class Drawn:
    """A random op of a traced program that draws from the generator state fed as ``key``
    (the runtime computes eager's state at it), not from the generator."""

    key: str


@torch.library.custom_op("autopar::fence", mutates_args=())
def fence(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` made once ``after`` exists, opaque to the compiler (``_Fences``)."""
    return x.clone()


@fence.register_fake
def _(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Emitter:
    def __init__(self, traceable: bool = False) -> None:
        self.globals: dict[str, Any] = {}
        self.kernel_names: dict[str, str] = {}
        self.traceable = traceable
        self.sent: list[str] = []         # values of sends run outside, in program order

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


def _last_uses(program: Program) -> dict[Value, int]:
    """Index of the op that last reads each value (or makes it, when nothing reads it)."""
    last: dict[Value, int] = {}
    for i, op in enumerate(program.ops):
        for v in op.outputs:
            last[v] = i
        for v in op.inputs:
            last[v] = i
    return last


def dying_after(program: Program) -> dict[int, list[Value]]:
    """Values by the index of the op after which the generated code frees them (the
    program's results live on): what ``runtime.memory_meter`` mirrors."""
    return _dying(_last_uses(program), set(program.output_op.inputs))


def _dying(last: dict[Value, int], kept: set[Value]) -> dict[int, list[Value]]:
    """Values by the index of the op after which they die (``kept`` never die inside)."""
    dying: dict[int, list[Value]] = {}
    for v, i in last.items():
        if v not in kept:
            dying.setdefault(i, []).append(v)
    return dying


def _emit_op(op: Op, em: _Emitter, names: dict[Value, str],
             comm: dict[Op, Callable] | None = None, rng_state: str | None = None) -> str:
    lhs = ", ".join(names[v] for v in op.outputs)
    bound = (comm or {}).get(op)
    if isinstance(bound, Outside) and op.kind is not OpKind.COMM:
        return _emit_outside(op, bound, em, names)
    if isinstance(bound, Drawn):
        rng_state = f"feeds[{bound.key!r}]"
    if op.kind is OpKind.COMM:
        if comm is None or op not in comm:
            raise ValueError(f"codegen: {op.target} ({op.module or 'top level'}) has no bound "
                             "collective; a rank program needs its process groups")
        if isinstance(comm[op], Outside):
            return _emit_outside(op, comm[op], em, names)
        if op.attrs.get(MULTI):
            lhs += ","
        call = f"{em.constant(comm[op])}({', '.join(names[v] for v in op.args)})"
        return f"{lhs} = {call}" if op.outputs else call
    if op.kind is OpKind.INPUT:
        return f"{lhs} = feeds[{op.attrs[NAME]!r}]"
    if op.kind is OpKind.STATE:
        return f"{lhs} = state[{op.attrs[NAME]!r}]"
    if op.kind is OpKind.OUTPUT:
        return "return (" + "".join(n + ", " for n in [names[v] for v in op.args] + em.sent) + ")"
    args = [em.literal(a, names) for a in op.args]
    args += [f"{k}={em.literal(v, names)}" for k, v in op.kwargs.items()]
    target = _TRACED_AS.get(op.target, op.target) if em.traceable else op.target
    call = f"{em.kernel(target)}({', '.join(args)})"
    if rng_state is not None:        # drawn from a given generator state (a traced program)
        call = (f"{em.constant(run_with_rng_state)}({rng_state}, "
                f"{em.kernel(functional_target(op.target))}, {', '.join(args)})"
                if isinstance(resolve(op.target), torch._ops.OpOverload) else
                f"{call[:-1]}, rng_state={rng_state})")
    if not op.outputs:
        return call
    if op.attrs.get(MULTI) and len(op.outputs) == 1:
        lhs += ","
    return f"{lhs} = {call}"


# a traced program's views reshape instead: the compiler may lay a tensor out otherwise than
# eager does (a decomposed attention's backward), where a view of it would fail; reshape is
# the same view wherever eager's layout allows one
_TRACED_AS = {"aten.view.default": "aten.reshape.default",
              "aten._unsafe_view.default": "aten.reshape.default"}


def _emit_outside(op: Op, outside: Outside, em: _Emitter, names: dict[Value, str]) -> str:
    if op.outputs:                                    # a receive: its value is fed
        return f"{names[op.outputs[0]]} = feeds[{outside.key!r}]"
    em.sent.append(names[op.args[0]])                 # a send: returned at the end
    return "pass"


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
    fns, source = generate_segments(program, [0], name, comm, traceable)
    return fns[0], source


def generate_segments(program: Program, starts: list[int], name: str = "step",
                      comm: dict[Op, Callable | Outside] | None = None,
                      traceable: bool = False) -> tuple[list[Callable], str]:
    """``program`` cut before each op index in ``starts`` (the first 0): one function per
    segment, ``fn(feeds, state, carried)`` for every segment but a lone one. A segment that
    is not the last returns ``(carried, *sent)``: ``carried`` the values later segments
    read, by name; the last returns the program's results, then its sends run
    ``Outside``. Values keep their names (``v<i>``) across segments."""
    em = _Emitter(traceable)
    names = {v: f"v{i}" for i, v in enumerate(v for op in program.ops for v in op.outputs)}
    last = _last_uses(program)
    sent = {v for op, bound in (comm or {}).items() if isinstance(bound, Outside)
            for v in op.args}
    dying = _dying(last, set(program.output_op.inputs) | sent)
    ends = list(starts[1:]) + [len(program.ops)]
    lines, made = [], set()
    for s, (begin, end) in enumerate(zip(starts, ends)):
        local = {v for op in program.ops[begin:end] for v in (*op.inputs, *op.outputs)}
        lines += _segment(program.ops, begin, end, f"{name}_{s}" if len(starts) > 1 else name,
                          len(starts) > 1, em, names, comm, dying, made)
        made |= {v for op in program.ops[begin:end] for v in op.outputs}
        if end < len(program.ops):
            carried = sorted((v for v in made if last[v] >= end), key=lambda v: int(names[v][1:]))
            lines.append("    return ({" + ", ".join(
                f"{names[v]!r}: " + (names[v] if v in local else f"carried[{names[v]!r}]")
                for v in carried) + "}, " + "".join(n + ", " for n in em.sent) + ")")
        em.sent = []
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<autopar {name}>", "exec")
    namespace = dict(em.globals, torch=torch)
    exec(code, namespace)
    fns = [namespace[f"{name}_{s}" if len(starts) > 1 else name] for s in range(len(starts))]
    return fns, source


class _Fences:
    """Recomputed ops under a compiler: Inductor would fuse a recomputed op with its original
    (they read the same activations) or run it as soon as its inputs exist, so what recompute
    frees would live from the forward to the backward. Each run of recomputed ops reads the
    activations it recomputes from through ``autopar::fence(x, after)``, a copy the
    compiler cannot see through, made after the last value the backward computed before it."""

    def __init__(self, em: _Emitter, names: dict[Value, str]) -> None:
        self.em, self.names = em, names
        self.after: str | None = None            # the backward's latest value
        self.fenced: dict[Value, str] = {}       # this run's fenced activations

    def lines_for(self, op: Op) -> list[str]:
        """The fences ``op`` needs first (names of fenced values swapped in meanwhile)."""
        if op.recomputes is None:
            if op.kind is OpKind.CALL and any(v.is_tensor for v in op.outputs):
                self.after = self.names[next(v for v in op.outputs if v.is_tensor)]
                self.fenced = {}
            return []
        lines = []
        for v in op.inputs:
            producer = v.producer
            if (self.after is None or v in self.fenced or not v.is_tensor or producer is None
                    or producer.kind is not OpKind.CALL or producer.recomputes is not None):
                continue
            self.fenced[v] = f"{self.names[v]}_fenced"
            lines.append(f"{self.fenced[v]} = {self.em.constant(fence)}({self.names[v]}, "
                         f"{self.after})")
        return lines

    def names_of(self, op: Op) -> Mapping[Value, str]:
        return ChainMap(self.fenced, self.names) if op.recomputes is not None else self.names


def _sets_generator_for_next(ops: list[Op], i: int, end: int) -> bool:
    """Whether op ``i`` sets the generator's state for the random op right after it."""
    return (ops[i].kind is OpKind.CALL and ops[i].target == "autopar.set_rng_state"
            and i + 1 < end and ops[i + 1].kind is OpKind.CALL and draws_random(ops[i + 1]))


def _segment(ops: list[Op], begin: int, end: int, fname: str, carries: bool, em: _Emitter,
             names: dict[Value, str], comm, dying: dict[int, list[Value]],
             made: set[Value]) -> list[str]:
    """The lines of one segment's function: values of earlier segments read from
    ``carried``, then its ops, each value deleted after its last use."""
    lines = [f"def {fname}(feeds, state{', carried' if carries else ''}):"]
    read = sorted({v for op in ops[begin:end] for v in op.inputs if v in made},
                  key=lambda v: int(names[v][1:]))
    lines += [f"    {names[v]} = carried[{names[v]!r}]" for v in read]
    fences = _Fences(em, names) if em.traceable else None
    i = begin
    while i < end:
        stop = min(_batch_run(ops, i), end)
        if em.traceable and _sets_generator_for_next(ops, i, end):
            # Dynamo cannot trace setting the generator: the draw takes the state instead
            stop = i + 2
            lines += ["    " + line for line in fences.lines_for(ops[i + 1])]
            line = _emit_op(ops[i + 1], em, fences.names_of(ops[i + 1]), comm,
                            rng_state=names[ops[i].args[0]])
        elif fences is not None and stop - i == 1:
            lines += ["    " + line for line in fences.lines_for(ops[i])]
            line = _emit_op(ops[i], em, fences.names_of(ops[i]), comm)
        else:
            line = (_emit_batched(ops[i:stop], em, names) if stop - i > 1
                    else _emit_op(ops[i], em, names, comm))
        lines.append("    " + line)
        dead = [names[v] for j in range(i, stop) if ops[j].kind is not OpKind.OUTPUT
                for v in dying.get(j, ())]
        if dead:
            lines.append("    del " + ", ".join(dead))
        i = stop
    return lines
