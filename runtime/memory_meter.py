"""The runtime's own account of what each process holds: bytes of live tensors as a step
runs, measured on the real tensors (to check the plan-time estimate, ``lower.memory_estimate``).

``measure_step`` runs one step of a lowered plan without a pipeline on the simulator (every
process, or the one process of a serial plan) with a ``MemoryMeter`` watching every op: it
drops each value after its last use in the process's program, as the generated code does,
and counts each live storage once (views and in-place results share their input's; a
started collective's handle counts the tensors it holds until its wait). State
tensors are counted for the whole step (the runtime's state dict holds them). Storages the
step did not allocate (a state piece or a feed cut from a full tensor) count only the bytes
their live tensors span. Optional and slow: for checking estimates (tests), never planning.

``RankMeter`` does the same on a real process: it stands in for that process's executor
(``ProgramExecutor`` or ``PipelineExecutor``) and runs the same lowered program op by op,
with the same collectives bound to the process's own groups (and, in a pipeline, the same
``RankStore`` and messages), dropping each value after its last use as the generated code
does; the state is the process's own pieces (``RankState``).

``AllocationMeter`` watches the compiled step itself (a ``TorchDispatchMode``): every storage
an aten call returns counts until its last tensor dies, so it also sees the temporaries
inside one IR op that the two meters above (and the estimate) do not.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..ir import OpKind, Program, Slot, Value
from ..ir.attrs import MULTI, NAME, STATE, StateKind
from ..lower.executable import Lowered, PipelineProcess
from ..lower.memory_estimate import STATE_CATEGORIES
from ..pipeline.phases import Phase
from .codegen import dying_after  # where generated code frees values
from .collectives import bind
from .executor import ProgramExecutor
from .job_store import RankStore, cut_feeds
from .pipeline_process import PipelineExecutor, logical_groups
from .process_groups import mesh_groups
from .seeding import eager_rng_states, forked_generator
from .simulator import call_op, simulate_step

__all__ = ["AllocationMeter", "MemoryMeter", "PipelineMeter", "RankMeter", "measure_step",
           "meter_step"]

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
        self.state_kinds: dict[int, StateKind | None] = {}
        self.grads: dict[Value, int] = {}
        self.peak_live = 0
        self.start(program)

    def start(self, program: Program | None) -> None:
        """A new program (a pipeline job) begins: nothing of the last one is live."""
        self.program = program
        self.dying = dying_after(program) if program is not None else {}
        self.live: dict[Value, torch.Tensor] = {}
        self.handles: dict[Value, list[torch.Tensor]] = {}    # a started collective's buffers

    def after(self, i: int, op, env: dict[Value, Any], kept: list[torch.Tensor] = ()) -> None:
        """After op ``i``: its results are live, then the values it last used die.
        ``kept``: tensors held between jobs (a pipeline's carries and sums)."""
        kept_keys = {x.untyped_storage().data_ptr() for x in kept}
        for v in op.outputs:
            x = env.get(v)
            if not isinstance(x, torch.Tensor):
                if op.kind is OpKind.COMM:
                    self.handles[v] = [t for t in pytree.tree_leaves(x)
                                       if isinstance(t, torch.Tensor)]
                continue
            key = x.untyped_storage().data_ptr()
            if op.kind is OpKind.STATE:
                if key not in self.state_storages:
                    self.state_storages.add(key)
                    self.state_spans.setdefault(key, []).append(_span(x))
                    self.state_kinds[key] = op.attrs[STATE].kind
                continue
            if op.kind is OpKind.INPUT and key not in kept_keys:   # a piece of a feed
                self.external.add(key)
            self.live[v] = x
        started = [t for tensors in self.handles.values() for t in tensors]
        live = _storage_bytes(list(self.live.values()) + started + list(kept),
                              self.state_storages, self.external)
        self.peak_live = max(self.peak_live, live)
        self._gradient(op, env)
        for v in self.dying.get(i, ()):
            self.live.pop(v, None)
            self.handles.pop(v, None)

    def _gradient(self, op, env: dict[Value, Any]) -> None:
        """An update op's gradient operand (its second: ``optimizer_updates``'s convention)."""
        if op.kind is not OpKind.CALL or not op.target.startswith("optim.") \
                or len(op.args) < 2 or not isinstance(op.args[1], Value):
            return
        x = env.get(op.args[1])
        if isinstance(x, torch.Tensor):       # by value: a dead gradient's address is reused
            self.grads[op.args[1]] = x.numel() * x.element_size()

    @property
    def peak(self) -> int:
        return sum(_union(s) for s in self.state_spans.values()) + self.peak_live

    def held(self) -> dict[str, int]:
        """Bytes of the state pieces by kind (params, optimizer_state, buffers) and of the
        gradients the update ops read with any gradient-merge accumulators (grads)."""
        out = {"params": 0, "grads": 0, "optimizer_state": 0, "buffers": 0}
        for key, spans in self.state_spans.items():
            out[STATE_CATEGORIES.get(self.state_kinds.get(key), "buffers")] += _union(spans)
        out["grads"] += sum(self.grads.values())
        return out


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

    def held(self) -> dict[int, dict[str, int]]:
        """Every process's state and gradient bytes by kind (``_Process.held``)."""
        return {p: proc.held() for p, proc in self.by_coordinate.values()}


def measure_step(lowered: Lowered, feeds: dict[str, Any], state: dict[str, torch.Tensor]
                 ) -> dict[int, int]:
    """Each process's measured peak bytes over one step (the state is not changed)."""
    return meter_step(lowered, feeds, state).peaks()


def meter_step(lowered: Lowered, feeds: dict[str, Any], state: dict[str, torch.Tensor]
               ) -> MemoryMeter:
    """One simulated step of every process under a ``MemoryMeter`` (the state is not
    changed); the meter has each process's peak and held state."""
    if lowered.pipeline is not None:
        raise ValueError("measure_step: a pipelined plan runs on the pipeline simulator, "
                         "whose peaks() reports the activations held between its jobs")
    meter = MemoryMeter(lowered)
    simulate_step(lowered, feeds, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in state.items()}, observe=meter)
    return meter


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


# -- a real process -------------------------------------------------------------------------

class RankMeter:
    """The executor interface over one real process's executor, counting that process's
    live tensor bytes: each ``run`` is the executor's step, run op by op (see the module
    docstring). ``peak`` is the largest over the metered steps. Slow: for checking the
    estimate (tests, ``bench/memory_estimate.py``), never for training."""

    def __init__(self, executor: ProgramExecutor | PipelineExecutor, lowered: Lowered):
        self.executor, self.lowered = executor, lowered
        self.process = _Process()

    @property
    def peak(self) -> int:
        return self.process.peak

    def held(self) -> dict[str, int]:
        return self.process.held()

    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        if isinstance(self.executor, PipelineExecutor):
            return self._run_pipeline(feeds, seed)
        return self._run_program(feeds, seed)

    def _run_program(self, feeds: dict[str, Any], seed: int | None) -> dict[Slot, Any]:
        """The executor's own ``run`` (feed cutting, seeding, write-back) around an op-by-op
        run of its program in place of the generated function."""
        ex, rank = self.executor, self.executor.rank
        groups = mesh_groups(self.lowered.mesh) if rank.comms else None
        comm = {rank.program.ops[i]: bind(spec, groups) for i, spec in rank.comms.items()}
        compiled = ex.fn
        ex.fn = lambda f, state: self._interpret(rank.program, comm, f, state)
        try:
            return ex.run(feeds, seed)
        finally:
            ex.fn = compiled

    def _run_pipeline(self, feeds: dict[str, Any], seed: int | None) -> dict[Slot, Any]:
        """``PipelineExecutor.run`` with each job run op by op; what the process's store
        keeps between jobs counts as live throughout. Mirrors ``PipelineExecutor._step``
        (keep the two alike): the store is local to a step there, and the meter needs it."""
        ex = self.executor
        process: PipelineProcess = ex.process
        # the groups of the full pipeline mesh, made by the executor on every process
        full = (mesh_groups(self.lowered.pipeline.full_mesh)
                if ex.transport is not None else None)
        with forked_generator(None), torch.no_grad():
            rng = (eager_rng_states(process.random_ops, seed)
                   if process.random_ops and seed is not None else {})
            bases = [{**cut_feeds(feeds, s), **rng} for s in process.micro_batch_inputs]
            store = RankStore(process.jobs, ex.micro_batches)
            if ex.transport is not None:
                ex.transport.start_step()
                ex.transport.prefetch()
            results: dict[Slot, Any] = {}
            for job in process.order:
                if job.phase in (Phase.PRE, Phase.POST):
                    store.finish(job.phase)
                made = process.programs[job]
                groups = None if full is None else logical_groups(
                    full, self.lowered.mesh, process.coordinate, max(job.micro_batch, 0))
                values = self._interpret(made.program, ex._bind(made, groups),
                                         store.feeds(job, bases[max(job.micro_batch, 0)]),
                                         ex.state, lambda: _kept(store))
                rest = store.absorb(job, ex.slots[job], values)
                del values
                if ex.transport is not None:
                    ex.transport.prefetch()
                if job.phase is Phase.POST:
                    results = rest
            if ex.transport is not None:
                ex.transport.finish()
        for slot, value in results.items():
            if slot.kind == "update":
                ex.state[slot.name] = value
        return {s: v for s, v in results.items() if s.kind != "update"}

    def _interpret(self, program: Program, comm: dict, feeds: dict[str, Any],
                   state: dict[str, Any], kept=lambda: ()) -> tuple:
        """One program op by op, as its generated code runs it: values dropped after their
        last use; the meter counts after every op."""
        self.process.start(program)
        env: dict[Value, Any] = {}
        for i, op in enumerate(program.ops):
            if op.kind is OpKind.OUTPUT:
                return tuple(env[v] for v in op.args)
            if op.kind is OpKind.INPUT:
                outs = [feeds[op.attrs[NAME]]]
            elif op.kind is OpKind.STATE:
                outs = [state[op.attrs[NAME]]]
            elif op.kind is OpKind.COMM:
                outs = _outputs(op, comm[op](*(env[v] for v in op.args)))
            else:
                outs = call_op(op, env)
            env.update(zip(op.outputs, outs))
            self.process.after(i, op, env, kept())
            for v in self.process.dying.get(i, ()):
                env.pop(v, None)
        raise ValueError("RankMeter: the program has no output op")


def _outputs(op, out: Any) -> list[Any]:
    """A comm call's results as the generated code unpacks them."""
    if not op.outputs:
        return []
    if len(op.outputs) == 1 and not op.attrs.get(MULTI):
        return [out]
    return list(out)


# -- every allocation of the compiled step ----------------------------------------------------

class AllocationMeter(TorchDispatchMode):
    """Live bytes of every tensor storage the ops allocate while it is active, sampled after
    every aten call (a context manager around a step of the real, compiled executor). A
    storage counts from the op that returns it until its last tensor dies (CPython frees a
    value when the generated code ``del``s it), so unlike ``RankMeter`` it also sees what
    runs inside an IR op: a composite's temporaries (torch's functional AdamW, a
    collective's padded or flattened buffers). Storages that exist before (``held``: the
    state pieces, the feeds) are not counted; ``peak`` adds ``held``'s bytes back.
    Kernels' scratch memory that never becomes a tensor is not seen."""

    def __init__(self, held: Iterable[Any] = ()):
        super().__init__()
        tensors = [t for t in held if isinstance(t, torch.Tensor)]
        self.known = {t.untyped_storage().data_ptr() for t in tensors}
        spans: dict[int, list[tuple[int, int]]] = {}
        for t in tensors:
            spans.setdefault(t.untyped_storage().data_ptr(), []).append(_span(t))
        self.held_bytes = sum(_union(s) for s in spans.values())
        self.storages: dict[int, list[int]] = {}       # key -> [bytes, live tensors]
        self.live = self.peak_live = 0

    @property
    def peak(self) -> int:
        return self.held_bytes + self.peak_live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak_live = max(self.peak_live, self.live)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.known or storage.nbytes() == 0:
            return
        entry = self.storages.get(key)
        if entry is None:
            entry = self.storages[key] = [storage.nbytes(), 0]
            self.live += entry[0]
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[key]
