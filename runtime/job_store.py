"""What a pipeline process keeps between its jobs during one step: activations kept for the
backward, once-a-step values, sums over micro-batches, freed after their last reader, with
the bytes of activations it holds (every pipeline runtime, real or simulated, uses it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..ir import Slot
from ..pipeline.jobs import STEP, Accumulation, JobId, RankJobs
from ..pipeline.phases import Phase
from ..reshard.steps import AllGather, AllReduce

__all__ = ["FedRows", "RankStore", "cut_feeds"]


@dataclass(frozen=True)
class FedRows:
    """Only some rows of a fed tensor: those a data-parallel process read from its shard of
    a stream (rows ``start`` on, along dim ``dim`` of the global batch of ``total`` rows).
    The process's piece is cut from them as from the whole tensor."""

    tensor: torch.Tensor
    dim: int
    start: int
    total: int


def cut_feeds(feeds: dict[str, Any], slices: dict[str, tuple[slice, ...]]) -> dict[str, Any]:
    """A process's pieces of the full feeds (views), by the slices lowering found."""
    return {name: _cut(name, x, slices.get(name)) for name, x in feeds.items()}


def _cut(name: str, fed: Any, where: tuple[slice, ...] | None) -> Any:
    if isinstance(fed, FedRows):
        return _cut_rows(name, fed, where)
    return fed[where] if where is not None and isinstance(fed, torch.Tensor) else fed


def _cut_rows(name: str, fed: FedRows, where: tuple[slice, ...] | None) -> torch.Tensor:
    """The piece of a process that was fed only its own rows: its slice along the batch dim
    moved to where those rows start."""
    rows = fed.tensor.shape[fed.dim]
    wanted = where[fed.dim] if where is not None else slice(None)
    lo = (wanted.start or 0) - fed.start
    hi = (fed.total if wanted.stop is None else wanted.stop) - fed.start
    if lo < 0 or hi > rows:
        raise ValueError(f"feed {name}: this process reads rows {lo + fed.start}:"
                         f"{hi + fed.start} of the batch (dim {fed.dim}), but was fed only "
                         f"its data shard's rows {fed.start}:{fed.start + rows}: the plan "
                         "does not cut the batch along the data-parallel axes the stream is "
                         "sharded over")
    cut = list(where) if where is not None else [slice(None)] * fed.tensor.dim()
    cut[fed.dim] = slice(lo, hi)
    return fed.tensor[tuple(cut)]


class RankStore:
    """One process's values between the jobs of one step."""

    def __init__(self, plan: RankJobs, micro_batches: int):
        self.plan, self.m = plan, micro_batches
        self.values: dict[tuple[str, int], Any] = {}
        self.terms: dict[str, Any] = {}
        self.accumulation = {a.input_key: a for a in plan.accumulations}
        # per-micro-batch tensors held between jobs, by storage: (bytes, references)
        self.storages: dict[int, list[int]] = {}
        self.held_bytes = 0
        self.peak_activation_bytes = 0

    def feeds(self, job: JobId, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (batch pieces, hyper-parameters, random states) and the job's carried
        values."""
        feeds = dict(base)
        for key, k in self.plan.carried_in.get(job, ()):
            feeds[key] = self.values[(key, k)]
        return feeds

    def absorb(self, job: JobId, slots: Sequence[Slot], values: Sequence[Any]) -> dict[Slot, Any]:
        """Keep what a job hands on; returns its other results (post: the step's results)."""
        k = job.micro_batch
        rest = {}
        exported = [v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)]
        for slot, value in zip(slots, values):
            if slot.kind == "carry":
                self.values[(slot.name, k)] = value
                if k != STEP and isinstance(value, torch.Tensor):
                    self._hold(value, +1)
            elif slot.kind == "accumulate":
                self._add(self.accumulation[slot.name], value, k, exported)
            else:
                rest[slot] = value
        if self.held_bytes > self.peak_activation_bytes:
            self.peak_activation_bytes = self.held_bytes
        for pair in self.plan.frees.get(job, ()):
            value = self.values.pop(pair, None)
            if pair[1] != STEP and isinstance(value, torch.Tensor):
                self._hold(value, -1)
        return rest

    def _hold(self, value: torch.Tensor, change: int) -> None:
        """Count a per-micro-batch tensor kept (+1) or freed (-1); each storage once."""
        storage = value.untyped_storage()
        key = storage.data_ptr()
        entry = self.storages.get(key)
        if entry is None:
            entry = self.storages[key] = [storage.nbytes(), 0]
            self.held_bytes += entry[0]
        entry[1] += change
        if entry[1] == 0:
            self.held_bytes -= entry[0]
            del self.storages[key]

    def finish(self, before: Phase) -> None:
        """Complete the sums over micro-batches that the ``before`` job reads."""
        for a in self.plan.accumulations:
            if a.before is before and a.input_key in self.terms:
                self.values[(a.output_key, STEP)] = self._total(a, self.terms.pop(a.input_key))

    # -- sums over micro-batches --------------------------------------------------------------
    def _add(self, a: Accumulation, value: Any, k: int, exported: list[int]) -> None:
        if isinstance(a.step, AllGather):
            self.terms.setdefault(a.input_key, {})[k] = value
            return
        old = self.terms.get(a.input_key)
        if old is None:
            # a sum of micro-batches' terms is contiguous and added to in place, like
            # autograd's AccumulateGrad (weight gradients often come out transposed views);
            # the first term itself serves when it is contiguous and nothing else shares it
            storage = value.untyped_storage().data_ptr()
            owned = (value._base is None and value.is_contiguous()
                     and exported.count(storage) == 1 and storage not in self.storages)
            keep = owned or self.m == 1 or a.step.op not in ("sum", "avg")
            self.terms[a.input_key] = (value if keep
                                       else value.clone(memory_format=torch.contiguous_format))
        elif a.step.op in ("sum", "avg"):
            old.add_(value)
        elif a.step.op == "max":
            self.terms[a.input_key] = torch.maximum(old, value)
        else:
            self.terms[a.input_key] = torch.minimum(old, value)

    def _total(self, a: Accumulation, terms: Any) -> Any:
        if isinstance(a.step, AllGather):
            return torch.cat([terms[k] for k in sorted(terms)], dim=a.step.tensor_dim)
        if isinstance(a.step, AllReduce) and a.step.op == "avg":
            return terms / self.m
        return terms
