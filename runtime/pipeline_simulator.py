"""Every process of a pipelined plan in this one process: each pp position runs its job list
in order, a job in lockstep over the coordinates of its stage mesh (its dp/tp collectives
with the reference semantics of ``reshard.simulate``), and messages go through mailboxes.
A job starts once every message it receives has been sent, so the simulator runs exactly
the jobs, transfers and sums over micro-batches the real runtime runs, in an order the
schedule allows, and reports each rank's peak activation bytes.

Like ``runtime.simulator.SimulatedExecutor`` it holds full tensors: each process's pieces
of the state are cut at the start of a step and the updated pieces assembled back after it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..ir import OpKind, Program, Slot
from ..ir.dist import DistAttr, ProcessMesh, assemble, shard_tensor_local
from ..passes.partition import partition
from ..pipeline.job_programs import job_program, local_keys
from ..pipeline.jobs import STEP, JobId, PipelinePlan
from ..pipeline.phases import Phase
from ..pipeline.timeline import timeline_events
from .pipeline_step import MicroBatchCutter, RankStore, RngTable
from .simulator import call_op, communicate
from ..ir.attrs import CONST, NAME, SLOTS
from ..pipeline.jobs import MESSAGE

__all__ = ["PipelineSimulator"]

Coordinate = tuple[int, ...]


class PipelineDeadlock(RuntimeError):
    """No pipeline rank can start its next job (a schedule or a plan that cannot run)."""


class PipelineSimulator:
    """The Executor interface (``run(feeds, seed)``) over every process of a pipeline."""

    def __init__(self, program: Program, plan: PipelinePlan, state: dict[str, Any]):
        self.program, self.plan, self.state = program, plan, state
        layout = plan.layout
        self.coords = layout.stage_coordinates()
        self.stage_mesh = (ProcessMesh(np.arange(len(self.coords)).reshape(layout.stage_shape),
                                       layout.stage_dims) if layout.stage_shape else None)
        self.jobs = self._job_programs()
        self.rng = RngTable(program)
        self.states = {op.attrs[NAME]: op.result for op in program.ops
                       if op.kind is OpKind.STATE}
        self.cutters = {c: MicroBatchCutter(program, c, layout.micro_batches)
                        for c in self.coords}
        self.peak_activation_bytes: list[int] = [0] * layout.ranks
        self.rank_states = {r.rank: {op.attrs[NAME] for (rank, c, _), job in self.jobs.items()
                                     if rank == r.rank and c == self.coords[0]
                                     for op in job.ops if op.kind is OpKind.STATE}
                            for r in plan.ranks}

    def _job_programs(self) -> dict[tuple[int, Coordinate, JobId], Program]:
        """Every job of every process, cut from the partition for its micro-batch (once-a-step
        jobs: any micro-batch's, they read only what every micro-batch holds alike)."""
        jobs = {}
        for k in range(self.plan.layout.micro_batches):
            for c in self.coords:
                local = partition(self.program, c + (k,))
                keys = local_keys(self.program, local, self.plan.names)
                for rank in self.plan.ranks:
                    for job in rank.order:
                        if job.micro_batch == k or (job.micro_batch == STEP and k == 0):
                            jobs[(rank.rank, c, job)] = job_program(
                                self.program, local, keys, self.plan, rank, job)
        return jobs

    def peaks(self) -> list[int]:
        """Each pipeline rank's peak activation bytes of the last step."""
        return list(self.peak_activation_bytes)

    def trace_events(self, process: int) -> list[tuple[int, str, float, float]]:
        """The schedule's simulated timeline (1 unit = 1 ms), per pipeline rank."""
        return timeline_events(self.plan.schedule.timeline)

    # -- one step -------------------------------------------------------------------------
    def run(self, feeds: dict[str, Any], seed: int | None = None) -> dict[Slot, Any]:
        generator = torch.default_generator
        saved = generator.get_state()
        try:
            rng = self.rng.states(seed) if (self.rng and seed is not None) else {}
            results, updated = self._step(feeds, rng)
        finally:
            generator.set_state(saved)
        self._write_back(updated)
        return results

    def _step(self, feeds: dict[str, Any], rng: dict[str, Any]):
        layout = self.plan.layout
        stores = {(r.rank, c): RankStore(r, layout.micro_batches)
                  for r in self.plan.ranks for c in self.coords}
        pieces = {(r.rank, c): self._state_pieces(r.rank, c)
                  for r in self.plan.ranks for c in self.coords}
        mailbox: dict[tuple, Any] = {}
        results: dict[Slot, Any] = {}
        updated: dict[tuple[int, Coordinate], dict[str, Any]] = {}
        runs = {r.rank: self._rank(r, feeds, rng, stores, pieces, mailbox, results, updated)
                for r in self.plan.ranks}
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
                    f"rank {r} waits for {m}" for r, m in sorted(waiting.items())))
        for r in self.plan.ranks:
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
        programs = {c: self.jobs[(rank, c, job)] for c in self.coords}
        envs: dict[Coordinate, dict] = {c: {} for c in self.coords}
        base = {c: self._feeds(feeds, c, job, rng) for c in self.coords}
        inputs = {c: stores[(rank, c)].feeds(job, base[c]) for c in self.coords}
        n = len(programs[self.coords[0]].ops)
        pending_rng = None
        outs = {}
        for i in range(n):
            ops = {c: programs[c].ops[i] for c in self.coords}
            first = ops[self.coords[0]]
            if first.kind is OpKind.INPUT:
                for c, op in ops.items():
                    envs[c][op.result] = inputs[c][op.attrs[NAME]]
            elif first.kind is OpKind.STATE:
                for c, op in ops.items():
                    envs[c][op.result] = pieces[(rank, c)][op.attrs[NAME]]
            elif first.target == "comm.recv":
                message = first.attrs[MESSAGE]
                while (message, self.coords[0]) not in mailbox:
                    yield message
                for c, op in ops.items():
                    envs[c][op.result] = mailbox.pop((op.attrs[MESSAGE], c))
            elif first.target == "comm.send":
                for c, op in ops.items():
                    mailbox[(op.attrs[MESSAGE], c)] = envs[c][op.args[0]]
            elif first.kind is OpKind.COMM:
                communicate(ops, envs, self.stage_mesh)
            elif first.target == "autopar.set_rng_state":
                pending_rng = envs[self.coords[0]][first.args[0]]
            elif first.kind is OpKind.CALL:
                for c, op in ops.items():
                    if pending_rng is not None:     # every process draws what eager draws
                        torch.default_generator.set_state(pending_rng)
                    for v, x in zip(op.outputs, call_op(op, envs[c])):
                        envs[c][v] = x
                pending_rng = None
            elif first.kind is OpKind.OUTPUT:
                for c, op in ops.items():
                    values = [envs[c][v] for v in op.args]
                    outs[c] = stores[(rank, c)].absorb(job, op.attrs[SLOTS], values)
        return outs

    def _feeds(self, feeds: dict[str, Any], c: Coordinate, job: JobId, rng) -> dict[str, Any]:
        """This coordinate's pieces of the batch for the job's micro-batch, the
        hyper-parameters and the random states."""
        return {**rng, **self.cutters[c].cut(feeds, max(job.micro_batch, 0))}

    # -- state ---------------------------------------------------------------------------------
    def _state_pieces(self, rank: int, c: Coordinate) -> dict[str, Any]:
        """The process's pieces of the state its jobs read (cut from the full tensors)."""
        out = {}
        for name in self.rank_states[rank]:
            v = self.states[name]
            full = self.state[name] if name in self.state else v.producer.attrs.get(CONST)
            if isinstance(full, torch.Tensor) and v.dist is not None:
                out[name] = shard_tensor_local(full, v.dist.mesh, v.dist.placements, c + (0,))
            else:
                out[name] = full
        return out

    def _write_back(self, updated: dict) -> None:
        """Assemble each updated state from its lowest stage's processes into the full
        tensor (a tied weight's copies on two stages are updated alike)."""
        done = set()
        for r in self.plan.ranks:
            for name in sorted(updated.get((r.rank, self.coords[0]), {})):
                if name in done:
                    continue
                done.add(name)
                parts = {c: updated[(r.rank, c)][name] for c in self.coords}
                value = self._assemble(name, parts)
                old = self.state.get(name)
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and old.shape == value.shape:
                    old.copy_(value)
                else:
                    self.state[name] = value

    def _assemble(self, name: str, parts: dict[Coordinate, Any]) -> Any:
        first = parts[self.coords[0]]
        v = self.states[name]
        if self.stage_mesh is None or not isinstance(first, torch.Tensor) or v.dist is None:
            return first
        stage = DistAttr(self.stage_mesh, v.dist.placements[:-1])
        return assemble(parts, v.type.shape, stage.mesh, stage.placements)
