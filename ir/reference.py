"""Reference semantics of placements on real tensors: what each rank holds
(``shard_tensor_local``) and how the pieces make the global tensor again (``assemble``).

Tests and the simulator check every pass against these two functions. Also what a
Partial's terms reduce to (``reduce_terms``), which index of a mesh dim keeps the value
when R becomes Partial (``keeps_partial_value``), and a grouped shard's cut and join on a
tensor (``chunk_grouped``, ``cat_grouped``).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from .chunks import local_offset, local_runs, local_shape, local_size, local_slices
from .mesh import Coordinate, ProcessMesh
from .placements import Partial, Placement, Shard, format_placements, is_grouped, norm_order
from .shard_groups import Groups, format_groups, group_starts, group_widths

__all__ = ["reduce_terms", "keeps_partial_value", "shard_tensor_local", "chunk_grouped",
           "cat_grouped", "assemble"]


def reduce_terms(terms: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The value Partial(op) terms make: sum, mean, max, min, or the p-norm of the terms
    (elementwise over the stacked terms)."""
    stacked = torch.stack(list(terms))
    order = norm_order(op)
    if order is not None:
        return torch.linalg.vector_norm(stacked, order, dim=0)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        total = stacked.sum(0)
        return total / len(terms) if total.is_floating_point() else total // len(terms)
    if op in ("max", "min"):
        return stacked.amax(0) if op == "max" else stacked.amin(0)
    raise ValueError(f"unknown partial op {op!r}")


def keeps_partial_value(p: Partial, index: int) -> bool:
    """Whether index ``index`` of a mesh dim keeps the value when R becomes ``p``: sum and
    finite norms keep it at index 0 and hold zeros elsewhere (a zero term adds nothing);
    avg/max/min and the max-norm are idempotent over equal terms, so every rank keeps it.
    A norm's terms are norms: this is exact for the non-negative values they are."""
    order = p.norm_order
    return index == 0 or not (p.op == "sum" or (order is not None and not math.isinf(order)))


def _keeps_partial_value(placements: Sequence[Placement], coordinate: Sequence[int]) -> bool:
    return all(keeps_partial_value(p, c) for p, c in zip(placements, coordinate)
               if isinstance(p, Partial))


def shard_tensor_local(tensor: torch.Tensor, mesh: ProcessMesh,
                       placements: Sequence[Placement], coordinate: Sequence[int]
                       ) -> torch.Tensor:
    """The piece of a full ``tensor`` that the rank at ``coordinate`` holds.

    Returns a fresh contiguous tensor, never a view, so a rank updating its piece in place
    (an optimizer step in the simulator) cannot touch the others' pieces.
    """
    if is_grouped(placements):
        piece = tensor
        for d, runs in enumerate(local_runs(tensor.shape, mesh, placements, coordinate)):
            if runs != ((0, tensor.shape[d]),):
                piece = torch.cat([piece.narrow(d, a, b - a) for a, b in runs] or
                                  [piece.narrow(d, 0, 0)], dim=d)
    else:
        piece = tensor[local_slices(tensor.shape, mesh, placements, coordinate)]
    if not _keeps_partial_value(placements, coordinate):
        return torch.zeros_like(piece, memory_format=torch.contiguous_format)
    return piece.clone(memory_format=torch.contiguous_format)


def _fold(pieces: Mapping[Coordinate, torch.Tensor], p: Placement,
          n: int) -> dict[Coordinate, torch.Tensor]:
    """Combine pieces along the last coordinate component: cat shards, reduce partials,
    take index 0 of replicas (replicas are assumed equal, not checked)."""
    out: dict[Coordinate, torch.Tensor] = {}
    for prefix in {c[:-1] for c in pieces}:
        row = [pieces[prefix + (i,)] for i in range(n)]
        if isinstance(p, Shard):
            out[prefix] = cat_grouped(row, p.dim, p.groups)
        elif isinstance(p, Partial):
            out[prefix] = reduce_terms(row, p.op)
        else:
            out[prefix] = row[0]
    return out


def chunk_grouped(x: torch.Tensor, dim: int, n: int, index: int, groups: Groups = 1
                  ) -> torch.Tensor:
    """What ``Shard(dim, groups)`` keeps of ``x`` at index ``index`` of ``n``: chunk
    ``index`` (torch.chunk sizes) of each group of ``dim`` (``groups`` equal ones, or
    groups of the given relative widths), in group order. A new tensor, never a view."""
    parts = group_starts(groups, x.shape[dim], f"chunk_grouped: dim {dim}")
    return torch.cat([x.narrow(dim, lo + local_offset(w, n, index), local_size(w, n, index))
                      for lo, w in parts], dim)


def cat_grouped(pieces: Sequence[torch.Tensor], dim: int, groups: Groups = 1) -> torch.Tensor:
    """Inverse of ``chunk_grouped`` over every index: piece j holds its chunk of each group
    (the groups' widths are those of the whole, the sum of the pieces); the result lays
    group k's blocks of all pieces, in order, before group k+1."""
    if groups == 1:
        return torch.cat(list(pieces), dim=dim)
    n = len(pieces)
    widths = group_widths(groups, sum(p.shape[dim] for p in pieces), f"cat_grouped: dim {dim}")
    blocks = []
    for j, piece in enumerate(pieces):
        sizes = [local_size(w, n, j) for w in widths]
        if sum(sizes) != piece.shape[dim]:
            raise ValueError(f"cat_grouped: piece {j} of {n} has size {piece.shape[dim]} along "
                             f"dim {dim}, not its chunks {sizes} of groups "
                             f"{format_groups(groups)}")
        blocks.append(piece.split(sizes, dim=dim))
    return torch.cat([b[k] for k in range(len(widths)) for b in blocks], dim=dim)


def assemble(pieces: Mapping[Sequence[int], torch.Tensor], global_shape: Sequence[int],
             mesh: ProcessMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """The global tensor from every rank's piece (inverse of ``shard_tensor_local``).

    Folds mesh dims from the last to the first: the last mesh dim cut innermost, so
    undoing the cuts in reverse order restores nested shards. Checks that every coordinate
    is present and every piece has its ``local_shape``.
    """
    pieces = {tuple(c): t for c, t in pieces.items()}
    for c in mesh.coordinates():
        want = local_shape(global_shape, mesh, placements, c)
        if c not in pieces:
            raise ValueError(f"assemble {format_placements(placements)} on {mesh}: "
                             f"no piece for coordinate {c}")
        if tuple(pieces[c].shape) != want:
            raise ValueError(f"assemble {format_placements(placements)} on {mesh}: piece at "
                             f"{c} has shape {list(pieces[c].shape)}, expected {list(want)}")
    if len(pieces) != mesh.size:
        extra = sorted(set(pieces) - set(mesh.coordinates()))
        raise ValueError(f"assemble on {mesh}: coordinates {extra} are outside the mesh")
    for d in reversed(range(mesh.ndim)):
        pieces = _fold(pieces, placements[d], mesh.shape[d])
    return pieces[()]
