"""Lowering: from the planned global program, everything each process runs, made once.

    lowered = lower_program(program, mesh, pipeline, schedule, processes=[rank])

* no mesh (serial): the program itself, whole state;
* a mesh: each process's partition (``partition``: local shapes, local calls), what each of
  its comm ops runs (``comms``), its pieces of the batch and of the state;
* a pipeline: every pipeline rank's jobs and messages (``pipeline.jobs``), and for each
  process its jobs as programs (``job_programs``: its ops localized at each micro-batch),
  their comm ops, its messages and peers, its micro-batches' pieces of the batch, the random
  states eager has at each random op, and the state its stages hold.

Every program made here is verified (and checked to have a comm spec for each comm op
and nothing else) and, with a dump target, written to ``rank<r>/<NN>_partition.txt`` or
``rank<r>/<NN>_jobs.txt`` next to the passes' dumps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..ir import OpKind, Program, Value, format_program, verify
from ..ir.attrs import NAME
from ..ir.dist import ProcessMesh, local_slices
from ..ir.ops import draws_random
from ..ir.printer import value_names
from ..pipeline.jobs import MESSAGE, PipelineJobs, plan_jobs
from ..pipeline.layout import PipelineLayout
from ..pipeline.phases import homes_of
from ..pipeline.schedules import PipelineSchedule
from .comms import comm_spec, state_piece
from .executable import (
    Comm,
    CompileSpec,
    JobProgram,
    Lowered,
    PipelineProcess,
    RankProgram,
    Recv,
    ResultLayout,
    Send,
)
from .job_programs import GLOBAL_OP, job_program, random_ops
from .partition import partition
from .rank_classes import classify_ranks

__all__ = ["Dump", "lower_program", "lower_representatives", "LoweringError"]


class LoweringError(RuntimeError):
    """A lowered program that breaks an invariant the runtime relies on."""


@dataclass(frozen=True)
class Dump:
    """Where lowering writes what it made: ``<dir>/rank<r>/<prefix><NN>_<what>.txt``, for
    the processes in ``ranks`` (None: every one lowered)."""

    dir: str
    prefix: str          # "" for training, "eval_" / "predict_" otherwise
    number: int          # after the last pass's
    ranks: frozenset[int] | None = None

    def wants(self, process: int) -> bool:
        return self.ranks is None or process in self.ranks

    def write(self, process: int, what: str, text: str) -> Path:
        path = Path(self.dir) / f"rank{process}" / f"{self.prefix}{self.number:02d}_{what}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path


def lower_program(program: Program, mesh: ProcessMesh | None,
                  pipeline: PipelineLayout | None, schedule: PipelineSchedule | None,
                  processes: Iterable[int] | None = None, dump: Dump | None = None,
                  check: bool = True, compile: CompileSpec | None = None) -> Lowered:
    """Lower ``program`` for ``processes`` (all of the plan's when None); ``compile``: how
    the runtime compiles the programs (None: not at all)."""
    results = tuple(ResultLayout(slot, tuple(v.type.shape) if v.is_tensor else None, v.dist)
                    for slot, v in program.results())
    random = any(draws_random(op) for op in program.ops_of(OpKind.CALL))
    names = value_names(program)
    lowered = Lowered(program, mesh, {}, results, pipeline, schedule, draws_random=random,
                      compile=compile, random_ops=tuple(
                          (f"rng/{names[op.outputs[0]]}", op) for op in random_ops(program)))
    if pipeline is not None:
        _lower_pipeline(lowered, processes, dump, check)
    elif mesh is None or mesh.size == 1:
        lowered.processes[0] = _serial(program, random)
    else:
        for process in (mesh.process_ids if processes is None else processes):
            rank = _rank_program(program, mesh, process, random)
            if check:
                _check(rank.program, rank.comms, f"process {process}")
            if dump is not None and dump.wants(process):
                dump.write(process, "partition", format_program(rank.program))
            lowered.processes[process] = rank
    return lowered


def lower_representatives(program: Program, mesh: ProcessMesh | None,
                          pipeline: PipelineLayout | None, schedule: PipelineSchedule | None,
                          made: Lowered | None = None) -> Lowered:
    """Lower one process per class of identical ranks (``classify_ranks``), for the reports
    (memory, time): ``Lowered.every_process`` gives every process its class's program. A
    1,024-rank dp x pp x tp plan of even cuts lowers one process per pipeline stage.
    ``made``: this program's lowering so far, whose processes are reused when it holds
    every representative (the ranks a plan dumped by class)."""
    classes = classify_ranks(program, mesh, pipeline)
    reps = classes.representatives
    if made is not None and all(r in made.processes for r in reps):
        lowered = dataclasses.replace(made, processes={r: made.processes[r] for r in reps})
    else:
        lowered = lower_program(program, mesh, pipeline, schedule, reps, check=False)
    lowered.classes = classes
    return lowered


def _serial(program: Program, random: bool) -> RankProgram:
    """One process runs the program itself (no mesh, or a mesh of one): every state whole."""
    state = {op.attrs[NAME]: dataclasses.replace(state_piece(op, ()), dist=None, gather=())
             for op in program.ops_of(OpKind.STATE) if op.result.is_tensor}
    return RankProgram(0, (), program, {}, {}, state, random)


def _rank_program(program: Program, mesh: ProcessMesh, process: int,
                  random: bool) -> RankProgram:
    coordinate = mesh.coordinate(process)
    if coordinate is None:
        raise LoweringError(f"process {process} is not on {mesh}")
    local = partition(program, mesh, coordinate)
    comms = {i: comm_spec(g, coordinate)
             for i, g in enumerate(program.ops) if g.kind is OpKind.COMM}
    inputs = {}
    for op in program.ops_of(OpKind.INPUT):
        v = op.result
        if v.is_tensor and v.dist is not None and not v.dist.is_replicated:
            inputs[op.attrs[NAME]] = local_slices(v.type.shape, mesh, v.dist.placements,
                                                  coordinate)
    state = {op.attrs[NAME]: state_piece(op, coordinate) for op in program.ops_of(OpKind.STATE)
             if op.result.is_tensor}
    return RankProgram(process, coordinate, local, comms, inputs, state, random)


# -- pipelines ------------------------------------------------------------------------------

def _lower_pipeline(lowered: Lowered, processes: Iterable[int] | None, dump: Dump | None,
                    check: bool) -> None:
    program, layout = lowered.program, lowered.pipeline
    if lowered.schedule is None:
        raise LoweringError("a pipelined program needs its schedule (the schedule_pipeline "
                            "pass) to be lowered")
    jobs = plan_jobs(program, layout, lowered.schedule)
    lowered.jobs = jobs
    every = sorted(i for ids in layout.stage_ids for i in ids)
    by_key = {key: v for v, key in jobs.names.items()}
    for process in (every if processes is None else processes):
        place = layout.locate(process)
        if place is None:
            raise LoweringError(f"process {process} is in no stage of the {layout.describe()}")
        made = _pipeline_process(lowered, jobs, by_key, process, *place)
        if check:
            for job in made.programs.values():
                _check(job.program, job.comms, f"process {process} job {job.job}")
        if dump is not None and dump.wants(process):
            dump.write(process, "jobs", _format_jobs(layout, made))
        lowered.processes[process] = made


def _pipeline_process(lowered: Lowered, jobs: PipelineJobs, by_key: dict[str, Value],
                      process: int, pp: int, coordinate: tuple[int, ...]) -> PipelineProcess:
    program, layout = lowered.program, lowered.pipeline
    rank = jobs.ranks[pp]
    peers = {p: layout.process(p, coordinate) for p in range(layout.ranks)}
    programs = {}
    for job in rank.order:
        at = coordinate + (max(job.micro_batch, 0),)
        made = job_program(program, lowered.mesh, at, by_key, jobs, rank, job)
        programs[job] = JobProgram(job, made, _job_comms(made, at, peers))
    mine = set(rank.stages)
    state, held = {}, set()
    for op in program.ops_of(OpKind.STATE):
        if not op.result.is_tensor:
            continue
        stages = {s for s, _ in homes_of(op)}
        holders = sorted({layout.rank_of(s) for s in stages})
        name = op.attrs[NAME]
        state[name] = state_piece(op, coordinate + (0,), owner=holders[0] if holders else 0)
        if stages & mine:
            held.add(name)
    messages = tuple(m for m in jobs.messages if pp in (m.src, m.dst) and m.src != m.dst)
    return PipelineProcess(process, pp, coordinate, rank, programs,
                           _micro_batch_inputs(program, coordinate, layout.micro_batches),
                           state, frozenset(held), messages, peers, lowered.random_ops)


def _job_comms(job: Program, coordinate: tuple[int, ...], peers: dict[int, int]
               ) -> dict[int, Comm]:
    comms: dict[int, Comm] = {}
    for i, op in enumerate(job.ops):
        if op.kind is not OpKind.COMM:
            continue
        if op.target == "comm.send":
            message = op.attrs[MESSAGE]
            comms[i] = Send(message, peers[message.dst])
        elif op.target == "comm.recv":
            message = op.attrs[MESSAGE]
            comms[i] = Recv(message, peers[message.src], tuple(op.result.type.shape),
                            op.result.type.dtype)
        else:
            comms[i] = comm_spec(op.attrs[GLOBAL_OP], coordinate)
    return comms


def _micro_batch_inputs(program: Program, coordinate: tuple[int, ...], micro_batches: int
                        ) -> tuple[dict, ...]:
    """Each micro-batch's piece of every placed fed tensor, at ``coordinate``."""
    placed = [(op.attrs[NAME], op.result) for op in program.ops_of(OpKind.INPUT)
              if op.result.is_tensor and op.result.dist is not None]
    return tuple({name: local_slices(v.type.shape, v.dist.mesh, v.dist.placements,
                                     coordinate + (k,)) for name, v in placed}
                 for k in range(micro_batches))


def _format_jobs(layout: PipelineLayout, made: PipelineProcess) -> str:
    """A process's jobs: its rank's job order and messages, then every job's program (the
    first micro-batch's; the others differ only in which rows they read)."""
    parts = [layout.describe(), made.jobs.describe()]
    for job in made.order:
        if job.micro_batch in (0, -1):
            parts.append(f"# job {job}\n" + format_program(made.programs[job].program))
    return "\n\n".join(parts) + "\n"


# -- checks ---------------------------------------------------------------------------------

def _check(program: Program, comms: dict[int, Comm], where: str) -> None:
    """A lowered program is valid IR, and exactly its comm ops have a comm spec."""
    try:
        verify(program)
    except Exception as exc:
        exc.add_note(f"autopar: lowering made an invalid program for {where}")
        raise
    expected = {i for i, op in enumerate(program.ops) if op.kind is OpKind.COMM}
    if set(comms) != expected:
        raise LoweringError(f"{where}: comm specs for ops {sorted(set(comms) - expected)} that "
                            f"are no comm ops, none for {sorted(expected - set(comms))}")
    for i, comm in comms.items():
        if isinstance(comm, (Send, Recv)) != (program.ops[i].target in ("comm.send",
                                                                        "comm.recv")):
            raise LoweringError(f"{where}: op {i} ({program.ops[i].target}) has comm spec "
                                f"{type(comm).__name__}")
