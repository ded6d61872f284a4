"""Plan-time memory estimate: what each lowered process holds, per category, and its peak.

Computed from a process's lowered program alone (local shapes and dtypes; nothing runs):

* state pieces (parameters, buffers, optimizer state, constants) are held for the whole
  step: the runtime's state dict keeps them, and the optimizer updates them in place;
* every other value is live from the op that produces it to its last use (the generated
  code ``del``s it there; results live to the end), and values that alias one buffer (views,
  the results of ops that write their inputs in place) hold it while any of them lives;
* gradients are the values the optimizer ops read as gradients (or ``grad`` results);
* communication buffers are the results of comm ops, and what a started collective holds
  until its wait (a gradient bucket's flat copy, a ZeRO-3 gather's buffer);
* a pipeline process's jobs: the activations held between jobs (carries of every
  micro-batch in flight, replayed over the process's job order) plus the job's own peak;
* offloaded state (``sharding.offload``), the host copies the step makes and the updates
  computed from them live in host memory: counted in ``host``, not in the device's peak.

The predicted peak is the largest, over the program's points (after each op, before its
dead inputs are freed), of state bytes plus live bytes. Kernels' internal scratch memory
is not counted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..ir import OpKind, Program, Value
from ..ir.attrs import NAME, ON_HOST, STATE, StateKind
from ..ir.dist import format_ranks
from ..ir.kernels.offload import before_copies
from ..ir.ops import op_info
from ..ir.printer import value_names
from ..pipeline.jobs import STEP
from ..reshard.steps import AllGather
from .comms import by_gather
from .executable import Lowered, PipelineProcess, RankProgram

__all__ = ["Holder", "MemoryEstimate", "estimate_memory", "estimate_process", "host_values",
           "MemoryLimitError", "check_memory_limit", "format_estimates", "STATE_CATEGORIES"]

_GIB = 1024 ** 3
# the category of each kind of state (any other: buffers); a gradient-merge accumulator is
# gradient memory held across steps, as eager's ``.grad``
STATE_CATEGORIES = {StateKind.PARAM: "params", StateKind.OPTIM: "optimizer_state",
                    StateKind.GRAD_MERGE: "grads"}


class MemoryLimitError(RuntimeError):
    """A plan whose predicted per-rank peak exceeds the strategy's ``memory_limit_gb``."""


@dataclass(frozen=True)
class Holder:
    """One value or state piece held at a process's peak."""

    what: str              # a state's name, or a value's dump name (%12) and its op
    module: str
    shape: tuple[int, ...]
    bytes: int


@dataclass
class MemoryEstimate:
    """What one process holds (bytes), by category, and its predicted peak."""

    process: int
    params: int = 0
    grads: int = 0                   # gradients the updates read, and merge accumulators
    optimizer_state: int = 0
    buffers: int = 0                 # module buffers and constants
    activations: int = 0             # peak of live values that are neither state nor grads
    comm_buffers: int = 0            # peak of live results of comm ops
    peak: int = 0                    # the device's
    host: int = 0                    # offloaded state and the step's host copies at their peak
    holders: list[Holder] = field(default_factory=list)    # biggest at the peak, largest first

    def cells(self, host: bool = False) -> str:
        """The table's row without the rank."""
        cells = [self.params, self.grads, self.optimizer_state, self.buffers,
                 self.activations, self.comm_buffers, self.peak] + ([self.host] if host else [])
        return " ".join(f"{_fmt(c):>10}" for c in cells)


def _fmt(n: int) -> str:
    for unit, size in (("GiB", _GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n}B"


def format_estimates(estimates: dict[int, MemoryEstimate]) -> str:
    """The per-rank table (``engine.cost``, the ``plan`` CLI, the ``memory`` dump): ranks
    with equal rows share one, named by their runs (``0-3,8-11``)."""
    host = any(e.host for e in estimates.values())     # a column only where offload is on
    rows: dict[str, list[int]] = {}
    for p in sorted(estimates):
        rows.setdefault(estimates[p].cells(host), []).append(p)
    labels = {cells: format_ranks(ranks) for cells, ranks in rows.items()}
    width = max([4] + [len(label) for label in labels.values()])
    head = (f"{'rank':>{width}} " + " ".join(f"{h:>10}" for h in (
        "params", "grads", "optim", "buffers", "activ", "comm", "peak")
        + (("host",) if host else ())))
    title = "memory per rank (predicted" + ("; the categories and peak: the device's)" if host
                                            else ")") + ":"
    return "\n".join([title, head] + [f"{labels[cells]:>{width}} {cells}" for cells in rows])


def value_bytes(v: Value) -> int:
    if not v.is_tensor:
        return 0
    n = 1
    for s in v.type.shape:
        n *= int(s)
    return n * _itemsize(v.type.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- buffers: which values share storage ----------------------------------------------------

def _aliases(program: Program) -> dict[Value, Value]:
    """Each tensor value's buffer root: a view's is its input's; an op that writes inputs in
    place returns the inputs it wrote (``_written``), whose buffers its results keep."""
    root: dict[Value, Value] = {}
    for op in program.ops:
        tensors = [v for v in op.inputs if v.is_tensor]
        info = op_info(op.target) if op.kind is OpKind.CALL else None
        if op.target == "autopar.host_ready":          # waits, and hands its inputs on
            root.update({v: root.get(a, a) for v, a in zip(op.outputs, op.args)})
        elif info is not None and info.view and tensors:
            for v in op.outputs:
                if v.is_tensor:
                    root[v] = root.get(tensors[0], tensors[0])
        elif info is not None and info.mutates:
            for v, written in zip(op.outputs, _written(op, info)):
                if v.is_tensor and written is not None and written.is_tensor:
                    root[v] = root.get(written, written)
    return root


# ``optimizer_updates``'s update ops: args (param, grad, hparams, *states), results
# (param, *states) -- the inputs they write, in order; the gradient is only read
_OPTIM_READ_ONLY = (1, 2)


def _written(op, info) -> list[Value | None]:
    """The input each result of mutating ``op`` is (None: a new buffer). Optimizer updates by
    their positional convention (a gradient or another state of the same shape must not be
    taken for the written one); aten ops by their schema's write aliases; other kernels
    (``autopar.*``, in place on a like input) by shape and dtype."""
    if op.target.startswith("optim."):
        return [v for i, v in enumerate(op.args) if i not in _OPTIM_READ_ONLY
                and isinstance(v, Value)]
    if info.schema is not None:
        return _schema_written(op, info.schema)
    free = [v for v in op.inputs if v.is_tensor]     # other kernels: the first input alike
    found: list[Value | None] = []
    for v in op.outputs:
        match = next((t for t in free if v.is_tensor and t.type.shape == v.type.shape
                      and t.type.dtype == v.type.dtype), None)
        if match is not None:
            free.remove(match)
        found.append(match)
    return found


def _schema_written(op, schema) -> list[Value | None]:
    """An aten op's results paired with the arguments whose alias set they share."""
    by_set: dict[str, Value] = {}
    for arg, value in zip(schema.arguments, op.args):
        alias = arg.alias_info
        if alias is not None and alias.is_write and isinstance(value, Value):
            for name in alias.before_set:
                by_set[name] = value
    found: list[Value | None] = []
    for ret in schema.returns:
        alias = ret.alias_info
        sets = list(alias.before_set) if alias is not None else []
        found.append(next((by_set[n] for n in sets if n in by_set), None))
    return found


def host_values(program: Program) -> set[Value]:
    """The values in host memory (``sharding.offload``): offloaded state, the host copies
    and what is computed from them (the updates), but not a copy back to the device."""
    host: set[Value] = set()
    for op in program.ops:
        if op.kind is OpKind.STATE and op.attrs.get(ON_HOST):
            host.update(op.outputs)
        elif op.kind is OpKind.CALL and op.target != "autopar.to_device" and (
                op.target in ("autopar.to_host", "autopar.host_ready")
                or any(v in host for v in op.inputs)):
            host.update(v for v in op.outputs if v.is_tensor)
    return host


def _is_state(v: Value) -> bool:
    return v.producer is not None and v.producer.kind is OpKind.STATE


def _buffer_bytes(program: Program) -> dict[Value, int]:
    """Bytes of every value that holds memory: tensors, and a started collective's handle
    (not a tensor in the IR), held from the start to its ``comm.wait``: its flat copy of the
    inputs, which the collective reads until the wait, and its output buffer (the size of
    the wait's results; a reduce-scatter's: the blocks every member sends this one, the
    input's size on gloo, where it travels as an all-to-all). A bucket's all-reduce is done
    in place, except a small one of activation gradients over a pair (``comms.by_gather``):
    an all-gather of both terms. The estimate counts gloo's forms (NCCL's are smaller)."""
    sizes = {v: value_bytes(v) for op in program.ops for v in op.outputs if v.is_tensor}
    for op in program.ops:
        if op.kind is OpKind.COMM and op.target == "comm.wait" and not op.args[0].is_tensor:
            start = op.args[0].producer
            flat = sum(value_bytes(v) for v in start.inputs)
            out = sum(value_bytes(v) for v in op.outputs)
            if start.target == "comm.reduce_scatter_start":
                out = flat
            if start.target == "comm.all_reduce_start":
                out = 2 * flat if by_gather(start) else 0   # else: in place
            sizes[op.args[0]] = flat + out
    return sizes


def _last_uses(program: Program, root: dict[Value, Value], sizes: dict[Value, int]
               ) -> dict[Value, int]:
    """Each buffer's last op (results: past the end)."""
    end = len(program.ops)
    last: dict[Value, int] = {}
    for i, op in enumerate(program.ops):
        for v in list(op.outputs) + list(op.inputs):
            if v in sizes:
                r = root.get(v, v)
                last[r] = end if op.kind is OpKind.OUTPUT else max(last.get(r, i), i)
        if op.target == "comm.wait" and not op.args[0].is_tensor and op.args[0] in sizes:
            last[op.args[0]] = i - 1     # a handle's buffer becomes its wait's results
    return last


def _grads(program: Program) -> set[Value]:
    found = {v for slot, v in program.results() if slot.kind == "grad" and v.is_tensor}
    for op in program.ops_of(OpKind.CALL):
        if op.target.startswith("optim.") and len(op.args) > 1 and isinstance(op.args[1], Value):
            found.add(before_copies(op.args[1]))     # the device's gradient, not its host copy
    return found


# -- one program ----------------------------------------------------------------------------

@dataclass
class _Liveness:
    state: dict[Value, int]                # state roots -> bytes (held throughout)
    peak_live: int                         # largest live non-state bytes at a point
    at_peak: dict[Value, int]              # the live buffers there, with their bytes
    grads_peak: int
    activations_peak: int
    comm_peak: int
    host_state: int = 0                    # offloaded state's bytes (not in ``state``)
    host_peak: int = 0                     # largest live bytes of host copies at a point


def _liveness(program: Program, extra: int = 0, carried: frozenset[str] = frozenset()
              ) -> _Liveness:
    """Liveness of one program over ``extra`` bytes held outside it; ``carried``: the
    inputs that are such held values (a pipeline job's carried-in activations)."""
    root = _aliases(program)
    sizes = _buffer_bytes(program)
    last = _last_uses(program, root, sizes)
    grads = {root.get(g, g) for g in _grads(program)}
    host = host_values(program)
    state = {op.result: value_bytes(op.result) for op in program.ops_of(OpKind.STATE)
             if op.result.is_tensor}
    host_state = {v: state.pop(v) for v in list(state) if v in host}
    outside = {op.result for op in program.ops_of(OpKind.INPUT) if op.attrs[NAME] in carried}
    live: dict[Value, int] = {}
    live_host: dict[Value, int] = {}
    comm: set[Value] = set()
    best = _Liveness(state, 0, {}, 0, 0, 0, sum(host_state.values()))
    dying: dict[int, list[Value]] = {}
    for r, i in last.items():
        dying.setdefault(i, []).append(r)
    for i, op in enumerate(program.ops):
        for v in op.outputs:
            r = root.get(v, v)
            if r in host:
                if v in sizes and r not in host_state:
                    live_host[r] = sizes[r]
            elif v in sizes and r not in state and r not in outside and r not in live:
                live[r] = sizes[r]
                if op.kind is OpKind.COMM:
                    comm.add(r)
        best.host_peak = max(best.host_peak, sum(live_host.values()))
        total = sum(live.values()) + extra
        g = sum(b for r, b in live.items() if r in grads)
        c = sum(b for r, b in live.items() if r in comm)
        best.grads_peak = max(best.grads_peak, g)
        best.comm_peak = max(best.comm_peak, c)
        best.activations_peak = max(best.activations_peak, total - extra - g - c)
        if total > best.peak_live:
            best.peak_live, best.at_peak = total, dict(live)
        for r in dying.get(i, ()):
            live.pop(r, None)
            live_host.pop(r, None)
    return best


def _categorize(est: MemoryEstimate, program: Program, live: _Liveness) -> None:
    for op in program.ops_of(OpKind.STATE):
        if op.result.is_tensor and op.result in live.state:       # the device's
            cat = STATE_CATEGORIES.get(op.attrs[STATE].kind, "buffers")
            setattr(est, cat, getattr(est, cat) + value_bytes(op.result))


def _holders(program: Program, live: _Liveness, limit: int = 8) -> list[Holder]:
    names = value_names(program)
    found = []
    for v, b in live.state.items():
        name = v.producer.attrs[NAME]
        found.append(Holder(name, v.producer.module or name.rpartition(".")[0],
                            tuple(v.type.shape), b))
    for v, b in live.at_peak.items():
        op = v.producer
        shape = tuple(v.type.shape) if v.is_tensor else ()
        held = "" if v.is_tensor else " (a started collective's buffers, until its wait)"
        found.append(Holder(f"{names.get(v, '?')} = {op.target}{held}", op.module, shape, b))
    found.sort(key=lambda h: -h.bytes)
    return found[:limit]


def estimate_process(made: RankProgram | PipelineProcess) -> MemoryEstimate:
    """One lowered process's estimate."""
    if isinstance(made, PipelineProcess):
        return _pipeline_estimate(made)
    est = MemoryEstimate(made.process)
    live = _liveness(made.program)
    _categorize(est, made.program, live)
    est.grads += sum(value_bytes(g) for g in _grads(made.program))
    est.activations, est.comm_buffers = live.activations_peak, live.comm_peak
    est.peak = sum(live.state.values()) + live.peak_live
    est.host = live.host_state + live.host_peak
    est.holders = _holders(made.program, live)
    return est


def _pipeline_estimate(made: PipelineProcess) -> MemoryEstimate:
    """A pipeline process: its held state, then its jobs in order, each running on top of
    what the process keeps between jobs (replaying ``RankStore``: carried activations of
    the micro-batches in flight until their last reader, sums over micro-batches)."""
    est = MemoryEstimate(made.process)
    rank = made.jobs
    values: dict[tuple[str, int], int] = {}       # kept between jobs: (key, mb) -> bytes
    terms: dict[str, int] = {}                    # sums over micro-batches being built
    states: dict[str, tuple[object, int]] = {}
    best, best_job = 0, None
    for job in made.order:
        program = made.programs[job].program
        _finish(rank, job.phase, values, terms)
        for op in program.ops_of(OpKind.STATE):
            if op.result.is_tensor:
                kind = "host" if op.attrs.get(ON_HOST) else op.attrs[STATE].kind
                states.setdefault(op.attrs[NAME], (kind, value_bytes(op.result)))
        held = sum(values.values()) + sum(terms.values())
        carried = frozenset(key for key, _ in rank.carried_in.get(job, ()))
        live = _liveness(program, held, carried)
        if live.peak_live > best:
            best, best_job = live.peak_live, (program, live)
        est.grads = max(est.grads, sum(value_bytes(g) for g in _grads(program)))
        est.comm_buffers = max(est.comm_buffers, live.comm_peak)
        est.activations = max(est.activations, live.activations_peak + held)
        est.host = max(est.host, live.host_peak)
        _absorb(rank, job, program, carried, values, terms)
    for kind, size in states.values():
        cat = "host" if kind == "host" else STATE_CATEGORIES.get(kind, "buffers")
        setattr(est, cat, getattr(est, cat) + size)
    est.peak = sum(size for kind, size in states.values() if kind != "host") + best
    if best_job is not None:
        est.holders = _holders(*best_job)
    return est


def _finish(rank, phase, values: dict, terms: dict) -> None:
    """Sums over micro-batches become values before their once-a-step reader."""
    for a in rank.accumulations:
        if a.before is phase and a.input_key in terms:
            values[(a.output_key, STEP)] = terms.pop(a.input_key)


def _absorb(rank, job, program: Program, carried: frozenset[str], values: dict,
            terms: dict) -> None:
    """What a job hands on is kept (a carried-in value handed on again shares its buffer);
    then the kept values it read last are freed."""
    root = _aliases(program)
    seen = {op.result for op in program.ops_of(OpKind.INPUT) if op.attrs[NAME] in carried}
    gathered = {a.input_key for a in rank.accumulations if isinstance(a.step, AllGather)}
    for slot, v in program.results():
        r = root.get(v, v)
        size = 0 if r in seen or _is_state(r) else value_bytes(r)
        seen.add(r)
        if slot.kind == "carry":
            values[(slot.name, job.micro_batch)] = size
        elif slot.kind == "accumulate":
            if slot.name not in terms or slot.name in gathered:
                terms[slot.name] = terms.get(slot.name, 0) + value_bytes(v)
    for pair in rank.frees.get(job, ()):
        values.pop(pair, None)


def estimate_memory(lowered: Lowered) -> dict[int, MemoryEstimate]:
    """Every process's estimate, by process id: each lowered process's own, and under
    ``lowered.classes`` every member's its class representative's."""
    made = {p: estimate_process(m) for p, m in sorted(lowered.processes.items())}
    return {p: made[m.process] if p == m.process else dataclasses.replace(made[m.process],
                                                                          process=p)
            for p, m in lowered.every_process().items()}


def check_memory_limit(estimates: dict[int, MemoryEstimate], limit_gb: float | None,
                       where: str) -> None:
    """Refuse a plan whose predicted peak exceeds ``limit_gb`` on some rank, naming the
    biggest holders there."""
    if limit_gb is None:
        return
    limit = int(limit_gb * _GIB)
    over = [e for e in estimates.values() if e.peak > limit]
    if not over:
        return
    worst = max(over, key=lambda e: e.peak)
    holders = "\n".join(f"  {h.what} ({h.module or 'top level'}) shape {list(h.shape)}: "
                        f"{_fmt(h.bytes)}" for h in worst.holders)
    raise MemoryLimitError(
        f"{where}: predicted peak memory {_fmt(worst.peak)} on rank {worst.process} exceeds "
        f"memory_limit_gb={limit_gb} ({len(over)} of {len(estimates)} ranks over); the "
        f"biggest holders there:\n{holders}\n{format_estimates(estimates)}")
