"""Process meshes: an n-D array of process ids with named dims (``ProcessMesh``), and the
micro-batch dim of a pipeline's logical mesh.

``groups(dim)`` fixes the order in which every rank creates its c10d groups (a different
order on two ranks hangs). A mesh is immutable and hashes once: a 1,024-rank mesh is a key
of every placement computation (``chunks.py`` remembers its answers per mesh).
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

__all__ = ["ProcessMesh", "Coordinate", "format_ranks", "MICRO_BATCH_DIM", "micro_batch_dim"]


Coordinate = tuple[int, ...]


def _nested_str(a: np.ndarray) -> str:
    return str(a.tolist()).replace(" ", "")


def _parse_ids(mesh: object) -> np.ndarray:
    """Turn an array-like of ints into an int64 ndarray, refusing ragged, empty or float input."""
    try:
        arr = np.asarray(mesh.tolist() if isinstance(mesh, torch.Tensor) else mesh)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"ProcessMesh: mesh {mesh!r} is not a rectangular array: {e}") from None
    if arr.ndim == 0 or arr.size == 0:
        raise ValueError(f"ProcessMesh: mesh {mesh!r} must be a non-empty array of >= 1 dims")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ProcessMesh: mesh {mesh!r} must hold integer process ids, "
                         f"got dtype {arr.dtype}")
    return arr.astype(np.int64)


class ProcessMesh:
    """An n-D array of process ids (any non-negative, unique ids) with one name per dim.

    Immutable and hashable: equal meshes are the same (shape, ids, dim_names), so passes can
    use meshes as dict keys and compare them without caring who built them. Dim names
    default to ``d0, d1, ...`` so every dim can be addressed by name.
    """

    __slots__ = ("_shape", "_ids", "_dim_names", "_coords", "_hash")

    def __init__(self, mesh: object, dim_names: Sequence[str] | None = None):
        arr = _parse_ids(mesh)
        names = tuple(f"d{i}" for i in range(arr.ndim)) if dim_names is None else tuple(dim_names)
        text = f"shape {list(arr.shape)} dim_names {list(names)} ids {_nested_str(arr)}"
        _validate_mesh(arr, names, text)
        object.__setattr__(self, "_shape", tuple(int(s) for s in arr.shape))
        object.__setattr__(self, "_ids", tuple(int(i) for i in arr.reshape(-1)))
        object.__setattr__(self, "_dim_names", names)
        coords = dict(zip(self._ids, itertools.product(*(range(s) for s in self._shape))))
        object.__setattr__(self, "_coords", coords)
        # hashed once: a 1,024-rank mesh is a dict key of every placement computation
        object.__setattr__(self, "_hash", hash((self._shape, self._ids, self._dim_names)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ProcessMesh is immutable (tried to set {name!r})")

    def __reduce__(self):
        return (ProcessMesh, (self.tolist(), list(self._dim_names)))

    # ----- properties

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self._dim_names

    @property
    def process_ids(self) -> tuple[int, ...]:
        """All ids, flat, row-major."""
        return self._ids

    @property
    def size(self) -> int:
        return len(self._ids)

    def tolist(self) -> list:
        """The ids as a nested list of the mesh's shape."""
        return np.array(self._ids, dtype=np.int64).reshape(self._shape).tolist()

    # ----- lookups

    def dim_index(self, dim: int | str) -> int:
        """Normalise a dim name or (possibly negative) index to an index in [0, ndim)."""
        if isinstance(dim, str):
            if dim not in self._dim_names:
                raise ValueError(f"{self}: no mesh dim named {dim!r}")
            return self._dim_names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise ValueError(f"{self}: mesh dim {dim!r} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def dim_size(self, dim: int | str) -> int:
        return self._shape[self.dim_index(dim)]

    def __contains__(self, rank: object) -> bool:
        return rank in self._coords

    def coordinate(self, rank: int) -> Coordinate | None:
        """The rank's position in the mesh, or None when the rank is not part of it."""
        return self._coords.get(rank)

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """The process id at a coordinate (inverse of ``coordinate``)."""
        coordinate = tuple(coordinate)
        if len(coordinate) != self.ndim or not all(0 <= c < s for c, s in
                                                   zip(coordinate, self._shape)):
            raise ValueError(f"{self}: coordinate {coordinate} is outside the mesh")
        return self._ids[int(np.ravel_multi_index(coordinate, self._shape))]

    def coordinates(self) -> Iterator[Coordinate]:
        """Every coordinate in row-major order (the order of ``process_ids``)."""
        return itertools.product(*(range(s) for s in self._shape))

    # ----- sub-meshes and groups

    def groups(self, dim: int | str) -> list[list[int]]:
        """The process groups along one mesh dim, in the order every rank must create them.

        Each group holds the ranks whose coordinates differ only in ``dim``, ordered by their
        index along ``dim``; groups come in row-major order of the other coordinates.
        """
        d = self.dim_index(dim)
        arr = np.moveaxis(np.array(self._ids).reshape(self._shape), d, -1)
        return arr.reshape(-1, self._shape[d]).tolist()

    def group_of(self, rank: int, dim: int | str) -> list[int]:
        """The one group of ``groups(dim)`` that contains ``rank``."""
        coord = self._require(rank)
        d = self.dim_index(dim)
        return [self.rank_at(coord[:d] + (i,) + coord[d + 1:]) for i in range(self._shape[d])]

    def submesh(self, **fixed: int) -> ProcessMesh:
        """The mesh left after fixing some dims by name, e.g. ``mesh.submesh(pp=1)``.

        The fixed dims disappear; at least one dim must stay free.
        """
        idx: list[object] = [slice(None)] * self.ndim
        for name, i in fixed.items():
            d = self.dim_index(name)
            if not 0 <= i < self._shape[d]:
                raise ValueError(f"{self}: index {i} out of range for mesh dim {name!r}")
            idx[d] = i
        kept = [n for n, ix in zip(self._dim_names, idx) if isinstance(ix, slice)]
        if not kept:
            raise ValueError(f"{self}: submesh({fixed}) fixes every dim; nothing is left")
        return ProcessMesh(np.array(self._ids).reshape(self._shape)[tuple(idx)], kept)

    def sub_mesh(self, dim: int | str, index: int) -> ProcessMesh:
        """The (ndim-1)-D mesh at ``index`` along ``dim`` (a pipeline stage's mesh, say)."""
        return self.submesh(**{self._dim_names[self.dim_index(dim)]: index})

    def _require(self, rank: int) -> Coordinate:
        coord = self.coordinate(rank)
        if coord is None:
            raise ValueError(f"{self}: rank {rank} is not in the mesh")
        return coord

    # ----- identity and text

    def _key(self) -> tuple:
        return (self._shape, self._ids, self._dim_names)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ProcessMesh) and self._hash == other._hash
                                 and self._key() == other._key())

    def __hash__(self) -> int:
        return self._hash

    def _head(self) -> str:
        return f"mesh[{','.join(map(str, self._shape))}]({','.join(self._dim_names)})"

    def __str__(self) -> str:
        if self.size > 64 and self._ids == tuple(range(self.size)):   # a message, not a wall
            return f"{self._head()}=[0..{self.size - 1} in order]"
        return f"{self._head()}={_nested_str(np.array(self._ids).reshape(self._shape))}"

    def short(self) -> str:
        """Compact text for dumps: ``mesh[2,2](dp,tp)`` when ids are 0..size-1 in order;
        otherwise the full form, so two stage meshes never print alike."""
        return self._head() if self._ids == tuple(range(self.size)) else str(self)

    def __repr__(self) -> str:
        return f"ProcessMesh({self.tolist()}, dim_names={list(self._dim_names)})"


def format_ranks(processes: Iterable[int]) -> str:
    """Processes as runs: ``0-3,8-11``."""
    runs: list[list[int]] = []
    for p in sorted(processes):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _validate_mesh(arr: np.ndarray, names: tuple[str, ...], text: str) -> None:
    if (arr < 0).any():
        raise ValueError(f"ProcessMesh: process ids must be non-negative ({text})")
    if len(np.unique(arr)) != arr.size:
        raise ValueError(f"ProcessMesh: process ids must be unique ({text})")
    if len(names) != arr.ndim:
        raise ValueError(f"ProcessMesh: {len(names)} dim_names for a {arr.ndim}-D mesh ({text})")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"ProcessMesh: dim_names must be unique non-empty strings ({text})")


# A pipeline's micro-batches are a mesh dim of the logical mesh placements are made on
# (``pipeline.layout``): the batch is sharded over it like over data parallel ranks, but its
# "ranks" are one process at different times. Reductions over it are gradient accumulation.
MICRO_BATCH_DIM = "mb"


def micro_batch_dim(mesh: ProcessMesh) -> int | None:
    """The index of the micro-batch dim of a pipeline's logical mesh; None for other meshes."""
    names = mesh.dim_names
    return names.index(MICRO_BATCH_DIM) if MICRO_BATCH_DIM in names else None
