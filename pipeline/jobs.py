"""A pipeline rank's jobs: which ops each runs, which values it keeps for later jobs,
receives from other ranks, sends and accumulates over micro-batches.

Every rank plans the same global program, so every rank computes the same ``PipelineJobs``
for all ranks: one ``RankJobs`` per pp position (every process of that position's stage mesh
runs the same jobs on its own pieces) and one list of ``Message``s. A rank runs

    pre_mb (each micro-batch) -> pre -> the schedule's F/B/W jobs -> post

where pre_mb, pre and post hold every op of the rank's stages in that phase, in program
order, and each schedule job one stage's ops of one phase. Values cross jobs through the
rank's store (``carry``: a forward activation kept for its backward, a once-a-step value the
micro-batches read), ranks through messages, and micro-batches through the reductions over
``mb`` (``accumulate``: a gradient summed over micro-batches).

Messages between two ranks are posted by both in one order, ``Message.order``: when the
sender's job ends on the schedule's timeline, then program order. NCCL matches a pair's
point-to-point operations in the order they are posted (and gloo a direction's), so a rank
posts every earlier receive of a pair before a send: no rank can wait on a receive its peer
has not posted, whatever the real timing (``runtime.p2p``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..ir import Op, OpKind, Program, Slot, Value
from ..ir.attrs import NAME, Attr
from ..ir.printer import value_names
from .layout import PipelineLayout
from .phases import BOUNDARY, Phase, homes_of
from .schedules import Job, PipelineSchedule

STEP = -1     # the micro-batch index of a once-a-step value or job


class PipelinePlanError(RuntimeError):
    """A pipelined program whose jobs cannot be made (a value no job can make in time)."""


@dataclass(frozen=True, order=True)
class JobId:
    phase: Phase
    stage: int = STEP          # a schedule job's stage; STEP for a rank's pre_mb/pre/post
    micro_batch: int = STEP    # STEP for once-a-step jobs

    def __str__(self) -> str:
        if self.phase in (Phase.F, Phase.B, Phase.W):
            return f"{self.phase.value}{self.micro_batch}@s{self.stage}"
        if self.phase is Phase.PRE_MB:
            return f"pre_mb{self.micro_batch}"
        return self.phase.value


@dataclass(frozen=True)
class Message:
    key: str                  # the value, by its name in the global program's dump
    micro_batch: int          # STEP for a once-a-step value
    src: int                  # pp positions
    dst: int
    src_job: JobId
    dst_job: JobId
    order: tuple              # the position both ranks post it in

    def __str__(self) -> str:
        mb = "" if self.micro_batch == STEP else f" mb{self.micro_batch}"
        return f"{self.key}{mb}: rank {self.src} {self.src_job} -> rank {self.dst} {self.dst_job}"


MESSAGE: Attr[Message] = Attr("message", Message, "the message a send or receive op moves")


@dataclass
class Accumulation:
    """A reduction over micro-batches (``comm.all_reduce`` / ``all_gather`` over ``mb``),
    run by the runtime: the terms each micro-batch's job exports, folded into one value."""
    input_key: str
    output_key: str
    step: object              # AllReduce or AllGather over mb
    before: Phase             # PRE or POST: the once-a-step job that first reads it


@dataclass
class RankJobs:
    rank: int
    stages: list[int]
    order: list[JobId] = field(default_factory=list)
    ops: dict[JobId, list[int]] = field(default_factory=dict)      # global op indices
    carried_in: dict[JobId, list[tuple[str, int]]] = field(default_factory=dict)  # (key, mb)
    received: dict[JobId, list[Message]] = field(default_factory=dict)
    sent: dict[JobId, list[Message]] = field(default_factory=dict)
    kept: dict[JobId, list[str]] = field(default_factory=dict)        # carry exports
    accumulated: dict[JobId, list[str]] = field(default_factory=dict)  # accumulate exports
    accumulations: list[Accumulation] = field(default_factory=list)
    results: list[tuple[Slot, str]] = field(default_factory=list)   # the post job's outputs
    last_read: dict[tuple[str, int], JobId] = field(default_factory=dict)

    @functools.cached_property
    def frees(self) -> dict[JobId, list[tuple[str, int]]]:
        """The kept values each job reads for the last time (freed after it)."""
        out: dict[JobId, list[tuple[str, int]]] = {}
        for pair, job in self.last_read.items():
            out.setdefault(job, []).append(pair)
        return out

    def describe(self) -> str:
        lines = [f"rank {self.rank} (stages {self.stages}): "
                 + " ".join(str(j) for j in self.order)]
        for job in self.order:
            parts = [f"{len(self.ops[job])} ops"]
            if self.received.get(job):
                parts.append("recv " + ", ".join(f"{m.key} from rank {m.src}"
                                                 for m in self.received[job]))
            if self.sent.get(job):
                parts.append("send " + ", ".join(f"{m.key} to rank {m.dst}"
                                                 for m in self.sent[job]))
            if self.accumulated.get(job):
                parts.append("accumulate " + ", ".join(self.accumulated[job]))
            lines.append(f"  {job}: " + "; ".join(parts))
        return "\n".join(lines)


@dataclass
class PipelineJobs:
    layout: PipelineLayout
    ranks: list[RankJobs]
    messages: list[Message]
    names: dict[Value, str]
    keys: dict[str, Value]
    schedule: PipelineSchedule | None = None     # the schedule_pipeline pass's

    def describe(self) -> str:
        return "\n".join(r.describe() for r in self.ranks)


# -- planning ------------------------------------------------------------------------------

def _job_time(job: JobId, position: int, timeline_end: dict[Job, float]) -> tuple:
    """When a job's messages go, in one order every rank agrees on: pre_mb by micro-batch,
    pre, the schedule's jobs by their end on its timeline (then by their place in their
    rank's list), post. Within pre_mb, pre and post every rank runs the program's order."""
    if job.phase is Phase.PRE_MB:
        return (0, job.micro_batch, 0.0, 0)
    if job.phase is Phase.PRE:
        return (1, 0, 0.0, 0)
    if job.phase is Phase.POST:
        return (3, 0, 0.0, 0)
    return (2, 0, timeline_end[Job(job.phase.value, job.stage, job.micro_batch)], position)


class _JobsBuilder:
    def __init__(self, program: Program, layout: PipelineLayout,
                 schedule: PipelineSchedule) -> None:
        self.program, self.layout, self.schedule = program, layout, schedule
        self.names = value_names(program)
        self.position = {op: i for i, op in enumerate(program.ops)}
        self.m = layout.micro_batches
        self.plans = [RankJobs(r, layout.stages_of(r)) for r in range(layout.ranks)]
        self.messages: list[Message] = []

    def per_mb(self, v: Value) -> bool:
        """Whether ``v`` differs between micro-batches (made in a per-micro-batch phase)."""
        op = v.producer
        if op.kind is OpKind.INPUT:
            return True
        if BOUNDARY in op.attrs:
            return False
        return any(p.per_micro_batch for _, p in homes_of(op))

    def run(self) -> PipelineJobs:
        for plan in self.plans:
            self._jobs(plan)
        for plan in self.plans:
            self._flows(plan)
            self._check_terms(plan)
        self._order_messages()
        keys = {name: v for v, name in self.names.items()}
        return PipelineJobs(self.layout, self.plans, self.messages, self.names, keys,
                            self.schedule)

    def _check_terms(self, plan: RankJobs) -> None:
        """Every micro-batch hands each sum or gather over micro-batches its term; a value
        of the whole batch that no micro-batch's job makes (a batch input gathered whole
        for an op read before the micro-batches run) is refused, naming who needs it."""
        for a in plan.accumulations:
            due = plan.order.index(JobId(a.before))     # the store completes it before this
            made = {job.micro_batch for job, keys in plan.accumulated.items()
                    if a.input_key in keys and plan.order.index(job) < due}
            if made == set(range(self.m)):
                continue
            value = self.program_values()[a.output_key]
            readers = [op for op in self.program.ops if value in op.inputs]
            needs = ", ".join(f"{op.target.removesuffix('.default')} "
                              f"({op.module or 'top level'})" for op in readers[:3])
            raise PipelinePlanError(
                f"pipeline rank {plan.rank}: {needs} reads {a.output_key}, the whole batch's "
                f"{a.input_key} summed or gathered over micro-batches, in {a.before.value}, "
                f"but the micro-batches make their terms only later (in time: micro-batches "
                f"{sorted(made)} of {self.m}). An op with no SPMD rule (it runs replicated) "
                "often forces this: give it a rule, or run without micro-batches")

    def program_values(self) -> dict[str, Value]:
        return {name: v for v, name in self.names.items()}

    # -- which ops each job runs ---------------------------------------------------------
    def _jobs(self, plan: RankJobs) -> None:
        mine = set(plan.stages)
        ops: dict[JobId, list[int]] = {}
        for i, op in enumerate(self.program.ops):
            if BOUNDARY in op.attrs:
                if any(s in mine for s, _ in homes_of(op)):
                    plan.accumulations.append(Accumulation(
                        self.names[op.args[0]], self.names[op.outputs[0]], op.attrs[BOUNDARY],
                        homes_of(op)[0][1]))
                continue
            if op.kind is OpKind.OUTPUT:
                ops.setdefault(JobId(Phase.POST), []).append(i)
                continue
            for job in self._jobs_of(op, mine):
                found = ops.setdefault(job, [])
                if not found or found[-1] != i:
                    found.append(i)
        schedule_jobs = [JobId(Phase(j.kind), j.stage, j.micro_batch)
                         for j in self.schedule.jobs[plan.rank]]
        plan.order = ([JobId(Phase.PRE_MB, STEP, k) for k in range(self.m)
                       if JobId(Phase.PRE_MB, STEP, k) in ops]
                      + [JobId(Phase.PRE)] + schedule_jobs + [JobId(Phase.POST)])
        plan.ops = {job: ops.get(job, []) for job in plan.order}

    def _jobs_of(self, op: Op, mine: set[int]) -> list[JobId]:
        jobs = []
        for stage, phase in homes_of(op):
            if stage not in mine:
                continue
            if phase in (Phase.F, Phase.B, Phase.W):
                jobs += [JobId(phase, stage, k) for k in range(self.m)]
            elif phase is Phase.PRE_MB:
                jobs += [JobId(phase, STEP, k) for k in range(self.m)]
            else:
                jobs.append(JobId(phase))
        return sorted(set(jobs))

    # -- where each value a job reads comes from --------------------------------------------
    def _flows(self, plan: RankJobs) -> None:
        available: dict[tuple[str, int], JobId] = {}
        early = {a.output_key for a in plan.accumulations if a.before is Phase.PRE}
        late = {a.output_key for a in plan.accumulations if a.before is Phase.POST}
        for job in plan.order:
            if job.phase in (Phase.PRE, Phase.POST):
                for key in (early if job.phase is Phase.PRE else late):
                    available[(key, STEP)] = job
            k = job.micro_batch
            made: set[Value] = set()
            for i in plan.ops[job]:
                op = self.program.ops[i]
                for v in self._reads(op, plan):
                    if v in made or v.producer.kind in (OpKind.INPUT, OpKind.STATE):
                        continue
                    self._bring(plan, job, v, self._micro_batch(v, k), available)
                made.update(op.outputs)
                for v in op.outputs:
                    available[(self.names[v], self._micro_batch(v, k))] = job
            for a in plan.accumulations:
                if job.phase.per_micro_batch and (a.input_key, k) in available \
                        and available[(a.input_key, k)] == job:
                    plan.accumulated.setdefault(job, []).append(a.input_key)
        if any(job.phase is Phase.POST for job in plan.order):
            plan.results = self._results(plan)

    def _micro_batch(self, v: Value, k: int) -> int:
        """Which micro-batch's ``v`` a job of micro-batch ``k`` means: its own, none for a
        once-a-step value, and the only one when a once-a-step job reads a micro-batch's
        value (one micro-batch: the optimizer reads the gradients the backward made)."""
        if not self.per_mb(v):
            return STEP
        return 0 if k == STEP else k

    def _reads(self, op: Op, plan: RankJobs) -> list[Value]:
        if op.kind is not OpKind.OUTPUT:
            return op.inputs
        return [v for _, v in self._result_values(plan)]

    def _result_values(self, plan: RankJobs) -> list[tuple[Slot, Value]]:
        """The program results this rank returns: the updates of the state it holds, the loss
        and the model's outputs (every rank reports them)."""
        mine = set(plan.stages)
        states = {op.attrs[NAME]: op for op in self.program.ops if op.kind is OpKind.STATE}
        out = []
        for slot, v in self.program.results():
            if slot.kind == "update":
                if any(s in mine for s, _ in homes_of(states[slot.name])):
                    out.append((slot, v))
            elif slot.kind != "grad":
                out.append((slot, v))
        return out

    def _results(self, plan: RankJobs) -> list[tuple[Slot, str]]:
        return [(slot, self.names[v]) for slot, v in self._result_values(plan)]

    def _bring(self, plan: RankJobs, job: JobId, v: Value, k: int,
               available: dict[tuple[str, int], JobId]) -> None:
        key = self.names[v]
        if BOUNDARY in v.producer.attrs and (key, k) in available:
            self._read_sum(plan, job, key)       # a sum over micro-batches, in the store
            return
        if (key, k) in available:
            source = available[(key, k)]
            if source != job:
                self._carry(plan, source, job, key, k)
            return
        src_stage, src_phase = self._source(v, plan)
        src_rank = self.layout.rank_of(src_stage)
        src_job = self._job_at(src_stage, src_phase, k)
        # a once-a-step value the micro-batches read arrives once, in pre
        dst_job = JobId(Phase.PRE) if (k == STEP and job.phase.per_micro_batch) else job
        if src_rank == plan.rank:
            # another chunk of this rank made it (interleaved stages): kept, not sent
            available[(key, k)] = src_job
            self._carry(plan, src_job, job, key, k)
            return
        message = Message(key, k, src_rank, plan.rank, src_job, dst_job, ())
        self.messages.append(message)
        available[(key, k)] = dst_job
        if dst_job != job:
            self._carry(plan, dst_job, job, key, k)

    def _read_sum(self, plan: RankJobs, job: JobId, key: str) -> None:
        carried = plan.carried_in.setdefault(job, [])
        if (key, STEP) not in carried:
            carried.append((key, STEP))
        plan.last_read[(key, STEP)] = max(plan.last_read.get((key, STEP), job), job,
                                          key=plan.order.index)

    def _carry(self, plan: RankJobs, source: JobId, job: JobId, key: str, k: int) -> None:
        kept = plan.kept.setdefault(source, [])
        if key not in kept:
            kept.append(key)
        carried = plan.carried_in.setdefault(job, [])
        if (key, k) not in carried:
            carried.append((key, k))
        plan.last_read[(key, k)] = max(plan.last_read.get((key, k), job), job,
                                       key=plan.order.index)

    def _source(self, v: Value, plan: RankJobs) -> tuple[int, Phase]:
        """The home another rank makes ``v`` in (the assign_phases pass checked one fits)."""
        op = v.producer
        if BOUNDARY in op.attrs:
            stage, phase = homes_of(op)[0]
            return stage, phase
        mine = set(plan.stages)
        homes = [h for h in homes_of(op) if h[0] not in mine] or list(homes_of(op))
        homes.sort(key=lambda h: (h[1] is not Phase.PRE_MB, h[0], h[1].order))
        return homes[0]

    def _job_at(self, stage: int, phase: Phase, k: int) -> JobId:
        if phase in (Phase.F, Phase.B, Phase.W):
            return JobId(phase, stage, k)
        if phase is Phase.PRE_MB:
            return JobId(phase, STEP, k)
        return JobId(phase)

    # -- one order for every pair's messages --------------------------------------------------
    def _order_messages(self) -> None:
        end = self.schedule.timeline.end
        position = {}
        for plan in self.plans:
            for i, job in enumerate(plan.order):
                position[(plan.rank, job)] = i
        values = {n: v for v, n in self.names.items()}
        keyed = []
        for msg in self.messages:
            made_at = self.position[values[msg.key].producer]
            order = (_job_time(msg.src_job, position[(msg.src, msg.src_job)], end),
                     made_at, msg.src, msg.dst, msg.key, msg.micro_batch)
            keyed.append(Message(msg.key, msg.micro_batch, msg.src, msg.dst, msg.src_job,
                                 msg.dst_job, order))
        keyed.sort(key=lambda m: m.order)
        self.messages = keyed
        for msg in keyed:
            self.plans[msg.src].sent.setdefault(msg.src_job, []).append(msg)
            self.plans[msg.dst].received.setdefault(msg.dst_job, []).append(msg)
            if BOUNDARY in values[msg.key].producer.attrs:   # sent from the store
                self._read_sum(self.plans[msg.src], msg.src_job, msg.key)


def plan_jobs(program: Program, layout: PipelineLayout,
                  schedule: PipelineSchedule) -> PipelineJobs:
    """Every rank's jobs and every message of one pipelined step of ``program`` (after the
    ``assign_phases`` and ``schedule_pipeline`` passes)."""
    plan = _JobsBuilder(program, layout, schedule).run()
    check_messages(plan)
    return plan


def check_messages(plan: PipelineJobs) -> None:
    """Every message is sent by one job of its source rank and received by one job of its
    destination, which runs that job; a rank never sends to itself."""
    sent = [m for r in plan.ranks for ms in r.sent.values() for m in ms]
    received = [m for r in plan.ranks for ms in r.received.values() for m in ms]
    for m in plan.messages:
        if m.src == m.dst or sent.count(m) != 1 or received.count(m) != 1:
            raise AssertionError(f"pipeline message {m}: sent {sent.count(m)} and received "
                                 f"{received.count(m)} times")
        for rank, job in ((m.src, m.src_job), (m.dst, m.dst_job)):
            if job not in plan.ranks[rank].order:
                raise AssertionError(f"pipeline message {m}: rank {rank} runs no job {job}")
    if len(sent) != len(plan.messages) or len(received) != len(plan.messages):
        raise AssertionError("pipeline: a job sends or receives a message the plan lacks")


__all__ = ["JobId", "Message", "Accumulation", "RankJobs", "PipelineJobs", "plan_jobs",
           "PipelinePlanError",
           "check_messages", "STEP"]
