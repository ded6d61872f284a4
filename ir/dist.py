"""Distributed attributes: process meshes, placements, and sharding arithmetic.

This is the vocabulary completion, partition and reshard speak. It is deliberately small,
immutable and printable:

* ``ProcessMesh`` — an n-D array of process ids with named dims. ``groups(dim)`` fixes the
  order in which every rank creates its c10d groups (a different order on two ranks hangs).
* ``Shard(d)`` / ``Replicate()`` / ``Partial(op)`` — one placement per mesh dim, the same
  vocabulary as DTensor and OneFlow SBP. Besides sum/avg/max/min, ``Partial(norm_partial(p))``
  (text ``P(norm2)``, ``P(norm1)``, ``P(norminf)``) is DTensor's ``_NormPartial``: each rank
  holds the p-norm of its piece and the value is the p-norm of those terms.
  ``Shard(d, groups=g)`` is a grouped shard (DTensor's
  ``_StridedShard``, Megatron's interleaved fused qkv): dim ``d`` is viewed as ``(g, n/g)``
  and the inner part is chunked, so a rank holds its chunk of every group, in group order.
  ``groups=(2, 1, 1)`` gives groups of relative widths (grouped-query attention's fused
  ``[q | k | v]`` with half as many kv heads; text ``S(d)x2:1:1``).
  Its piece is not one slice: ``local_runs`` gives the index runs, ``local_slices`` refuses.
* ``DistAttr(mesh, placements)`` — what completion writes into ``Value.dist``; its ``str`` is
  the compact, stable text IR dumps print after the value's type.
* Chunk arithmetic with ``torch.chunk`` semantics (uneven allowed; chunk size ``ceil(n/k)``,
  trailing chunks smaller or empty). Several mesh dims sharding one tensor dim nest in
  mesh-dim order, as in DTensor: mesh dim 0 cuts first, later mesh dims cut the piece.
* ``shard_tensor_local`` / ``assemble`` — the reference semantics of a placement on real
  tensors: what each rank holds, and how the pieces make the global tensor again. Tests and
  the simulator check every pass against these two functions.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "ProcessMesh", "format_ranks", "MICRO_BATCH_DIM", "micro_batch_dim", "Placement", "Shard",
    "Replicate",
    "Partial", "PARTIAL_OPS", "norm_partial", "norm_order", "reduce_terms", "keeps_partial_value",
    "DistAttr", "local_size", "local_offset", "local_shape",
    "local_offsets", "local_slices", "local_runs", "is_grouped", "chunk_grouped", "cat_grouped",
    "Groups", "normalize_groups", "group_total", "group_widths", "format_groups",
    "shard_tensor_local", "assemble", "format_placements", "parse_placements",
]

Coordinate = tuple[int, ...]


# --------------------------------------------------------------------------- ProcessMesh


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


# --------------------------------------------------------------------------- group layouts

# A grouped shard's parts: a count of equal parts, or the parts' relative widths.
Groups = int | tuple[int, ...]


def normalize_groups(groups: object, what: str = "Shard") -> Groups:
    """The one spelling of a group layout: a positive count, or relative widths (two or
    more positive ints) divided by their gcd; equal widths become their count."""
    if isinstance(groups, (tuple, list)):
        widths = tuple(groups)
        if len(widths) < 2 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
                                  for w in widths):
            raise ValueError(f"{what}, groups={groups!r}: group widths must be two or more "
                             "positive ints")
        if len(set(widths)) == 1:
            return len(widths)
        g = math.gcd(*widths)
        return tuple(w // g for w in widths)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{what}, groups={groups!r}: groups must be a positive int or a "
                         "tuple of relative widths")
    return groups


def group_total(groups: Groups) -> int:
    """The sum of a layout's relative widths: a dim it cuts must be a multiple of it."""
    return groups if isinstance(groups, int) else sum(groups)


def group_widths(groups: Groups, size: int, what: str = "") -> tuple[int, ...]:
    """The parts' absolute widths in a dim of ``size``; ValueError when they are not whole."""
    total = group_total(groups)
    if size % total:
        layout = f"{total} groups" if isinstance(groups, int) else \
            f"groups {format_groups(groups)} ({total} units)"
        raise ValueError(f"{what + ': ' if what else ''}a piece of size {size} does not "
                         f"divide into {layout}")
    unit = size // total
    return (unit,) * groups if isinstance(groups, int) else tuple(w * unit for w in groups)


def format_groups(groups: Groups) -> str:
    """``3`` for equal parts, ``2:1:1`` for relative widths."""
    return str(groups) if isinstance(groups, int) else ":".join(map(str, groups))


# --------------------------------------------------------------------------- placements

PARTIAL_OPS = ("sum", "avg", "max", "min")
# The norm family: ``norm<p>`` for any order p > 0 (``norminf`` for the max-norm). A term is
# the p-norm of a rank's piece, so terms are never negative; the value is their p-norm.
_NORM = "norm"


def norm_partial(p: float) -> str:
    """The Partial op of a p-norm: ``norm2``, ``norm1``, ``norminf``, ``norm1.5`` (one
    spelling per order, so ``Partial`` equality is order equality)."""
    p = float(p)
    if not p > 0:
        raise ValueError(f"a norm partial needs an order p > 0 (got {p}): the terms of "
                         "smaller orders do not combine by the same norm")
    if math.isinf(p):
        return f"{_NORM}inf"
    return f"{_NORM}{int(p)}" if p.is_integer() else f"{_NORM}{p!r}"


def norm_order(op: str) -> float | None:
    """The order p of a norm partial op (``norm2`` -> 2.0), None for sum/avg/max/min."""
    if not op.startswith(_NORM):
        return None
    try:
        p = float(op[len(_NORM):])
    except ValueError:
        return None
    return p if p > 0 else None


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


@dataclass(frozen=True)
class Placement:
    """How a tensor lies along one mesh dim. Subclasses: Shard, Replicate, Partial."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim ``dim`` is cut into ``torch.chunk`` pieces along the mesh dim.

    ``dim`` is non-negative: a negative dim would make ``Shard(-1)`` and ``Shard(1)`` unequal
    spellings of one placement; normalise with ``dim % ndim`` first.

    ``groups=g`` views the dim as ``g`` consecutive equal parts and chunks each: the rank
    holds its chunk of each part, parts in order (a fused ``[q; k; v]`` weight cut so that
    every rank holds its heads of q, k and v). ``groups=(w0, w1, ...)`` gives the parts'
    relative widths (grouped-query attention's fused ``[q; k; v]`` with fewer kv heads:
    ``(2, 1, 1)``, text ``S(d)x2:1:1``). Widths are stored divided by their gcd, and equal
    widths are the count, so one layout has one spelling. ``Shard(d)`` is
    ``Shard(d, groups=1)``.
    """

    dim: int
    groups: Groups = 1

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim!r}): dim must be a non-negative int")
        object.__setattr__(self, "groups", normalize_groups(self.groups, f"Shard(dim={self.dim})"))

    @property
    def grouped(self) -> bool:
        return self.groups != 1

    def __str__(self) -> str:
        groups = "" if self.groups == 1 else f"x{format_groups(self.groups)}"
        return f"S({self.dim}){groups}"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank along the mesh dim holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a term; the tensor is the ``op``-reduction over the mesh dim:
    one of ``PARTIAL_OPS`` or a norm (``norm_partial(p)``: the p-norm of the terms)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        order = norm_order(self.op) if isinstance(self.op, str) else None
        if order is not None:
            object.__setattr__(self, "op", norm_partial(order))   # norm2.0 is norm2
        elif self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial(op={self.op!r}): op must be one of {PARTIAL_OPS} or "
                             "norm<p> for an order p > 0 (norm2, norm1, norminf)")

    @property
    def norm_order(self) -> float | None:
        """p for a norm partial, None otherwise."""
        return norm_order(self.op)

    def __str__(self) -> str:
        return f"P({self.op})"


def format_placements(placements: Iterable[Placement]) -> str:
    """``{S(0),R}`` — the placement part of a DistAttr's text."""
    return "{" + ",".join(str(p) for p in placements) + "}"


_PLACEMENT_TEXT = re.compile(r"^(?:S\((\d+)\)(?:x(\d+(?::\d+)*))?|R|"
                             r"P(?:\((sum|avg|max|min|norm(?:inf|[0-9.e+-]+))\))?)$")


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Inverse of ``format_placements``: ``"S(0),R"``, ``"{S(0),P(sum)}"``, ``"S(0)x3"``,
    ``"S(1)x2:1:1"``, ``"P(norm2)"``."""
    items = [t.strip() for t in text.strip().strip("{}").split(",") if t.strip()]
    placements: list[Placement] = []
    for item in items:
        match = _PLACEMENT_TEXT.match(item)
        if match is None:
            raise ValueError(f"cannot read placement {item!r} in {text!r}: expected S(<dim>), "
                             "S(<dim>)x<groups>, S(<dim>)x<w0>:<w1>:..., R or "
                             "P(sum|avg|max|min|norm<p>)")
        shard, groups, op = match.groups()
        widths = tuple(int(w) for w in (groups or "1").split(":"))
        placements.append(Shard(int(shard), widths if len(widths) > 1 else widths[0])
                          if shard is not None
                          else Replicate() if item == "R" else Partial(op or "sum"))
    return tuple(placements)


# --------------------------------------------------------------------------- DistAttr


@dataclass(frozen=True)
class DistAttr:
    """A value's distribution: one placement per mesh dim. What completion writes and
    partition/reshard read. Shape-independent; ``check(shape)`` binds it to a tensor."""

    mesh: ProcessMesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        if not isinstance(self.mesh, ProcessMesh):
            raise TypeError(f"DistAttr: mesh must be a ProcessMesh, got {self.mesh!r}")
        bad = [p for p in self.placements if not isinstance(p, Placement)]
        if bad:
            raise TypeError(f"DistAttr on {self.mesh}: not placements: {bad!r}")
        if len(self.placements) != self.mesh.ndim:
            raise ValueError(f"DistAttr: {len(self.placements)} placements "
                             f"{format_placements(self.placements)} for {self.mesh.ndim}-D "
                             f"{self.mesh}")

    @classmethod
    def replicated(cls, mesh: ProcessMesh) -> DistAttr:
        return cls(mesh, (Replicate(),) * mesh.ndim)

    def check(self, shape: Sequence[int]) -> DistAttr:
        """Raise ValueError unless every Shard dim exists in a tensor of ``shape`` and every
        grouped shard's piece (before its mesh dim cuts it) divides into its groups."""
        bad = [p for p in self.placements if p.is_shard() and p.dim >= len(shape)]
        if bad:
            raise ValueError(f"DistAttr {format_placements(self.placements)} on {self.mesh} "
                             f"shards dim {bad[0].dim} of a tensor of shape {list(shape)} "
                             f"({len(shape)} dims)")
        if is_grouped(self.placements):
            _check_groups(shape, self.mesh, self.placements)
        return self

    def with_placement(self, mesh_dim: int | str, placement: Placement) -> DistAttr:
        """A copy with one mesh dim's placement replaced."""
        d = self.mesh.dim_index(mesh_dim)
        return DistAttr(self.mesh, self.placements[:d] + (placement,) + self.placements[d + 1:])

    def shard_mesh_dims(self, tensor_dim: int) -> list[int]:
        """The mesh dims sharding ``tensor_dim``, in nesting (mesh-dim) order."""
        return [i for i, p in enumerate(self.placements) if p.is_shard(tensor_dim)]

    def partial_mesh_dims(self) -> dict[int, str]:
        """Mesh dim -> reduce op for every Partial placement."""
        return {i: p.op for i, p in enumerate(self.placements) if isinstance(p, Partial)}

    @property
    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def local_shape(self, global_shape: Sequence[int], coordinate: Sequence[int]) -> tuple:
        return local_shape(global_shape, self.mesh, self.placements, coordinate)

    def __str__(self) -> str:
        return f"{format_placements(self.placements)} @{self.mesh.short()}"


# --------------------------------------------------------------------------- chunk arithmetic


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
    DistAttr(mesh, tuple(placements)).check(global_shape)
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


def is_grouped(placements: Iterable[Placement]) -> bool:
    """Whether any placement is a grouped shard (``Shard(d, groups>1)``)."""
    return any(isinstance(p, Shard) and p.grouped for p in placements)


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
    for lo, width in _group_starts(groups, sum(b - a for a, b in runs), what):
        start = lo + local_offset(width, n, index)
        for a, b in _sub_runs(runs, start, start + local_size(width, n, index)):
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return out


def _group_starts(groups: Groups, size: int, what: str = "") -> list[tuple[int, int]]:
    """(start, width) of each group of a dim of ``size``."""
    widths = group_widths(groups, size, what)
    return [(sum(widths[:k]), w) for k, w in enumerate(widths)]


def local_runs(global_shape: Sequence[int], mesh: ProcessMesh,
               placements: Sequence[Placement], coordinate: Sequence[int]
               ) -> tuple[Runs, ...]:
    """Per tensor dim, the global index runs ``(start, stop)`` the rank's piece holds, in
    the order they lie in the piece: one run for a plain shard or a whole dim (an empty
    piece: no run), one per group (merged where adjacent) for a grouped shard. Mesh dims
    cut in order, each cutting the piece the earlier ones left."""
    _check_coordinate(mesh, placements, coordinate)
    dist = DistAttr(mesh, tuple(placements))
    if any(p.is_shard() and p.dim >= len(global_shape) for p in placements):
        dist.check(global_shape)
    runs: list[list[tuple[int, int]]] = [[(0, n)] if n else [] for n in global_shape]
    for p, n, c in zip(placements, mesh.shape, coordinate):
        if isinstance(p, Shard):
            runs[p.dim] = _cut_runs(runs[p.dim], n, c, p.groups,
                                    f"{format_placements(placements)} on {mesh}, shape "
                                    f"{list(global_shape)}")
    return tuple(tuple(r) for r in runs)


def _check_groups(shape: Sequence[int], mesh: ProcessMesh,
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


# --------------------------------------------------------------------------- reference semantics


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
    parts = _group_starts(groups, x.shape[dim], f"chunk_grouped: dim {dim}")
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
