"""Distributed attributes: process meshes, placements, and sharding arithmetic.

This is the vocabulary completion, partition and reshard speak. It is deliberately small,
immutable and printable. Each concern has its own module; this one re-exports them all, so
``from autopar.ir.dist import ...`` keeps working:

* ``mesh.py`` — ``ProcessMesh``, an n-D array of process ids with named dims, and the
  micro-batch dim of a pipeline's logical mesh.
* ``placements.py`` — ``Shard(d)`` / ``Replicate()`` / ``Partial(op)``, one per mesh dim,
  their text (``format_placements``, ``parse_placements``) and the norm partials;
  ``shard_groups.py`` — a grouped shard's layouts (``Shard(d, groups=(2, 1, 1))``).
* ``dist_attr.py`` — ``DistAttr(mesh, placements)``, what completion writes into
  ``Value.dist``; its ``str`` is the compact, stable text IR dumps print.
* ``chunks.py`` — chunk arithmetic with ``torch.chunk`` semantics: each rank's piece
  (``local_shape``, ``local_offsets``, ``local_runs``), remembered per question.
* ``reference.py`` — the reference semantics of a placement on real tensors
  (``shard_tensor_local``, ``assemble``): tests and the simulator check every pass against
  them.
"""
from __future__ import annotations

from .chunks import (
    Runs,
    local_offset,
    local_offsets,
    local_runs,
    local_shape,
    local_size,
    local_slices,
)
from .dist_attr import DistAttr
from .mesh import MICRO_BATCH_DIM, Coordinate, ProcessMesh, format_ranks, micro_batch_dim
from .placements import (
    PARTIAL_OPS,
    Partial,
    Placement,
    Replicate,
    Shard,
    format_placements,
    is_grouped,
    norm_order,
    norm_partial,
    parse_placements,
)
from .reference import (
    assemble,
    cat_grouped,
    chunk_grouped,
    keeps_partial_value,
    reduce_terms,
    shard_tensor_local,
)
from .shard_groups import Groups, format_groups, group_total, group_widths, normalize_groups

__all__ = [
    # mesh.py
    "ProcessMesh", "Coordinate", "format_ranks", "MICRO_BATCH_DIM", "micro_batch_dim",
    # placements.py, shard_groups.py
    "Placement", "Shard", "Replicate", "Partial", "PARTIAL_OPS", "norm_partial", "norm_order",
    "is_grouped", "format_placements", "parse_placements",
    "Groups", "normalize_groups", "group_total", "group_widths", "format_groups",
    # dist_attr.py
    "DistAttr",
    # chunks.py
    "local_size", "local_offset", "local_shape", "local_offsets", "local_slices", "local_runs",
    "Runs",
    # reference.py
    "reduce_terms", "keeps_partial_value", "chunk_grouped", "cat_grouped", "shard_tensor_local",
    "assemble",
]
