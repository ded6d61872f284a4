"""The planner: the strategy the cost model predicts fastest within the memory limit.

1. The space (``auto.space``): every (dp, tp, pp) of ``auto.devices`` ranks on the allowed
   axes, each pipeline with each micro-batch count, no ZeRO and no recompute; what the user
   fixed (sections beside ``auto``, annotations) stays fixed.
2. Tensor parallel's placements, once per degree: the placement integer program
   (``placement_ilp``) on the model cut to two repeated layers, every rank of the tp group
   seeing the whole batch (the batch is data parallel's to split), read back as a
   ``tensor_parallel.plan`` a user can keep. A degree whose choice is no plan (nothing
   sharded pays, or no plan style expresses it) is left out, with the reason.
3. Each layout is planned as the engine plans it and predicted (``auto.evaluate``; the
   repeated layers once: cut and extended).
4. A layout over the memory limit is tried with more ZeRO, then with the repeated layers
   recomputed, until one fits. The fastest few that fit are tried with ZeRO 1 and 2 as well
   (a sharded optimizer step can be the faster).
5. The fastest that fits wins, planned whole first (an extension is not always affine);
   ``NoPlanFits`` when none does.

Stops starting new candidates when ``auto.time_budget_s`` is spent (the report says so).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..cost.profile import Profile
from ..ir import OpKind, Program
from ..ir.dist import DistAttr, ProcessMesh
from ..ir.reason import Reason
from ..pass_infra.pinning import pin
from ..strategy import Strategy
from .apply import placed_program
from .evaluate import Estimate, evaluate, plan_and_predict
from .placement_ilp import PlacementChoice, solve_placements
from .report import format_auto_plan
from .space import Constraints, Layout, base_layouts, layout_strategy, memory_variants
from .tp_plan import nearest_tensor_parallel_plan
from .truncate import RepeatedStack, cut_model, cut_optimizer, find_repeated_stack

__all__ = ["Problem", "TensorParallelChoice", "AutoPlan", "NoPlanFits", "search_strategy"]

FASTEST_TRIED_WITH_ZERO = 3


@dataclass
class Problem:
    """What is being planned: the model, loss, optimizer, a sample global batch (``rows``
    along the batch dim) and the parameters' ``shard_tensor`` annotations."""

    model: torch.nn.Module
    loss: Callable | None
    optimizer: torch.optim.Optimizer
    inputs: Any
    labels: Any
    rows: int
    annotations: dict[str, DistAttr]


@dataclass(frozen=True)
class TensorParallelChoice:
    """The ILP's answer for one tensor-parallel degree: the plan (None: not usable, ``why``),
    and how long it took."""

    degree: int
    plan: dict[str, str] | None
    why: str
    seconds: float
    summary: str = ""


@dataclass
class AutoPlan:
    """The search's result: every candidate evaluated, best first, and the chosen one."""

    chosen: Estimate
    candidates: list[Estimate]
    skipped: list[str]
    tensor_parallel: dict[int, TensorParallelChoice]
    stack: RepeatedStack | None
    devices: int
    memory_limit_bytes: float | None
    profile: Profile
    profile_note: str
    seconds: float
    budget_spent: bool = False
    notes: list[str] = field(default_factory=list)
    top: int = 5                  # how many candidates the report shows

    @property
    def strategy(self) -> Strategy:
        """The chosen candidate's strategy, with the memory limit (the runtime checks it)."""
        assert self.chosen.strategy is not None
        if self.memory_limit_bytes is None:
            return self.chosen.strategy
        return self.chosen.strategy.model_copy(
            update={"memory_limit_gb": self.memory_limit_bytes / 2**30})


class NoPlanFits(ValueError):
    """No candidate's predicted peak fits ``auto.memory_limit_gb`` (the report lists them)."""


def search_strategy(problem: Problem, strategy: Strategy, profile: Profile,
                    profile_note: str = "") -> AutoPlan:
    """Plan ``strategy``'s ``auto`` section for ``problem``."""
    auto = strategy.auto
    if auto is None:
        raise ValueError("search needs a strategy with an auto section")
    start = time.perf_counter()
    limit_gb = auto.memory_limit_gb or strategy.memory_limit_gb
    limit = None if limit_gb is None else limit_gb * 2**30
    run = _Search(problem, strategy, profile, limit, limit_gb, start)
    layouts, skipped = base_layouts(auto, run.fixed, problem.rows)
    if not layouts:
        raise ValueError(f"auto: no layout of {auto.devices} devices on axes "
                         f"{list(auto.axes)} fits the batch: " + "; ".join(skipped))
    for layout in layouts:
        run.evaluate(layout)
    for estimate in list(run.done.values()):
        if estimate.predicted is not None and not estimate.fits:
            for variant in memory_variants(estimate.layout, auto, run.fixed, run.stack):
                if run.evaluate(variant) and run.done[variant].fits:
                    break
    for estimate in _ranked(run.done.values())[:FASTEST_TRIED_WITH_ZERO]:
        if estimate.fits and estimate.layout.dp > 1 and run.fixed.zero is None:
            for zero in (z for z in auto.zero_stages if 0 < z < 3 and z != estimate.layout.zero):
                run.evaluate(Layout(**{**estimate.layout.__dict__, "zero": zero}))
    ranked = _verified_first(run, _ranked(run.done.values()))
    plan = AutoPlan(ranked[0], ranked, skipped + run.skipped, run.tp, run.stack,
                    auto.devices, limit, profile, profile_note,
                    time.perf_counter() - start, run.budget_spent, top=auto.top)
    if not ranked[0].fits:
        raise NoPlanFits(f"auto: no candidate fits memory_limit_gb={limit_gb} per rank\n"
                         + format_auto_plan(plan, chosen=False))
    return plan


def _verified_first(run: "_Search", ranked: list[Estimate]) -> list[Estimate]:
    """The winner is planned whole before it wins: a cut model's prediction extended to the
    full depth is not always affine (a bucket's buffers and its exposed time grow with the
    layers it holds once the first bucket is full: dp4 ZeRO-1 on GPT 4x128 extended 10.0 MiB
    and 26.5 ms, whole 12.0 MiB and 31.6 ms), and the engine refuses a plan whose whole-model
    estimate is over the memory limit. Until the first is planned whole, it is, and all are
    ranked again: at most one plan per candidate."""
    while True:
        ranked = _ranked(ranked)
        first = ranked[0]
        if first.predicted is None or not first.fits or not first.layers_planned:
            return ranked
        run.plan_whole(first)


def _ranked(estimates) -> list[Estimate]:
    """Those that fit, fastest first; then those that do not, smallest peak first; then
    those that could not be planned."""
    def key(e: Estimate):
        if e.predicted is None:
            return (2, 0.0)
        return (0, e.predicted.step_s) if e.fits else (1, e.predicted.max_peak)
    return sorted(estimates, key=key)


class _Search:
    """The search's working state: what was evaluated, the tp plans, the clock."""

    def __init__(self, problem: Problem, strategy: Strategy, profile: Profile,
                 limit: float | None, limit_gb: float | None, start: float):
        self.problem, self.strategy, self.profile = problem, strategy, profile
        self.auto = strategy.auto
        self.limit, self.limit_gb, self.start = limit, limit_gb, start
        self.fixed = Constraints.of(strategy, problem.annotations)
        self.stack = find_repeated_stack(problem.model)
        self.plan = plan_and_predict(problem.loss, problem.inputs, problem.labels, profile)
        self.done: dict[Layout, Estimate] = {}
        self.tp: dict[int, TensorParallelChoice] = {}
        self.skipped: list[str] = []
        self.budget_spent = False

    def evaluate(self, layout: Layout) -> bool:
        """Evaluate ``layout`` unless done or out of time; whether it is done now."""
        if layout in self.done:
            return True
        if time.perf_counter() - self.start > self.auto.time_budget_s:
            if not self.budget_spent:
                self.skipped.append(f"time budget of {self.auto.time_budget_s:g} s spent: "
                                    f"{layout.name()} and later candidates not evaluated")
            self.budget_spent = True
            return False
        plan = None
        if layout.tp > 1:
            choice = self.tensor_parallel(layout)
            if choice.plan is None:
                why = f"no tp{layout.tp} plan (see tp{layout.tp} above)"
                self.done[layout] = Estimate(layout, None, error=why)
                return True
            plan = choice.plan
        # no memory limit in the candidate: the planner would refuse one over it, and the
        # search wants its prediction to rank it
        strategy = layout_strategy(layout, self.strategy, self.fixed, plan, self.stack, None)
        p = self.problem
        self.done[layout] = evaluate(layout, strategy, p.model, p.optimizer, self.plan,
                                     self.stack, self.limit)
        return True

    def plan_whole(self, estimate: Estimate) -> None:
        """Plan an extended estimate on the whole model and judge it again."""
        extended = estimate.predicted
        p = self.problem
        whole = evaluate(estimate.layout, estimate.strategy, p.model, p.optimizer, self.plan,
                         None, self.limit)
        estimate.seconds += whole.seconds
        if whole.predicted is None:
            estimate.fits, estimate.error = False, whole.error
            return
        estimate.predicted, estimate.fits, estimate.layers_planned = whole.predicted, \
            whole.fits, ()
        estimate.notes.append(
            f"planned whole (it ranked first): {whole.predicted.step_s * 1e3:.2f} ms, peak "
            f"{whole.predicted.max_peak / 2**20:.1f} MiB; extended from the cut model "
            f"{extended.step_s * 1e3:.2f} ms, {extended.max_peak / 2**20:.1f} MiB")

    def tensor_parallel(self, layout: Layout) -> TensorParallelChoice:
        if layout.tp not in self.tp:
            self.tp[layout.tp] = self._solve_tp(layout)
        return self.tp[layout.tp]

    def _solve_tp(self, layout: Layout) -> TensorParallelChoice:
        if self.fixed.tp_plan is not None:
            return TensorParallelChoice(layout.tp, self.fixed.tp_plan, "", 0.0,
                                        "the strategy's tensor_parallel.plan")
        start = time.perf_counter()
        p = self.problem
        model = p.model
        if self.stack is not None and self.stack.layers > 2:
            model = cut_model(p.model, self.stack, 2)
        tp_only = Layout(1, layout.tp, 1)
        if self.fixed.mesh_dims is not None:       # annotations fix the mesh: solve on it
            tp_only = Layout(layout.dp, layout.tp, 1)
        strategy = layout_strategy(tp_only, self.strategy, self.fixed, None, None, None)
        try:
            program, ctx = placed_program(model, p.loss, cut_optimizer(p.optimizer, model),
                                          strategy, p.inputs, p.labels, p.annotations)
            mesh = ctx.state.mesh
            _replicate_batch(program, mesh)
            choice = solve_placements(program, mesh, self.profile,
                                      time_limit_s=max(2.0, self.auto.time_budget_s / 8))
        except (ValueError, NotImplementedError, RuntimeError) as err:
            return TensorParallelChoice(layout.tp, None, f"placement ILP for tp{layout.tp} "
                                        f"failed: {err}", time.perf_counter() - start)
        plan, notes = nearest_tensor_parallel_plan(
            program, _unannotated(choice.params, p.annotations), mesh)
        if plan and self.stack is not None:
            plan = _per_layer_patterns(plan, self.stack, notes)
        why = "; ".join(notes)
        if plan == {}:
            plan, why = None, (f"the placement ILP keeps every parameter replicated under "
                               f"tp{layout.tp}: no tensor-parallel plan pays on this machine")
        elif plan is None:
            why = f"the placement ILP's tp{layout.tp} choice is not a plan: {why}"
        return TensorParallelChoice(layout.tp, plan, why, time.perf_counter() - start,
                                    _ilp_note(choice))


def _ilp_note(choice: PlacementChoice) -> str:
    """The ILP at a glance for the report (``choice.summary()`` has every figure)."""
    tied = f", {choice.tied_ops} ops tied" if choice.tied_ops else ""
    return (f"ILP {choice.variables} variables{tied}, solved in {choice.solve_s:.2f} s, "
            f"{choice.status.split('(')[-1].rstrip(')').strip() or choice.status}")


def _unannotated(params: dict[str, DistAttr], annotations: dict[str, DistAttr]
                 ) -> dict[str, DistAttr]:
    """The ILP's placements of the modules the user annotated none of: an annotated module
    keeps its annotations (they are pinned in every plan), and completion places the rest
    of it, so the plan names only the others."""
    annotated = {name.rpartition(".")[0] for name in annotations}
    return {name: d for name, d in params.items() if name.rpartition(".")[0] not in annotated}


def _per_layer_patterns(plan: dict[str, str], stack: RepeatedStack, notes: list[str]
                        ) -> dict[str, str]:
    """The plan solved on two layers of the stack, for every layer: ``blocks.0.fc1`` and
    ``blocks.1.fc1`` become ``blocks.*.fc1`` (the first layer's style where they differ,
    noted)."""
    prefix = f"{stack.path}." if stack.path else ""
    out: dict[str, str] = {}
    for module, style in plan.items():
        head, _, rest = module[len(prefix):].partition(".")
        if not module.startswith(prefix) or not head.isdigit():
            out[module] = style
            continue
        pattern = f"{prefix}*" + (f".{rest}" if rest else "")
        if out.setdefault(pattern, style) != style:
            notes.append(f"{module}: {style}, unlike layer 0's {out[pattern]}: "
                         f"{pattern} takes layer 0's")
    return out


def _replicate_batch(program: Program, mesh: ProcessMesh) -> None:
    """Under tensor parallel every rank of the group sees the whole (data-parallel) batch:
    pin the fed values not placed yet replicated, so the ILP cannot turn tp into dp."""
    for op in program.ops_of(OpKind.INPUT):
        if op.result.is_tensor and op.result.dist is None:
            pin(op.result, DistAttr.replicated(mesh),
                Reason("plan", "tensor parallel: each rank of the group sees the whole batch"))
