"""Writing a process's piece of a parameter as an init function writes the whole, without
ever holding the whole.

A piece is the product of per-dim index lists (``ir.dist.local_runs``: a plain or grouped
shard of each dim). Deterministic in-place writes (``fill_``, ``zero_``, ``mul_``...,
``copy_`` from a given tensor) act on the positions the piece holds, through the select /
slice views an init takes (``weight[padding_idx].zero_()``).

Random fills draw the whole tensor's numbers in order, a bounded chunk at a time, and keep
the piece's positions: the generator ends where drawing the whole would leave it, and the
kept numbers are the whole's. That rests on how torch's CPU kernels consume the generator,
checked by ``tests/state/test_meta_init.py`` for every dtype the tests use:

* ``uniform_`` draws one number per element, in order;
* ``normal_`` of a contiguous tensor of n >= 16 elements fills n uniforms, turns each block
  of 16 into normals (Box-Muller pairs inside the block), and, when 16 does not divide n,
  draws 16 more for the last 16 positions; so chunks whose sizes are multiples of 16, the
  last one at least 16, give the whole's numbers. Below 16 elements the whole is drawn (it
  is tiny).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..ir.dist import ProcessMesh, local_runs

__all__ = ["PieceIndex", "Region", "draw_into", "write_region", "read_region", "CHUNK"]

CHUNK = 1 << 16        # most elements per draw: a multiple of 16 (normal_'s block)
SMALL = 16             # below this many elements, normal_ takes another path: draw whole


@dataclass(frozen=True)
class PieceIndex:
    """The positions of a whole tensor of ``shape`` that a piece holds: per dim, the global
    index runs ``(start, stop)`` in the order they lie in the piece."""

    shape: tuple[int, ...]
    runs: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> PieceIndex:
        return cls(tuple(shape), tuple(((0, n),) if n else () for n in shape))

    @classmethod
    def of(cls, shape: Sequence[int], mesh: ProcessMesh | None, placements: Sequence,
           coordinate: Sequence[int]) -> PieceIndex:
        if mesh is None:
            return cls.whole(shape)
        return cls(tuple(shape), local_runs(shape, mesh, placements, coordinate))

    @property
    def is_whole(self) -> bool:
        return self == PieceIndex.whole(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in r) for r in self.runs)

    def indices(self, dim: int) -> torch.Tensor:
        """The global indices along ``dim`` the piece holds, in piece order."""
        parts = [torch.arange(a, b) for a, b in self.runs[dim]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class Region:
    """A basic-indexing view of a whole tensor, per dim of the whole: an int (selected
    away) or a ``(start, stop, step)`` slice. The identity region views the whole."""

    dims: tuple[int | tuple[int, int, int], ...]

    @classmethod
    def identity(cls, shape: Sequence[int]) -> Region:
        return cls(tuple((0, n, 1) for n in shape))

    def kept(self) -> list[int]:
        """The whole's dims the view keeps, in view order."""
        return [d for d, s in enumerate(self.dims) if not isinstance(s, int)]

    def is_identity(self, shape: Sequence[int]) -> bool:
        return self == Region.identity(shape)

    def shape(self) -> tuple[int, ...]:
        return tuple(len(range(*self.dims[d])) for d in self.kept())

    def select(self, view_dim: int, index: int) -> Region:
        d = self.kept()[view_dim]
        start, stop, step = self.dims[d]
        n = len(range(start, stop, step))
        index = index + n if index < 0 else index
        return self._replace(d, start + index * step)

    def slice(self, view_dim: int, start: int | None, stop: int | None, step: int) -> Region:
        d = self.kept()[view_dim]
        s0, s1, s2 = self.dims[d]
        inner = range(s0, s1, s2)[slice(start, stop, step)]
        return self._replace(d, (inner.start, inner.stop, inner.step))

    def _replace(self, d: int, new: int | tuple[int, int, int]) -> Region:
        return Region(self.dims[:d] + (new,) + self.dims[d + 1:])

    def hits(self, index: PieceIndex) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per whole dim, the piece positions inside the region, and for kept dims the
        matching positions in the view."""
        local, view = [], []
        for d, s in enumerate(self.dims):
            glob = index.indices(d)
            if isinstance(s, int):
                mask = glob == s
            else:
                start, stop, step = s
                within = range(start, stop, step)
                lo, hi = (start, stop) if step > 0 else (stop + 1, start + 1)
                mask = (glob >= lo) & (glob < hi) & ((glob - start) % step == 0) \
                    if len(within) else torch.zeros_like(glob, dtype=torch.bool)
                view.append((glob[mask] - start) // step)
            local.append(mask.nonzero().flatten())
        return local, view


def _grid(index: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Broadcastable index tensors (numpy's ``ix_``)."""
    n = len(index)
    return tuple(t.view([-1 if i == d else 1 for i in range(n)]) for d, t in enumerate(index))


def read_region(piece: torch.Tensor, index: PieceIndex, region: Region) -> torch.Tensor:
    """The piece's values inside ``region`` (a copy), shaped by the whole's dims."""
    local, _ = region.hits(index)
    return piece[_grid(local)] if piece.dim() else piece.clone()


def write_region(piece: torch.Tensor, index: PieceIndex, region: Region,
                 update: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Apply the in-place ``update`` to the piece's values inside ``region``."""
    if not piece.dim():
        update(piece)
        return
    local, _ = region.hits(index)
    grid = _grid(local)
    values = piece[grid]
    update(values)
    piece[grid] = values


def source_values(source: torch.Tensor, index: PieceIndex, region: Region) -> torch.Tensor:
    """The values a ``copy_`` of ``source`` into ``region`` puts at the piece's positions in
    it, shaped by the whole's dims (selected dims have size 1)."""
    local, view = region.hits(index)
    out = source.expand(region.shape())
    for j, positions in enumerate(view):
        out = out.index_select(j, positions)
    shape = [len(t) if not isinstance(s, int) else 1 for t, s in zip(local, region.dims)]
    return out.reshape(shape)


def _chunks(n: int, piece: int) -> list[tuple[int, int]]:
    """(start, size): sizes a multiple of 16 and no bigger than the piece (or ``CHUNK``),
    the last one all that remains (at least 16), so no draw buffer is the whole's size."""
    step = min(CHUNK, max(SMALL, -(-piece // SMALL) * SMALL))
    out, pos = [], 0
    while pos < n:
        size = n - pos if n - pos < step + SMALL else step
        out.append((pos, size))
        pos += size
    return out


def draw_into(piece: torch.Tensor, index: PieceIndex,
              draw: Callable[[torch.Tensor], object]) -> None:
    """Fill ``piece`` with what ``draw(whole)`` (an in-place random fill of a contiguous
    tensor) puts at its positions, drawing the whole's numbers chunk by chunk."""
    n = math.prod(index.shape)
    if index.is_whole:
        draw(piece)
        return
    if n < SMALL:
        whole = torch.empty(index.shape, dtype=piece.dtype)
        draw(whole)
        piece.copy_(whole[_grid([index.indices(d) for d in range(whole.dim())])])
        return
    rows = index.indices(0)
    rest = math.prod(index.shape[1:])
    offsets = _row_offsets(index)
    by_row = piece.view(len(rows), math.prod(index.local_shape[1:]))
    for start, size in _chunks(n, piece.numel()):
        chunk = torch.empty(size, dtype=piece.dtype)
        draw(chunk)
        if piece.numel():
            _keep(chunk, start, rows, offsets, rest, by_row)


def _row_offsets(index: PieceIndex) -> torch.Tensor:
    """Flat offsets, inside one row of the whole (dims 1..), of the piece's positions."""
    strides = [math.prod(index.shape[d + 1:]) for d in range(len(index.shape))]
    offsets = torch.zeros(1, dtype=torch.long)
    for d in range(1, len(index.shape)):
        offsets = (offsets[:, None] + index.indices(d)[None, :] * strides[d]).flatten()
    return offsets


def _keep(chunk: torch.Tensor, start: int, rows: torch.Tensor, offsets: torch.Tensor,
          rest: int, out: torch.Tensor) -> None:
    """Copy the piece's positions that lie in ``chunk`` (whole positions ``start..``)."""
    stop = start + len(chunk)
    first_full, end_full = -(-start // rest), stop // rest
    full = (rows >= first_full) & (rows < end_full)
    if bool(full.any()):
        if len(offsets) == rest:             # whole rows: pick rows, not elements
            inside = chunk[first_full * rest - start:end_full * rest - start].view(-1, rest)
            out[full] = inside[rows[full] - first_full]
        else:
            out[full] = chunk[(rows[full] * rest - start)[:, None] + offsets[None, :]]
    for row in {start // rest, (stop - 1) // rest}:
        if first_full <= row < end_full:
            continue
        hit = (rows == row).nonzero().flatten()
        if not len(hit):
            continue
        base = row * rest
        inside = (offsets >= start - base) & (offsets < stop - base)
        out[hit[0], inside] = chunk[base + offsets[inside] - start]
