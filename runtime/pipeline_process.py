"""One process of a pipelined plan on real processes.

Lowering made this process's jobs (each a program, cut at its stage coordinate and the
job's micro-batch) with what every comm op runs; here they are compiled with their
collectives bound to the stage's process groups and their messages to ``runtime.p2p``, and
run in the rank's order each step, keeping values between jobs in a ``RankStore``.

Its state is the pieces of the parameters and optimizer state its stages hold; a weight
two stages share (tied embeddings) is held, and updated alike, by both.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..ir import Slot
from ..ir.attrs import SLOTS
from ..lower.executable import CompileSpec, JobProgram, PipelineProcess, Recv, Send
from ..pipeline.jobs import JobId
from ..pipeline.phases import Phase
from .codegen import Outside, generate, generate_segments
from .collectives import bind
from .compiled import CompiledStep
from .job_store import RankStore, cut_feeds
from .p2p import P2PTransport
from .process_groups import MeshAxisGroup, MeshGroups
from .seeding import eager_rng_states, forked_generator

__all__ = ["PipelineExecutor", "logical_groups"]


def logical_groups(full: MeshGroups, logical_mesh, coordinate: tuple[int, ...],
                   micro_batch: int) -> MeshGroups:
    """This process's groups seen from the logical mesh at one micro-batch: the stage dims'
    groups of the full mesh (pp first), and no group for ``mb`` (reductions over
    micro-batches run between jobs)."""
    over_time = MeshAxisGroup(None, (), micro_batch, ())
    return MeshGroups(logical_mesh, full.rank, tuple(coordinate) + (micro_batch,),
                      tuple(full.axes[1:]) + (over_time,))


class PipelineExecutor:
    """``run(feeds, seed)``: one step of this process's jobs; ``events`` holds the last
    step's (job, start, end) wall times and ``peak_activation_bytes`` its high-water mark."""

    def __init__(self, process: PipelineProcess, state: dict[str, Any], logical_mesh,
                 groups: MeshGroups | None, p2p_group=None, device=None,
                 compile: CompileSpec | None = None):
        self.process, self.state = process, state
        self.micro_batches = len(process.micro_batch_inputs)
        self.transport = None
        if groups is not None:
            receives = {c.message: (c.shape, c.dtype) for job in process.programs.values()
                        for c in job.comms.values() if isinstance(c, Recv)}
            self.transport = P2PTransport(process.messages, process.pp, process.peers,
                                          receives, device or torch.device("cpu"), p2p_group)
        self.fns, self.slots = {}, {}
        for i, job in enumerate(process.order):
            made = process.programs[job]
            job_groups = None if groups is None else logical_groups(
                groups, logical_mesh, process.coordinate, max(job.micro_batch, 0))
            comm = self._bind(made, job_groups)
            self.fns[job] = (_compiled_job(made, comm, compile, f"process {process.process}'s "
                                           f"job {job} (job{i})", f"job{i}", process.process)
                             if compile is not None else
                             generate(made.program, name=f"job{i}", comm=comm)[0])
            self.slots[job] = made.program.output_op.attrs[SLOTS]
        # wall-clock seconds of a perf_counter reading, so processes' events line up
        self.clock = time.time() - time.perf_counter()
        self.events: list[tuple[JobId, float, float]] = []     # the last step's
        self.trace: list[tuple[JobId, float, float]] | None = None   # every step's, if kept
        self.peak_activation_bytes = 0

    def _bind(self, job: JobProgram, groups: MeshGroups | None) -> dict:
        comm: dict = {}
        for i, spec in job.comms.items():
            op = job.program.ops[i]
            if isinstance(spec, Send):
                comm[op] = _sender(self.transport, spec.message)
            elif isinstance(spec, Recv):
                comm[op] = _receiver(self.transport, spec.message)
            elif groups is None:
                raise ValueError(f"{op.target} ({op.module or '-'}) in a pipeline of one "
                                 "process: nothing to communicate with")
            else:
                comm[op] = bind(spec, groups)
        return comm

    @property
    def compile_s(self) -> float:
        """Seconds this process's jobs spent compiling so far."""
        return sum(getattr(fn, "compile_s", 0.0) for fn in self.fns.values())

    def keep_trace(self) -> None:
        """Keep every step's job times (not only the last step's) for ``trace_events``."""
        self.trace = []

    def peaks(self) -> list[int]:
        """Each pipeline rank's peak activation bytes of the last step (every process's
        gathered: a collective)."""
        mine = (self.process.pp, self.peak_activation_bytes)
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        peaks = [0] * len(self.process.peers)
        for pp, peak in everyone:
            peaks[pp] = max(peaks[pp], peak)
        return peaks

    def trace_events(self) -> list[tuple[int, str, float, float]]:
        """Every process's jobs of the kept steps, (process, job, start, end) in seconds
        from the first (a collective)."""
        mine = [(self.process.process, str(job), start + self.clock, end + self.clock)
                for job, start, end in self.trace or ()]
        events = mine
        if dist.is_initialized():
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            events = [e for part in everyone for e in part]
        origin = min((e[2] for e in events), default=0.0)
        return [(r, label, a - origin, b - origin) for r, label, a, b in events]

    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        with forked_generator(None), torch.no_grad():
            results = self._step(feeds, seed)
        for slot, value in results.items():
            if slot.kind == "update":
                self.state[slot.name] = value
        return {s: v for s, v in results.items() if s.kind != "update"}

    def _step(self, feeds: dict[str, Any], seed: int | None) -> dict[Slot, Any]:
        process = self.process
        rng = (eager_rng_states(process.random_ops, seed)
               if process.random_ops and seed is not None else {})
        bases = [{**cut_feeds(feeds, slices), **rng} for slices in process.micro_batch_inputs]
        store = RankStore(process.jobs, self.micro_batches)
        if self.transport is not None:
            self.transport.start_step()
            self.transport.prefetch()
        results: dict[Slot, Any] = {}
        events = []
        for job in process.order:
            if job.phase in (Phase.PRE, Phase.POST):
                store.finish(job.phase)
            start = time.perf_counter()
            values = self.fns[job](store.feeds(job, bases[max(job.micro_batch, 0)]),
                                   self.state)
            rest = store.absorb(job, self.slots[job], values)
            del values     # the store keeps what it needs; the rest must not outlive the job
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


class _MessagesAround:
    """A job compiled without its messages, in segments: each segment's receives are waited
    for before its compiled body runs and fed to it, its sends posted after it. A segment
    ends where the job receives after it has sent (a post job exchanging a tied weight's
    gradient or a norm), so every receive still comes after the sends before it, and each
    is a message an earlier job of the peer sent (``runtime.p2p``)."""

    def __init__(self, bodies: list[CompiledStep], receives: list[list[tuple[str, Callable]]],
                 sends: list[list[Callable]], results: int):
        self.bodies, self.receives, self.sends, self.results = bodies, receives, sends, results

    @property
    def compile_s(self) -> float:
        return sum(body.compile_s for body in self.bodies)

    def __call__(self, feeds: dict[str, Any], state: dict[str, Any]) -> tuple:
        carried: tuple = () if len(self.bodies) == 1 else ({},)
        for body, receives, sends in zip(self.bodies, self.receives, self.sends):
            fed = dict(feeds, **{key: receive() for key, receive in receives})
            values = body(fed, state, *carried)
            if body is self.bodies[-1]:
                values, sent = values[:self.results], values[self.results:]
            else:
                carried, sent = values[:1], values[1:]
            for send, value in zip(sends, sent):
                send(value)
        return values


def _compiled_job(job: JobProgram, comm: dict, spec: CompileSpec, where: str, name: str,
                  process: int) -> Callable:
    """The job's program through ``torch.compile`` without its messages
    (``_MessagesAround``): a new segment starts at each receive that follows a send."""
    ops = job.program.ops
    outside = dict(comm)
    starts, receives, sends = [0], [[]], [[]]
    for i, message in sorted(job.comms.items()):
        if not isinstance(message, (Send, Recv)):
            continue
        key = f"message/{i}"
        outside[ops[i]] = Outside(key)
        if isinstance(message, Recv):
            if sends[-1]:
                starts.append(i)
                receives.append([])
                sends.append([])
            receives[-1].append((key, comm[ops[i]]))
        else:
            sends[-1].append(comm[ops[i]])
    fns, source = generate_segments(job.program, starts, name=name, comm=outside,
                                    traceable=True)
    segmented = len(fns) > 1
    bodies = [CompiledStep(fn, source, job.program, spec,
                           where + (f", segment {k}" if segmented else ""),
                           name + (f"_{k}" if segmented else ""), process)
              for k, fn in enumerate(fns)]
    return _MessagesAround(bodies, receives, sends, len(job.program.output_op.args))


def _sender(transport: P2PTransport, message) -> Callable:
    return lambda x: transport.send(message, x)


def _receiver(transport: P2PTransport, message) -> Callable:
    return lambda: transport.recv(message)

