"""One candidate strategy's predicted step time and memory: planned (capture, passes,
lowering of every rank) by the step planner the engine plans with (``StepPlanner``), then
``cost.predict`` and the plan-time memory estimate (``lower.memory_estimate``).

Repeated layers are planned once, in effect: a model with a repeated stack of ``L`` layers
is planned cut to ``k1 = pp`` and ``k2 = 2 pp`` layers (one and two per pipeline stage) and
each rank's step time, compute, exposed communication and peak bytes are extended linearly
to ``L`` (``auto.truncate`` says why they are affine). A model without one, or one no
deeper than ``k2``, is planned whole. ``check_extrapolation`` (tests) compares the two.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..cost import Profile
from ..planner import StepPlanner
from ..strategy import Strategy
from .space import Layout
from .truncate import RepeatedStack, cut_model, cut_optimizer

__all__ = ["Estimate", "Measured", "PlanFn", "evaluate", "plan_and_predict"]


@dataclass(frozen=True)
class Measured:
    """What the cost model says of one plan: the step's seconds (the slowest rank's), the
    slowest rank's compute and exposed communication, the pipeline bubble, each rank's
    predicted peak bytes."""

    step_s: float
    compute_s: float
    comm_s: float
    bubble: float | None
    peak: dict[int, float]

    @property
    def max_peak(self) -> float:
        return max(self.peak.values())

    def extended(self, other: "Measured", at: float) -> "Measured":
        """The line through self (at 0) and ``other`` (at 1), evaluated at ``at``."""
        def line(a: float, b: float) -> float:
            return max(0.0, a + (b - a) * at)
        bubble = None if self.bubble is None or other.bubble is None else \
            min(1.0, line(self.bubble, other.bubble))
        return Measured(line(self.step_s, other.step_s), line(self.compute_s, other.compute_s),
                        line(self.comm_s, other.comm_s), bubble,
                        {r: line(self.peak[r], other.peak[r]) for r in self.peak})


# plans a training step of (model, optimizer, strategy) on the sample batch for every rank
# and predicts it (``plan_and_predict`` with the batch and profile bound)
PlanFn = Callable[[torch.nn.Module, torch.optim.Optimizer, Strategy], Measured]


def plan_and_predict(loss: Callable | None, inputs: Any, labels: Any, profile: Profile
                     ) -> PlanFn:
    """The planning of one candidate: a training step, predicted for every rank (lowering
    one per class of identical ranks)."""
    def plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             strategy: Strategy) -> Measured:
        planner = StepPlanner(model, loss, optimizer, strategy)
        step = planner.plan("train", inputs, labels)
        timed = planner.time(step, profile)
        slowest = max(timed.processes.values(), key=lambda t: t.finish_s)
        memory = planner.memory(step)
        return Measured(timed.step_s, slowest.compute_s, slowest.comm_s, timed.bubble,
                        {r: float(m.peak) for r, m in memory.items()})
    return plan


@dataclass
class Estimate:
    """A candidate: its layout and strategy, and the cost model's verdict (``error``: why it
    could not be planned)."""

    layout: Layout
    strategy: Strategy | None
    predicted: Measured | None = None
    error: str | None = None
    layers_planned: tuple[int, ...] = ()       # the cut depths it was planned at
    seconds: float = 0.0                        # planning + prediction time
    fits: bool = False
    notes: list[str] = field(default_factory=list)


def evaluate(layout: Layout, strategy: Strategy, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, plan: PlanFn, stack: RepeatedStack | None,
             memory_limit_bytes: float | None) -> Estimate:
    """Plan ``strategy`` (cut and extended when the model has a deep repeated stack) and
    judge it against the memory limit; a strategy the planner refuses is an Estimate with
    the error."""
    estimate = Estimate(layout, strategy)
    start = time.perf_counter()
    try:
        depths = _depths(layout, stack)
        if depths is None:
            estimate.predicted = plan(model, optimizer, strategy)
        else:
            estimate.predicted = _extended(depths, stack, strategy, model, optimizer, plan)
            estimate.layers_planned = depths
    except (ValueError, NotImplementedError, RuntimeError, TypeError, KeyError) as err:
        estimate.error = f"{type(err).__name__}: {_first_line(err)}"
    estimate.seconds = time.perf_counter() - start
    if estimate.predicted is not None:
        estimate.fits = memory_limit_bytes is None or \
            estimate.predicted.max_peak <= memory_limit_bytes
    return estimate


def _depths(layout: Layout, stack: RepeatedStack | None) -> tuple[int, int] | None:
    if stack is None or stack.layers <= 2 * layout.pp:
        return None
    return layout.pp, 2 * layout.pp


def _extended(depths: tuple[int, int], stack: RepeatedStack, strategy: Strategy,
              model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: PlanFn
              ) -> Measured:
    k1, k2 = depths
    found = []
    for k in depths:
        cut = cut_model(model, stack, k)
        found.append(plan(cut, cut_optimizer(optimizer, cut), strategy))
    return found[0].extended(found[1], (stack.layers - k1) / (k2 - k1))


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]
