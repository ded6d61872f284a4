"""Recompute (activation checkpointing): the backward of a matched module runs its forward
again instead of keeping what the forward made.

``recompute: {enable: true, modules: ["blocks.*"], policy: full | selective}``; without
``modules``, every repeated layer (each instance of a module list of identical layers,
``pass_infra.layers``: the layers the auto planner ties; torchtitan's and Paddle's default),
named in the report. Each module instance a pattern matches (the outermost: ``blocks.*``
matches ``blocks.0``, not also ``blocks.0.attn``) is a *segment*: its forward ops (calls,
and the collectives reshard put in it, but not a ZeRO-3 gather of a parameter, which
``regather_for_backward`` handles).
The values a segment makes and its own backward reads are dropped: clones of the segment's
ops that make them run again, from the segment's kept values, just before the first such
backward op, and those backward ops read the clones. The originals die after their last
forward use, so between a segment's forward and its backward only its kept values live:

* ``full``: every op is recomputed, collectives too (Megatron's full recompute re-runs the
  forward); only the segment's inputs (values made outside it, parameters) are kept;
* ``selective``: the results of matmuls, attention and collectives are kept as well, and
  only the cheap ops between them are recomputed (Megatron's selective recompute; keeping
  collectives' results, as torchtitan's selective checkpointing does, means the backward
  communicates no more than without recompute).

A clone has role backward, the original's placements, needs and attributes (its pipeline
stage: it runs in the micro-batch's backward job), ``op.recomputes`` pointing at the
original, and ``{recompute=<policy>}`` in dumps; ``NN_recompute.recompute.txt`` lists per
segment what is kept, what is recomputed and why. An op that writes an input in place is
recomputed only when what it writes is a clone too (else the original would be changed).

A recomputed random op draws again what its original drew: the generator's state is read
(``autopar.get_rng_state``) just before the original and set back
(``autopar.set_rng_state``) just before the clone. In a pipeline, lowering already makes
every random op of a job restore eager's state at it, and a clone restores its original's
(``lower/job_programs.py``), so no state is read or carried between jobs there.

Runs after reshard (every value is placed, collectives are ops) and before gradient
bucketing and ZeRO-3's regather (which then sees the clones as backward readers).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.attrs import COMM_TEXT, STATE, Attr
from ..ir.kernels.generator_state import RNG_STATE
from ..ir.ops import draws_random, op_info
from ..ir.printer import value_names
from ..pass_infra.context import PassContext
from ..pass_infra.layers import repeated_layers
from ..reshard.comm import FOR_ROLE

__all__ = ["recompute", "format_recompute", "RECOMPUTE", "segments", "modules_of", "Segment"]

RECOMPUTE: Attr[str] = Attr("recompute", str, "a recomputed op's (or a saved generator "
                            "state's) recompute policy: full or selective", shown=True)

# what selective recompute keeps: the results of matmuls, attention and convolutions (by
# ATen op name; a target is ``aten.<name>.<overload>``)
_EXPENSIVE = {"mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "convolution",
              "_convolution", "_flash_attention_forward", "_efficient_attention_forward"}
_ATTENTION = "_scaled_dot_product_"


@dataclass
class Segment:
    """One recomputed module instance: its forward ops, in program order."""

    path: str
    ops: list[Op] = field(default_factory=list)

    def holds(self, module: str) -> bool:
        return module == self.path or module.startswith(self.path + ".")


def recompute(program: Program, ctx: PassContext) -> Program:
    config = ctx.strategy.recompute
    if not config.enable:
        return program
    pipelined = ctx.state.pipeline is not None
    position = {op: i for i, op in enumerate(program.ops)}
    before: dict[Op, list[Op]] = {}
    for segment in segments(program, modules_of(program, config.modules)):
        _Recompute(program, segment, config.policy, pipelined, before).run(position)
    if before:
        program.ops = [new for op in program.ops for new in before.get(op, []) + [op]]
    return program


def modules_of(program: Program, patterns: tuple[str, ...]) -> tuple[str, ...]:
    """What to recompute: the strategy's patterns, or when it gives none every repeated
    layer (identical instances of a module list; a list's only instance too: a stack of
    one), an error naming the problem when the model has none."""
    if patterns:
        return patterns
    found = repeated_layers(program)
    containers = [container for container, _ in found.untied]
    alone = [(c, i) for c, i in found.untied if containers.count(c) == 1]   # a stack of one
    layers = tuple(sorted(f"{c.container}.{i}" for c in found.classes for i in c.indices)
                   + [f"{c}.{i}" for c, i in alone])
    if not layers:
        raise ValueError("recompute: {enable: true} without modules recomputes every repeated "
                         "layer (the instances of a module list of identical layers), and "
                         "this model has none: name the modules to recompute, e.g. "
                         "recompute: {enable: true, modules: [\"encoder.*\"]}")
    return layers


def segments(program: Program, patterns: tuple[str, ...]) -> list[Segment]:
    """The outermost module instances ``patterns`` match, with their forward ops; a pattern
    that matches no module is an error naming it and some module paths."""
    paths = {p for op in program.ops if op.module for p in _prefixes(op.module)}
    matched: set[str] = set()
    for pattern in patterns:
        hits = {p for p in paths if fnmatch.fnmatchcase(p, pattern)}
        if not hits:
            some = ", ".join(sorted(paths)[:8])
            raise ValueError(f"recompute: module pattern {pattern!r} matches no module of the "
                             f"model (module paths: {some}, ...)")
        matched |= hits
    outermost = sorted(p for p in matched
                       if not any(p != q and p.startswith(q + ".") for q in matched))
    found = {path: Segment(path) for path in outermost}
    for op in program.ops:
        if _is_forward(op):
            path = next((p for p in _prefixes(op.module) if p in found), None)
            if path is not None:
                found[path].ops.append(op)
    return [s for s in found.values() if s.ops]


def _prefixes(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _is_forward(op: Op) -> bool:
    if op.kind is OpKind.CALL:
        return op.role is Role.FORWARD
    if op.kind is not OpKind.COMM or op.attrs.get(FOR_ROLE) is not Role.FORWARD:
        return False
    # a parameter's gather (ZeRO-3) is regather_for_backward's: leave it alone
    return not any(v.producer.kind is OpKind.STATE for v in op.inputs)


def _is_backward(op: Op) -> bool:
    return op.role is Role.BACKWARD or (op.kind is OpKind.COMM
                                        and op.attrs.get(FOR_ROLE) is Role.BACKWARD)


def keeps(op: Op, policy: str) -> bool:
    """Whether ``policy`` keeps ``op``'s results rather than recompute them."""
    if policy == "full":
        return False
    if op.kind is OpKind.COMM:
        return True
    name = op.target.split(".")[1] if op.target.startswith("aten.") else ""
    return name in _EXPENSIVE or name.startswith(_ATTENTION)


class _Recompute:
    """One segment: clone what its backward reads, redirect the backward to the clones."""

    def __init__(self, program: Program, segment: Segment, policy: str, pipelined: bool,
                 before: dict[Op, list[Op]]):
        self.program, self.segment, self.policy = program, segment, policy
        self.pipelined, self.before = pipelined, before
        self.ops = set(segment.ops)
        self.made = {v for op in segment.ops for v in op.outputs}
        self.decided: dict[Value, bool] = {}      # made again (True) or kept
        self.clones: dict[Value, Value] = {}
        self.cloned: list[Op] = []

    def run(self, position: dict[Op, int]) -> None:
        readers = [op for op in self.program.ops if self._reads_saved(op)]
        if not readers:          # no backward (eval, predict): nothing is saved
            return
        for reader in readers:
            reader.map_inputs(lambda v: self._clone(v) if v in self.made else v)
        if not self.cloned:
            return
        first = min(readers, key=position.__getitem__)
        made = sorted(self.cloned, key=lambda op: position[op.recomputes])
        self.before.setdefault(first, []).extend(self._with_rng(made))

    def _reads_saved(self, op: Op) -> bool:
        if not _is_backward(op) or not any(v in self.made for v in op.inputs):
            return False
        if op.forward_op is not None:
            return op.forward_op in self.ops
        return op.kind is OpKind.COMM and self.segment.holds(op.module)

    def _recomputed(self, v: Value) -> bool:
        """Whether ``v`` is made again: made in the segment, not kept by the policy, and
        not written in place over a value that is kept (that would change the original)."""
        if v in self.decided:
            return self.decided[v]
        op = v.producer
        again = v in self.made and not keeps(op, self.policy)
        if again and op.kind is OpKind.CALL and op_info(op.target).mutates:
            again = all(self._recomputed(x) for x in op.inputs if x.is_tensor)
        for x in op.outputs:
            self.decided[x] = again
        return again

    def _clone(self, v: Value) -> Value:
        """The value the backward reads for ``v``: a clone's result, or ``v`` kept."""
        if not self._recomputed(v):
            return v
        if v not in self.clones:
            self._copy(v.producer)
        return self.clones[v]

    def _copy(self, op: Op) -> None:
        new = Op(op.kind, op.target, op.args, dict(op.kwargs), [Value(x.type) for x in op.outputs],
                 Role.BACKWARD, op.module, None, {**op.attrs, RECOMPUTE: self.policy},
                 recomputes=op)
        new.map_inputs(self._clone)
        new.needs = op.needs
        if op.kind is OpKind.COMM:    # a collective of the segment, run again in the backward
            new.attrs[FOR_ROLE] = Role.BACKWARD
            new.attrs[COMM_TEXT] = f"recomputed: {op.attrs[COMM_TEXT]}"
        for old, out in zip(op.outputs, new.outputs):
            out.producer, out.index = new, old.index
            out.dist, out.why = old.dist, old.why
            self.clones[old] = out
        self.cloned.append(new)

    def _with_rng(self, clones: list[Op]) -> list[Op]:
        """The clones, each random one preceded by setting back the generator state read
        just before its original (not in a pipeline: there jobs restore eager's state)."""
        out = []
        for clone in clones:
            original = clone.recomputes
            if clone.kind is OpKind.CALL and draws_random(original) and not self.pipelined:
                saved = Op(OpKind.CALL, "autopar.get_rng_state", (), {}, [Value(RNG_STATE)],
                           original.role, original.module, None, {RECOMPUTE: self.policy})
                saved.result.producer = saved
                self.before.setdefault(original, []).append(saved)
                out.append(Op(OpKind.CALL, "autopar.set_rng_state", (saved.result,), {}, [],
                              Role.BACKWARD, original.module, None,
                              {RECOMPUTE: self.policy}))
            out.append(clone)
        return out


def format_recompute(program: Program, ctx: PassContext) -> str:
    """Per segment: what its backward reads kept, what it recomputes, and its collectives."""
    config = ctx.strategy.recompute
    if not config.enable:
        return ""
    names = value_names(program)
    clones = [op for op in program.ops if op.recomputes is not None]
    lines = [f"recompute policy {config.policy}: "
             + ("every forward op of a segment runs again, collectives included (Megatron "
                "full recompute)" if config.policy == "full" else
                "matmul, attention and collective results are kept, the ops between them run "
                "again; kept collective results mean no extra communication in the backward")]
    found = segments(program, modules_of(program, config.modules))
    if not config.modules:
        lines.append("modules: every repeated layer (no modules given): "
                     + ", ".join(s.path for s in found))
    for segment in found:
        mine = [op for op in clones if segment.holds(op.module)]
        lines += [""] + _segment_lines(segment, mine, names)
    return "\n".join(lines) + "\n"


def _segment_lines(segment: Segment, clones: list[Op], names: dict) -> list[str]:
    recomputed = {op.recomputes for op in clones}
    made = {v for op in clones for v in op.outputs}
    kept = {v for op in clones for v in op.inputs if v not in made and v.is_tensor}
    inside = {v for op in segment.ops for v in op.outputs}
    lines = [f"segment {segment.path}: {len(clones)} of {len(segment.ops)} forward ops "
             "recomputed before its backward"]
    lines.append("  kept inputs: " + (", ".join(
        f"{names[v]} {v.type} ({_who(v)})" for v in _ordered(kept - inside, names)) or "-"))
    saved = _ordered(kept & inside, names)
    if saved:
        lines.append("  kept results (policy): " + ", ".join(
            f"{names[v]} {v.type} ({_who(v)})" for v in saved))
    for op in segment.ops:
        if op.kind is not OpKind.COMM:
            continue
        what = ("recomputed (full recompute re-runs the forward, its collectives too)"
                if op in recomputed else
                "kept (its result is saved: no extra communication in the backward)"
                if any(v in kept for v in op.outputs) else "not needed by the backward")
        lines.append(f"  collective {names[op.result]} {op.attrs.get(COMM_TEXT, op.target)}: "
                     f"{what}")
    lines.append("  recomputed: " + (", ".join(
        f"{names[op.recomputes.outputs[0]]} {_short(op.target)}" for op in clones
        if op.outputs) or "-"))
    return lines


def _who(v: Value) -> str:
    op = v.producer
    if op.kind is OpKind.STATE:
        return op.attrs[STATE].kind.value      # a parameter, buffer or constant
    return f"{_short(op.target)} {op.module or '-'}"


def _short(target: str) -> str:
    return target.removeprefix("aten.").removesuffix(".default")


def _ordered(values: set[Value], names: dict) -> list[Value]:
    return sorted(values, key=lambda v: int(names[v].lstrip("%")))
