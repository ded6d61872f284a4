"""Where a pipeline runs: which processes hold each stage, and the mesh its placements live on.

A pipeline has ``ranks`` positions along its pp axis; each holds ``chunks`` model chunks
(interleaved VPP), so there are ``stages = ranks * chunks`` stages and stage ``s`` runs on
pp position ``s % ranks`` as its chunk ``s // ranks``. Every pp position has a *stage mesh*
of the same shape (the strategy mesh without its pp dim, or one of the meshes the user
annotated layers with), whose dims (dp, tp, ...) shard values inside a stage.

Placements are made on the *logical mesh*: the stage mesh's dims plus a last dim ``mb`` of
``micro_batches`` entries. Micro-batching is sharding the batch over time: the batch dim is
``Shard(0)`` on ``mb`` after dp (dp cuts the global batch first, each dp piece is cut into
micro-batches), gradients come out ``Partial(sum)`` on ``mb`` and their reduction over it is
gradient accumulation. So every SPMD rule, the loss scaling and the random slicing that make
data parallelism exact make micro-batching exact too. The logical mesh's ids are positions,
not processes: ``process`` maps a stage and a logical coordinate to the process that runs it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..ir.dist import MICRO_BATCH_DIM, DistAttr, ProcessMesh, Replicate, format_ranks

__all__ = ["PipelineLayout"]


@dataclass(frozen=True)
class PipelineLayout:
    stage_ids: tuple[tuple[int, ...], ...]   # per pp position: its stage mesh's ids, row-major
    stage_shape: tuple[int, ...]             # every stage mesh's shape; () for one process
    stage_dims: tuple[str, ...]
    micro_batches: int
    schedule: str
    chunks: int = 1
    axis: str = "pp"
    # how ops are cut into stages: "auto" (balanced by FLOPs), the module names where stages
    # begin, or "meshes" (each layer on the stage of the mesh it is annotated on)
    split: str | tuple[str, ...] = "auto"

    def __post_init__(self) -> None:
        sizes = {len(ids) for ids in self.stage_ids}
        if sizes != {math.prod(self.stage_shape)}:
            raise ValueError(f"pipeline stage meshes hold {sorted(sizes)} processes each; "
                             f"shape {list(self.stage_shape)} needs {math.prod(self.stage_shape)}")
        every = [i for ids in self.stage_ids for i in ids]
        if len(set(every)) != len(every):
            raise ValueError(f"pipeline stage meshes share processes: {self._describe()}")
        if MICRO_BATCH_DIM in self.stage_dims:
            raise ValueError(f"mesh dim name {MICRO_BATCH_DIM!r} is reserved for a pipeline's "
                             f"micro-batches; rename that dim of {list(self.stage_dims)}")

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_mesh(cls, mesh: ProcessMesh, axis: str, micro_batches: int, schedule: str,
                  chunks: int = 1, split: str | tuple[str, ...] = "auto") -> "PipelineLayout":
        """The stages of a strategy mesh: one per index along its ``axis`` dim."""
        d = mesh.dim_index(axis)
        ids = np.array(mesh.process_ids).reshape(mesh.shape)
        stages = tuple(tuple(int(i) for i in np.take(ids, k, axis=d).reshape(-1))
                       for k in range(mesh.shape[d]))
        rest = tuple(n for i, n in enumerate(mesh.shape) if i != d)
        dims = tuple(n for i, n in enumerate(mesh.dim_names) if i != d)
        return cls(stages, rest, dims, micro_batches, schedule, chunks, axis, split)

    @classmethod
    def from_stage_meshes(cls, meshes: Sequence[ProcessMesh], micro_batches: int,
                          schedule: str, chunks: int = 1) -> "PipelineLayout":
        """Stages given as meshes (layers annotated on different meshes), in pipeline order."""
        first = meshes[0]
        for other in meshes[1:]:
            if other.shape != first.shape or other.dim_names != first.dim_names:
                raise ValueError(
                    f"pipeline stages annotated on meshes of different shapes: {first} and "
                    f"{other}; every stage mesh needs the same shape and dim names")
        return cls(tuple(m.process_ids for m in meshes), first.shape, first.dim_names,
                   micro_batches, schedule, chunks, split="meshes")

    # -- sizes ------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        """Positions along the pp axis (pipeline ranks)."""
        return len(self.stage_ids)

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    @property
    def world_size(self) -> int:
        return self.ranks * math.prod(self.stage_shape)

    def rank_of(self, stage: int) -> int:
        """The pp position that runs ``stage``."""
        return stage % self.ranks

    def chunk_of(self, stage: int) -> int:
        return stage // self.ranks

    def stages_of(self, pp_index: int) -> list[int]:
        """The stages pp position ``pp_index`` runs, chunk by chunk."""
        return [c * self.ranks + pp_index for c in range(self.chunks)]

    # -- meshes -----------------------------------------------------------------------------
    @property
    def logical_mesh(self) -> ProcessMesh:
        """The mesh placements are made on: the stage dims, then ``mb``."""
        shape = self.stage_shape + (self.micro_batches,)
        return ProcessMesh(np.arange(math.prod(shape)).reshape(shape),
                           self.stage_dims + (MICRO_BATCH_DIM,))

    @property
    def full_mesh(self) -> ProcessMesh:
        """Every process: the pp axis, then the stage dims (process groups are made on it,
        by every rank in the same order)."""
        ids = np.array(self.stage_ids).reshape((self.ranks,) + self.stage_shape)
        return ProcessMesh(ids, (self.axis,) + self.stage_dims)

    def stage_mesh(self, pp_index: int) -> ProcessMesh | None:
        """The mesh of one pp position's processes; None when a stage is one process."""
        if not self.stage_shape:
            return None
        return ProcessMesh(np.array(self.stage_ids[pp_index]).reshape(self.stage_shape),
                           self.stage_dims)

    # -- processes ----------------------------------------------------------------------------
    def process(self, stage: int, coordinate: Sequence[int]) -> int:
        """The process running ``stage`` at a stage (or logical: ``mb`` is ignored) coordinate."""
        coordinate = tuple(coordinate)[:len(self.stage_shape)]
        flat = int(np.ravel_multi_index(coordinate, self.stage_shape)) if self.stage_shape else 0
        return self.stage_ids[self.rank_of(stage)][flat]

    def locate(self, process: int) -> tuple[int, tuple[int, ...]] | None:
        """(pp position, stage coordinate) of a process; None when it is in no stage."""
        for index, ids in enumerate(self.stage_ids):
            if process in ids:
                flat = ids.index(process)
                coordinate = np.unravel_index(flat, self.stage_shape) if self.stage_shape else ()
                return index, tuple(int(c) for c in coordinate)
        return None

    def stage_coordinates(self) -> list[tuple[int, ...]]:
        """Every coordinate of a stage mesh, row-major."""
        return [tuple(int(x) for x in c) for c in np.ndindex(*self.stage_shape)] \
            if self.stage_shape else [()]

    def to_logical(self, dist: DistAttr, strategy_mesh: ProcessMesh | None
                   ) -> tuple[DistAttr, int | None]:
        """An annotation's placement on the logical mesh, and the pp position it ties the
        value to (an annotation on one stage's mesh) or None. Annotations may use the
        logical mesh, the strategy's whole mesh (replicated over the pipeline axis) or one
        stage's mesh."""
        logical = self.logical_mesh
        if dist.mesh == logical:
            return dist, None
        if strategy_mesh is not None and dist.mesh == strategy_mesh:
            d = strategy_mesh.dim_index(self.axis)
            if not dist.placements[d].is_replicate():
                raise ValueError(
                    f"{dist} places a value as {dist.placements[d]} on the pipeline axis "
                    f"{self.axis!r}: pipeline.split cuts the model into stages, values are not "
                    f"sharded over {self.axis!r}; use Replicate() on it")
            rest = tuple(dist.placements[:d]) + tuple(dist.placements[d + 1:])
            return DistAttr(logical, rest + (Replicate(),)), None
        for index in range(self.ranks):
            if dist.mesh == self.stage_mesh(index):
                return DistAttr(logical, tuple(dist.placements) + (Replicate(),)), index
        raise ValueError(f"{dist.mesh} is neither the strategy's mesh nor one of the pipeline's "
                         f"stage meshes ({self._describe()})")

    def with_micro_batches(self, micro_batches: int) -> "PipelineLayout":
        return dataclasses.replace(self, micro_batches=micro_batches)

    def describe(self) -> str:
        return (f"pipeline over {self.axis} of {self.ranks} ranks x {self.chunks} chunk(s) = "
                f"{self.stages} stages, {self.micro_batches} micro-batches, schedule "
                f"{self.schedule}; {self._describe()}")

    def _describe(self) -> str:
        return "; ".join(f"stage rank {i}: processes {format_ranks(ids)}"
                         for i, ids in enumerate(self.stage_ids))
