"""What a process runs: plain data made once, at plan time, by ``lower.lowering`` and consumed
by the runtime (real ranks, the simulator, the pipeline runtimes). Nothing here plans or
executes; every shape, slice and peer a step needs is already worked out.

* ``RankProgram`` — one process of a plan without a pipeline: its local program, what each
  of its comm ops runs, how to cut its pieces of the fed batch and of the state;
* ``PipelineProcess`` — one process of a pipelined plan: its jobs (each a program), the
  order it runs them in, what it keeps between them, its messages and its state pieces;
* ``Lowered`` — every process lowered for one planned program, with what is needed to put
  results back together (the simulator) and to describe the plan (dumps, summaries).

Comm specs say what one comm op of a process's program runs: a reshard step with every
group member's piece shape (``StepComm``), a bucket's asynchronous all-reduce
(``BucketStart``/``BucketWait``), or a pipeline message (``Send``/``Recv``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from ..ir import Op, Program, Slot, StateKey
from ..ir.dist import DistAttr, ProcessMesh
from ..pipeline.jobs import JobId, Message, PipelineJobs, RankJobs
from ..pipeline.layout import PipelineLayout
from ..pipeline.schedules import PipelineSchedule
from ..reshard.steps import Step
from .rank_classes import RankClasses

__all__ = ["CompileSpec", "StepComm", "BucketStart", "BucketWait", "GatherStart", "GatherWait",
           "ScatterStart", "ScatterWait", "Send", "Recv", "Comm", "StatePiece", "ResultLayout",
           "RankProgram", "JobProgram", "PipelineProcess", "Lowered", "Shape"]

Shape = tuple[int, ...]
Slices = tuple[slice, ...]


@dataclass(frozen=True)
class StepComm:
    """A reshard step as one process runs it: the piece every member of its group along
    ``step.mesh_dim`` holds, by index along that dim (collectives pad to the largest)."""

    step: Step
    member_shapes: tuple[Shape, ...]


# An all-reduce of at most this many bytes over a pair of gloo processes runs as an
# all-gather of both terms and a local sum (``runtime.collectives._GatheredReduce``; a
# bucket's: ``comms.by_gather``): gloo's own all-reduce costs about 2 ms from 64 KiB up on
# loopback, its all-gather half that; past about 1 MiB the sum's extra pass over both terms
# costs more than it saves
GATHERED_REDUCE_BYTES = 512 * 1024


@dataclass(frozen=True)
class BucketStart:
    """An asynchronous all-reduce of several tensors flattened into one buffer."""

    steps: tuple[Step, ...]          # one per input: one mesh dim, one reduce op
    shapes: tuple[Shape, ...]        # the inputs' local shapes
    gathered: bool = False           # on gloo, an all-gather of both terms (``comms.by_gather``)


@dataclass(frozen=True)
class BucketWait:
    """The end of a bucket's all-reduce: its results, as views of the reduced buffer."""


@dataclass(frozen=True)
class GatherStart:
    """An asynchronous all-gather of several pieces flattened into one buffer (each member's
    pieces end to end, padded to the largest member's total)."""

    steps: tuple[Step, ...]                          # one per input: one mesh dim
    member_shapes: tuple[tuple[Shape, ...], ...]     # per input: each member's piece, by index


@dataclass(frozen=True)
class GatherWait:
    """The end of a unit's all-gather: the gathered tensors, one per input."""


@dataclass(frozen=True)
class ScatterStart:
    """An asynchronous reduce-scatter of several whole gradients at once: each member's
    chunks of every input end to end (padded to the largest member's total), so one
    collective leaves each member its pieces."""

    steps: tuple[Step, ...]                          # one per input: one mesh dim, one op
    member_shapes: tuple[tuple[Shape, ...], ...]     # per input: each member's piece, by index


@dataclass(frozen=True)
class ScatterWait:
    """The end of a unit's reduce-scatter: this process's pieces, one per input."""


@dataclass(frozen=True)
class Send:
    message: Message
    peer: int                        # the receiving process


@dataclass(frozen=True)
class Recv:
    message: Message
    peer: int                        # the sending process
    shape: Shape
    dtype: torch.dtype


Comm = Union[StepComm, BucketStart, BucketWait, GatherStart, GatherWait, ScatterStart,
             ScatterWait, Send, Recv]


@dataclass(frozen=True)
class StatePiece:
    """A process's piece of one state value (parameter, buffer, optimizer state, constant),
    with its typed key (what it is, whose it is) and, for state that starts at a constant,
    that constant (``fill``): what the training state needs to make its starting value."""

    key: StateKey
    shape: Shape                     # global
    dtype: torch.dtype
    dist: DistAttr | None            # None: whole (serial)
    coordinate: tuple[int, ...]      # where the piece is cut, on ``dist.mesh``
    const: torch.Tensor | None = None            # a constant's whole value
    gather: tuple[StepComm, ...] = ()            # the steps back to the whole tensor
    owner: int | None = None         # pipelines: the pp position whose copy is the value
    fill: float | None = None        # a fresh value's every element (None: from the model,
                                     # the optimizer or ``const``)
    on_host: bool = False            # kept in host memory (sharding.offload), not the device's

    @property
    def name(self) -> str:
        return self.key.name


@dataclass(frozen=True)
class CompileSpec:
    """How the runtime compiles a process's program (``compile:`` in the strategy):
    ``torch.compile``'s backend and mode, what a program it refuses does (``error`` or
    ``eager``), Inductor's cache directory (None: torch's default), and where the code
    Inductor made goes (``debug.dump_dir``): a path with ``{process}`` and ``{name}`` (the
    program: ``program``, ``job<i>``...) to fill, None for nowhere."""

    backend: str = "inductor"
    mode: str = "default"
    fallback: str = "error"
    cache_dir: str | None = None
    dump: str | None = None


@dataclass(frozen=True)
class ResultLayout:
    """A program result's global shape and placement (to assemble it from pieces)."""

    slot: Slot
    shape: Shape | None              # None: not a tensor
    dist: DistAttr | None


@dataclass
class RankProgram:
    process: int
    coordinate: tuple[int, ...]      # on the plan's mesh; () when serial
    program: Program                 # local shapes, local calls
    comms: dict[int, Comm]           # op index in ``program`` -> what it runs
    inputs: dict[str, Slices]        # the piece of each fed tensor that is not whole
    state: dict[str, StatePiece]
    draws_random: bool               # the step draws random numbers (seed it)


@dataclass
class JobProgram:
    job: JobId
    program: Program
    comms: dict[int, Comm]


@dataclass
class PipelineProcess:
    process: int
    pp: int                          # its position along the pipeline axis
    coordinate: tuple[int, ...]      # on its stage mesh
    jobs: RankJobs                   # its pp position's jobs, carries, sums and results
    programs: dict[JobId, JobProgram]
    micro_batch_inputs: tuple[dict[str, Slices], ...]    # per micro-batch
    state: dict[str, StatePiece]     # every state of the program (held: its stages read it)
    held: frozenset[str]             # the states this process holds a piece of
    messages: tuple[Message, ...]    # the messages it sends or receives, in posting order
    peers: dict[int, int]            # pp position -> the process at the same coordinate
    random_ops: tuple[tuple[str, Op], ...]   # (feed key, global random op): eager's RNG

    @property
    def order(self) -> list[JobId]:
        return self.jobs.order


@dataclass
class Lowered:
    """Every lowered process of one planned program."""

    program: Program                 # the planned global program (not to be changed)
    mesh: ProcessMesh | None         # its mesh (a pipeline's logical mesh); None: serial
    processes: dict[int, RankProgram | PipelineProcess]
    results: tuple[ResultLayout, ...]
    pipeline: PipelineLayout | None = None
    schedule: PipelineSchedule | None = None
    jobs: PipelineJobs | None = None
    draws_random: bool = False
    random_ops: tuple[tuple[str, Op], ...] = field(default=())
    # gradient merge: the training step is a cycle of ``k_steps`` batches; the first k-1 run
    # ``accumulating`` (gradients summed, no update) and the k-th runs this program
    accumulating: "Lowered | None" = None
    k_steps: int = 1
    compile: CompileSpec | None = None      # None: the runtime runs the programs uncompiled
    # a report's lowering (``lower_representatives``): one process per class of identical
    # ranks was lowered; the classes say whose program every other process runs
    classes: RankClasses | None = None

    def steps_optimizer(self, batch: int) -> bool:
        """Whether the run's ``batch``-th training batch (0-based) steps the optimizer:
        every batch, or with gradient merge the last of each cycle of ``k_steps``."""
        return (batch + 1) % self.k_steps == 0

    def unfinished(self, batches: int) -> int:
        """Batches of a gradient-merge cycle trained after ``batches`` without their update."""
        return batches % self.k_steps

    def state_pieces(self) -> list[StatePiece]:
        """Every lowered process's state pieces (the accumulating program's too)."""
        pieces = [p for made in self.processes.values() for p in made.state.values()]
        return pieces + (self.accumulating.state_pieces() if self.accumulating else [])

    def every_process(self) -> dict[int, RankProgram | PipelineProcess]:
        """Each process by what it runs: its own lowering, or under ``classes`` its class
        representative's (the same program but for the pieces held)."""
        if self.classes is None:
            return dict(sorted(self.processes.items()))
        return {p: self.processes[r] for p, r in sorted(self.classes.representative.items())}

    def process(self, process: int) -> RankProgram | PipelineProcess:
        if process not in self.processes:
            raise KeyError(f"process {process} was not lowered (lowered: "
                           f"{sorted(self.processes)})")
        return self.processes[process]
