"""Run one rank's program step after step, holding its state (parameters, buffers,
optimizer state) between steps."""
from __future__ import annotations

from typing import Any

import torch

from ..ir import OpKind, Program, Slot, StateKind
from ..ir.ops import draws_random
from .codegen import generate
from ..ir.attrs import CONST, NAME, STATE


def has_random_ops(program: Program) -> bool:
    return any(draws_random(op) for op in program.ops_of(OpKind.CALL))


class Executor:
    """Compiles a program once; ``run`` feeds a step and writes state updates back.

    ``state`` maps state names to tensors and is shared with the engine (and, in serial
    runs, aliases the model's own parameters, so the model trains in place). A rank's
    program of a distributed plan holds this rank's pieces, and ``comm`` binds its COMM ops
    to their collectives (``runtime.rank_program``).
    """

    def __init__(self, program: Program, state: dict[str, Any],
                 comm: dict | None = None, random: bool | None = None):
        self.program = program
        self.state = state
        for op in program.ops_of(OpKind.STATE):
            if op.attrs[STATE] is StateKind.CONST:
                state.setdefault(op.attrs[NAME], op.attrs[CONST])
        missing = [op.attrs[NAME] for op in program.ops_of(OpKind.STATE)
                   if op.attrs[NAME] not in state]
        if missing:
            raise KeyError(f"no initial value for program state {missing[:5]}")
        self.fn, self.source = generate(program, comm=comm)
        self.slots: list[Slot] = [s for s, _ in program.results()]
        self._updates = [(i, s.name) for i, s in enumerate(self.slots) if s.kind == "update"]
        self._returned = [i for i, s in enumerate(self.slots) if s.kind != "update"]
        # a rank's program calls random ops through their local forms: its caller says
        # whether the global program draws
        self.random = has_random_ops(program) if random is None else random

    def _run_seeded(self, feeds: dict[str, Any], seed: int) -> tuple:
        """Random ops draw from the CPU generator seeded with ``seed`` (what
        ``torch.manual_seed(seed)`` gives eager code); the caller's RNG state is restored.
        Seeding the generator directly skips manual_seed's per-call accelerator hooks."""
        generator = torch.default_generator
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.fn(feeds, self.state)
        finally:
            generator.set_state(saved)

    def run(self, feeds: dict[str, Any], seed: int | None = None) -> dict[Slot, Any]:
        """Run one step; state updates are written back, the other results returned."""
        with torch.no_grad():
            if self.random and seed is not None:
                values = self._run_seeded(feeds, seed)
            else:
                values = self.fn(feeds, self.state)
        for index, name in self._updates:
            self.state[name] = values[index]
        return {self.slots[i]: values[i] for i in self._returned}
