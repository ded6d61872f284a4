"""One rank of a distributed plan on real processes: its local program with bound
collectives, its pieces of the state, and the way back to full tensors.

Every rank plans the same global program (same model, same strategy, same seed), so every
rank's local program has the same comm ops in the same order and collectives line up. A
state value (parameter, buffer, optimizer state, constant) lives in one placement for the
engine's lifetime: the first program that uses it cuts this rank's piece from the full
initial value, and later programs (eval, predict, a new batch shape) are planned with the
parameters pinned where training keeps them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..ir.core import Op, OpKind, Program, StateKind
from ..ir.dist import DistAttr, Replicate, local_slices, shard_tensor_local
from ..passes.partition import partition
from ..reshard import plan_reshard
from .collectives import Collective, bind_comm, bind_step
from .executor import Executor, has_random_ops
from .process_groups import MeshGroups
from ..ir.attrs import CONST, NAME, STATE

__all__ = ["RankPieces", "rank_executor", "gather_full", "initial_piece"]


def rank_executor(program: Program, local: Program | None, groups: MeshGroups,
                  pieces: "RankPieces") -> Executor:
    """An executor for this rank's part of the planned global ``program`` (``local``: its
    partition for this rank, when already made)."""
    local = local if local is not None else partition(program, groups.coordinate)
    comm: dict[Op, Collective] = {
        mine: bind_comm(op, groups)
        for op, mine in zip(program.ops, local.ops) if op.kind is OpKind.COMM}
    return Executor(local, pieces.tensors, comm, random=has_random_ops(program))


def input_cutter(program: Program, groups: MeshGroups) -> Callable[[dict], dict]:
    """``full feeds -> this rank's feeds``: batch tensors cut (as views) by their dist."""
    cuts = {}
    for op in program.ops_of(OpKind.INPUT):
        v = op.result
        if v.is_tensor and v.dist is not None and not v.dist.is_replicated:
            cuts[op.attrs[NAME]] = local_slices(v.type.shape, groups.mesh,
                                                  v.dist.placements, groups.coordinate)

    def cut(feeds: dict[str, Any]) -> dict[str, Any]:
        return {k: (x[cuts[k]] if k in cuts else x) for k, x in feeds.items()}
    return cut


@dataclass
class RankPieces:
    """This rank's piece of every state value, with the placement it was cut by."""

    groups: MeshGroups
    tensors: dict[str, torch.Tensor]
    dists: dict[str, DistAttr]
    shapes: dict[str, tuple[int, ...]]      # global shapes

    @classmethod
    def empty(cls, groups: MeshGroups) -> "RankPieces":
        return cls(groups, {}, {}, {})

    def adopt(self, program: Program, full: Mapping[str, Any],
              make_full: Callable[[str], torch.Tensor | None]) -> None:
        """Cut the pieces ``program`` needs that this rank does not hold yet. ``full``
        holds the engine's full tensors; ``make_full(name)`` makes a missing one (fresh
        optimizer state; it raises KeyError for a name it does not know)."""
        for op in program.ops_of(OpKind.STATE):
            name, value = op.attrs[NAME], op.result
            if not value.is_tensor:
                continue
            if name in self.dists:
                if self.dists[name] != value.dist:
                    raise ValueError(
                        f"state {name!r} is kept at {self.dists[name]} but a program "
                        f"({op.module or 'top level'}) wants it at {value.dist}; "
                        "a state value keeps one placement for the engine's lifetime")
                continue
            self.tensors[name] = initial_piece(op, full, make_full, self.groups.coordinate)
            self.dists[name] = value.dist
            self.shapes[name] = tuple(value.type.shape)

    def names(self) -> list[str]:
        """Every state this rank holds a piece of, in the order ``full`` is called."""
        return sorted(self.dists)

    def full(self, name: str) -> torch.Tensor | None:
        """The whole tensor of state ``name``, gathered (collective: every rank calls it
        for the same names in the same order)."""
        if self.tensors[name] is None:
            return None
        return gather_full(self.tensors[name], self.shapes[name], self.dists[name],
                           self.groups)


def initial_piece(op: Op, full: Mapping[str, Any],
                  make_full: Callable[[str], torch.Tensor | None],
                  coordinate: tuple[int, ...]) -> torch.Tensor | None:
    """The piece of state ``op``'s starting value a process at ``coordinate`` holds: cut
    from the engine's full tensor, from ``make_full`` (fresh optimizer state) or from the
    constant; None for a state the first update creates (SGD's momentum buffer)."""
    name, value = op.attrs[NAME], op.result
    if op.attrs[STATE] is StateKind.CONST:
        whole = op.attrs[CONST]
    else:
        whole = full[name] if name in full else make_full(name)
    if whole is None:
        return None
    return shard_tensor_local(whole, value.dist.mesh, value.dist.placements, coordinate)


def gather_full(piece: torch.Tensor, shape, dist: DistAttr, groups: MeshGroups) -> torch.Tensor:
    """The whole tensor from this rank's ``piece`` (placed ``dist``): the reshard
    planner's cheapest path to replicated, run as collectives."""
    target = DistAttr(dist.mesh, tuple(Replicate() for _ in dist.placements))
    placements, current = tuple(dist.placements), piece
    for step in plan_reshard(shape, dist, target, piece.element_size()):
        current = bind_step(step, shape, placements, groups)(current)
        placements = step.advance(placements)
    return current
