"""Why a value has its placement: the record completion (and the annotation and reshard
passes) leave on every placed value, read by ``pass_infra.explain`` and the dumps.

Plain data, stored by the IR (``Value.why``): the kind of decision, a sentence, the op whose
rule or need decided, the values it was decided from, and, per mesh dim, what was chosen
over what at which price.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .shard_groups import Groups, format_groups

if TYPE_CHECKING:
    from .core import Op, Value

__all__ = ["Option", "REPLICATE", "MeshDimChoice", "Reason", "REASON_KINDS"]

REASON_KINDS = ("annotation", "plan", "data_parallel", "rule", "no_rule", "consumer", "default",
                "reshard", "merge")


@dataclass(frozen=True)
class Option:
    """One placement a rule may give a mesh dim: shard a letter, a partial, or replicate."""

    kind: str          # "shard" | "partial" | "replicate"
    arg: str = ""      # the letter, or the partial op
    groups: Groups = 1    # a shard's groups (Shard(d, groups))

    def __str__(self) -> str:
        shard = f"shard '{self.arg}'" + (f" x{format_groups(self.groups)}"
                                         if self.groups != 1 else "")
        return {"shard": shard, "partial": f"P({self.arg})"}.get(self.kind, "R")


REPLICATE = Option("replicate")


@dataclass(frozen=True)
class MeshDimChoice:
    """What one mesh dim was given, what it cost, and what else was priced (for explain)."""

    mesh_dim: int
    chosen: Option
    cost: float
    alternatives: tuple[tuple[Option, float], ...]


@dataclass(frozen=True)
class Reason:
    kind: str                                        # one of REASON_KINDS
    text: str
    op: Op | None = None                             # the op whose rule or need decided
    sources: tuple[Value, ...] = ()                  # values this choice was made from
    choices: tuple[MeshDimChoice, ...] = ()
    # the pass that recorded it (the pass manager stamps it after each pass, so explain can
    # say which pass decided); not part of the reason's identity
    made_by: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in REASON_KINDS:
            raise ValueError(f"unknown reason kind {self.kind!r}; kinds: {REASON_KINDS}")
