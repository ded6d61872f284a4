"""What a local form reads and returns: the rank's context and the call it makes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ...ir.core import Op
from ...ir.dist import (
    DistAttr,
    ProcessMesh,
    Shard,
    format_placements,
    is_grouped,
    local_offsets,
    local_shape,
)


class UnsupportedLocalForm(NotImplementedError):
    """The op cannot run on this rank's pieces under these placements (e.g. a random op
    with a sharded output and no local form): silently running it would be wrong."""


@dataclass(frozen=True)
class LocalCall:
    """The call one rank makes: ``target(*args, **kwargs)`` with the op's input Values
    standing for the rank's local tensors. ``note`` says why it differs (for dumps)."""

    target: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class LocalContext:
    """Where the rank sits and how the op's operands are placed."""

    mesh: ProcessMesh
    coordinate: tuple[int, ...]
    needs: tuple[DistAttr, ...]              # per tensor input, op.inputs order
    outputs: tuple[DistAttr | None, ...]     # per output (None: not a tensor)

    @classmethod
    def of(cls, op: Op, mesh: ProcessMesh, coordinate: Sequence[int]) -> "LocalContext":
        """The context completion left on ``op`` (its needs and its outputs' dists)."""
        return cls(mesh, tuple(coordinate), tuple(op.needs),
                   tuple(v.dist if v.is_tensor else None for v in op.outputs))

    # -- outputs --------------------------------------------------------------------------
    def out_placements(self, index: int = 0) -> tuple:
        dist = self.outputs[index]
        return dist.placements if dist is not None else ()

    def out_sharded(self, index: int = 0) -> bool:
        return any(isinstance(p, Shard) for p in self.out_placements(index))

    def out_offsets(self, op: Op, index: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local shape, global offset) of this rank's piece of output ``index``."""
        placements = self.out_placements(index)
        _refuse_grouped(op, placements, f"output {index}")
        return local_offsets(op.outputs[index].type.shape, self.mesh, placements,
                             self.coordinate)

    def out_shape(self, op: Op, index: int = 0) -> tuple[int, ...]:
        return local_shape(op.outputs[index].type.shape, self.mesh,
                           self.out_placements(index), self.coordinate)

    def out_bounds(self, op: Op, index: int = 0) -> tuple[tuple[int, int], ...]:
        """(start, stop) per dim of this rank's piece of output ``index``."""
        size, start = self.out_offsets(op, index)
        return tuple((o, o + n) for o, n in zip(start, size))

    # -- inputs ---------------------------------------------------------------------------
    def in_offsets(self, op: Op, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local shape, global offset) of this rank's piece of tensor input ``index``."""
        value = [v for v in op.inputs if v.is_tensor][index]
        _refuse_grouped(op, self.needs[index].placements, f"tensor input {index}")
        return local_offsets(value.type.shape, self.mesh, self.needs[index].placements,
                             self.coordinate)

    def in_shard_mesh_dims(self, index: int, tensor_dim: int) -> list[int]:
        return self.needs[index].shard_mesh_dims(tensor_dim)


def _refuse_grouped(op: Op, placements, what: str) -> None:
    """A local form that reads a piece's offsets cannot serve a grouped shard (its piece is
    several runs of the global dim): refuse by name rather than compute a wrong offset."""
    if is_grouped(placements):
        raise UnsupportedLocalForm(
            f"{op.target} ({op.module or 'top level'}): its local form reads the global "
            f"offset of {what}, placed {format_placements(placements)}, but a grouped "
            "shard's piece has no single offset")
