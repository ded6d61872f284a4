"""What every pipeline runtime (real processes or the in-process simulator) keeps during one
step: the random-number states eager has at each random op, and a process's store of values
between its jobs (activations kept for the backward, once-a-step values, sums over
micro-batches), freed after their last reader, with the bytes of activations it holds.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..ir import Op, OpKind, Program, Slot
from ..ir.dist import local_slices
from ..ir.attrs import STRIDES
from ..ir.printer import value_names
from ..pipeline.job_programs import random_ops
from ..pipeline.jobs import STEP, Accumulation, JobId, RankPlan
from ..pipeline.phases import Phase
from ..reshard.steps import AllGather, AllReduce
from ..ir.ops import resolve
from ..ir.attrs import NAME

__all__ = ["RngTable", "RankStore", "MicroBatchCutter"]


class MicroBatchCutter:
    """``cut(feeds, k)``: a process's piece of the full feeds for micro-batch ``k`` (views),
    by the input values' placements at its coordinate; the slices are found once."""

    def __init__(self, program: Program, coordinate: tuple[int, ...], micro_batches: int):
        placed = [(op.attrs[NAME], op.result) for op in program.ops_of(OpKind.INPUT)
                  if op.result.is_tensor and op.result.dist is not None]
        self.slices = [{name: local_slices(v.type.shape, v.dist.mesh, v.dist.placements,
                                           tuple(coordinate) + (k,)) for name, v in placed}
                       for k in range(micro_batches)]

    def cut(self, feeds: dict[str, Any], k: int) -> dict[str, Any]:
        slices = self.slices[k]
        return {name: (x[slices[name]] if name in slices and isinstance(x, torch.Tensor)
                       else x) for name, x in feeds.items()}


class RngTable:
    """The CPU generator's state before each random op of the global program, as eager
    would have it after ``manual_seed(seed)``: a pipeline rank runs only its stages' random
    ops, and a micro-batch's draw is its slice of the whole batch's draw, so each random op
    restores its state (``autopar.set_rng_state``) instead of following the rank's own."""

    def __init__(self, program: Program):
        names = value_names(program)
        self.ops = [(f"rng/{names[op.outputs[0]]}", op) for op in random_ops(program)]

    def __bool__(self) -> bool:
        return bool(self.ops)

    def states(self, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.default_generator
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            states = {}
            for key, op in self.ops:
                states[key] = generator.get_state()
                _draw_like(op)
            return states
        finally:
            generator.set_state(saved)


def _draw_like(op: Op) -> None:
    """Draw what ``op`` draws at its global shape, in the traced layout, and drop it: the
    generator advances as eager's does (draws depend on shapes and strides, not values)."""
    strides = op.attrs.get(STRIDES) or ()
    layout = strides[1] if op.target == "aten.native_dropout.default" else \
        (strides[0] if strides else None)
    first = True

    def fake(v):
        nonlocal first
        shape, dtype = tuple(v.type.shape), v.type.dtype
        if first and layout is not None and len(layout) == len(shape):
            first = False
            return torch.empty_strided(shape, layout, dtype=dtype)
        first = False
        return torch.zeros(shape, dtype=dtype)

    args = [fake(a) if hasattr(a, "type") and a.is_tensor else a for a in op.args]
    kwargs = {k: (fake(a) if hasattr(a, "type") and a.is_tensor else a)
              for k, a in op.kwargs.items()}
    resolve(op.target)(*args, **kwargs)


class RankStore:
    """One process's values between the jobs of one step."""

    def __init__(self, plan: RankPlan, micro_batches: int):
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
            self.terms[a.input_key] = value if owned or self.m == 1 or \
                a.step.op not in ("sum", "avg") else value.clone(memory_format=torch.contiguous_format)
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
