"""Candidate strategies of one op, generated from the SPMD rule registry (no per-op table).

A strategy is a Decision of the op's rule: the placement each tensor input needs and each
output gets. What is enumerated:

* a CALL op with a rule: ``rule.forward`` asked once with every input replicated, then once
  per (tensor input, candidate placement of that input) with that input as the only placed
  one and the others None (they follow at no cost, so the rule answers what this input's
  placement implies). An input's candidate placements are the enumerated ones below plus
  the placements its producer's strategies can give it (``offered``; the ILP offers grouped
  shards only): so a fused qkv's ``S(0)x3``, pinned by a plan, passes through the ops that
  keep it. Deduplicated by (needs, outputs).
* a candidate placement of a tensor: on each mesh dim of more than one rank, Replicate or
  Shard(d) for every tensor dim d the mesh dim divides, all combinations across mesh dims.

What is not: Partial driving placements (a partial value is reduced where its consumer needs
it: the edge pays), grouped shards (``S(d)xg``) no producer offers, uneven shards (unless
offered), and combinations of two or more inputs placed at once beyond what the rule derives
from one.

An op without a rule has one strategy: everything replicated (as completion runs it). A
parameter, state or input is an "op" whose strategies are its placements: one when it is
already pinned (annotation, batch sharding, plan), else the candidate placements without
partials (state holds whole values or shards), plus the grouped shard of a fused
projection (``fused_shards``): the weight and bias of a linear whose output the program
splits into pieces (a fused qkv's ``S(0)x3``, Megatron's colwise), and their optimizer
states, on each mesh dim, as a ``colwise`` plan entry would pin them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Collection, Sequence

from ..ir import Op, OpKind, Program, StateKind, Value
from ..ir.attrs import NAME, STATE
from ..ir.core import TensorType
from ..ir.dist import DistAttr, Placement, ProcessMesh, Replicate, Shard
from ..pass_infra.pinning import AnnotationError
from ..passes.tensor_parallel_plan import style_placement
from ..spmd import lookup
from ..spmd.rule_registry import tensor_inputs

__all__ = ["Candidate", "placements_of", "op_candidates", "start_candidates", "fused_shards"]


@dataclass(frozen=True)
class Candidate:
    """One strategy: the placement each tensor input needs and each output gets (None: not
    a tensor)."""

    needs: tuple[DistAttr, ...]
    outputs: tuple[DistAttr | None, ...]


def placements_of(t: TensorType, mesh: ProcessMesh) -> list[DistAttr]:
    """Replicated first, then every even shard combination over the mesh dims."""
    per_dim: list[list[Placement]] = []
    for n in mesh.shape:
        options: list[Placement] = [Replicate()]
        if n > 1:
            options += [Shard(d) for d, size in enumerate(t.shape) if size % n == 0 and size]
        per_dim.append(options)
    found = []
    for combo in itertools.product(*per_dim):
        if _divides(t.shape, mesh, combo):
            found.append(DistAttr(mesh, tuple(combo)))
    return found


def _divides(shape: tuple[int, ...], mesh: ProcessMesh, combo: tuple[Placement, ...]) -> bool:
    """Every tensor dim divides by the product of the mesh dims that cut it."""
    cut = [1] * len(shape)
    for n, p in zip(mesh.shape, combo):
        if isinstance(p, Shard):
            cut[p.dim] *= n
    return all(size % c == 0 for size, c in zip(shape, cut))


def _replicated_candidate(op: Op, mesh: ProcessMesh) -> Candidate:
    r = DistAttr.replicated(mesh)
    return Candidate(tuple(r for _ in tensor_inputs(op)),
                     tuple(r if v.is_tensor else None for v in op.outputs))


def op_candidates(op: Op, mesh: ProcessMesh,
                  offered: Sequence[Collection[DistAttr]] = ()) -> list[Candidate]:
    """The strategies of CALL ``op`` on ``mesh`` (module docstring); ``offered``: per tensor
    input, the placements its producer's strategies give it."""
    rule = lookup(op)
    ins = tensor_inputs(op)
    if rule is None or not ins:
        return [_replicated_candidate(op, mesh)]
    replicated = DistAttr.replicated(mesh)
    asks: list[list[DistAttr | None]] = [[replicated] * len(ins)]
    for i, v in enumerate(ins):
        extra = offered[i] if i < len(offered) else ()
        driving = dict.fromkeys([*placements_of(v.type, mesh), *extra])
        for dist in driving:
            if dist != replicated:
                asks.append([dist if j == i else None for j in range(len(ins))])
    found: dict[tuple, Candidate] = {}
    for dists in asks:
        try:
            decision = rule.forward(op, dists, mesh)
        except (ValueError, NotImplementedError):   # SpecError too
            continue    # a placement the rule refuses for this op is no candidate
        key = (decision.needs, decision.outputs)
        found.setdefault(key, Candidate(decision.needs, decision.outputs))
    return list(found.values()) or [_replicated_candidate(op, mesh)]


def start_candidates(op: Op, mesh: ProcessMesh, grouped: Sequence[DistAttr] = ()
                     ) -> list[Candidate]:
    """A parameter's, state's or input's placements: its pinned one, else every candidate
    placement (replicated first), then ``grouped`` (``fused_shards``). A non-tensor start
    has one, empty, strategy."""
    assert op.kind in (OpKind.INPUT, OpKind.STATE), op
    v: Value = op.outputs[0]
    if not v.is_tensor:
        return [Candidate((), (None,))]
    if v.dist is not None:
        return [Candidate((), (v.dist,))]
    return [Candidate((), (dist,)) for dist in (*placements_of(v.type, mesh), *grouped)]


def fused_shards(program: Program, mesh: ProcessMesh) -> dict[Value, tuple[DistAttr, ...]]:
    """The grouped shards of each unpinned parameter a ``colwise`` plan entry would cut in
    groups (``passes.tensor_parallel_plan``: a linear's output split into pieces; the
    enumeration has no grouped shards, so without these the ILP could not choose a fused
    qkv's colwise ``S(0)x3``), one per mesh dim, and the same for the parameter's optimizer
    states of its shape (``StateKey.param``)."""
    users = program.users()
    found: dict[Value, tuple[DistAttr, ...]] = {}
    by_name: dict[str, Value] = {}
    for op in program.states(StateKind.PARAM):
        v, name = op.result, op.attrs[NAME]
        if v.is_tensor and v.dist is None and (dists := _grouped(v, name, mesh, users)):
            found[v], by_name[name] = dists, v
    for op in program.states(StateKind.OPTIM):
        param = by_name.get(op.attrs[STATE].param)
        v = op.result
        if param is not None and v.is_tensor and v.dist is None \
                and v.type.shape == param.type.shape:
            found[v] = found[param]
    return found


def _grouped(v: Value, name: str, mesh: ProcessMesh, users: dict[Value, list[Op]]
             ) -> tuple[DistAttr, ...]:
    dists = []
    for axis, n in enumerate(mesh.shape):
        if n == 1:
            continue
        try:
            dist = style_placement(v, "colwise", axis, mesh, users, name)
        except AnnotationError:     # no dim gives a sharded output, or heads not whole
            continue
        if any(isinstance(p, Shard) and p.grouped for p in dist.placements):
            dists.append(dist)
    return tuple(dists)
