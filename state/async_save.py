"""Checkpoints written in the background (``Engine.save(path, async_save=True)``).

At the call every process snapshots its boxes into CPU memory (DCP's ``DefaultStager``:
a copy per storage, so training may go on changing the state in place) and hands them to
DCP's ``async_save``, which writes them from a thread; the call returns then. The write
commits like a synchronous save (``SaveJob``): into ``<path>.partial``, renamed by the
coordinator only once DCP returned there, which on real processes means every process's
write finished (DCP gathers their results before it writes ``.metadata``). A crash
mid-write leaves the partial directory, which ``latest_checkpoint`` and ``resume`` skip.

At most one save is in flight: the next save, a load and ``close`` wait for it first, and
a write that failed raises there (``CheckpointError``, naming the path) on every process.
On real processes the background collectives run on a gloo group of their own, so they
never interleave with the training's collectives on the other groups.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..checkpoint import Chunk
from .checkpointing import CheckpointError, RunRecord, SaveJob, begin_save, dump_save
from .train_state import TrainState

__all__ = ["BackgroundSaver"]


@dataclass
class _InFlight:
    job: SaveJob
    done: Future      # the final path once committed, or the CheckpointError


class BackgroundSaver:
    """One engine's background checkpoints: at most one in flight."""

    def __init__(self, timeout: timedelta | None = None):
        self._timeout = timeout                  # of the checkpoint group's collectives
        self._pending: _InFlight | None = None
        self._stager: DefaultStager | None = None
        self._group: Any = None                  # the gloo group of the background writes

    def save(self, state: TrainState, runtime: Any, path: str | os.PathLike,
             run: RunRecord) -> Path:
        """Snapshot this process's state and start writing it to ``path``; returns the
        directory it will be once committed (every process calls it)."""
        self.wait()
        job = begin_save(state, runtime, path, run)
        group = self._checkpoint_group(job.distributed)
        job = replace(job, chunks=self._staged(job))
        _quiet_single_process_warning()
        written = dcp.async_save({}, storage_writer=job.writer(), planner=job.planner(),
                                 process_group=group, no_dist=not job.distributed)
        done: Future = Future()
        written.add_done_callback(lambda f: _settle(job, f, done))
        self._pending = _InFlight(job, done)
        dump_save(run, job)
        return job.target.final

    def wait(self) -> Path | None:
        """Block until the save in flight is committed; returns its path (None when none
        was in flight). A write that failed on any process raises ``CheckpointError`` on
        every process (a collective on real processes)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.done.exception()
        if pending.job.distributed:
            error = self._agree(pending.job, error)
        if error is not None:
            raise error
        return pending.job.target.final

    def close(self, together: bool = True) -> None:
        """Wait for the save in flight, then free the staging memory and the group.
        ``together``: every process is closing (a failed write raises); otherwise this one
        leaves on an error: no collective, and a failed write only warns."""
        try:
            if together:
                self.wait()
            else:
                self._wait_alone()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    def _wait_alone(self) -> None:
        pending, self._pending = self._pending, None
        error = pending.done.exception() if pending is not None else None
        if error is not None:
            warnings.warn(str(error), stacklevel=3)

    def _staged(self, job: SaveJob) -> list[Chunk]:
        """The boxes copied to CPU memory now (each storage once, however many boxes view
        it), so the write reads a snapshot of the call's state."""
        if self._stager is None:
            cuda = any(c.tensor.is_cuda for c in job.chunks)
            # pinned memory and non-blocking copies need a device to copy from
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=cuda))
        staged = self._stager.stage({i: c.tensor for i, c in enumerate(job.chunks)})
        return [replace(c, tensor=staged[i]) for i, c in enumerate(job.chunks)]

    def _checkpoint_group(self, distributed: bool) -> Any:
        """Real processes: a gloo group over every process for the background writes (made
        at the first save, by every process alike; gloo, as DCP's async save needs a CPU
        backend even when training uses NCCL); one process: none."""
        if self._group is None and distributed:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def _agree(self, job: SaveJob, error: BaseException | None) -> BaseException | None:
        """Every process learns whether any failed (DCP's own failures reach all of them; a
        failed rename only the coordinator), so all raise or none; also the barrier after
        which the committed directory is visible to every process."""
        outcomes: list[str | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(outcomes, None if error is None else str(error),
                               group=self._group)
        if error is not None:
            return error
        failed = [r for r, o in enumerate(outcomes) if o is not None]
        if not failed:
            return None
        return CheckpointError(f"save to {job.target.final} failed on rank(s) {failed}: "
                               f"{outcomes[failed[0]]}")


def _settle(job: SaveJob, written: Future, done: Future) -> None:
    """In DCP's writer thread once the write returned: commit, and record the outcome for
    ``wait`` (a done-callback's own exceptions would only be logged)."""
    try:
        job.commit(written.result())
    except BaseException as failed:      # DCP's CheckpointException is a BaseException
        done.set_exception(job.failure(failed))
    else:
        done.set_result(job.target.final)


def _quiet_single_process_warning() -> None:
    """DCP warns from its writer thread that it assumes one process when none is grouped:
    here that is the plan (serial or simulated), as for the synchronous save. The thread
    cannot use ``catch_warnings`` (it swaps the process-wide filters, racing the training
    thread), so this one message is filtered for good; re-adding it is a no-op."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                            category=UserWarning, module=r"torch\.distributed\.checkpoint")

