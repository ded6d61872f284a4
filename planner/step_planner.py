"""Planning a step: capture -> passes -> lowering, once per mode and batch signature.

Planning never executes: it needs the model's shapes, not its memory, so a plan for a
model too big for this machine can still be made, dumped and inspected. Each planned step
remembers where its parameters went; later programs of the same engine (eval, predict, a
new batch shape) keep them there, so every program reads the pieces training updates.

A training step with gradient merge is a cycle of two programs, both planned from one
capture (``passes/merge_gradients.py``): the one that accumulates and the one that applies;
the lowered step holds both (``Lowered.accumulating``) and the runtime steps through them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from ..capture import Captured, StepSpec, batch_size_of, capture, flatten_batch
from ..cost import Profile, StepTime, predict_step
from ..ir import NAME, ProcessMesh, Program, StateKind, format_program
from ..ir.annotation import param_annotations
from ..lower import (
    Dump,
    Lowered,
    MemoryEstimate,
    check_memory_limit,
    classify_ranks,
    estimate_memory,
    format_estimates,
    lower_program,
    lower_representatives,
)
from ..pass_infra import ParallelLayout, PassContext, PlanInputs, PlanState
from ..passes import pass_manager
from ..strategy import Strategy
from . import options
from .plan_cache import PlanCache, plan_key

__all__ = ["PlanMade", "PlannedStep", "StepCost", "StepPlanner"]


@dataclass(frozen=True)
class PlanMade:
    """A plan the planner made: for which mode and batch shapes, in how many seconds."""

    mode: str
    shapes: tuple[tuple[int, ...], ...]
    seconds: float
    cached: bool = False      # the passes' and lowering's work loaded from the plan cache

    def __str__(self) -> str:
        shapes = ", ".join(str(list(s)) for s in self.shapes)
        how = " (captured; the rest from the plan cache)" if self.cached else ""
        return (f"planned the {self.mode} step for batch shapes {shapes} in "
                f"{self.seconds:.2f} s{how}")


class StepCost(dict[int, MemoryEstimate]):
    """``Engine.cost``'s answer: each rank's predicted memory (rank -> ``MemoryEstimate``),
    the predicted step ``time`` (``cost.predict.StepTime``), and with ``compile:`` the
    seconds this step's programs took to compile (``compile_s``: measured when the step
    first ran; None before it has, or when nothing is compiled)."""

    def __init__(self, memory: dict[int, MemoryEstimate], time: StepTime,
                 profile_note: str = "", compile_s: float | None = None):
        super().__init__(memory)
        self.time, self.profile_note, self.compile_s = time, profile_note, compile_s

    @property
    def step_s(self) -> float:
        """Predicted seconds of one step (the slowest rank's)."""
        return self.time.step_s

    @property
    def peak(self) -> int:
        """The largest predicted peak of any rank, in bytes."""
        return max(m.peak for m in self.values())


@dataclass
class PlannedStep:
    """One planned program: what it computes, how it was planned, what each process runs,
    and (once it first runs) its executor."""

    spec: StepSpec
    program: Program
    facts: PlanState
    pass_timings: dict[str, float]
    lowered: Lowered
    executor: Any = None
    checked: bool = False          # its first step was checked by locate_divergence
    # gradient merge: the planned step of the cycle's accumulating batches
    accumulating: "PlannedStep | None" = None
    mode: str = field(init=False)
    # every process lowered, for the reports (memory, time): made once, on first ask
    every_process: Lowered | None = None

    def __post_init__(self) -> None:
        self.mode = self.spec.mode


class StepPlanner:
    """Plans the steps of one model, loss and optimizer under one strategy.

    Which processes are lowered when planning: ``process`` only, on real processes; every
    one when ``every`` (simulating: it runs them all) and a one-process plan's; else the ones
    whose dumps are asked for (``debug.dump_ranks``), or none (a plan for several processes
    made in one that does not simulate is only inspected: nothing here can run it). The
    reports (``memory``, ``time``) lower one process per class of identical ranks.

    The auto search plans its candidates with this class too (``auto.evaluate``), so what
    it costs is what runs."""

    def __init__(self, model: torch.nn.Module, loss: Callable | None,
                 optimizer: torch.optim.Optimizer | None, strategy: Strategy, *,
                 dump_dir: str | None = None, process: int | None = None,
                 every: bool = False):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.strategy, self.layout = strategy, ParallelLayout.of(strategy)
        options.check_micro_batches(strategy)
        self.dump_dir, self.process, self.every = dump_dir, process, every
        self.rank = process or 0
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.kept: dict[str, Any] = {}        # where earlier programs placed each parameter
        self.steps: dict[tuple, PlannedStep] = {}
        self.made: list[PlanMade] = []        # every plan made, in order
        # ``plan_cache_dir``: planned programs on disk (``planner/plan_cache.py``)
        self.cache = PlanCache(strategy.plan_cache_dir) if strategy.plan_cache_dir else None
        self.loaded = 0                       # plans the cache gave

    def plan(self, mode: str, inputs: Any, labels: Any) -> PlannedStep:
        """The planned step for this mode and batch signature (planned on first use)."""
        key = (mode, _signature(inputs), _signature(labels))
        if key not in self.steps:
            if mode == "train" and self.optimizer is None:
                raise ValueError("training needs an optimizer: Engine(model, loss, optimizer=...)")
            start, loaded = time.perf_counter(), self.loaded
            with _gc_paused():
                self.steps[key] = self._plan_step(mode, inputs, labels)
            shapes = tuple(tuple(t.shape) for t in flatten_batch(inputs, labels)[0])
            self.made.append(PlanMade(mode, shapes, time.perf_counter() - start,
                                      self.loaded > loaded))
        return self.steps[key]

    def _plan_step(self, mode: str, inputs: Any, labels: Any) -> PlannedStep:
        step = self._plan(mode, inputs, labels, accumulate_only=False)
        k = self.strategy.gradient_merge.k_steps
        if mode == "train" and k > 1:
            step.accumulating = self._plan(mode, inputs, labels, accumulate_only=True)
            step.lowered.accumulating, step.lowered.k_steps = step.accumulating.lowered, k
        return step

    def last(self, mode: str) -> PlannedStep | None:
        found = [step for (m, *_), step in self.steps.items() if m == mode]
        return found[-1] if found else None

    def capture(self, mode: str, inputs: Any, labels: Any) -> Captured:
        """The step traced as the strategy computes it (amp's precision, ring attention):
        what the passes plan, and what the auto search's placement program sees."""
        return capture(self.model, self.loss, inputs, labels, mode=mode,
                       precision=options.precision(self.strategy),
                       ring_pieces=options.ring_pieces(self.strategy, self.layout.mesh))

    def plan_inputs(self, mode: str, inputs: Any, accumulate_only: bool = False
                    ) -> PlanInputs:
        """What the passes read for a program of this mode and batch."""
        rows = batch_size_of(inputs, self.strategy.batch_dim)
        return PlanInputs(
            self.strategy, mode, self.optimizer, self.param_names, self.layout.mesh,
            options.micro_batches(self.strategy, mode, rows), param_annotations(self.model),
            dict(self.kept), rank=self.rank, accumulate_only=accumulate_only)

    def _plan(self, mode: str, inputs: Any, labels: Any, accumulate_only: bool) -> PlannedStep:
        captured = self.capture(mode, inputs, labels)
        plan_inputs = self.plan_inputs(mode, inputs, accumulate_only)
        key = self._cache_key(captured.program, plan_inputs)
        cached = None if key is None else self.cache.load(key)
        dump = None
        if cached is not None:
            program, facts, timings, lowered = cached
            self.loaded += 1
        else:
            program, facts, timings, lowered, dump = self._run_passes(captured.program,
                                                                      plan_inputs)
            if key is not None:
                self.cache.save(key, (program, facts, timings, lowered))
        for op in program.states(StateKind.PARAM):
            if op.result.dist is not None:
                self.kept.setdefault(op.attrs[NAME], op.result.dist)
        step = PlannedStep(captured.spec, program, facts, timings, lowered)
        if dump is not None or self.strategy.memory_limit_gb is not None:
            estimates = self.memory(step)
            if dump is not None:
                for process, est in estimates.items():
                    if dump.wants(process):
                        dump.write(process, "memory", format_estimates({process: est}) + "\n")
            check_memory_limit(estimates, self.strategy.memory_limit_gb,
                               f"planning the {mode} step on {facts.mesh or 'one process'} "
                               f"({options.sharding_text(self.strategy)})")
        return step

    def _run_passes(self, captured: Program, plan_inputs: PlanInputs) -> tuple:
        """(program, facts, pass timings, lowered, dump): the passes, then every process's
        program (``dump``: where they were dumped, None when not asked)."""
        ctx = PassContext(plan_inputs)
        debug = self.strategy.debug
        manager = pass_manager(verify=debug.verify, dump_dir=self.dump_dir,
                               dump_formats=debug.dump_format)
        program = manager.run(captured, ctx)
        facts = ctx.state
        dump = None if self.dump_dir is None else Dump(
            self.dump_dir, ctx.inputs.dump_prefix, len(manager.passes) + 1,
            self._dump_ranks(program, facts))
        lowered = lower_program(program, facts.mesh, facts.pipeline, facts.schedule,
                                self._processes(facts, dump), dump,
                                check=self.strategy.debug.verify,
                                compile=options.compile_spec(self.strategy, dump))
        return program, facts, dict(manager.timings), lowered, dump

    def _cache_key(self, captured: Program, plan_inputs: PlanInputs) -> str | None:
        """The plan's key in the plan cache (None: no cache, or dumps asked for: a cached
        plan would not write them)."""
        if self.cache is None or self.dump_dir is not None:
            return None
        fields = {f.name: getattr(plan_inputs, f.name) for f in dataclasses.fields(plan_inputs)}
        fields["param_names"] = sorted(fields["param_names"].values())
        return plan_key(format_program(captured), **fields, process=self.process,
                        every=self.every)

    def memory(self, step: PlannedStep) -> dict[int, MemoryEstimate]:
        """Every process's plan-time memory estimate (lowering the ones not lowered yet,
        for this report only)."""
        return estimate_memory(self._every_process(step))

    def time(self, step: PlannedStep, profile: Profile) -> StepTime:
        """The step's predicted time on the machine ``profile`` measured, every process."""
        return predict_step(self._every_process(step), profile)

    def _every_process(self, step: PlannedStep) -> Lowered:
        """The step lowered for every process of its mesh: as planned when every one was
        lowered, else one process per class of identical ranks (``lower_representatives``),
        once per step: the memory estimate and the time prediction share it."""
        if step.every_process is not None:
            return step.every_process
        lowered, facts = step.lowered, step.facts
        mesh = _processes_mesh(facts)
        every = [0] if mesh is None else sorted(int(p) for p in mesh.process_ids)
        if any(p not in lowered.processes for p in every):
            lowered = lower_representatives(step.program, facts.mesh, facts.pipeline,
                                            facts.schedule, lowered)
        step.every_process = lowered
        return lowered

    def _processes(self, facts: PlanState, dump: Dump | None) -> list[int] | None:
        """The processes lowered at plan time (None: every one): this one's own on a real
        process; every one when simulating (it runs them) or for a one-process plan;
        otherwise the ones whose dumps are asked for (``debug.dump_ranks``), or none."""
        if self.process is not None:
            return [self.process]
        mesh = _processes_mesh(facts)
        if self.every or mesh is None or mesh.size == 1:
            return None
        if dump is None:
            return []
        return None if dump.ranks is None else sorted(dump.ranks)

    def _dump_ranks(self, program: Program, facts: PlanState) -> frozenset[int] | None:
        """``debug.dump_ranks`` as processes (None: all), checked against the mesh."""
        asked = self.strategy.debug.dump_ranks
        if asked == "all":
            return None
        if asked == "classes":
            return frozenset(classify_ranks(program, facts.mesh, facts.pipeline).representatives)
        mesh = _processes_mesh(facts)
        every = {0} if mesh is None else {int(p) for p in mesh.process_ids}
        missing = sorted(set(asked) - every)
        if missing:
            raise ValueError(f"debug.dump_ranks {list(asked)}: ranks {missing} are not on "
                             f"{mesh or 'the one process of a serial plan'} "
                             f"({len(every)} processes)")
        return frozenset(asked)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning builds tens of thousands of long-lived objects (fake tensors, IR); Python's
    cyclic collector would rescan them all many times over. Refcounting still frees
    garbage meanwhile, and the collector resumes afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _signature(tree: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(tree)
    return (str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                             for x in leaves))


def _processes_mesh(facts: PlanState) -> ProcessMesh | None:
    """The mesh of a plan's processes: a pipeline's full mesh (the pp axis too), else the
    program's (None: serial)."""
    return facts.pipeline.full_mesh if facts.pipeline is not None else facts.mesh
