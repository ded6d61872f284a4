"""``DistAttr(mesh, placements)``: a value's distribution, what completion writes into
``Value.dist``; its ``str`` is the compact, stable text IR dumps print after the value's
type."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .chunks import check_groups, local_shape
from .mesh import ProcessMesh
from .placements import (
    Partial,
    Placement,
    Replicate,
    check_on_mesh,
    check_shard_dims,
    format_placements,
    is_grouped,
)

__all__ = ["DistAttr"]


@dataclass(frozen=True)
class DistAttr:
    """A value's distribution: one placement per mesh dim. What completion writes and
    partition/reshard read. Shape-independent; ``check(shape)`` binds it to a tensor."""

    mesh: ProcessMesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        check_on_mesh(self.mesh, self.placements)

    @classmethod
    def replicated(cls, mesh: ProcessMesh) -> DistAttr:
        return cls(mesh, (Replicate(),) * mesh.ndim)

    def check(self, shape: Sequence[int]) -> DistAttr:
        """Raise ValueError unless every Shard dim exists in a tensor of ``shape`` and every
        grouped shard's piece (before its mesh dim cuts it) divides into its groups."""
        check_shard_dims(self.mesh, self.placements, shape)
        if is_grouped(self.placements):
            check_groups(shape, self.mesh, self.placements)
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
