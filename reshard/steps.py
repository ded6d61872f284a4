"""The reshard catalogue: one frozen dataclass per 1-D transition on one mesh dim.

A step is pure data: which mesh dim it works on, which placement it turns into which, and
what it costs (bytes, via ``reshard.traffic``). It does not know whether it is valid in a given
n-D state (nesting order, reduce-op commutation) — the planner decides that — and it does
not move data: ``reshard.simulate`` gives the reference semantics, a runtime inserter the
real collectives.

| step | src -> dst on its mesh dim |
|---|---|
| AllReduce(d, op)           | P(op) -> R |
| ReduceScatter(d, t, op, g) | P(op) -> S(t)xg |
| AllGather(d, t, g)         | S(t)xg -> R |
| Slice(d, t, g)             | R -> S(t)xg, local, no communication |
| AllToAll(d, f, t)          | S(f) -> S(t) (plain shards only) |
| MakePartial(d, op)         | R -> P(op) (sum: index 0 keeps the value, others zeros) |
| Shift(d, t, k)             | S(t) -> S(t), the pieces passed k members along the ring |

``op`` may be a norm (``norm2``, ``norm1``, ``norminf``: ``ir.dist.norm_partial``): its
reduction is the p-norm of the terms (all-reduce: local ``|x|^p``, sum, ``^(1/p)``; norminf:
max), and MakePartial keeps the value on index 0 (norminf: everywhere), which is exact for
the non-negative values a norm partial holds.

``Shift`` is the one step that keeps the placement: member ``i`` of a group of ``n`` receives
the piece of member ``(i - k) mod n`` (a p2p ring pass, each member sends one piece and
receives one). In global terms it rolls dim ``t`` by ``k`` pieces. The planner never chooses
it (``transition`` has no placement change to ask for it): ring attention writes it
(``passes/ring_shifts.py``), and it needs even pieces.

S -> P and P(x) -> P(y) have no step of their own: they go through R, as does any
S -> S where either side is a grouped shard (``g`` != 1: ``Shard(t, groups=g)``, ``g`` a
count of equal groups or their relative widths, ``(2, 1, 1)``: text ``2:1:1 groups``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from ..ir.dist import (
    Groups,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    format_groups,
    local_shape,
)
from .traffic import reshard_bytes

__all__ = ["Step", "AllReduce", "ReduceScatter", "AllGather", "Slice", "AllToAll",
           "MakePartial", "Shift", "STEP_KINDS", "transition", "parent_shape"]


def parent_shape(shape: Sequence[int], mesh: ProcessMesh, placements: Sequence[Placement],
                 mesh_dim: int, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
    """The piece a rank holds before ``mesh_dim`` cuts it: its local shape with that mesh
    dim replicated. Coordinate 0 (the default) holds the largest piece (torch.chunk puts
    the big chunks first), which is what a padded collective moves."""
    coord = tuple(coordinate) if coordinate is not None else (0,) * mesh.ndim
    rest = tuple(placements[:mesh_dim]) + (Replicate(),) + tuple(placements[mesh_dim + 1:])
    return local_shape(shape, mesh, rest, coord)


def _groups_text(groups: Groups) -> str:
    return "" if groups == 1 else f", {format_groups(groups)} groups"


@dataclass(frozen=True)
class Step:
    """One collective (or local op) over one mesh dim. ``axis`` is the mesh dim's name, for
    dumps only: it does not take part in equality."""

    mesh_dim: int
    axis: str = field(default="", kw_only=True, compare=False)
    kind: ClassVar[str] = ""

    @property
    def src(self) -> Placement:
        raise NotImplementedError

    @property
    def dst(self) -> Placement:
        raise NotImplementedError

    def advance(self, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        """The placements after this step (checks the step starts from its ``src``)."""
        if placements[self.mesh_dim] != self.src:
            raise ValueError(f"{self} needs {self.src} on mesh dim {self.mesh_dim}, "
                             f"found placements {[str(p) for p in placements]}")
        d = self.mesh_dim
        return tuple(placements[:d]) + (self.dst,) + tuple(placements[d + 1:])

    def cost(self, shape: Sequence[int], mesh: ProcessMesh, placements: Sequence[Placement],
             itemsize: int = 4) -> float:
        """Bytes one rank sends, for the largest piece, from the state ``placements``."""
        full = math.prod(parent_shape(shape, mesh, placements, self.mesh_dim)) * itemsize
        return reshard_bytes(self.src, self.dst, full, mesh.shape[self.mesh_dim])

    def _args(self) -> str:
        return ""

    def __str__(self) -> str:
        over = self.axis or f"mesh dim {self.mesh_dim}"
        return f"{self.kind}({self._args()}) over {over}"


@dataclass(frozen=True)
class AllReduce(Step):
    op: str = "sum"
    kind: ClassVar[str] = "all_reduce"

    @property
    def src(self) -> Placement:
        return Partial(self.op)

    @property
    def dst(self) -> Placement:
        return Replicate()

    def _args(self) -> str:
        return self.op


@dataclass(frozen=True)
class ReduceScatter(Step):
    tensor_dim: int = 0
    op: str = "sum"
    groups: Groups = 1
    kind: ClassVar[str] = "reduce_scatter"

    @property
    def src(self) -> Placement:
        return Partial(self.op)

    @property
    def dst(self) -> Placement:
        return Shard(self.tensor_dim, self.groups)

    def _args(self) -> str:
        return f"{self.op}, dim {self.tensor_dim}{_groups_text(self.groups)}"


@dataclass(frozen=True)
class AllGather(Step):
    tensor_dim: int = 0
    groups: Groups = 1
    kind: ClassVar[str] = "all_gather"

    @property
    def src(self) -> Placement:
        return Shard(self.tensor_dim, self.groups)

    @property
    def dst(self) -> Placement:
        return Replicate()

    def _args(self) -> str:
        return f"dim {self.tensor_dim}{_groups_text(self.groups)}"


@dataclass(frozen=True)
class Slice(Step):
    tensor_dim: int = 0
    groups: Groups = 1
    kind: ClassVar[str] = "slice"

    @property
    def src(self) -> Placement:
        return Replicate()

    @property
    def dst(self) -> Placement:
        return Shard(self.tensor_dim, self.groups)

    def _args(self) -> str:
        return f"dim {self.tensor_dim}{_groups_text(self.groups)}"


@dataclass(frozen=True)
class AllToAll(Step):
    from_dim: int = 0
    to_dim: int = 1
    kind: ClassVar[str] = "all_to_all"

    @property
    def src(self) -> Placement:
        return Shard(self.from_dim)

    @property
    def dst(self) -> Placement:
        return Shard(self.to_dim)

    def _args(self) -> str:
        return f"dim {self.from_dim} -> dim {self.to_dim}"


@dataclass(frozen=True)
class MakePartial(Step):
    op: str = "sum"
    kind: ClassVar[str] = "make_partial"

    @property
    def src(self) -> Placement:
        return Replicate()

    @property
    def dst(self) -> Placement:
        return Partial(self.op)

    def _args(self) -> str:
        return self.op


@dataclass(frozen=True)
class Shift(Step):
    tensor_dim: int = 0
    shift: int = 1
    kind: ClassVar[str] = "shift"

    @property
    def src(self) -> Placement:
        return Shard(self.tensor_dim)

    @property
    def dst(self) -> Placement:
        return Shard(self.tensor_dim)

    def cost(self, shape: Sequence[int], mesh: ProcessMesh, placements: Sequence[Placement],
             itemsize: int = 4) -> float:
        """A rank sends its own piece (nothing when the shift is a whole turn); coordinate
        0's, the largest, as for the other steps."""
        if self.shift % mesh.shape[self.mesh_dim] == 0:
            return 0.0
        return math.prod(local_shape(shape, mesh, placements, (0,) * mesh.ndim)) * itemsize

    def _args(self) -> str:
        return f"dim {self.tensor_dim}, by {self.shift}"


STEP_KINDS: dict[str, type[Step]] = {c.kind: c for c in (
    AllReduce, ReduceScatter, AllGather, Slice, AllToAll, MakePartial, Shift)}


def transition(mesh_dim: int, src: Placement, dst: Placement, axis: str = "") -> Step | None:
    """The catalogue's one step from ``src`` to ``dst`` on a mesh dim, or None where the
    catalogue has none (equal placements, S -> P, P(x) -> P(y): those go through R)."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return AllReduce(mesh_dim, src.op, axis=axis)
        if isinstance(dst, Shard):
            return ReduceScatter(mesh_dim, dst.dim, src.op, dst.groups, axis=axis)
        return None
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return AllGather(mesh_dim, src.dim, src.groups, axis=axis)
        if isinstance(dst, Shard) and src.groups == dst.groups == 1:
            return AllToAll(mesh_dim, src.dim, dst.dim, axis=axis)
        return None
    if isinstance(dst, Shard):
        return Slice(mesh_dim, dst.dim, dst.groups, axis=axis)
    return MakePartial(mesh_dim, dst.op, axis=axis)
