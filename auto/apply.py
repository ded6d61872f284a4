"""Applying the placement ILP: capture a training step, run the passes that pin placements
(annotations, the strategy's batch sharding), solve, and pin the chosen placements of the
values that start the program, so the normal pipeline (completion, reshard, lowering) then
makes the plan from them. The step is captured and given its planning inputs by the step
planner itself (``StepPlanner.capture``, ``plan_inputs``): the ILP sees the program that
runs (amp's casts, ring attention, the micro-batch count).

Only starts (parameters, optimizer states, inputs) are pinned: completion derives every op
from them, as it does from a hand-written plan; where its greedy choice for an intermediate
op differs from the ILP's, the program is still correct, only possibly dearer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..cost.profile import Profile
from ..ir import OpKind, Program
from ..ir.attrs import NAME
from ..ir.dist import DistAttr
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pass_infra.manager import PassManager
from ..pass_infra.pinning import pin
from ..passes import PIPELINE
from ..planner import StepPlanner
from ..strategy import Strategy
from .placement_ilp import PlacementChoice, solve_placements
from .tp_plan import tensor_parallel_plan_of

__all__ = ["AutoPlacements", "auto_placements", "pin_placements", "placed_program"]


@dataclass
class AutoPlacements:
    """What the ILP chose for one strategy's mesh: each parameter's placement, each fed
    input's, the solved program (costs, timings), and the choice as a
    ``tensor_parallel.plan`` where it is one (else None, and ``tp_plan_why`` says why)."""

    params: dict[str, DistAttr]
    inputs: dict[str, DistAttr]
    choice: PlacementChoice
    tp_plan: dict[str, str] | None = None
    tp_plan_why: str = ""


def placed_program(model: torch.nn.Module, loss: Callable | None,
                   optimizer: torch.optim.Optimizer, strategy: Strategy, inputs: Any,
                   labels: Any, annotations: dict[str, DistAttr] | None = None
                   ) -> tuple[Program, PassContext]:
    """The captured training step after every pass before completion: the values the
    strategy and annotations pin are placed, the rest are not. ``annotations``: the
    parameters' placements (default: their ``shard_tensor`` annotations, as planned)."""
    planner = StepPlanner(model, loss, optimizer, strategy)
    captured = planner.capture("train", inputs, labels)
    plan_inputs = planner.plan_inputs("train", inputs)
    if annotations is not None:
        plan_inputs = dataclasses.replace(plan_inputs, param_annotations=annotations)
    ctx = PassContext(plan_inputs)
    until = next(i for i, p in enumerate(PIPELINE) if p.name == "completion")
    program = PassManager(passes=PIPELINE[:until], verify=False).run(captured.program, ctx)
    return program, ctx


def pin_placements(program: Program, choice: PlacementChoice) -> Program:
    """Pin the chosen placement of every parameter, state and input not placed yet."""
    for op in program.ops:
        if op.kind in (OpKind.INPUT, OpKind.STATE) and op.result.is_tensor \
                and op.result.dist is None and op.result in choice.values:
            pin(op.result, choice.values[op.result],
                Reason("plan", f"placement ILP: {op.attrs[NAME]} at "
                               f"{choice.values[op.result]}"))
    return program


def auto_placements(model: torch.nn.Module, loss: Callable | None,
                    optimizer: torch.optim.Optimizer, strategy: Strategy, inputs: Any,
                    labels: Any = None, annotations: dict[str, DistAttr] | None = None,
                    profile: Profile | None = None, memory_limit_bytes: float | None = None
                    ) -> AutoPlacements:
    """Placements for ``strategy``'s mesh chosen by the ILP for one training step on the
    sample batch: every parameter's (annotations kept) and every fed input's (those the
    strategy shards, e.g. by ``data_parallel``, kept)."""
    program, ctx = placed_program(model, loss, optimizer, strategy, inputs, labels,
                                  annotations)
    mesh = ctx.state.mesh
    if mesh is None:
        raise ValueError("auto_placements needs a strategy with a mesh (mesh: {shape: [...], "
                         "dim_names: [...]})")
    choice = solve_placements(program, mesh, profile, memory_limit_bytes)
    fed = {op.attrs[NAME]: choice.values[op.result] for op in program.ops_of(OpKind.INPUT)
           if op.result.is_tensor and op.result in choice.values}
    plan, why = tensor_parallel_plan_of(program, choice.params, mesh)
    return AutoPlacements(dict(choice.params), fed, choice, plan, why)
