"""Every process of a pipelined plan in this one process: each pp position runs its job list
in order, a job in lockstep over the coordinates of its stage mesh (its dp/tp collectives
with the reference semantics of ``reshard.simulate``), and messages go through mailboxes.
A job starts once every message it receives has been sent, so the simulator runs exactly
the jobs, transfers and sums over micro-batches the real runtime runs, in an order the
schedule allows, and reports each rank's peak activation bytes.

Like ``runtime.simulator.SimulatedExecutor`` it holds full tensors: each process's pieces
of the state are cut at the start of a step and the updated pieces assembled back after it.
Every process of the plan must have been lowered.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..ir import OpKind, Slot
from ..ir.attrs import NAME, SLOTS
from ..ir.dist import DistAttr, ProcessMesh, assemble
from ..lower.executable import JobProgram, Lowered, PipelineProcess, Recv, Send
from ..pipeline.jobs import JobId
from ..pipeline.phases import Phase
from ..pipeline.timeline import timeline_events
from .job_store import RankStore, cut_feeds
from .rank_state import cut_piece
from .seeding import draw_generator, eager_rng_states, forked_generator
from .simulator import call_op, communicate

__all__ = ["PipelineSimulator", "PipelineDeadlock"]

Coordinate = tuple[int, ...]


class PipelineDeadlock(RuntimeError):
    """No pipeline rank can start its next job (a schedule or a plan that cannot run)."""


class PipelineSimulator:
    """The Executor interface (``run(feeds, seed)``) over every process of a lowered
    pipeline (every process lowered)."""

    def __init__(self, lowered: Lowered, state: dict[str, Any]):
        self.lowered, self.state = lowered, state
        layout = lowered.pipeline
        self.layout, self.ranks = layout, lowered.jobs.ranks
        self.coords = layout.stage_coordinates()
        self.stage_mesh = (ProcessMesh(np.arange(len(self.coords)).reshape(layout.stage_shape),
                                       layout.stage_dims) if layout.stage_shape else None)
        self.processes: dict[tuple[int, Coordinate], PipelineProcess] = {
            (p.pp, p.coordinate): p for p in lowered.processes.values()}
        missing = [(r.rank, c) for r in self.ranks for c in self.coords
                   if (r.rank, c) not in self.processes]
        if missing:
            raise ValueError(f"pipeline simulator: processes at (pp, coordinate) {missing[:4]} "
                             "were not lowered")
        self.peak_activation_bytes: list[int] = [0] * layout.ranks
        self.meter = None     # a runtime.memory_meter.PipelineMeter counts live bytes when set

    def peaks(self) -> list[int]:
        """Each pipeline rank's peak activation bytes of the last step."""
        return list(self.peak_activation_bytes)

    def keep_trace(self) -> None:
        """Nothing to keep: the trace is the schedule's own timeline."""

    def trace_events(self) -> list[tuple[int, str, float, float]]:
        """The schedule's simulated timeline (1 unit = 1 ms), per pipeline rank."""
        return timeline_events(self.lowered.schedule.timeline)

    # -- one step -------------------------------------------------------------------------
    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        random_ops = self.lowered.random_ops
        with forked_generator(None):
            rng = eager_rng_states(random_ops, seed) if random_ops and seed is not None else {}
            results, updated = self._step(feeds, rng)
        self._write_back(updated)
        return results

    def _step(self, feeds: dict[str, Any], rng: dict[str, Any]):
        m = self.layout.micro_batches
        stores = {(r.rank, c): RankStore(r, m) for r in self.ranks for c in self.coords}
        pieces = {(r.rank, c): self._state_pieces(self.processes[(r.rank, c)])
                  for r in self.ranks for c in self.coords}
        mailbox: dict[tuple, Any] = {}
        results: dict[Slot, Any] = {}
        updated: dict[tuple[int, Coordinate], dict[str, Any]] = {}
        runs = {r.rank: self._rank(r, feeds, rng, stores, pieces, mailbox, results, updated)
                for r in self.ranks}
        while runs:
            waiting = {}
            for rank, run in list(runs.items()):
                try:
                    waiting[rank] = next(run)
                except StopIteration:
                    del runs[rank]
            if runs and all(w is not None for w in waiting.values()) \
                    and len(waiting) == len(runs):
                raise PipelineDeadlock("pipeline simulator: no rank can go on: " + "; ".join(
                    f"rank {r} waits for {msg}" for r, msg in sorted(waiting.items())))
        for r in self.ranks:
            self.peak_activation_bytes[r.rank] = max(
                stores[(r.rank, c)].peak_activation_bytes for c in self.coords)
        return results, updated

    def _rank(self, rank, feeds, rng, stores, pieces, mailbox, results, updated):
        """One pp position's jobs, in order, as a coroutine: it yields None after some work
        and the missing message when it must wait for one."""
        for job in rank.order:
            if job.phase in (Phase.PRE, Phase.POST):
                for c in self.coords:
                    stores[(rank.rank, c)].finish(job.phase)
            outs = yield from self._run_job(rank.rank, job, feeds, rng, stores, pieces, mailbox)
            if job.phase is Phase.POST:
                results.update({s: v for s, v in outs[self.coords[0]].items()
                                if s.kind != "update"})
                for c, out in outs.items():
                    updated[(rank.rank, c)] = {s.name: v for s, v in out.items()
                                               if s.kind == "update"}
            yield None

    # -- one job on every coordinate of a rank ----------------------------------------------
    def _run_job(self, rank: int, job: JobId, feeds: dict, rng: dict, stores: dict,
                 pieces: dict, mailbox: dict):
        """Run ``job`` on every coordinate in lockstep (a coroutine: it waits at a receive
        whose message is not sent yet); returns each coordinate's results."""
        jobs: dict[Coordinate, JobProgram] = {
            c: self.processes[(rank, c)].programs[job] for c in self.coords}
        programs = {c: j.program for c, j in jobs.items()}
        first_job = jobs[self.coords[0]]
        envs: dict[Coordinate, dict] = {c: {} for c in self.coords}
        k = max(job.micro_batch, 0)
        inputs = {c: stores[(rank, c)].feeds(job, {**rng, **cut_feeds(
                      feeds, self.processes[(rank, c)].micro_batch_inputs[k])})
                  for c in self.coords}
        pending_rng = None
        outs = {}
        if self.meter is not None:
            for c in self.coords:
                self.meter.start(rank, c, programs[c])
        for i, first in enumerate(first_job.program.ops):
            ops = {c: programs[c].ops[i] for c in self.coords}
            comm = first_job.comms.get(i)
            if first.kind is OpKind.INPUT:
                for c, op in ops.items():
                    envs[c][op.result] = inputs[c][op.attrs[NAME]]
            elif first.kind is OpKind.STATE:
                for c, op in ops.items():
                    envs[c][op.result] = pieces[(rank, c)][op.attrs[NAME]]
            elif isinstance(comm, Recv):
                while (comm.message, self.coords[0]) not in mailbox:
                    yield comm.message
                for c, op in ops.items():
                    envs[c][op.result] = mailbox.pop((comm.message, c))
            elif isinstance(comm, Send):
                for c, op in ops.items():
                    mailbox[(comm.message, c)] = envs[c][op.args[0]]
            elif first.kind is OpKind.COMM:
                communicate(ops, comm, envs, self.stage_mesh)
            elif first.target == "autopar.set_rng_state":
                pending_rng = envs[self.coords[0]][first.args[0]]
            elif first.kind is OpKind.CALL:
                for c, op in ops.items():
                    if pending_rng is not None:     # every process draws what eager draws
                        draw_generator().set_state(pending_rng)
                    for v, x in zip(op.outputs, call_op(op, envs[c])):
                        envs[c][v] = x
                pending_rng = None
            elif first.kind is OpKind.OUTPUT:
                for c, op in ops.items():
                    values = [envs[c][v] for v in op.args]
                    outs[c] = stores[(rank, c)].absorb(job, op.attrs[SLOTS], values)
            if self.meter is not None:
                for c, op in ops.items():
                    self.meter.after(rank, c, i, op, envs[c], stores[(rank, c)])
        return outs

    # -- state ---------------------------------------------------------------------------------
    def _state_pieces(self, process: PipelineProcess) -> dict[str, Any]:
        """The process's pieces of the state its jobs read (cut from the full tensors)."""
        out = {}
        for name in process.held:
            piece = process.state[name]
            full = self.state[name] if name in self.state else piece.const
            out[name] = cut_piece(full, piece) if isinstance(full, torch.Tensor) else full
        return out

    def _write_back(self, updated: dict) -> None:
        """Assemble each updated state from its lowest stage's processes into the full
        tensor (a tied weight's copies on two stages are updated alike)."""
        done = set()
        for r in self.ranks:
            for name in sorted(updated.get((r.rank, self.coords[0]), {})):
                if name in done:
                    continue
                done.add(name)
                parts = {c: updated[(r.rank, c)][name] for c in self.coords}
                value = self._assemble(self.processes[(r.rank, self.coords[0])].state[name],
                                       parts)
                old = self.state.get(name)
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and old.shape == value.shape:
                    old.copy_(value)
                else:
                    self.state[name] = value

    def _assemble(self, piece, parts: dict[Coordinate, Any]) -> Any:
        first = parts[self.coords[0]]
        if self.stage_mesh is None or not isinstance(first, torch.Tensor) or piece.dist is None:
            return first
        stage = DistAttr(self.stage_mesh, piece.dist.placements[:-1])
        return assemble(parts, piece.shape, stage.mesh, stage.placements)
