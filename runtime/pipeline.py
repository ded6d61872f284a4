"""One process of a pipelined plan on real processes.

Every process plans the same global program and the same ``PipelinePlan``; this process
keeps its pp position's jobs, cut at its stage coordinate and each job's micro-batch
(``pipeline.job_programs``), compiles them with their collectives bound to its stage's
process groups and their messages to ``runtime.p2p``, and runs them in its rank's order
each step, keeping values between jobs in a ``RankStore``.

Its state is the pieces of the parameters and optimizer state its stages hold; a weight
two stages share (tied embeddings) is held, and updated alike, by both.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..ir import OpKind, Program, Slot
from ..ir.dist import DistAttr
from ..passes.partition import partition
from ..pipeline.job_programs import job_program, local_keys
from ..pipeline.jobs import JobId, Message, PipelinePlan
from ..pipeline.layout import PipelineLayout
from ..pipeline.phases import Phase, homes_of
from .codegen import generate
from .collectives import bind_comm
from .distributed import gather_full, initial_piece
from .p2p import P2PTransport
from .pipeline_step import MicroBatchCutter, RankStore, RngTable
from .process_groups import MeshAxisGroup, MeshGroups
from ..ir.attrs import NAME, SLOTS
from ..pipeline.job_programs import GLOBAL_OP
from ..pipeline.jobs import MESSAGE

__all__ = ["PipelineExecutor", "PipelinePieces", "logical_groups"]


def logical_groups(full: MeshGroups | None, layout: PipelineLayout,
                   coordinate: tuple[int, ...], micro_batch: int) -> MeshGroups | None:
    """This process's groups seen from the logical mesh at one micro-batch: the stage dims'
    groups of the full mesh (pp first), and no group for ``mb`` (reductions over
    micro-batches run between jobs)."""
    if full is None:
        return None
    over_time = MeshAxisGroup(None, (), micro_batch, ())
    return MeshGroups(layout.logical_mesh, full.rank, tuple(coordinate) + (micro_batch,),
                      tuple(full.axes[1:]) + (over_time,))


class PipelinePieces:
    """This process's pieces of the state its stages hold, and the way back to full tensors
    for every state of the engine's programs (a collective: every process calls ``full``
    for the same names in the same order)."""

    def __init__(self, layout: PipelineLayout, groups: MeshGroups | None, pp: int,
                 coordinate: tuple[int, ...]):
        self.layout, self.groups, self.pp, self.coordinate = layout, groups, pp, coordinate
        self.tensors: dict[str, torch.Tensor | None] = {}
        self.dists: dict[str, DistAttr] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.owner: dict[str, int] = {}       # the lowest pp position holding each state

    def names(self) -> list[str]:
        return sorted(self.owner)

    def adopt(self, program: Program, full: dict[str, Any],
              make_full: Callable[[str], torch.Tensor | None]) -> None:
        mine = set(self.layout.stages_of(self.pp))
        for op in program.ops_of(OpKind.STATE):
            name, value = op.attrs[NAME], op.result
            if not value.is_tensor:
                continue
            stages = {s for s, _ in homes_of(op)}
            holders = sorted({self.layout.rank_of(s) for s in stages})
            self.owner.setdefault(name, holders[0] if holders else 0)
            self.shapes[name], self.dtypes[name] = tuple(value.type.shape), value.type.dtype
            if not stages & mine:
                continue
            placement = tuple(value.dist.placements[:-1])
            if name in self.dists:
                if tuple(self.dists[name].placements[:-1]) != placement:
                    raise ValueError(f"state {name!r} is kept at {self.dists[name]} but a "
                                     f"program ({op.module or 'top level'}) wants it at "
                                     f"{value.dist}; a state value keeps one placement")
                continue
            self.tensors[name] = initial_piece(op, full, make_full, self.coordinate + (0,))
            self.dists[name] = value.dist

    def full(self, name: str) -> torch.Tensor | None:
        owner = self.owner[name]
        value = None
        if self.pp == owner:
            piece = self.tensors.get(name)
            if piece is not None:
                groups = logical_groups(self.groups, self.layout, self.coordinate, 0)
                value = piece if groups is None else gather_full(
                    piece, self.shapes[name], self.dists[name], groups)
        if self.layout.ranks == 1 or self.groups is None:
            return value
        present = torch.tensor([value is not None], dtype=torch.int32)
        source = self.layout.process(owner, self.coordinate)
        pp_group = self.groups.axes[0].group
        dist.broadcast(present, src=source, group=pp_group)
        if not present.item():
            return None
        if value is None:
            value = torch.empty(self.shapes[name], dtype=self.dtypes[name])
        dist.broadcast(value, src=source, group=pp_group)
        return value


class PipelineExecutor:
    """``run(feeds, seed)``: one step of this process's jobs; ``events`` holds the last
    step's (job, start, end) wall times and ``peak_activation_bytes`` its high-water mark."""

    def __init__(self, program: Program, plan: PipelinePlan, pieces: PipelinePieces,
                 groups: MeshGroups | None, p2p_group=None, device=None):
        self.program, self.plan, self.pieces = program, plan, pieces
        layout = plan.layout
        self.layout, self.rank = layout, plan.ranks[pieces.pp]
        self.coordinate = pieces.coordinate
        self.cutter = MicroBatchCutter(program, self.coordinate, layout.micro_batches)
        self.rng = RngTable(program)
        shapes: dict[Message, tuple] = {}
        self.jobs, self.fns, self.slots = {}, {}, {}
        self.transport = None
        locals_: dict[int, tuple[Program, dict]] = {}
        for job in self.rank.order:
            k = max(job.micro_batch, 0)
            if k not in locals_:
                local = partition(program, self.coordinate + (k,))
                locals_[k] = (local, local_keys(program, local, plan.names))
            self.jobs[job] = job_program(program, *locals_[k], plan, self.rank, job)
            for op in self.jobs[job].ops:
                if op.target == "comm.recv":
                    shapes[op.attrs[MESSAGE]] = (tuple(op.result.type.shape),
                                                    op.result.type.dtype)
        if groups is not None:
            self.transport = P2PTransport(
                plan.messages, pieces.pp, lambda pp: layout.process(pp, self.coordinate),
                shapes, device or torch.device("cpu"), p2p_group)
        for i, job in enumerate(self.rank.order):
            comm = self._bind(self.jobs[job], logical_groups(groups, layout, self.coordinate,
                                                             max(job.micro_batch, 0)))
            self.fns[job], _ = generate(self.jobs[job], name=f"job{i}", comm=comm)
            self.slots[job] = self.jobs[job].output_op.attrs[SLOTS]
        # wall-clock seconds of a perf_counter reading, so processes' events line up
        self.clock = time.time() - time.perf_counter()
        self.events: list[tuple[JobId, float, float]] = []     # the last step's
        self.trace: list[tuple[JobId, float, float]] | None = None   # every step's, if kept
        self.peak_activation_bytes = 0

    def peaks(self) -> list[int]:
        """Each pipeline rank's peak activation bytes of the last step (every process's
        gathered: a collective)."""
        mine = (self.pieces.pp, self.peak_activation_bytes)
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        peaks = [0] * self.layout.ranks
        for pp, peak in everyone:
            peaks[pp] = max(peaks[pp], peak)
        return peaks

    def trace_events(self, process: int) -> list[tuple[int, str, float, float]]:
        """Every process's jobs of the kept steps, (process, job, start, end) in seconds
        from the first (a collective)."""
        mine = [(process, str(job), start + self.clock, end + self.clock)
                for job, start, end in self.trace or ()]
        events = mine
        if dist.is_initialized():
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            events = [e for part in everyone for e in part]
        origin = min((e[2] for e in events), default=0.0)
        return [(r, label, a - origin, b - origin) for r, label, a, b in events]

    def _bind(self, program: Program, groups: MeshGroups | None) -> dict:
        comm = {}
        for op in program.ops_of(OpKind.COMM):
            if op.target == "comm.send":
                comm[op] = (lambda m: lambda x: self.transport.send(m, x))(op.attrs[MESSAGE])
            elif op.target == "comm.recv":
                comm[op] = (lambda m: lambda: self.transport.recv(m))(op.attrs[MESSAGE])
            elif groups is None:
                raise ValueError(f"{op.target} ({op.module or '-'}) in a pipeline of one "
                                 "process: nothing to communicate with")
            else:
                comm[op] = bind_comm(op.attrs[GLOBAL_OP], groups)
        return comm

    def run(self, feeds: dict[str, Any], seed: int | None = None) -> dict[Slot, Any]:
        generator = torch.default_generator
        saved = generator.get_state()
        try:
            with torch.no_grad():
                results = self._step(feeds, seed)
        finally:
            generator.set_state(saved)
        for slot, value in results.items():
            if slot.kind == "update":
                self.pieces.tensors[slot.name] = value
        return {s: v for s, v in results.items() if s.kind != "update"}

    def _step(self, feeds: dict[str, Any], seed: int | None) -> dict[Slot, Any]:
        rng = self.rng.states(seed) if (self.rng and seed is not None) else {}
        bases = {k: {**self.cutter.cut(feeds, k), **rng}
                 for k in range(self.layout.micro_batches)}
        store = RankStore(self.rank, self.layout.micro_batches)
        if self.transport is not None:
            self.transport.start_step()
            self.transport.prefetch()
        results: dict[Slot, Any] = {}
        events = []
        for job in self.rank.order:
            if job.phase in (Phase.PRE, Phase.POST):
                store.finish(job.phase)
            start = time.perf_counter()
            values = self.fns[job](store.feeds(job, bases[max(job.micro_batch, 0)]),
                                   self.pieces.tensors)
            rest = store.absorb(job, self.slots[job], values)
            events.append((job, start, time.perf_counter()))
            if self.transport is not None:
                self.transport.prefetch()
            if job.phase is Phase.POST:
                results = rest
        if self.transport is not None:
            self.transport.finish()
        self.events, self.peak_activation_bytes = events, store.peak_activation_bytes
        if self.trace is not None:
            self.trace += events
        return results
