"""The runtime's own account of what each process holds: bytes of live tensors as a step
runs, measured on the real tensors (to check the plan-time estimate, ``lower.memory``).

``measure_step`` runs one step of a lowered plan without a pipeline on the simulator (every
process, or the one process of a serial plan) with a ``MemoryMeter`` watching every op: it
drops each value after its last use in the process's program, as the generated code does,
and counts each live storage once (views and in-place results share their input's). State
tensors are counted for the whole step (the runtime's state dict holds them). Storages the
step did not allocate (a state piece or a feed cut from a full tensor) count only the bytes
their live tensors span. Optional and slow: for checking estimates (tests), never planning.
"""
from __future__ import annotations

from typing import Any

import torch

from ..ir import OpKind, Program, Value
from ..lower.executable import Lowered
from .codegen import _last_uses as last_uses  # where generated code frees values
from .simulator import simulate_step

__all__ = ["MemoryMeter", "PipelineMeter", "measure_step"]

Coordinate = tuple[int, ...]


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    start = t.storage_offset() * t.element_size()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return (start, start + extent * t.element_size())


def _union(spans: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _storage_bytes(tensors, state: set[int], external: set[int]) -> int:
    """Bytes of the storages of ``tensors``, each once, state storages left out."""
    spans: dict[int, list[tuple[int, int]]] = {}
    sizes: dict[int, int] = {}
    for x in tensors:
        key = x.untyped_storage().data_ptr()
        if key in state:
            continue
        spans.setdefault(key, []).append(_span(x))
        sizes[key] = x.untyped_storage().nbytes()
    return sum(_union(s) if key in external else sizes[key] for key, s in spans.items())


class _Process:
    """One process: its state storages (held all step) and its peak of other live bytes."""

    def __init__(self, program: Program | None = None):
        self.state_storages: set[int] = set()
        self.external: set[int] = set()
        self.state_spans: dict[int, list[tuple[int, int]]] = {}
        self.peak_live = 0
        self.start(program)

    def start(self, program: Program | None) -> None:
        """A new program (a pipeline job) begins: nothing of the last one is live."""
        self.program = program
        self.dying = last_uses(program) if program is not None else {}
        self.live: dict[Value, torch.Tensor] = {}

    def after(self, i: int, op, env: dict[Value, Any], kept: list[torch.Tensor] = ()) -> None:
        """After op ``i``: its results are live, then the values it last used die.
        ``kept``: tensors held between jobs (a pipeline's carries and sums)."""
        kept_keys = {x.untyped_storage().data_ptr() for x in kept}
        for v in op.outputs:
            x = env.get(v)
            if not isinstance(x, torch.Tensor):
                continue
            key = x.untyped_storage().data_ptr()
            if op.kind is OpKind.STATE:
                if key not in self.state_storages:
                    self.state_storages.add(key)
                    self.state_spans.setdefault(key, []).append(_span(x))
                continue
            if op.kind is OpKind.INPUT and key not in kept_keys:   # a piece of a feed
                self.external.add(key)
            self.live[v] = x
        live = _storage_bytes(list(self.live.values()) + list(kept), self.state_storages,
                              self.external)
        self.peak_live = max(self.peak_live, live)
        for v in self.dying.get(i, ()):
            self.live.pop(v, None)

    @property
    def peak(self) -> int:
        return sum(_union(s) for s in self.state_spans.values()) + self.peak_live


class MemoryMeter:
    """An observer for ``simulate_step``: every process's peak bytes of live tensors."""

    def __init__(self, lowered: Lowered):
        self.by_coordinate = {made.coordinate: (p, _Process(made.program))
                              for p, made in lowered.processes.items()}

    def __call__(self, i: int, global_op, ops: dict, envs: dict, rng) -> None:
        for c, op in ops.items():
            self.by_coordinate[c][1].after(i, op, envs[c])

    def peaks(self) -> dict[int, int]:
        return {p: proc.peak for p, proc in self.by_coordinate.values()}


def measure_step(lowered: Lowered, feeds: dict[str, Any], state: dict[str, torch.Tensor]
                 ) -> dict[int, int]:
    """Each process's measured peak bytes over one step (the state is not changed)."""
    if lowered.pipeline is not None:
        raise ValueError("measure_step: a pipelined plan runs on the pipeline simulator, "
                         "whose peaks() reports the activations held between its jobs")
    meter = MemoryMeter(lowered)
    simulate_step(lowered, feeds, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in state.items()}, observe=meter)
    return meter.peaks()


class PipelineMeter:
    """The pipeline simulator's observer (``PipelineSimulator.meter``): every process's
    peak bytes of live tensors: its state pieces, what its store keeps between jobs, and
    the running job's live values."""

    def __init__(self, lowered: Lowered):
        self.process_of = {(made.pp, made.coordinate): p
                           for p, made in lowered.processes.items()}
        self.processes: dict[int, _Process] = {}

    def start(self, pp: int, coordinate: Coordinate, program: Program) -> None:
        p = self.process_of[(pp, coordinate)]
        self.processes.setdefault(p, _Process()).start(program)

    def after(self, pp: int, coordinate: Coordinate, i: int, op, env: dict, store) -> None:
        self.processes[self.process_of[(pp, coordinate)]].after(i, op, env, _kept(store))

    def peaks(self) -> dict[int, int]:
        return {p: proc.peak for p, proc in sorted(self.processes.items())}


def _kept(store) -> list[torch.Tensor]:
    """The tensors a pipeline process's store holds between jobs."""
    found = [x for x in store.values.values() if isinstance(x, torch.Tensor)]
    for term in store.terms.values():
        found += ([x for x in term.values() if isinstance(x, torch.Tensor)]
                  if isinstance(term, dict) else [term] if isinstance(term, torch.Tensor) else [])
    return found
