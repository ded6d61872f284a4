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

from ..ir import Op, OpKind, Slot
from ..ir.ops import draws_random
from ..lower.executable import CompileSpec, RankProgram
from .codegen import Drawn, Outside, generate
from .collectives import bind
from .compiled import CompiledStep
from .job_store import cut_feeds
from .process_groups import MeshGroups
from .rank_state import cut_piece
from .seeding import eager_rng_states, forked_generator

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
                 groups: MeshGroups | None = None, compile: CompileSpec | None = None,
                 random_ops: tuple[tuple[str, Op], ...] = ()):
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
        self.random_ops: tuple[tuple[str, Op], ...] = ()
        if compile is not None and any(op.target == "autopar.get_rng_state" for op in ops):
            comm.update(_fed_draws(rank.program, random_ops))
            self.random_ops = random_ops
        self.fn, self.source = generate(rank.program, comm=comm, traceable=compile is not None)
        if compile is not None:
            self.fn = CompiledStep(self.fn, self.source, rank.program, compile,
                                   f"process {rank.process}'s program", "program",
                                   rank.process)
        slots: list[Slot] = [s for s, _ in rank.program.results()]
        self.slots = slots
        self._updates = [(i, s.name) for i, s in enumerate(slots) if s.kind == "update"]
        self._returned = [i for i, s in enumerate(slots) if s.kind != "update"]

    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        """Run one step; state updates are written back, the other results returned."""
        feeds = cut_feeds(feeds, self.rank.inputs)
        if self.random_ops and seed is not None:
            feeds = {**feeds, **eager_rng_states(self.random_ops, seed)}
        with torch.no_grad():
            if self.rank.draws_random and seed is not None:
                with forked_generator(seed):
                    values = self.fn(feeds, self.state)
            else:
                values = self.fn(feeds, self.state)
        for index, name in self._updates:
            self.state[name] = values[index]
        return {self.slots[i]: values[i] for i in self._returned}


def _fed_draws(program, random_ops: tuple[tuple[str, Op], ...]) -> dict[Op, Drawn | Outside]:
    """A traced program that recomputes random ops: Dynamo cannot read the generator, so
    every random op draws from eager's state at it, fed by the runtime (``Drawn``), and each
    read of the state before one (``autopar.get_rng_state``) is that feed (``Outside``).
    The program has the global program's random ops, in its order (``lower.partition``)."""
    drawing = [op for op in program.ops
               if op.kind is OpKind.CALL and op.recomputes is None and draws_random(op)]
    if len(drawing) != len(random_ops):
        raise ValueError(f"compile: the program draws {len(drawing)} times, the global "
                         f"program {len(random_ops)}: their random states cannot be fed")
    keys = {op: key for op, (key, _) in zip(drawing, random_ops)}
    bound: dict[Op, Drawn | Outside] = {op: Drawn(key) for op, key in keys.items()}
    pending = []
    for op in program.ops:
        if op.kind is OpKind.CALL and op.target == "autopar.get_rng_state":
            pending.append(op)
        elif op in keys:
            bound.update({read: Outside(keys[op]) for read in pending})
            pending = []
    return bound
