"""The phases of one pipelined training step, in the order a rank runs them.

* ``pre_mb`` — per micro-batch, before the schedule: what a value reduced over every
  micro-batch is made of, when the pipeline needs it (the token count of a mean loss);
* ``pre`` — once, before the schedule: values every micro-batch reads alike (a transposed
  weight, position embeddings, that token count);
* ``F``, ``B``, ``W`` — per micro-batch, in the schedule's order: forward, backward (input
  gradients only when the schedule splits the backward) and weight gradients;
* ``post`` — once, after the schedule: accumulated gradients, the optimizer, the loss.

A *home* is a (stage, phase) pair where an op runs; an op may have several (a value every
stage needs is computed on each; a cheap op two phases need is computed in both).
"""
from __future__ import annotations

import enum

from ..ir.attrs import Attr
from ..reshard.steps import Step


class Phase(str, enum.Enum):
    PRE_MB = "pre_mb"
    PRE = "pre"
    F = "F"
    B = "B"
    W = "W"
    POST = "post"

    @property
    def per_micro_batch(self) -> bool:
        return self in (Phase.PRE_MB, Phase.F, Phase.B, Phase.W)

    @property
    def order(self) -> int:
        return _ORDER[self]

    def __str__(self) -> str:
        return self.value


_ORDER = {p: i for i, p in enumerate(Phase)}

Home = tuple[int, Phase]


class Homes(tuple):
    """The sorted (stage, phase) pairs where an op runs; prints compactly for dumps:
    ``s0:F``, ``s0,1:post``, ``s2:pre_mb,F``."""

    def __new__(cls, homes) -> "Homes":
        return super().__new__(cls, sorted(set(homes), key=lambda h: (h[0], h[1].order)))

    def __str__(self) -> str:
        by_phase: dict[Phase, list[int]] = {}
        for stage, phase in self:
            by_phase.setdefault(phase, []).append(stage)
        by_stages: dict[tuple[int, ...], list[str]] = {}
        for phase in sorted(by_phase, key=lambda p: p.order):
            by_stages.setdefault(tuple(sorted(by_phase[phase])), []).append(phase.value)
        return " ".join(f"s{','.join(map(str, stages))}:{','.join(phases)}"
                        for stages, phases in by_stages.items())


# -- the op attributes of a pipelined program ------------------------------------------------
STAGE: Attr[int] = Attr("stage", int, "the pipeline stage an op runs on (split_stages)",
                        note=lambda stage: f"@s{stage}")
STAGE_HINT: Attr[int] = Attr("stage_hint", int, "the stage whose mesh a traced annotation "
                             "was made on (settle_mesh)")
HOMES: Attr[Homes] = Attr("homes", Homes, "every (stage, phase) an op runs in "
                          "(assign_phases)", note=lambda h: f"@{h}", replaces=("stage",))
BOUNDARY: Attr[Step] = Attr("boundary", Step, "a sum or gather over micro-batches (its "
                            "step), which runs between jobs")


def homes_of(op) -> Homes:
    return op.attrs.get(HOMES, Homes(()))


__all__ = ["Phase", "Home", "Homes", "homes_of", "STAGE", "STAGE_HINT", "HOMES", "BOUNDARY"]
