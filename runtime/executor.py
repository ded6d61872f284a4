"""The executor interface, and the executor of one process's program: serial, or one rank of
a plan on real processes.

Every executor takes a lowered plan at construction and then only runs it:
``run(feeds, seed, batch)`` feeds one step (the full batch tensors and the optimizer's param
groups), writes the state updates back and returns the other results; ``batch`` is the
training batch's index in the run (a gradient-merge cycle steps by it, ``cycle.py``).
Pipelined ones also report the activations they held (``peaks``) and when their jobs ran
(``trace_events``).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from ..ir import Slot
from ..lower.executable import CompileSpec, RankProgram
from .codegen import generate
from .collectives import bind
from .compiled import CompiledStep
from .job_store import cut_feeds
from .process_groups import MeshGroups
from .rank_state import cut_piece
from .seeding import forked_generator

__all__ = ["Executor", "PipelinedExecutor", "ProgramExecutor", "compile_seconds"]


class Executor(Protocol):
    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]: ...


class PipelinedExecutor(Executor, Protocol):
    def peaks(self) -> list[int]: ...           # each pipeline rank's peak activation bytes
    def keep_trace(self) -> None: ...           # keep every step's job times
    def trace_events(self) -> list[tuple[int, str, float, float]]: ...


def compile_seconds(executor: Any) -> float:
    """Seconds ``executor`` spent compiling so far (0 when it does not compile)."""
    if hasattr(executor, "compile_s"):
        return executor.compile_s
    parts = [getattr(executor, name, None) for name in ("accumulate", "apply")]
    if any(parts):
        return sum(compile_seconds(part) for part in parts)
    return getattr(getattr(executor, "fn", None), "compile_s", 0.0)


class ProgramExecutor:
    """Compiles a process's program once; ``run`` feeds a step and writes state updates back.

    ``state`` maps state names to tensors and is shared with the caller: in serial runs the
    model's own parameters (so the model trains in place), on real processes this rank's
    pieces. ``groups`` are this rank's process groups (None when serial).
    """

    def __init__(self, rank: RankProgram, state: dict[str, Any],
                 groups: MeshGroups | None = None, compile: CompileSpec | None = None):
        self.rank, self.state = rank, state
        for name, piece in rank.state.items():
            if piece.const is not None:
                state.setdefault(name, cut_piece(piece.const, piece))
        missing = [name for name in rank.state if name not in state]
        if missing:
            raise KeyError(f"no initial value for program state {missing[:5]}")
        if rank.comms and groups is None:
            raise ValueError(f"process {rank.process}'s program communicates: it needs its "
                             "process groups")
        ops = rank.program.ops
        comm = {ops[i]: bind(spec, groups) for i, spec in rank.comms.items()}
        self.fn, self.source = generate(rank.program, comm=comm, traceable=compile is not None)
        if compile is not None:
            self.fn = CompiledStep(self.fn, self.source, rank.program, compile,
                                   f"process {rank.process}'s program")
        slots: list[Slot] = [s for s, _ in rank.program.results()]
        self.slots = slots
        self._updates = [(i, s.name) for i, s in enumerate(slots) if s.kind == "update"]
        self._returned = [i for i, s in enumerate(slots) if s.kind != "update"]

    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        """Run one step; state updates are written back, the other results returned."""
        if self.rank.inputs:
            feeds = cut_feeds(feeds, self.rank.inputs)
        with torch.no_grad():
            if self.rank.draws_random and seed is not None:
                with forked_generator(seed):
                    values = self.fn(feeds, self.state)
            else:
                values = self.fn(feeds, self.state)
        for index, name in self._updates:
            self.state[name] = values[index]
        return {self.slots[i]: values[i] for i in self._returned}
