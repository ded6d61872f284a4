"""What a pass may read besides the program, and what passes hand to later passes.

* ``PlanInputs`` — chosen once by the engine for one program, never changed by a pass (and
  no pass reads the environment);
* ``PlanState`` — the typed facts passes produce for later passes and for lowering: each
  field is made by one pass, declared in ``autopar.passes.PIPELINE`` (``Pass.makes``). Reading a
  fact no pass has made yet raises, naming the pass that makes it, so a disabled or
  reordered pass fails loudly instead of silently changing what later passes see.

Facts without data (the program is placed, resharded, split into stages...) are ``Fact``
members too: the manager checks a pass's ``needs`` against the facts made before it runs.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..ir.dist import DistAttr, ProcessMesh
from ..pipeline.layout import PipelineLayout
from ..pipeline.schedules import PipelineSchedule
from ..strategy import Strategy
from .parallel_layout import ParallelLayout

__all__ = ["Fact", "PlanInputs", "PlanState", "PassContext", "FactError"]


class Fact(str, enum.Enum):
    """What a pass establishes about the program (or the plan) for later ones."""

    OPTIMIZER = "optimizer"    # the optimizer's update ops are in the program (training)
    MESH = "mesh"              # PlanState.mesh / pipeline / param_placements / param_stages
    STAGES = "stages"          # every forward, loss and backward op has its pipeline stage
    PLACED = "placed"          # every tensor value has a placement, every op its needs
    RESHARDED = "resharded"    # every op reads its inputs as it needs them (comm ops)
    PHASES = "phases"          # every op has its pipeline homes (stage, phase)
    SCHEDULE = "schedule"      # PlanState.schedule: every pipeline rank's job order


class FactError(RuntimeError):
    """A pass (or lowering) reads a fact that no pass has made."""


@dataclass(frozen=True)
class PlanInputs:
    """One program's planning inputs, as the engine chose them."""

    strategy: Strategy
    mode: str = "train"                          # train | eval | predict
    optimizer: torch.optim.Optimizer | None = None
    param_names: Mapping[int, str] = field(default_factory=dict)   # id(parameter) -> FQN
    # the strategy's mesh (``ParallelLayout.of(strategy)``), before the program's own
    # annotations are looked at
    mesh: ProcessMesh | None = None
    # the micro-batches this program cuts its batch into under a pipeline, as the step
    # planner decided them (``planner.options.micro_batches``: the strategy's for training,
    # eval and predict as many as divide their batch); ``settle_mesh`` lays the stages out
    # with it. The only home of the count between the strategy and the pipeline fact.
    micro_batches: int = 1
    # shard_tensor placements given to parameters before planning, by parameter FQN
    param_annotations: Mapping[str, DistAttr] = field(default_factory=dict)
    # where earlier programs of the same engine placed each parameter: a parameter keeps
    # one placement (eval and predict programs read the pieces training updates)
    kept_placements: Mapping[str, DistAttr] = field(default_factory=dict)
    rank: int = 0        # the process planning (for dump paths)
    # gradient merge: this training program only accumulates its gradients (batches 1..k-1
    # of a cycle: no update), where the other one also applies them (passes/merge_gradients)
    accumulate_only: bool = False

    @classmethod
    def of(cls, strategy: Strategy, **fields: Any) -> "PlanInputs":
        """Inputs for ``strategy`` with its interpreted mesh (``fields`` set the rest; a
        pipelined program's ``micro_batches`` is the step planner's to decide)."""
        return cls(strategy, mesh=ParallelLayout.of(strategy).mesh, **fields)

    @property
    def dump_prefix(self) -> str:
        """How this program's dump files start: nothing for the training step (the one
        that updates), ``accumulate_`` for gradient merge's other, ``<mode>_`` otherwise."""
        if self.mode == "train":
            return "accumulate_" if self.accumulate_only else ""
        return f"{self.mode}_"

    def name_of(self, param: torch.Tensor) -> str:
        try:
            return self.param_names[id(param)]
        except KeyError:
            raise ValueError(
                f"the optimizer holds a tensor of shape {list(param.shape)} that is not a "
                "parameter of the model given to Engine") from None


_UNSET: Any = object()

# which pass makes each data-carrying fact (for the error when it is missing)
_MADE_BY = {"mesh": "settle_mesh", "pipeline": "settle_mesh",
            "param_placements": "settle_mesh", "param_stages": "settle_mesh",
            "schedule": "schedule_pipeline"}
# the fields each fact carries
_FIELDS = {Fact.MESH: ("mesh", "pipeline", "param_placements", "param_stages"),
           Fact.SCHEDULE: ("schedule",)}


class PlanState:
    """The facts passes hand on. Each is set once, by the pass named in ``_MADE_BY``."""

    __slots__ = ("_values", "made")

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self.made: set[Fact] = set()    # facts established so far (the manager adds them)

    def _get(self, name: str) -> Any:
        value = self._values.get(name, _UNSET)
        if value is _UNSET:
            raise FactError(f"plan fact {name!r} is read before pass '{_MADE_BY[name]}' made "
                            "it (is that pass disabled, or run later?)")
        return value

    # -- settle_mesh ---------------------------------------------------------------------
    @property
    def mesh(self) -> ProcessMesh | None:
        """The mesh the program runs on (a pipeline's logical mesh); None: serial."""
        return self._get("mesh")

    @property
    def pipeline(self) -> PipelineLayout | None:
        """The pipeline's stages and micro-batches; None without a pipeline."""
        return self._get("pipeline")

    @property
    def param_placements(self) -> Mapping[str, DistAttr]:
        """shard_tensor placements of parameters, on the program's mesh."""
        return self._get("param_placements")

    @property
    def param_stages(self) -> Mapping[str, int]:
        """The stage of each parameter annotated on one stage's mesh."""
        return self._get("param_stages")

    def settle_mesh(self, mesh: ProcessMesh | None, pipeline: PipelineLayout | None,
                    param_placements: Mapping[str, DistAttr],
                    param_stages: Mapping[str, int]) -> None:
        self._set(mesh=mesh, pipeline=pipeline, param_placements=dict(param_placements),
                  param_stages=dict(param_stages))

    # -- schedule_pipeline -----------------------------------------------------------------
    @property
    def schedule(self) -> PipelineSchedule | None:
        """Every pipeline rank's job order, played on a timeline; None without a pipeline."""
        return self._get("schedule")

    def set_schedule(self, schedule: PipelineSchedule | None) -> None:
        self._set(schedule=schedule)

    def check_made(self, facts: frozenset[Fact], by: str) -> None:
        """Every field of ``facts`` is set (after pass ``by``, which declares it makes them)."""
        unset = [name for fact in facts for name in _FIELDS.get(fact, ())
                 if name not in self._values]
        if unset:
            raise FactError(f"pass '{by}' declares it makes {sorted(f.value for f in facts)} "
                            f"but left {unset} unset")

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            if name in self._values:
                raise FactError(f"plan fact {name!r} is made twice")
            self._values[name] = value


@dataclass
class PassContext:
    """A pass's view: the inputs (read-only) and the state passes build up."""

    inputs: PlanInputs
    state: PlanState = field(default_factory=PlanState)

    @property
    def strategy(self) -> Strategy:
        return self.inputs.strategy

    @property
    def mode(self) -> str:
        return self.inputs.mode
