"""Completion: give every tensor value of the program a placement.

Pinned values (annotations, the plan, the batch) never change. Each op is decided once, by
its SPMD rule, when all its tensor inputs are placed (forward sweep); the rule also says
which placement each input must have, so where a value's consumers disagree with it reshard
will move it. An op whose inputs are only partly placed asks its unplaced inputs for the
placement it would want; the reverse sweep carries such requests up through ops whose inputs
are all unplaced (by the rules' reverse inference) to the parameters, states and inputs that
start them, which take the first request. Sweeps repeat to a fixpoint; a start value nobody
asked for ends replicated. Every choice is recorded on the value for explain.
"""
from __future__ import annotations

import warnings

from ..ir import Op, OpKind, Program, Value
from ..ir.attrs import NAME
from ..ir.dist import DistAttr, ProcessMesh, Replicate
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..spmd import lookup
from ..spmd.einsum import Decision, MeshDimChoice, Option
from ..spmd.rule_registry import describe, tensor_inputs


def _signature(a):
    """Hashable form of op arguments: values by their type, containers as tuples."""
    if isinstance(a, Value):
        return a.type
    if isinstance(a, (tuple, list)):
        return tuple(_signature(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _signature(x)) for k, x in a.items())
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


class MissingRuleError(NotImplementedError):
    """An op has no SPMD rule and ``debug.strict_rules`` is on."""


class MissingRuleWarning(UserWarning):
    """An op has no SPMD rule: it runs replicated."""


def completion(program: Program, ctx: PassContext) -> Program:
    if ctx.state.mesh is None:
        return program
    _Completion(program, ctx.state.mesh, ctx.strategy.debug.strict_rules).run()
    return program


class _Completion:
    def __init__(self, program: Program, mesh: ProcessMesh, strict: bool):
        self.program, self.mesh, self.strict = program, mesh, strict
        self.requests: dict[Value, tuple[DistAttr, Op]] = {}
        self.pending = [op for op in program.ops if op.kind is OpKind.CALL]
        self.position = {op: i for i, op in enumerate(program.ops)}
        self.ins = {op: tensor_inputs(op) for op in self.pending}
        # placements values are already being moved to, for their earlier consumers
        self.moved: dict[Value, set[DistAttr]] = {}
        self.decided: dict[tuple, Decision] = {}
        self.warned: set[str] = set()

    def run(self) -> None:
        while self.pending:
            before = len(self.pending)
            self._forward_sweep()
            # a start placed by request is progress: the next forward sweep may decide its
            # consumers, which ask for the other starts they read (an optimizer state asks
            # for its parameter's placement) before any is replicated by default
            started = self._reverse_sweep()
            if len(self.pending) == before and not started and not self._place_starts():
                stuck = ", ".join(describe(op) for op in self.pending[:5])
                raise RuntimeError(f"completion made no progress on {len(self.pending)} ops "
                                   f"on {self.mesh}: {stuck}")
        self._place_starts(default=True)
        self._place_outputs()

    # -- sweeps -----------------------------------------------------------------------
    def _forward_sweep(self) -> None:
        waiting = []
        for op in self.pending:
            ins = self.ins[op]
            dists = [v.dist for v in ins]
            if ins and all(d is None for d in dists):
                waiting.append(op)
                continue
            decision = self._decide(op, dists)
            if any(d is None for d in dists):
                for v, need in zip(ins, decision.needs):
                    if v.dist is None:
                        self._request(v, need, op)
                waiting.append(op)
                continue
            self._commit(op, ins, decision)
        self.pending = waiting

    def _reverse_sweep(self) -> bool:
        """Carry requests up; True if a start value took one."""
        pending, started = set(self.pending), False
        for op in reversed(self.program.ops):
            if op.kind in (OpKind.INPUT, OpKind.STATE):
                started = self._place_start(op.outputs[0]) or started
            elif op in pending and all(v.dist is None for v in self.ins[op]):
                # an op with a placed input asked for the rest itself, in the forward sweep
                hints = [self.requests.get(v, (None, None))[0] for v in op.outputs]
                if any(h is not None for h in hints):
                    rule = lookup(op)
                    wanted = (rule.reverse(op, hints, self.mesh) if rule is not None
                              else [DistAttr.replicated(self.mesh)] * len(self.ins[op]))
                    for v, need in zip(self.ins[op], wanted):
                        if v.dist is None:
                            self._request(v, need, op)
        return started

    def _request(self, v: Value, need: DistAttr, op: Op) -> None:
        """The earliest consumer in program order wins: forward uses before backward ones."""
        current = self.requests.get(v)
        if current is None or self.position[op] < self.position[current[1]]:
            self.requests[v] = (need, op)

    # -- decisions ---------------------------------------------------------------------
    def _decide(self, op: Op, dists: list[DistAttr | None]) -> Decision:
        rule = lookup(op)
        if rule is not None:
            available = [frozenset(self.moved.get(v, ())) for v in self.ins[op]]
            # A rule sees only the op's arguments, types and placements: the 24 identical
            # layers of a model ask the same question 24 times; answer it once.
            key = (op.target, _signature(op.args), _signature(op.kwargs),
                   tuple(v.type for v in op.outputs), tuple(dists), tuple(available))
            if key not in self.decided:
                self.decided[key] = rule.forward(op, dists, self.mesh, available)
            return self.decided[key]
        self._missing_rule(op)
        replicated = DistAttr.replicated(self.mesh)
        fallback = tuple(MeshDimChoice(m, Option("no rule", "replicated"), 0.0, ())
                         for m in range(self.mesh.ndim))
        return Decision(tuple(replicated for _ in dists),
                        tuple(replicated if v.is_tensor else None for v in op.outputs), fallback)

    def _missing_rule(self, op: Op) -> None:
        message = (f"no SPMD rule for {describe(op)} on {self.mesh}: it runs replicated "
                   f"(its inputs are gathered). Add a rule in autopar/spmd/rules/, or set "
                   f"debug.strict_rules: false to accept this")
        if self.strict:
            raise MissingRuleError(message.replace(
                "debug.strict_rules: false to accept this",
                "debug.strict_rules: false to run it replicated"))
        if op.target not in self.warned:
            self.warned.add(op.target)
            warnings.warn(message.replace(", or set debug.strict_rules: false to accept this",
                                          "; debug.strict_rules: true makes this an error"),
                          MissingRuleWarning, stacklevel=2)

    def _commit(self, op: Op, ins: list[Value], decision: Decision) -> None:
        op.needs = decision.needs
        for v, need in zip(ins, decision.needs):
            if need != v.dist:
                self.moved.setdefault(v, set()).add(need)
        has_rule = lookup(op) is not None
        for v, dist in zip(op.outputs, decision.outputs):
            if v.is_tensor and v.dist is None:   # a pinned output (annotate) keeps its why
                v.dist = dist
                v.why = Reason("rule" if has_rule else "no_rule",
                               f"{op.target.removesuffix('.default')} "
                               f"{'rule' if has_rule else 'has no rule: replicated'}",
                               op, tuple(ins), decision.choices)

    # -- values that start the program ------------------------------------------------
    def _place_start(self, v: Value) -> bool:
        if not v.is_tensor or v.dist is not None or v not in self.requests:
            return False
        dist, op = self.requests[v]
        # parameters, states and inputs hold whole values or shards, never partial terms
        v.dist = DistAttr(dist.mesh, tuple(Replicate() if p.is_partial() else p
                                           for p in dist.placements)).check(v.type.shape)
        v.why = Reason("consumer", f"as its first consumer {op.target.removesuffix('.default')}"
                                   f" ({op.module or '-'} {op.role.value}) wants it", op)
        return True

    def _place_starts(self, default: bool = False) -> bool:
        """Replicate every unplaced parameter, state or input nobody asked for; True if any."""
        placed = False
        for op in self.program.ops:
            v = op.outputs[0] if op.kind in (OpKind.INPUT, OpKind.STATE) else None
            if v is not None and v.is_tensor and v.dist is None:
                v.dist = DistAttr.replicated(self.mesh)
                v.why = Reason("default", "no annotation and no consumer placed it: replicated")
                placed = True
        return placed or default

    def _place_outputs(self) -> None:
        place_outputs(self.program, self.mesh)


def place_outputs(program: Program, mesh: ProcessMesh) -> None:
    """The loss and model outputs are wanted whole on every rank; updated state goes back
    where the state lives; gradients stay as computed (also the ILP's completion)."""
    out = program.output_op
    states = {op.attrs[NAME]: op.result for op in program.ops_of(OpKind.STATE)}
    needs = []
    for slot, v in program.results():
        if not v.is_tensor:
            continue
        if slot.kind == "update":
            needs.append(states[slot.name].dist)
        elif slot.kind == "grad":
            needs.append(v.dist)
        else:
            needs.append(DistAttr.replicated(mesh))
    out.needs = tuple(needs)
