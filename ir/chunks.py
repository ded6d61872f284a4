"""Chunk arithmetic: which piece of a tensor each rank of a mesh holds.

``torch.chunk`` semantics (uneven allowed; chunk size ``ceil(n/k)``, trailing chunks smaller
or empty). Several mesh dims sharding one tensor dim nest in mesh-dim order, as in DTensor:
mesh dim 0 cuts first, later mesh dims cut the piece. A grouped shard's piece is not one
slice: ``local_runs`` gives the index runs, ``local_slices`` refuses.

``local_offsets`` and ``local_shape`` are remembered per (shape, mesh, placements,
coordinate): lowering asks the same question of every value of every process and
micro-batch.
"""
from __future__ import annotations

import functools
import itertools
from typing import Sequence

from .mesh import ProcessMesh
from .placements import (
    Placement,
    Shard,
    check_on_mesh,
    check_shard_dims,
    format_placements,
    is_grouped,
)
from .shard_groups import Groups, group_starts

__all__ = ["local_offset", "local_size", "local_offsets", "local_shape", "local_slices",
           "local_runs", "Runs", "check_groups"]


def _check_chunk_args(global_size: int, num_chunks: int, index: int) -> None:
    if global_size < 0 or num_chunks < 1 or not 0 <= index < num_chunks:
        raise ValueError(f"chunk of size {global_size} into {num_chunks}: bad index {index}")


def local_offset(global_size: int, num_chunks: int, index: int) -> int:
    """Start of chunk ``index`` of ``torch.chunk(range(global_size), num_chunks)``; an
    empty trailing chunk starts at ``global_size``."""
    _check_chunk_args(global_size, num_chunks, index)
    return min(index * -(-global_size // num_chunks), global_size)


def local_size(global_size: int, num_chunks: int, index: int) -> int:
    """Length of chunk ``index``: ``ceil(n/k)`` for leading chunks, then smaller, then 0."""
    _check_chunk_args(global_size, num_chunks, index)
    step = -(-global_size // num_chunks)
    return max(0, min(step, global_size - index * step))


def _check_coordinate(mesh: ProcessMesh, placements: Sequence[Placement],
                      coordinate: Sequence[int]) -> None:
    if len(placements) != mesh.ndim or len(coordinate) != mesh.ndim or not all(
            0 <= c < s for c, s in zip(coordinate, mesh.shape)):
        raise ValueError(f"{format_placements(placements)} on {mesh}: bad coordinate "
                         f"{tuple(coordinate)}")


def local_offsets(global_shape: Sequence[int], mesh: ProcessMesh,
                  placements: Sequence[Placement], coordinate: Sequence[int]
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the piece at ``coordinate``.

    Shards of one tensor dim nest in mesh-dim order: each later mesh dim chunks the piece
    the earlier ones left (DTensor's order), so offsets accumulate. A grouped shard's piece
    has no single offset: this refuses it (use ``local_runs``). Remembered per (shape,
    mesh, placements, coordinate): lowering asks the same question of every value of every
    process and micro-batch.
    """
    return _local_offsets(tuple(global_shape), mesh, tuple(placements), tuple(coordinate))


@functools.lru_cache(maxsize=1 << 17)
def _local_offsets(global_shape: tuple[int, ...], mesh: ProcessMesh,
                   placements: tuple[Placement, ...], coordinate: tuple[int, ...]
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    _check_coordinate(mesh, placements, coordinate)
    if is_grouped(placements):
        raise ValueError(f"{format_placements(placements)} on {mesh}: a grouped shard's piece "
                         f"of shape {list(global_shape)} is not one slice (no single offset); "
                         "use ir.dist.local_runs for its index runs")
    check_on_mesh(mesh, placements)
    check_shard_dims(mesh, placements, global_shape)
    size, start = list(global_shape), [0] * len(global_shape)
    for p, n, c in zip(placements, mesh.shape, coordinate):
        if isinstance(p, Shard):
            start[p.dim] += local_offset(size[p.dim], n, c)
            size[p.dim] = local_size(size[p.dim], n, c)
    return tuple(size), tuple(start)


def local_shape(global_shape: Sequence[int], mesh: ProcessMesh,
                placements: Sequence[Placement], coordinate: Sequence[int]) -> tuple[int, ...]:
    """Shape of the piece the rank at ``coordinate`` holds (remembered, as
    ``local_offsets``)."""
    return _local_shape(tuple(global_shape), mesh, tuple(placements), tuple(coordinate))


@functools.lru_cache(maxsize=1 << 17)
def _local_shape(global_shape: tuple[int, ...], mesh: ProcessMesh,
                 placements: tuple[Placement, ...], coordinate: tuple[int, ...]
                 ) -> tuple[int, ...]:
    if is_grouped(placements):
        return tuple(sum(b - a for a, b in runs)
                     for runs in local_runs(global_shape, mesh, placements, coordinate))
    return local_offsets(global_shape, mesh, placements, coordinate)[0]


def local_slices(global_shape: Sequence[int], mesh: ProcessMesh,
                 placements: Sequence[Placement], coordinate: Sequence[int]
                 ) -> tuple[slice, ...]:
    """Index of the rank's piece in the global tensor: ``full[local_slices(...)]``.
    Refuses grouped shards (their piece is several runs: ``local_runs``)."""
    size, start = local_offsets(global_shape, mesh, placements, coordinate)
    return tuple(slice(o, o + n) for o, n in zip(start, size))


Runs = tuple[tuple[int, int], ...]


def _sub_runs(runs: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of the index sequence that ``runs`` spell, as global runs."""
    out, pos = [], 0
    for a, b in runs:
        start, stop = max(lo, pos), min(hi, pos + b - a)
        if start < stop:
            out.append((a + start - pos, a + stop - pos))
        pos += b - a
    return out


def _cut_runs(runs: Sequence[tuple[int, int]], n: int, index: int, groups: Groups,
              what: str) -> list[tuple[int, int]]:
    """Chunk ``index`` of ``n`` of each group of the piece ``runs`` spell (``groups``: a
    count of equal groups or their relative widths), groups in order; adjacent runs
    merged."""
    out: list[tuple[int, int]] = []
    for lo, width in group_starts(groups, sum(b - a for a, b in runs), what):
        start = lo + local_offset(width, n, index)
        for a, b in _sub_runs(runs, start, start + local_size(width, n, index)):
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return out


def local_runs(global_shape: Sequence[int], mesh: ProcessMesh,
               placements: Sequence[Placement], coordinate: Sequence[int]
               ) -> tuple[Runs, ...]:
    """Per tensor dim, the global index runs ``(start, stop)`` the rank's piece holds, in
    the order they lie in the piece: one run for a plain shard or a whole dim (an empty
    piece: no run), one per group (merged where adjacent) for a grouped shard. Mesh dims
    cut in order, each cutting the piece the earlier ones left."""
    _check_coordinate(mesh, placements, coordinate)
    check_on_mesh(mesh, tuple(placements))
    check_shard_dims(mesh, placements, global_shape)
    runs: list[list[tuple[int, int]]] = [[(0, n)] if n else [] for n in global_shape]
    for p, n, c in zip(placements, mesh.shape, coordinate):
        if isinstance(p, Shard):
            runs[p.dim] = _cut_runs(runs[p.dim], n, c, p.groups,
                                    f"{format_placements(placements)} on {mesh}, shape "
                                    f"{list(global_shape)}")
    return tuple(tuple(r) for r in runs)


def check_groups(shape: Sequence[int], mesh: ProcessMesh,
                 placements: Sequence[Placement]) -> None:
    """Every piece a grouped shard cuts divides into its groups (on every coordinate of
    the mesh dims that shard the same tensor dim)."""
    for d in {p.dim for p in placements if isinstance(p, Shard) and p.grouped}:
        cutting = [m for m, p in enumerate(placements) if p.is_shard(d)]
        for coords in itertools.product(*(range(mesh.shape[m]) for m in cutting)):
            coordinate = [0] * mesh.ndim
            for m, c in zip(cutting, coords):
                coordinate[m] = c
            local_runs(shape, mesh, placements, coordinate)
