"""The placement integer program: one strategy per op for a whole captured step.

Variables: ``x[op, c]`` binary, one strategy per op (parameters, states and inputs are ops
whose strategies are their placements, ``auto.candidates``). On each edge (a value from its
producer to one consumer) the cost of moving the producer's output placement ``p`` to the
placement ``q`` the consumer needs is paid when both are chosen: where either side has one
distinct placement over all its strategies that cost is linear in the other side's ``x``;
otherwise the edge's joint choice ``e[p, q]`` in [0, 1] for every pair (p, q), with
``sum_q e[p, q] = sum x[producer, c: out=p]`` and ``sum_p e[p, q] = sum x[consumer, c':
need=q]`` (the marginal, or local-polytope, form Alpa uses: its relaxation is tight, so
HiGHS mostly solves at the root; ``e >= x + y - 1`` on the costly pairs alone left gaps it
branched on for minutes).

Repeated layers (``pass_infra.layers``): the ops of identical layers share their ``x`` (the
compute and memory of all of them on one variable, one one-hot row), and an edge repeated
by them shares its ``e`` (its costs added up), so a 24-layer model's program is about a
one-layer model's.

Objective, in seconds: communication (each reshard step's collective by the profile's alpha-
beta at the bytes ``reshard.traffic`` counts; local slices by the pointwise curve) + compute
(the op's FLOPs, ``pipeline.flops``, divided by the ranks that share its output, on the
profile's matmul curve for matrix products and attention, bytes on the pointwise curve
otherwise) + a tiny penalty per change of placement (ties go to moving nothing).

Constraint (optional): per-rank bytes of parameters (counted twice: the gradient is placed
like its parameter) and optimizer states <= ``memory_limit_bytes``.

Grouped shards: a parameter's only where a ``colwise`` plan entry would cut it in groups (a
fused qkv's ``S(0)x3``: ``candidates.fused_shards``) or a pin placed it so, and then passed
on to the values descending from it.

Not modelled: a value moved once for several consumers (each consumer pays, unless
``shared_moves``; the reshard pass reuses moves), overlap of communication with compute,
activation memory.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from ..cost.profile import Profile
from ..ir import Op, OpKind, Program, Value
from ..ir.attrs import NAME, STATE, StateKind
from ..ir.core import TensorType
from ..ir.dist import DistAttr, Partial, ProcessMesh, Shard
from ..pass_infra.layers import RepeatedLayers, repeated_layers
from ..pipeline.flops import FLOPS, op_flops
from ..reshard.paths import plan_reshard
from ..spmd.rule_registry import tensor_inputs
from .candidates import Candidate, fused_shards, op_candidates, start_candidates

__all__ = ["PlacementChoice", "solve_placements", "CHANGE_PENALTY_S"]

# a change of placement that moves nothing (R -> P) still costs an op: 1 ns breaks ties
CHANGE_PENALTY_S = 1e-9
# HiGHS stops within this relative gap of its bound (its default, 1e-4, let a 2-layer GPT's
# tied and untied solves stop at plans 53 ns apart in 3.79 ms); the relaxation is tight, so
# a small gap costs little
MIP_REL_GAP = 1e-7
# HiGHS sees the objective in microseconds: its absolute gap (1e-6) and cost tolerances
# (1e-7) in seconds would swallow the 1 ns change penalty and tell apart no two plans
# within 1 us (on a small model: a 3.79 ms step's plans 53 ns apart came out either way)
OBJECTIVE_UNITS = 1e6


@dataclass
class PlacementChoice:
    """The solved program: a placement per tensor value, the chosen strategy per op, and
    where the objective's seconds come from."""

    values: dict[Value, DistAttr]
    strategies: dict[Op, Candidate]
    comm_s: float
    compute_s: float
    penalty_s: float
    state_bytes: float                       # per rank: parameters, gradients, states
    build_s: float
    solve_s: float
    variables: int
    constraints: int
    status: str
    params: dict[str, DistAttr] = field(default_factory=dict)
    tied_ops: int = 0                        # ops sharing a repeated layer's variables
    layer_classes: int = 0                   # classes of identical layers solved once

    @property
    def objective_s(self) -> float:
        return self.comm_s + self.compute_s + self.penalty_s

    def summary(self) -> str:
        return (f"placement ILP: {self.variables} variables, {self.constraints} constraints, "
                f"build {self.build_s:.3f} s, solve {self.solve_s:.3f} s ({self.status}); "
                f"predicted communication {self.comm_s * 1e3:.3f} ms, compute "
                f"{self.compute_s * 1e3:.3f} ms, state {self.state_bytes / 2**20:.2f} MiB "
                f"per rank; {self.tied_ops} ops tied in {self.layer_classes} layer classes")


def _shards(dist: DistAttr | None) -> int:
    """Ranks over which a value is split (a partial value's terms split the work too)."""
    if dist is None:
        return 1
    return math.prod(n for n, p in zip(dist.mesh.shape, dist.placements)
                     if isinstance(p, (Shard, Partial)))


def _bytes(t: TensorType) -> float:
    return float(t.numel * t.dtype.itemsize)


class _Costs:
    """Seconds of moves and of compute on ``profile``, cached (a model's repeated layers
    ask the same questions)."""

    def __init__(self, mesh: ProcessMesh, profile: Profile):
        self.mesh, self.profile = mesh, profile
        self._moves: dict[tuple, float] = {}

    def move(self, t: TensorType, src: DistAttr, dst: DistAttr) -> float:
        if src == dst:
            return 0.0
        key = (t, src, dst)
        if key not in self._moves:
            self._moves[key] = self._move(t, src, dst) + CHANGE_PENALTY_S
        return self._moves[key]

    def _move(self, t: TensorType, src: DistAttr, dst: DistAttr) -> float:
        itemsize = t.dtype.itemsize
        state, seconds = src.placements, 0.0
        for step in plan_reshard(t.shape, src, dst, itemsize):
            nbytes = step.cost(t.shape, self.mesh, state, itemsize)
            if step.kind in ("slice", "make_partial"):
                seconds += self.profile.pointwise.seconds(nbytes) if nbytes > 0 else 0.0
            else:
                seconds += self.profile.collective_seconds(
                    step.kind, self.mesh.shape[step.mesh_dim], nbytes)
            state = step.advance(state)
        return seconds

    def compute(self, op: Op, cand: Candidate) -> float:
        if op.kind is not OpKind.CALL:
            return 0.0
        out = next((d for d in cand.outputs if d is not None), None)
        share = _shards(out)
        if op.target in FLOPS:
            return self.profile.matmul.seconds(op_flops(op) / share)
        moved = sum(_bytes(v.type) for v in (*tensor_inputs(op), *op.outputs) if v.is_tensor)
        return self.profile.pointwise.seconds(moved / share) if moved else 0.0


def _keeping_pins(op: Op, cands: list[Candidate]) -> list[Candidate]:
    """The strategies that give ``op``'s pinned outputs (an annotation inside the model)
    their placement; all of them if none does (completion too keeps the pin then)."""
    pinned = [v.dist if v.is_tensor else None for v in op.outputs]
    if all(p is None for p in pinned):
        return cands
    kept = [c for c in cands if all(p is None or p == d for p, d in zip(pinned, c.outputs))]
    return kept or cands


def _state_bytes(op: Op, cand: Candidate) -> float:
    """Per-rank bytes a state strategy keeps: a parameter twice (its gradient is placed like
    it), an optimizer state once."""
    if op.kind is not OpKind.STATE or not op.result.is_tensor:
        return 0.0
    copies = 2.0 if op.attrs[STATE].kind is StateKind.PARAM else 1.0
    return copies * _bytes(op.result.type) / _shards(cand.outputs[0])


def _comm_part(cost: float) -> float:
    """A move's seconds without the change penalty (reported apart)."""
    return max(cost - CHANGE_PENALTY_S, 0.0) if cost else 0.0


@dataclass
class _Node:
    op: Op
    cands: list[Candidate]
    first: int = 0        # index of x[op, 0] in the variable vector


class _Builder:
    def __init__(self, program: Program, mesh: ProcessMesh, profile: Profile,
                 shared_moves: bool = False, ties: dict[Op, Op] | None = None,
                 fused: bool = True):
        self.program, self.mesh, self.shared_moves = program, mesh, shared_moves
        self.ties = ties or {}                 # op -> the op whose variables it shares
        self.tied = 0
        # an edge's e variable per (producer variables, consumer variables): tied layers
        # repeat each edge, which then costs its count times on one variable
        self.pairs: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        self.moved: dict[tuple, int] = {}      # shared_moves' u variable per repeated key
        self.joints: dict[tuple, list[int]] = {}   # an edge's joint e[p, q], likewise
        # a fused projection's grouped shards, offered to its parameters and their states
        self.fused = fused_shards(program, mesh) if fused else {}
        self.costs = _Costs(mesh, profile)
        self.nodes: dict[Op, _Node] = {}
        self.c: list[float] = []               # objective per variable
        self.comm: list[float] = []            # its communication part
        self.rows: list[tuple[dict[int, float], float, float]] = []   # (coefs, lo, hi)
        self.binary: list[int] = []
        self.memory_coefs: dict[int, float] = {}
        self.grouped: set[Value] = set()       # values descending from a grouped pin
        # per value, each consumer's strategies by the placement they need (an empty list:
        # needed whatever is chosen, as the loss is replicated)
        self.wanted: dict[Value, list[dict[DistAttr, list[int]]]] = defaultdict(list)
        self.constant_s = self.constant_comm_s = 0.0    # moves no choice can avoid

    def _var(self, cost: float, comm: float, binary: bool) -> int:
        self.c.append(cost)
        self.comm.append(comm)
        self.binary.append(1 if binary else 0)
        return len(self.c) - 1

    def build(self, memory_limit_bytes: float | None) -> None:
        for op in self.program.ops:
            if op.kind in (OpKind.INPUT, OpKind.STATE):
                offered: tuple = self.fused.get(op.result, ())
                if offered or op.result.is_tensor and op.result.dist is not None and any(
                        isinstance(p, Shard) and p.groups != 1
                        for p in op.result.dist.placements):
                    self.grouped.add(op.result)
            elif op.kind is OpKind.CALL:
                offered = tuple(frozenset(self._offered(v)) for v in tensor_inputs(op))
            else:
                continue
            node = self._tied(op) or self._own(op, offered)
            self.nodes[op] = node
            for i, cand in enumerate(node.cands):
                self.c[node.first + i] += self.costs.compute(op, cand)
        for op in self.program.ops:
            if op.kind is OpKind.CALL:
                for j, v in enumerate(tensor_inputs(op)):
                    self.wanted[v].append(self._by_need(op, j))
        self._outputs()
        for v, wants in self.wanted.items():
            if len(wants) > 1 and self.shared_moves:
                self._shared(v, wants)
            else:
                for want in wants:
                    self._edge(v, want)
        self._memory(memory_limit_bytes)

    def _own(self, op: Op, offered: tuple) -> _Node:
        """``op``'s own variables x[op, c] and their one-hot row."""
        if op.kind is OpKind.CALL:
            cands = _keeping_pins(op, op_candidates(op, self.mesh, offered))
        else:
            cands = start_candidates(op, self.mesh, offered)
        node = _Node(op, cands, len(self.c))
        for _ in cands:
            self._var(0.0, 0.0, True)
        self.rows.append(({node.first + i: 1.0 for i in range(len(cands))}, 1.0, 1.0))
        return node

    def _tied(self, op: Op) -> _Node | None:
        """The variables (and so the candidates) of the op ``op`` is tied to
        (``pass_infra.layers``: same target, arguments, types and pins, so each of its strategies
        is one of ``op``'s). What the producers offer may differ at a layer's edge (a
        grouped shard a view derives, offered to a later layer only: its residual input
        descends from the first layer's fused qkv); the first layer's offers stand."""
        rep = self.ties.get(op)
        node = self.nodes.get(rep) if rep is not None else None
        if node is None:
            return None
        self.tied += 1
        return _Node(op, node.cands, node.first)

    def _offered(self, v: Value) -> set[DistAttr]:
        """Grouped shards ``v``'s producer offers where ``v`` descends from a value placed
        grouped (a plan's fused qkv ``S(0)x3``, or a candidate of one: ``fused_shards``):
        the enumeration lacks them. Only there: offering every producer placement
        (partials, grouped and uneven shards the rules derive) made the 2-layer GPT's solve
        15-25x slower (34-65 s, not 2.4 s, in the earlier e >= x + y - 1 form) for the
        same optimum."""
        node = self.nodes[v.producer]
        if v.producer.kind is OpKind.CALL:
            if not any(u in self.grouped for u in tensor_inputs(v.producer)):
                return set()
            self.grouped.add(v)
        return {d for c in node.cands if (d := c.outputs[v.index]) is not None
                and any(isinstance(p, Shard) and p.groups != 1 for p in d.placements)}

    # -- edges -------------------------------------------------------------------------
    def _by_produced(self, v: Value) -> dict[DistAttr, list[int]]:
        node = self.nodes[v.producer]
        groups: dict[DistAttr, list[int]] = defaultdict(list)
        for i, cand in enumerate(node.cands):
            groups[cand.outputs[v.index]].append(node.first + i)
        return groups

    def _by_need(self, op: Op, j: int) -> dict[DistAttr, list[int]]:
        node = self.nodes[op]
        groups: dict[DistAttr, list[int]] = defaultdict(list)
        for i, cand in enumerate(node.cands):
            groups[cand.needs[j]].append(node.first + i)
        return groups

    def _edge(self, v: Value, needs: dict[DistAttr, list[int]], always: bool = True) -> None:
        """Pay moving ``v`` from its producer's placement to the one its consumer needs;
        ``needs``: placement -> the variables choosing it. With one key and ``always``,
        the consumer needs it whatever it chooses: the cost is linear in the producer's
        choice (a constant if that is fixed too)."""
        have = self._by_produced(v)
        if len(needs) == 1 and always:
            q = next(iter(needs))
            for p, xs in have.items():
                cost = self.costs.move(v.type, p, q)
                if len(have) == 1:
                    self.constant_s += cost
                    self.constant_comm_s += _comm_part(cost)
                for x in xs if len(have) > 1 else ():
                    self.c[x] += cost
                    self.comm[x] += _comm_part(cost)
            return
        if len(have) == 1:
            p = next(iter(have))
            for q, ys in needs.items():
                cost = self.costs.move(v.type, p, q)
                for y in ys:
                    self.c[y] += cost
                    self.comm[y] += _comm_part(cost)
            return
        if always:
            self._joint(v, have, needs)
            return
        for p, xs in have.items():       # shared_moves' u: needs[q] is no partition
            for q, ys in needs.items():
                cost = self.costs.move(v.type, p, q)
                if cost != 0.0:
                    self._pair(tuple(xs), tuple(ys), cost)

    def _joint(self, v: Value, have: dict[DistAttr, list[int]],
               needs: dict[DistAttr, list[int]]) -> None:
        """The edge's joint choice: ``e[p, q]`` in [0, 1] for every pair, whose sums over
        ``q`` are the producer's ``x`` choosing ``p`` and over ``p`` the consumer's choosing
        ``q``; ``e`` pays the move. Tight: on the 2-layer E=1024 GPT (tp2) the relaxation's
        optimum is integral and HiGHS solves at the root in 0.05 s, where the looser
        ``e >= x + y - 1`` on the costly pairs only left a 6% gap and branched 8 s. A tied
        layer's repeat of an edge adds its costs to the first one's ``e``."""
        costs = [self.costs.move(v.type, p, q) for p in have for q in needs]
        key = (tuple(tuple(xs) for xs in have.values()),
               tuple(tuple(ys) for ys in needs.values()))
        es = self.joints.get(key)
        if es is None:
            es = self.joints[key] = [self._var(0.0, 0.0, False) for _ in costs]
            nq = len(needs)
            for i, xs in enumerate(have.values()):
                row = {es[i * nq + j]: 1.0 for j in range(nq)}
                row.update({x: -1.0 for x in xs})
                self.rows.append((row, 0.0, 0.0))
            for j, ys in enumerate(needs.values()):
                row = {es[i * nq + j]: 1.0 for i in range(len(have))}
                row.update({y: row.get(y, 0.0) - 1.0 for y in ys})
                self.rows.append((row, 0.0, 0.0))
        for e, cost in zip(es, costs):
            self.c[e] += cost
            self.comm[e] += _comm_part(cost)

    def _pair(self, xs: tuple[int, ...], ys: tuple[int, ...], cost: float) -> None:
        """``e >= sum xs + sum ys - 1`` costing ``cost``; a repeated pair adds its cost to
        the first one's e."""
        e = self.pairs.get((xs, ys))
        if e is not None:
            self.c[e] += cost
            self.comm[e] += _comm_part(cost)
            return
        e = self.pairs[(xs, ys)] = self._var(cost, _comm_part(cost), False)
        coefs = {e: 1.0}
        for x in (*xs, *ys):
            coefs[x] = coefs.get(x, 0.0) - 1.0
        self.rows.append((coefs, -1.0, np.inf))

    def _shared(self, v: Value, wants: list[dict[DistAttr, list[int]]]) -> None:
        """Several consumers: each distinct placement they need is paid once (reshard moves
        a value once per target): ``u[q] >= sum x[consumer, c': need=q]`` per consumer, then
        the producer-to-``q`` cost on ``u[q]`` as on a single edge."""
        have = self._by_produced(v)
        targets: dict[DistAttr, list[list[int]]] = defaultdict(list)
        for want in wants:
            for q, ys in want.items():
                targets[q].append(ys)
        for q, groups in targets.items():
            costs = {p: self.costs.move(v.type, p, q) for p in have}
            if not any(costs.values()):
                continue
            if any(not ys for ys in groups):          # needed whatever is chosen
                self._edge(v, {q: []})
                continue
            key = (tuple(x for xs in have.values() for x in xs), q,
                   tuple(sorted(tuple(ys) for ys in groups)))
            u = self.moved.get(key)
            if u is None:        # a tied layer's repeat: same u, its cost counted again
                u = self.moved[key] = self._var(0.0, 0.0, False)
                for ys in groups:
                    self.rows.append(({u: 1.0, **{y: -1.0 for y in ys}}, 0.0, np.inf))
            self._edge(v, {q: [u]}, always=False)

    def _outputs(self) -> None:
        """The loss and outputs are wanted replicated; an updated state goes back where the
        state lives; a gradient stays as computed."""
        states = {op.attrs[NAME]: op for op in self.program.ops_of(OpKind.STATE)}
        for slot, v in self.program.results():
            if not v.is_tensor or slot.kind == "grad":
                continue
            if slot.kind == "update":
                state = self.nodes[states[slot.name]]
                needs: dict[DistAttr, list[int]] = defaultdict(list)
                for i, cand in enumerate(state.cands):
                    needs[cand.outputs[0]].append(state.first + i)
                self.wanted[v].append(needs)
            else:
                self.wanted[v].append({DistAttr.replicated(self.mesh): []})

    def _memory(self, limit: float | None) -> None:
        """Per-rank state bytes of each start strategy (tied states' summed); a row when
        there is a limit."""
        coefs: dict[int, float] = defaultdict(float)
        for op, node in self.nodes.items():
            for i, cand in enumerate(node.cands):
                if nbytes := _state_bytes(op, cand):
                    coefs[node.first + i] += nbytes
        self.memory_coefs = coefs
        if limit is not None:
            self.rows.append((coefs, -np.inf, float(limit)))

    # -- solve -------------------------------------------------------------------------
    def matrix(self):
        r, c, d = [], [], []
        for i, (coefs, _, _) in enumerate(self.rows):
            for j, a in coefs.items():
                r.append(i)
                c.append(j)
                d.append(a)
        shape = (len(self.rows), len(self.c))
        a = coo_array((d, (r, c)), shape=shape).tocsr()
        lo = np.array([row[1] for row in self.rows])
        hi = np.array([row[2] for row in self.rows])
        return LinearConstraint(a, lo, hi)


def solve_placements(program: Program, mesh: ProcessMesh, profile: Profile | None = None,
                     memory_limit_bytes: float | None = None,
                     time_limit_s: float | None = None, shared_moves: bool = False,
                     tie_layers: bool = True, fused: bool = True,
                     mip_rel_gap: float = MIP_REL_GAP) -> PlacementChoice:
    """Choose a strategy for every op of ``program`` (placed values stay as pinned) on
    ``mesh``, minimising predicted step seconds on ``profile`` (default: the reference
    profile), within ``memory_limit_bytes`` of parameters, gradients and optimizer state per
    rank. ``shared_moves``: a value several consumers need in one placement is moved (and
    paid) once, as the reshard pass does, at the price of a variable per (value, placement)
    and one row per consumer: on the 2-layer E=512 GPT it chose the same plan with a solve
    6x slower (0.6 s, not 0.1 s), so it is off by default. Raises ValueError when no placement
    fits the limit. ``tie_layers``: identical repeated layers (``pass_infra.layers``) share one
    strategy, so the program holds one layer of each class (the optimum is then the best
    plan in which every identical layer does the same). ``fused``: offer the grouped shard
    of a fused projection's parameters (``candidates.fused_shards``); without it the ILP
    cannot choose Megatron's colwise qkv."""
    profile = profile or Profile.reference()
    start = time.perf_counter()
    layers = repeated_layers(program) if tie_layers else RepeatedLayers()
    builder = _Builder(program, mesh, profile, shared_moves, layers.ties, fused)
    builder.build(memory_limit_bytes)
    constraints = builder.matrix()
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    n = len(builder.c)
    options = {"disp": False, "mip_rel_gap": mip_rel_gap} | (
        {"time_limit": time_limit_s} if time_limit_s else {})
    result = milp(np.array(builder.c) * OBJECTIVE_UNITS, constraints=constraints,
                  integrality=np.array(builder.binary), bounds=Bounds(0, 1), options=options)
    solve_s = time.perf_counter() - start
    if result.x is None:
        limit = "" if memory_limit_bytes is None else \
            f" within {memory_limit_bytes / 2**20:.2f} MiB of state per rank"
        raise ValueError(f"placement ILP on {mesh}: no placement found{limit} "
                         f"({result.message})")
    choice = _choice(builder, result, build_s, solve_s, n)
    choice.tied_ops, choice.layer_classes = builder.tied, len(layers.classes)
    return choice


def _choice(builder: _Builder, result, build_s: float, solve_s: float, n: int
            ) -> PlacementChoice:
    x = result.x
    values: dict[Value, DistAttr] = {}
    strategies: dict[Op, Candidate] = {}
    compute = state_bytes = 0.0
    for op, node in builder.nodes.items():
        chosen = max(range(len(node.cands)), key=lambda i: x[node.first + i])
        cand = strategies[op] = node.cands[chosen]
        compute += builder.costs.compute(op, cand)
        state_bytes += _state_bytes(op, cand)
        for v, dist in zip(op.outputs, cand.outputs):
            if dist is not None:
                values[v] = dist
    rounded = np.round(x)
    comm = float(np.dot(builder.comm, rounded)) + builder.constant_comm_s
    penalty = float(np.dot(builder.c, rounded)) + builder.constant_s - comm - compute
    params = {op.attrs[NAME]: values[op.result] for op in builder.program.states(StateKind.PARAM)
              if op.result in values}
    return PlacementChoice(values, strategies, comm, compute, max(penalty, 0.0), state_bytes,
                           build_s, solve_s, n, len(builder.rows), result.message, params)
