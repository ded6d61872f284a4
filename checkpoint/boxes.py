"""Which boxes of a state value a process writes, and where they sit in its piece: pure
functions of the piece's layout (``StatePiece``), no I/O.

A checkpoint stores each state value under its global shape as a set of boxes
(``offsets``, ``sizes``), DCP's chunks. A process's piece is one box, or several for a
grouped shard (a fused ``[q; k; v]`` weight cut into heads holds one run per group: the
product of each dim's runs). Validity rules:

* the boxes every writing process writes tile the global tensor exactly once: of the
  processes that hold the same piece (mesh dims that replicate the value), one writes
  (``writes_piece``), picked by the value's name so that replicated values spread over the
  replicas instead of all landing on coordinate 0; in a pipeline only the stage that owns
  the value writes (the caller checks ``owner``);
* a ``Partial`` value has no box (its terms are not the value): state is never partial, and
  a state that is (a gradient-merge accumulator) is not checkpointed.

Keys follow ``torch.distributed.checkpoint.state_dict.get_state_dict`` flattened by DCP:
``model.<fqn>`` for parameters and buffers, ``optim.state.<fqn>.<key>`` for optimizer
state, so plain DCP can read the model back (``dcp.load({"model": model.state_dict()})``).
"""
from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

from ..ir import StateKey, StateKind
from ..ir.dist import Partial, local_runs, micro_batch_dim
from ..lower.executable import StatePiece

__all__ = ["Box", "piece_boxes", "writes_piece", "checkpoint_key", "MODEL",
           "OPTIM", "EXTRA"]

MODEL, OPTIM, EXTRA = "model.", "optim.state.", "autopar."


@dataclass(frozen=True)
class Box:
    """One box of a state value: where it sits in the global tensor (``offsets``,
    ``sizes``) and in the process's piece (``local``: the offset per dim)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[int, ...]

    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def piece_boxes(piece: StatePiece) -> list[Box]:
    """The boxes a process's piece of ``piece.name`` covers (one for a whole tensor or a
    plain shard; the product of each dim's runs for a grouped shard; none for an empty
    piece)."""
    shape = tuple(piece.shape)
    if piece.dist is None:
        return [Box((0,) * len(shape), shape, (0,) * len(shape))]
    runs = local_runs(shape, piece.dist.mesh, piece.dist.placements, piece.coordinate)
    per_dim = []
    for dim_runs in runs:
        starts, at = [], 0
        for a, b in dim_runs:
            starts.append((a, b - a, at))
            at += b - a
        per_dim.append(starts)
    return [Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo),
                tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim)]


def writes_piece(piece: StatePiece) -> bool:
    """Whether the process holding this piece writes it: one of the processes holding the
    same piece (its coordinates along the mesh dims that replicate it), chosen by a hash of
    the name that every process computes alike. A partial value cannot be written: it is
    refused, with its name and placement."""
    if piece.dist is None:
        return True
    partial = [p for p in piece.dist.placements if isinstance(p, Partial)]
    if partial:
        raise ValueError(f"state {piece.name!r} is {piece.dist}: a partial value has no "
                         "boxes to checkpoint (its terms are not the value)")
    # a pipeline's micro-batch dim is no replica: its "ranks" are this one process at
    # different times (coordinate 0 on every process)
    mb = micro_batch_dim(piece.dist.mesh)
    replicas = [(c, n) for d, (p, c, n) in enumerate(zip(piece.dist.placements,
                                                         piece.coordinate,
                                                         piece.dist.mesh.shape))
                if not p.is_shard() and d != mb]
    index = 0
    for c, n in replicas:              # this process's index among the replicas
        index = index * n + c
    count = math.prod(n for _, n in replicas)
    return index == zlib.crc32(piece.name.encode()) % count


def checkpoint_key(key: StateKey) -> str | None:
    """The checkpoint key of a state: ``model.<fqn>`` for a parameter or buffer,
    ``optim.state.<fqn>.<key>`` for optimizer state, ``autopar.<name>`` for the loss
    scaler's; None for state a checkpoint leaves out (a gradient-merge accumulator: a save
    happens between cycles, when it is zeros; a constant: the program holds it)."""
    if key.of_module:
        return MODEL + key.param
    if key.kind is StateKind.OPTIM:
        return f"{OPTIM}{key.param}.{key.key}"
    if key.kind is StateKind.SCALER:
        return EXTRA + key.name
    return None
