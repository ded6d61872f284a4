"""Schedule the pipeline: every pipeline rank's job order, F, B and W jobs over its stages
and the micro-batches (``pipeline.schedules``), checked and played out on a timeline before
anything runs: a schedule that could deadlock is refused here. Jobs are weighed by the FLOPs
of the ops they run (the homes ``assign_phases`` gave them), so the picture shows this
model's bubble.

The program is unchanged; the schedule is ``PlanState.schedule``, which lowering reads, and
the dump ``NN_schedule_pipeline.jobs.txt`` lists every rank's jobs and draws them, ranks x
time.
"""
from __future__ import annotations

from ..ir import OpKind, Program
from ..pass_infra.context import PassContext
from ..pipeline.flops import op_flops
from ..pipeline.phases import Phase, homes_of
from ..pipeline.schedules import PipelineSchedule, build_schedule, splits_backward
from ..pipeline.timeline import (
    check_jobs,
    peak_in_flight,
    play,
    render,
    unit_cost,
)


def schedule_pipeline(program: Program, ctx: PassContext) -> Program:
    layout = ctx.state.pipeline
    if layout is None:
        ctx.state.set_schedule(None)
        return program
    forward_only = ctx.mode != "train"
    jobs = build_schedule(layout.schedule, layout.ranks, layout.micro_batches, layout.chunks,
                          forward_only=forward_only)
    split = splits_backward(layout.schedule) and not forward_only
    check_jobs(jobs, layout.ranks, layout.micro_batches, layout.chunks, split, forward_only)
    costs = _job_costs(program)
    scale = max(costs.values(), default=1.0) or 1.0
    timeline = play(jobs, lambda job: max(costs.get((job.stage, job.kind), 0.0) / scale, 1e-3))
    ctx.state.set_schedule(PipelineSchedule(layout.schedule, jobs, costs, timeline,
                                            forward_only))
    return program


def _job_costs(program: Program) -> dict[tuple[int, str], float]:
    costs: dict[tuple[int, str], float] = {}
    for op in program.ops:
        if op.kind is not OpKind.CALL:
            continue
        for stage, phase in homes_of(op):
            if phase in (Phase.F, Phase.B, Phase.W):
                costs[(stage, phase.value)] = costs.get((stage, phase.value), 0.0) + op_flops(op)
    return costs


def format_schedule(program: Program, ctx: PassContext) -> str:
    """Every rank's job order, then the schedule drawn with unit job costs (the textbook
    picture) and with this model's FLOPs."""
    plan, layout = ctx.state.schedule, ctx.state.pipeline
    if plan is None:
        return ""
    lines = [f"{layout.describe()}", ""]
    for rank, jobs in enumerate(plan.jobs):
        held = peak_in_flight(jobs) if not plan.forward_only else 0
        lines.append(f"rank {rank} (stages {layout.stages_of(rank)}, peak in-flight "
                     f"micro-batches {held}): "
                     + " ".join(job.label(layout.ranks, layout.chunks) for job in jobs))
    unit = play(plan.jobs, unit_cost)
    lines += ["", render(unit, title=f"{plan.name}, unit job costs"), "",
              render(plan.timeline, title=f"{plan.name}, jobs weighed by their FLOPs")]
    return "\n".join(lines) + "\n"


__all__ = ["schedule_pipeline", "format_schedule"]
