"""Reference executor: run reshard steps on the pieces of every rank at once.

This fixes the exact semantics the in-process simulator backend and the c10d runtime must
match. A *group* along mesh dim d is the ranks whose coordinates differ only in d, ordered
by their index along d (``ProcessMesh.groups`` order). For a rank at index i of its group
of n ranks, and ``chunk(x, t, i)`` = chunk i of ``torch.chunk(x, n, dim=t)`` (empty when
torch.chunk returns fewer chunks):

* all_reduce(op):          every rank gets op-reduce(group pieces)
* reduce_scatter(t, op):   chunk(op-reduce(group pieces), t, i)
* all_gather(t):           cat(group pieces in group order, dim=t)
* slice(t):                chunk(own piece, t, i)

With ``g`` groups (a grouped shard, ``S(t)xg``, or ``S(t)x2:1:1``: groups of relative
widths 2, 1, 1) chunk and cat work group by group (``ir.dist.chunk_grouped`` /
``cat_grouped``): chunk i of each group of dim t, in group order; all_gather puts every
rank's block of group k before group k+1.

* all_to_all(f -> t):      chunk(cat(group pieces, dim=f), t, i)  — what a real all_to_all
                           delivers when the blocks split evenly (the planner ensures it)
* make_partial(op):        sum and finite norms: index 0 keeps its piece, the others hold
                           zeros; avg/max/min and norminf: every rank keeps its piece
* shift(t, k):             the piece of member (i - k) mod n — the placement stays S(t),
                           dim t of the whole tensor rolls by k pieces (the pieces must be
                           equal: a shift of uneven ones would break S(t)'s chunk sizes)

avg is the mean over the group; a norm op (``P(norm2)``, ``ir.dist.norm_partial``) reduces
to the p-norm of the group's terms, elementwise (norminf: their largest magnitude). Pieces
are never mutated; every output is a new tensor.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ..ir.dist import (
    Partial,
    ProcessMesh,
    cat_grouped,
    chunk_grouped,
    keeps_partial_value,
    local_offset,
    local_size,
    reduce_terms,
)
from .steps import (
    AllGather,
    AllReduce,
    AllToAll,
    MakePartial,
    ReduceScatter,
    Shift,
    Slice,
    Step,
)

__all__ = ["apply_steps", "apply_step"]

Coordinate = tuple[int, ...]
Pieces = dict[Coordinate, torch.Tensor]


def _chunk(x: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    """Chunk i of n along ``dim`` with torch.chunk sizes (ir.dist arithmetic)."""
    size = x.shape[dim]
    return x.narrow(dim, local_offset(size, n, i), local_size(size, n, i)).clone()


def _reduce(terms: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    if op == "avg":     # the group's mean, a float even of integer terms
        return torch.stack(list(terms)).sum(0) / len(terms)
    return reduce_terms(terms, op)


def _group(pieces: Mapping[Coordinate, torch.Tensor], coord: Coordinate,
           mesh_dim: int, n: int) -> list[torch.Tensor]:
    """The pieces of ``coord``'s group along ``mesh_dim``, in group order."""
    return [pieces[coord[:mesh_dim] + (j,) + coord[mesh_dim + 1:]] for j in range(n)]


# Each rule: (step, own index i in the group, group size n, group pieces) -> new piece.
Rule = Callable[[Step, int, int, list[torch.Tensor]], torch.Tensor]


def _all_reduce(s: AllReduce, i: int, n: int, group: list[torch.Tensor]) -> torch.Tensor:
    return _reduce(group, s.op)


def _reduce_scatter(s: ReduceScatter, i: int, n: int,
                    group: list[torch.Tensor]) -> torch.Tensor:
    if s.groups != 1:
        return chunk_grouped(_reduce(group, s.op), s.tensor_dim, n, i, s.groups)
    return _chunk(_reduce(group, s.op), s.tensor_dim, n, i)


def _all_gather(s: AllGather, i: int, n: int, group: list[torch.Tensor]) -> torch.Tensor:
    return cat_grouped(group, s.tensor_dim, s.groups)


def _slice(s: Slice, i: int, n: int, group: list[torch.Tensor]) -> torch.Tensor:
    if s.groups != 1:
        return chunk_grouped(group[i], s.tensor_dim, n, i, s.groups)
    return _chunk(group[i], s.tensor_dim, n, i)


def _all_to_all(s: AllToAll, i: int, n: int, group: list[torch.Tensor]) -> torch.Tensor:
    return _chunk(torch.cat(group, dim=s.from_dim), s.to_dim, n, i)


def _make_partial(s: MakePartial, i: int, n: int, group: list[torch.Tensor]) -> torch.Tensor:
    if not keeps_partial_value(Partial(s.op), i):
        return torch.zeros_like(group[i])
    return group[i].clone()


def _shift(s: Shift, i: int, n: int, group: list[torch.Tensor]) -> torch.Tensor:
    shapes = {tuple(p.shape) for p in group}
    if len(shapes) != 1:
        raise ValueError(f"{s}: the group's pieces differ in shape ({sorted(shapes)}); a "
                         "shift needs equal pieces, or it would break S(t)'s chunk sizes")
    return group[(i - s.shift) % n].clone()


RULES: dict[type[Step], Rule] = {
    AllReduce: _all_reduce, ReduceScatter: _reduce_scatter, AllGather: _all_gather,
    Slice: _slice, AllToAll: _all_to_all, MakePartial: _make_partial, Shift: _shift,
}


def apply_step(pieces: Mapping[Coordinate, torch.Tensor], mesh: ProcessMesh,
               step: Step) -> Pieces:
    """Run one step on every rank's piece; returns new pieces keyed by coordinate."""
    rule, d = RULES[type(step)], step.mesh_dim
    n = mesh.shape[d]
    return {c: rule(step, c[d], n, _group(pieces, c, d, n)) for c in mesh.coordinates()}


def apply_steps(pieces: Mapping[Sequence[int], torch.Tensor], shape: Sequence[int],
                mesh: ProcessMesh, steps: Sequence[Step]) -> Pieces:
    """Run ``steps`` in order on the pieces of all ranks of ``mesh`` (one per coordinate)
    of a tensor of global ``shape``; returns the pieces after the last step."""
    current: Pieces = {tuple(c): t for c, t in pieces.items()}
    missing = [c for c in mesh.coordinates() if c not in current]
    if missing or len(current) != mesh.size:
        raise ValueError(f"apply_steps on {mesh} for shape {list(shape)}: need one piece per "
                         f"coordinate; missing {missing}, got {sorted(current)}")
    for step in steps:
        if not 0 <= step.mesh_dim < mesh.ndim:
            raise ValueError(f"{step}: mesh dim {step.mesh_dim} out of range for {mesh}")
        current = apply_step(current, mesh, step)
    return current
