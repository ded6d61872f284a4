"""The reshard planner: which 1-D steps turn one DistAttr into another. Pure — no ops.

An n-D change is a path through placement states (one placement per mesh dim); each edge
is one catalogue step on one mesh dim, valid in that state. ``plan_reshard`` runs a
shortest-path search over those states, weighted by ``reshard.traffic`` bytes, so nested shards,
partials and S(i)->S(j) all come out of one rule set instead of special cases.

Validity of a step in a state (why each rule exists):

* Shards of one tensor dim nest in mesh-dim order (later mesh dims cut the piece earlier
  ones left). A step may only add or remove the *innermost* cut of a tensor dim: no later
  mesh dim may shard that dim. So ``(S0,S0) -> (R,S0)`` gathers mesh dim 1, then 0, then
  re-slices mesh dim 1.
* Partials fold from the last mesh dim to the first. Reducing mesh dim d before an inner
  partial e > d is only right when the two ops commute (equal ops, or both of sum/avg).
* All-to-all is planned only when every piece splits evenly on both tensor dims: uneven
  blocks have no exact equal-split all_to_all, so gather + slice is planned instead.
  All-gather and reduce-scatter stay exact for uneven torch.chunk sizes by padding to
  ``n * ceil(size / n)`` and trimming, so they need no such check.
* A grouped shard (``S(t)xg``) is reached only where every piece it cuts divides into its
  groups; it has no all-to-all (S <-> S with a grouped side goes through R).
* New partials (R -> P) cost nothing and are valid anywhere: the extra terms are zeros
  (sum) or copies (avg/max/min), which every reduction order folds back to the value.
* A pipeline's micro-batch dim ``mb`` is time, not processes: over it only sums, gathers,
  slices and new partials exist, they cost nothing, and any other step costs once per
  micro-batch while the value still differs between micro-batches (so gradients are
  accumulated before they are all-reduced). A change with no such step (``S(0) -> S(1)``)
  goes through R: gathered over every micro-batch, then each micro-batch's piece. Norm
  partials (``P(norm2)``) never live on it: accumulating over time knows sums, maxima and
  minima only.
"""
from __future__ import annotations

import heapq
import itertools
from functools import lru_cache
from typing import Sequence

from ..ir.dist import (
    DistAttr,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    format_placements,
    micro_batch_dim,
    norm_order,
)
from .steps import (
    AllGather,
    AllReduce,
    AllToAll,
    MakePartial,
    ReduceScatter,
    Slice,
    Step,
    parent_shape,
    transition,
)

__all__ = ["plan_reshard", "naive_plan", "plan_cost", "step_is_valid"]

State = tuple[Placement, ...]
_LINEAR_OPS = frozenset({"sum", "avg"})
# Over a pipeline's micro-batch dim (one process at different times) a value can only be
# summed or gathered once every micro-batch has made its term, or cut into a micro-batch's
# own piece; each is local work, not communication.
_OVER_TIME = (AllReduce, AllGather, Slice, MakePartial)


def _innermost(state: State, mesh_dim: int, tensor_dim: int) -> bool:
    """True when no mesh dim after ``mesh_dim`` cuts ``tensor_dim``."""
    return not any(p.is_shard(tensor_dim) for p in state[mesh_dim + 1:])


def _reduction_commutes(state: State, mesh_dim: int) -> bool:
    op = state[mesh_dim].op
    return all(p.op == op or {p.op, op} <= _LINEAR_OPS
               for p in state[mesh_dim + 1:] if isinstance(p, Partial))


def _splits_evenly(shape: Sequence[int], mesh: ProcessMesh, state: State, mesh_dim: int,
                   dims: Sequence[int]) -> bool:
    """Every rank's piece before ``mesh_dim`` cuts it divides by the mesh dim's size on
    each of ``dims`` (pieces differ only with the coordinates of the other mesh dims)."""
    n = mesh.shape[mesh_dim]
    others = [range(s) if i != mesh_dim else (0,) for i, s in enumerate(mesh.shape)]
    return all(parent_shape(shape, mesh, state, mesh_dim, c)[t] % n == 0
               for c in itertools.product(*others) for t in dims)


def step_is_valid(step: Step, shape: Sequence[int], mesh: ProcessMesh,
                  state: Sequence[Placement]) -> bool:
    """Whether ``step`` is exact from placements ``state`` (see the module docstring)."""
    state, d = tuple(state), step.mesh_dim
    if state[d] != step.src:
        return False
    if d == micro_batch_dim(mesh) and (not isinstance(step, _OVER_TIME)
                                       or norm_order(getattr(step, "op", "")) is not None):
        return False
    if isinstance(step, (AllReduce, ReduceScatter)) and not _reduction_commutes(state, d):
        return False
    if isinstance(step, (ReduceScatter, Slice, AllToAll)) and not _innermost(
            state, d, step.dst.dim):
        return False
    if isinstance(step, (AllGather, AllToAll)) and not _innermost(state, d, step.src.dim):
        return False
    if isinstance(step, AllToAll):
        return _splits_evenly(shape, mesh, state, d, (step.from_dim, step.to_dim))
    if getattr(step, "groups", 1) != 1 and isinstance(step, (ReduceScatter, Slice)):
        return _groups_divide(shape, mesh, step.advance(state))
    return True


def _groups_divide(shape: Sequence[int], mesh: ProcessMesh, state: State) -> bool:
    try:
        DistAttr(mesh, state).check(shape)
    except ValueError:
        return False
    return True


def plan_cost(shape: Sequence[int], src: DistAttr, steps: Sequence[Step],
              itemsize: int = 4) -> float:
    """Total bytes of ``steps`` run from ``src`` (each step costed in its own state)."""
    state, total = src.placements, 0.0
    for step in steps:
        total += step.cost(shape, src.mesh, state, itemsize)
        state = step.advance(state)
    return total


def _check(shape: Sequence[int], src: DistAttr, dst: DistAttr) -> None:
    if src.mesh != dst.mesh:
        raise ValueError(f"reshard of shape {list(shape)} from {src} to {dst}: moving between "
                         f"meshes ({src.mesh} -> {dst.mesh}) is not supported yet")
    src.check(shape)
    dst.check(shape)


def naive_plan(shape: Sequence[int], src: DistAttr, dst: DistAttr) -> list[Step]:
    """The baseline: reduce every partial and gather every shard (last mesh dim first, so
    each step is innermost), then slice and add partials (first mesh dim first)."""
    _check(shape, src, dst)
    names, steps = src.mesh.dim_names, []
    for d in reversed(range(src.mesh.ndim)):
        step = transition(d, src.placements[d], Replicate(), names[d])
        steps += [step] if step else []
    for d in range(src.mesh.ndim):
        step = transition(d, Replicate(), dst.placements[d], names[d])
        steps += [step] if step else []
    return steps


def _candidates(shape: Sequence[int], src: DistAttr, dst: DistAttr) -> list[list[Placement]]:
    """Placements each mesh dim may pass through: R, its src and dst, any shard (an
    intermediate shard can make an all-to-all possible). Other partials never help.
    A micro-batch dim goes straight from src to dst: a sum or gather over micro-batches is
    only possible once every micro-batch has made its term, so never on the way."""
    shards = [Shard(t) for t in range(len(shape))]
    mb = micro_batch_dim(src.mesh)
    return [list(dict.fromkeys(_over_time(s, t) if d == mb else [Replicate(), s, t, *shards]))
            for d, (s, t) in enumerate(zip(src.placements, dst.placements))]


def _over_time(src: Placement, dst: Placement) -> list[Placement]:
    """A micro-batch dim's way: straight, or through R where no step over time goes
    (``S(0) -> S(1)``: gathered once every micro-batch has made its piece, then cut again).
    Whether the reader can wait for every micro-batch is the pipeline's question
    (``passes/assign_phases.py`` refuses, naming it, where it cannot)."""
    if src == dst or src.is_replicate() or dst.is_replicate():
        return [src, dst]
    return [src, Replicate(), dst]


def plan_reshard(shape: Sequence[int], src: DistAttr, dst: DistAttr,
                 itemsize: int = 4) -> list[Step]:
    """The cheapest valid step sequence from ``src`` to ``dst`` (fewest steps on ties).

    Dijkstra over placement states; ``naive_plan`` is always one of the paths, so the
    result never costs more than gathering everything and slicing again. Remembered per
    question: lowering asks it again for every state piece of every process.
    """
    return list(_plan_reshard(tuple(shape), src, dst, itemsize))


@lru_cache(maxsize=1 << 14)
def _plan_reshard(shape: tuple[int, ...], src: DistAttr, dst: DistAttr,
                  itemsize: int) -> tuple[Step, ...]:
    _check(shape, src, dst)
    mesh, goal = src.mesh, dst.placements
    candidates = _candidates(shape, src, dst)

    @lru_cache(maxsize=None)
    def moves(state: State) -> list[tuple[float, Step]]:
        out = []
        for d, options in enumerate(candidates):
            for target in options:
                step = transition(d, state[d], target, mesh.dim_names[d])
                if step is not None and step_is_valid(step, shape, mesh, state):
                    cost = 0.0 if d == micro_batch_dim(mesh) else \
                        step.cost(shape, mesh, state, itemsize) * _repeats(mesh, state, d)
                    out.append((cost, step))
        return out

    # Keys are (bytes rounded to 1e-6, steps): float noise must not beat a shorter plan.
    best, back = {src.placements: (0.0, 0)}, {src.placements: None}
    heap, tie = [(0.0, 0, 0, src.placements)], itertools.count(1)
    while heap:
        cost, n, _, state = heapq.heappop(heap)
        if state == goal:
            return tuple(_path(back, state))
        if (cost, n) > best[state]:
            continue
        for step_cost, step in moves(state):
            nxt, key = step.advance(state), (round(cost + step_cost, 6), n + 1)
            if nxt not in best or key < best[nxt]:
                best[nxt], back[nxt] = key, (state, step)
                heapq.heappush(heap, (*key, next(tie), nxt))
    raise RuntimeError(f"no reshard plan for shape {list(shape)} from "
                         f"{format_placements(src.placements)} to "
                         f"{format_placements(goal)} on {mesh}: naive_plan should exist")


def _repeats(mesh: ProcessMesh, state: State, mesh_dim: int) -> int:
    """How often a step runs per training step: once per micro-batch while the value still
    differs between micro-batches (sharded or partial over a pipeline's ``mb`` dim), else
    once. So a gradient is accumulated over micro-batches before it is all-reduced."""
    mb = micro_batch_dim(mesh)
    if mb is None or mesh_dim == mb or state[mb].is_replicate():
        return 1
    return mesh.shape[mb]


def _path(back: dict, state: State) -> list[Step]:
    steps: list[Step] = []
    while back[state] is not None:
        state, step = back[state]
        steps.append(step)
    return steps[::-1]

