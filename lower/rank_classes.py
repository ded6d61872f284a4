"""Which processes of a plan lower alike: classes of ranks whose programs differ only in
which piece they hold, so that a report (memory, time) lowers one per class.

Two processes' partitions (``partition``) differ where their coordinates give different
local shapes, or different local calls. Local calls read the coordinate for offsets (a
vocab shard's first row, a causal block's first row, a random slice's start), which change
no shape and no cost; they change a call's kind only on an empty piece (an uneven shard).
So along a mesh dim that cuts every value evenly, all coordinates lower to programs with
the same ops, the same local types and the same collectives (group sizes and pieces):

* a *distinguishing* dim cuts some value unevenly (a batch of 5 rows over dp2: 3 + 2, a
  ZeRO shard of a parameter whose rows do not divide): each coordinate along it is its
  own class;
* a pipeline's pp position is always distinguishing (its stages are other ops);
* every other dim (dp replicas, the tp ranks of a stage, evenly cut) is not.

Values are checked as placed (every op's results) and as read (every op's ``needs``), at
the logical mesh: a pipeline's micro-batch dim is no process dim. A test lowers a mix of
meshes both ways and compares every process's program with its class representative's.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..ir import Program
from ..ir.dist import DistAttr, ProcessMesh, Shard, group_widths, local_shape
from ..pipeline.layout import PipelineLayout

__all__ = ["RankClasses", "classify_ranks"]


@dataclass(frozen=True)
class RankClasses:
    """The processes of one plan by class: ``representative[p]`` is the lowest process
    whose program ``p``'s equals but for the pieces held (itself for a representative)."""

    representative: dict[int, int]
    distinguishing: tuple[str, ...]     # the mesh dims whose coordinate makes a new class

    @property
    def representatives(self) -> list[int]:
        return sorted(set(self.representative.values()))

    def members(self, representative: int) -> list[int]:
        return sorted(p for p, r in self.representative.items() if r == representative)

    def __len__(self) -> int:
        return len(self.representatives)

    def describe(self) -> str:
        dims = (f"distinguished by {', '.join(self.distinguishing)}" if self.distinguishing
                else "every dim cuts evenly")
        return (f"{len(self.representative)} processes in {len(self)} classes of identical "
                f"programs ({dims})")


def classify_ranks(program: Program, mesh: ProcessMesh | None,
                 pipeline: PipelineLayout | None) -> RankClasses:
    """The classes of ``program``'s processes (``mesh``: the program's mesh, a pipeline's
    logical mesh; None: serial, one process)."""
    if mesh is None or (mesh.size == 1 and pipeline is None):
        return RankClasses({0: 0}, ())
    uneven = _uneven_dims(program, mesh)
    names = [mesh.dim_names[d] for d in sorted(uneven)]
    if pipeline is None:
        places = ((int(p), mesh.coordinate(p)) for p in mesh.process_ids)
        return _classes(((p, (), c) for p, c in places), uneven, tuple(names))
    places = ((process, pp, c) for pp, ids in enumerate(pipeline.stage_ids)
              for process, c in zip(ids, pipeline.stage_coordinates()))
    return _classes(places, uneven, (pipeline.axis, *names))


def _classes(places: Iterator[tuple[int, object, Sequence[int]]], uneven: set[int],
             names: tuple[str, ...]) -> RankClasses:
    first: dict[tuple, int] = {}
    representative = {}
    for process, pp, coordinate in sorted(places):
        key = (pp, tuple(c for d, c in enumerate(coordinate) if d in uneven))
        representative[process] = first.setdefault(key, process)
    return RankClasses(representative, names)


def _uneven_dims(program: Program, mesh: ProcessMesh) -> set[int]:
    """The mesh dims that cut some value of ``program`` into pieces of different shapes."""
    seen: set[tuple] = set()
    uneven: set[int] = set()
    for op in program.ops:
        placed = [(v.type.shape, v.dist) for v in op.outputs if v.is_tensor and v.dist]
        tensors = [v for v in op.inputs if v.is_tensor]      # ``needs``: per tensor input
        read = [(v.type.shape, d) for v, d in zip(tensors, op.needs) if isinstance(d, DistAttr)]
        for shape, dist in placed + read:
            key = (tuple(shape), dist.placements)
            if key not in seen and dist.mesh == mesh:
                seen.add(key)
                uneven |= _cuts_unevenly(tuple(shape), dist, mesh)
    return uneven


def _cuts_unevenly(shape: tuple[int, ...], dist: DistAttr, mesh: ProcessMesh) -> set[int]:
    """The mesh dims that cut a tensor dim of ``shape`` into pieces of different sizes:
    all that cut a tensor dim together, when its pieces differ anywhere."""
    out: set[int] = set()
    for d in {p.dim for p in dist.placements if isinstance(p, Shard)}:
        cutting = [m for m, p in enumerate(dist.placements) if p.is_shard(d)]
        if not _even(shape, d, cutting, dist, mesh):
            out |= set(cutting)
    return out


def _even(shape: tuple[int, ...], d: int, cutting: list[int], dist: DistAttr,
          mesh: ProcessMesh) -> bool:
    """Whether every coordinate of the ``cutting`` mesh dims holds as many of tensor dim
    ``d``: plain shards when their product divides it; grouped ones (a group per part)
    when it divides every part, else by the pieces themselves."""
    n = math.prod(mesh.shape[m] for m in cutting)
    groups = [dist.placements[m].groups for m in cutting]
    if all(g == 1 for g in groups):
        return shape[d] % n == 0
    if len(cutting) == 1:
        return all(w % n == 0 for w in group_widths(groups[0], shape[d]))
    sizes = set()
    for coords in itertools.product(*(range(mesh.shape[m]) for m in cutting)):
        coordinate = [0] * mesh.ndim
        for m, c in zip(cutting, coords):
            coordinate[m] = c
        sizes.add(local_shape(shape, mesh, dist.placements, coordinate)[d])
    return len(sizes) == 1


