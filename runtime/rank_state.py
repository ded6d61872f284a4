"""A process's pieces of the state (parameters, buffers, optimizer state, constants) on real
processes, and the way back to whole tensors.

A state value lives in one placement for the engine's lifetime: the first program that
reads it cuts this process's piece from the whole initial value (``adopt``), and later
programs (eval, predict, a new batch shape) are planned with the parameters pinned where
training keeps them; a program that wants another placement is refused. ``full`` gathers a
value whole by the steps lowering found; in a pipeline the copy of the lowest stage that
holds it is broadcast over the pipeline axis. Both are collectives: every process calls
them for the same names in the same order.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from ..ir.dist import shard_tensor_local
from ..lower.executable import StatePiece
from .collectives import bind_step
from .process_groups import MeshGroups

__all__ = ["RankState", "PipelineAxis", "cut_piece", "at_home", "Pieces"]

# this process's starting pieces of several states at once, by name
Pieces = Callable[[Mapping[str, StatePiece]], "dict[str, torch.Tensor | None]"]


def cut_piece(whole: torch.Tensor | None, piece: StatePiece) -> torch.Tensor | None:
    """The piece of ``whole`` a process holds (None stays None: a state the first update
    creates, such as SGD's momentum buffer)."""
    if whole is None or piece.dist is None:
        return whole
    return shard_tensor_local(whole, piece.dist.mesh, piece.dist.placements, piece.coordinate)


def at_home(value: torch.Tensor | None, piece: StatePiece, device: torch.device
            ) -> torch.Tensor | None:
    """``value`` where ``piece``'s state lives: the device the process computes on, or host
    memory for an offloaded state (``sharding.offload``), pinned when the device is a GPU
    (so its copies to and from the device need not block). A value already there is
    returned itself (a serial run trains the model's own tensors in place)."""
    if value is None:
        return None
    if not piece.on_host:
        return value if value.device == device else value.to(device)
    if value.device.type != "cpu":
        value = value.to("cpu")
    if device.type == "cuda" and not value.is_pinned():
        value = value.pin_memory()
    return value


class PipelineAxis:
    """How a pipeline process reaches the other stages' copies: its pp position, the
    process at its coordinate on every pp position, and the group along the pp axis."""

    def __init__(self, pp: int, peers: Mapping[int, int], group) -> None:
        self.pp, self.peers, self.group = pp, dict(peers), group


class RankState:
    """This process's pieces, by state name."""

    def __init__(self, groups: MeshGroups | None, pipeline: PipelineAxis | None = None,
                 device: torch.device | None = None):
        self.groups, self.pipeline = groups, pipeline
        self.device = device or torch.device("cpu")
        self.tensors: dict[str, torch.Tensor | None] = {}
        self.pieces: dict[str, StatePiece] = {}      # every state known, held or not

    def adopt(self, pieces: Mapping[str, StatePiece], held: Iterable[str],
              initial: Callable[[StatePiece], torch.Tensor | None],
              cut: Pieces | None = None) -> None:
        """Take this process's pieces of the ``held`` states not held yet, and learn every
        state's layout. A piece is cut from ``initial(piece)`` (the whole starting value; a
        constant's own), or made by ``cut(wanted)`` when given (the pieces of several
        states at once, which a model built on the meta device draws without its whole)."""
        held, wanted, placed = set(held), {}, {}
        for name, piece in pieces.items():
            known = self.pieces.get(name)
            if known is not None and known.dist is not None and \
                    tuple(known.dist.placements) != tuple(piece.dist.placements):
                raise ValueError(
                    f"state {name!r} is kept at {known.dist} but a program wants it at "
                    f"{piece.dist}; a state value keeps one placement for the engine's lifetime")
            self.pieces.setdefault(name, piece)
            if name in held and name not in self.tensors:
                if piece.const is not None:
                    placed[name] = cut_piece(piece.const, piece)
                else:
                    wanted[name] = piece
        if cut is not None:
            placed.update(cut(wanted))
        else:
            placed.update({n: cut_piece(initial(p), p) for n, p in wanted.items()})
        self.tensors.update({n: at_home(v, pieces[n], self.device) for n, v in placed.items()})

    def names(self) -> list[str]:
        """Every state known but constants, in the order every process calls ``full``."""
        return sorted(name for name, piece in self.pieces.items() if piece.const is None)

    def full(self, name: str) -> torch.Tensor | None:
        """The whole tensor of state ``name`` (None where it does not exist yet)."""
        piece = self.pieces[name]
        mine = self.pipeline is None or piece.owner == self.pipeline.pp
        value = self._gathered(name, piece) if mine else None
        if self.pipeline is None or len(self.pipeline.peers) == 1 or self.groups is None:
            return value
        source = self.pipeline.peers[piece.owner]
        present = torch.tensor([value is not None], dtype=torch.int32, device=self.device)
        dist.broadcast(present, src=source, group=self.pipeline.group)
        if not present.item():
            return None
        if value is None:
            value = torch.empty(piece.shape, dtype=piece.dtype, device=self.device)
        dist.broadcast(value, src=source, group=self.pipeline.group)
        return value

    def _gathered(self, name: str, piece: StatePiece) -> torch.Tensor | None:
        value = self.tensors.get(name)
        if value is None or self.groups is None:
            return value
        for comm in piece.gather:
            value = bind_step(comm, self.groups)(value)
        return value
