"""Predicted step time of a lowered plan, from a machine profile (``cost.profile``).

Every process's local program is walked once, in program order, with a clock:

* a computation costs its own measured curve where the profile has one
  (``Profile.op_curves``: gelu, layer norm, softmax, SDPA, AdamW per parameter, ... over
  ``op_size``), else its class's (``matmul`` by FLOPs for the op classes in ``MATMUL``,
  ``pointwise`` by bytes read + written for the rest, a few ops several kernels:
  ``KERNELS``); a view (``VIEWS``) moves nothing and costs the profile's ``view_s``; plus
  ``op_overhead_s``, the executor's own cost of running an op — every CALL and COMM op of
  the program is one;
* a collective costs the profile's alpha-beta fit of its kind and group size at the bytes a
  rank sends (``reshard.traffic.reshard_bytes``' ring formulas, on the padded pieces the
  runtime moves); a shift (``Shift``, a ring pass that keeps its placement) sends its whole
  piece, on the ``all_to_all`` fit (``_shift_cost``).

Overlap, as ``runtime.collectives`` runs them: a plain reshard step (``comm.all_reduce``,
...) is synchronous: the process waits for it. A started one (a gradient bucket's
all-reduce, a ZeRO unit's all-gather or reduce-scatter: ``BucketStart``, ``GatherStart``,
``ScatterStart``) runs on c10d's thread while the program goes on, and only its ``wait``
blocks. Collectives over the same mesh dim run one after another (one process group, one
queue), so the clock keeps, per mesh dim, when its queue frees up. *Exposed* communication
is the time the clock spends waiting on collectives; the rest is compute.

Pipelines: each pp position's job durations (the slowest process of its stage mesh, which
collectives keep in step) are played out on the schedule's job order with a cross-rank
latency of the largest message's ``send_recv`` time, on cores the processes share
(``pipeline.timeline.play`` with ``CoreSharing``: a job runs faster while other ranks wait, as in
the bubble). A rank's
once-a-step ``pre_mb``/``pre`` jobs are added to its first schedule job (they run before
it; on a rank whose first job waits for a message this counts them even when they would
hide in the wait) and its ``post`` job after its last one.

Processes sharing cores: the profile's compute was measured by one process alone. A plan
of P processes has its compute (the curves and the executor's overhead) scaled by
``contention``: the profile's measured ``slowdown`` of P processes computing at once
(``Profile.contention``; on 2 cores, 2 processes run about as fast as one, 4 about half
as fast). A profile without it (hand-made ones in tests) falls back to the ratio of
``max(1, P x threads / cpus)`` to the profile's own. Ops are timed on their dtype's curve
(``op_dtype``; half precision has its own curves, fp32's for dtypes not measured).
Collectives are not scaled: they were measured with all the launch's processes running,
and over loopback gloo they are latency-bound. The planner asks about one machine, the
one calibrated.

The pipeline runtime's own work, as ``calibrate/pipeline_probe.py`` measured it with all the
calibration's processes exchanging messages (so not scaled by ``contention``): every
schedule job's send of a message costs the job ``Profile.p2p_send`` at the message's
bytes, and every job the transport's prefetch after it, ``pipeline_job_s``. Both are
counted as communication, not compute.

What is not modelled: copies a ``reshape`` makes of a non-contiguous input (counted as a
view), the random-state bookkeeping of dropout, the cost of a receive's own call, and the
pipeline runtime's store between jobs beyond the accumulations' adds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..ir import Op, OpKind, Program
from ..ir.core import TensorType
from ..ir.dist import ProcessMesh, format_ranks
from ..lower.executable import (
    BucketStart,
    BucketWait,
    Comm,
    GatherStart,
    GatherWait,
    Lowered,
    PipelineProcess,
    RankProgram,
    Recv,
    ScatterStart,
    ScatterWait,
    Send,
    StepComm,
)
from ..pipeline.flops import FLOPS
from ..pipeline.jobs import JobId
from ..pipeline.phases import Phase
from ..pipeline.schedules import Job
from ..pipeline.timeline import CoreSharing, play
from ..reshard.steps import AllGather, AllReduce, ReduceScatter, Shift
from ..reshard.traffic import reshard_bytes
from .profile import Profile

__all__ = ["ProcessTime", "StepTime", "predict_step", "op_seconds", "comm_seconds", "contention",
           "MATMUL", "VIEWS", "KERNELS", "OPTIMIZERS", "format_step_time", "op_dtype",
           "op_size"]


# --------------------------------------------------------------------------------------
# op classes: one registry, one line per op
# --------------------------------------------------------------------------------------
def _linear(op: Op) -> float:
    """aten.linear(x, w[, b]): x is [..., k], w is [n, k]."""
    x, w = _tensor_shapes(op)[:2]
    return 2.0 * math.prod(x[:-1]) * x[-1] * w[0]


def _matmul(op: Op) -> float:
    """aten.matmul: batched [..., m, k] @ [..., k, n] (1-D operands as torch promotes them)."""
    a, b = (list(s) for s in _tensor_shapes(op)[:2])
    a, b = ([1] + a if len(a) == 1 else a), (b + [1] if len(b) == 1 else b)
    batch = max(math.prod(a[:-2]), math.prod(b[:-2]))
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


# FLOP rules of matmul-class ops: pipeline/flops.py's (mm, addmm, bmm, baddbmm, SDPA and its
# backward) and the ones it lacks. Everything here is timed on the profile's matmul curve.
MATMUL: dict[str, Callable[[Op], float]] = {
    **FLOPS,
    "aten.linear.default": _linear,
    "aten.matmul.default": _matmul,
}

# Ops that make a view or a list of views: no data moves, only the executor's overhead.
VIEWS: frozenset[str] = frozenset({
    "aten.reshape.default", "aten.view.default", "aten._unsafe_view.default", "aten.t.default",
    "aten.transpose.int", "aten.permute.default", "aten.expand.default",
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
    "aten.select.int", "aten.slice.Tensor", "aten.alias.default", "aten.detach.default",
    "aten.as_strided.default", "autopar.annotate",
})


def _adam_kernels(op: Op) -> list[float]:
    """torch.optim's single-tensor Adam(W) on CPU (the executor's ``optim.adam``), per
    parameter of n bytes: decoupled weight decay (param, 2n), lerp of exp_avg (3n),
    exp_avg_sq mul and addcmul (2n + 4n), denominator sqrt, div, add (3 x 2n), addcdiv of
    the parameter (4n)."""
    n = _nbytes(op.args[0].type)
    return [2 * n, 3 * n, 2 * n, 4 * n, 2 * n, 2 * n, 2 * n, 4 * n]


def _sgd_kernels(op: Op) -> list[float]:
    """torch.optim's single-tensor SGD: with a momentum buffer, buf.mul_().add_(grad) then
    param.add_(buf); without, param.add_(grad)."""
    n = _nbytes(op.args[0].type)
    has_buffer = len(op.args) > 3 and getattr(op.args[3], "is_tensor", False)
    return [2 * n, 3 * n, 3 * n] if has_buffer else [3 * n]


def _embedding_kernels(op: Op) -> list[float]:
    """A lookup reads the rows it copies (not the whole table): indices + 2 x output."""
    out = sum(_nbytes(v.type) for v in op.outputs if v.is_tensor)
    indices = _nbytes(_tensors(op)[1].type)
    return [indices + 2 * out]


# Ops that run several memory-bound kernels (bytes read + written of each), or whose bytes
# are not simply everything they read and write.
KERNELS: dict[str, Callable[[Op], list[float]]] = {
    "optim.adam": _adam_kernels,
    "optim.sgd": _sgd_kernels,
    "aten.embedding.default": _embedding_kernels,
}


def _tensors(op: Op) -> list:
    return [v for v in op.inputs if v.is_tensor]


def _tensor_shapes(op: Op) -> list[tuple[int, ...]]:
    return [tuple(v.type.shape) for v in _tensors(op)]


def _nbytes(t) -> float:
    return float(t.numel * t.dtype.itemsize) if isinstance(t, TensorType) else 0.0


def _moved_bytes(op: Op) -> float:
    """Bytes a memory-bound op reads and writes: every tensor in, every tensor out."""
    return (sum(_nbytes(v.type) for v in _tensors(op))
            + sum(_nbytes(v.type) for v in op.outputs if v.is_tensor))


# Ops whose size measure is the bytes of the parameter they update (their first input).
OPTIMIZERS: frozenset[str] = frozenset({"optim.adam", "optim.sgd"})


def op_size(op: Op) -> float:
    """The size an op's curve is over: FLOPs of a matmul-class op (``MATMUL``), the
    parameter's bytes of an optimizer update, bytes read + written otherwise. Calibration
    measures the profile's per-op curves over this very function (``calibrate/op_probes.py``)."""
    rule = MATMUL.get(op.target)
    if rule is not None:
        return rule(op)
    if op.target in OPTIMIZERS:
        return _nbytes(op.args[0].type)
    return _moved_bytes(op)


def op_seconds(op: Op, profile: Profile) -> float:
    """Compute time of one CALL op (local shapes), without the executor's overhead: the
    op's own measured curve where the profile has one (``Profile.op_curves``), else its
    class's (matmul by FLOPs, pointwise by bytes, ``KERNELS`` for a few multi-kernel ops);
    a view costs the profile's ``view_s``."""
    if op.target in VIEWS:
        return profile.view_s
    dtype = op_dtype(op)
    own = profile.op_curve(op.target, dtype)
    if own is not None:
        return own.seconds(op_size(op))
    rule = MATMUL.get(op.target)
    if rule is not None:
        return profile.matmul_curve(dtype).seconds(rule(op))
    kernels = KERNELS.get(op.target)
    sizes = kernels(op) if kernels is not None else [_moved_bytes(op)]
    curve = profile.pointwise_curve(dtype)
    return sum(curve.seconds(b) for b in sizes if b > 0)


def op_dtype(op: Op) -> str:
    """The dtype name an op computes in: its first tensor input's ("float32" if none)."""
    first = next((v for v in op.inputs if v.is_tensor), None)
    if first is None or not isinstance(first.type, TensorType):
        return "float32"
    return str(first.type.dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------
# communication
# --------------------------------------------------------------------------------------
def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _itemsize(op: Op) -> int:
    first = next((v for v in op.inputs if v.is_tensor), None)
    return first.type.dtype.itemsize if first is not None else 4


@dataclass(frozen=True)
class CommCost:
    """What one comm op costs: ``seconds`` of a collective on ``mesh_dim``'s queue
    (``started``: asynchronous, a later wait ends it), or ``local`` seconds of compute
    (a slice, a partial's zeros)."""
    seconds: float = 0.0
    mesh_dim: int | None = None
    started: bool = False
    local: float = 0.0


def _across(profile: Profile, mesh: ProcessMesh | None, dim: int) -> bool:
    """Whether mesh dim ``dim``'s groups span machines (``Profile.devices_per_node``)."""
    return (mesh is not None and 0 <= dim < mesh.ndim
            and profile.crosses_node(mesh.tolist(), dim))


def _step_cost(spec: StepComm, op: Op, profile: Profile, mesh: ProcessMesh | None = None
               ) -> CommCost:
    step, n = spec.step, len(spec.member_shapes)
    piece = max(_numel(s) for s in spec.member_shapes) * _itemsize(op)
    if isinstance(step, Shift):
        return _shift_cost(step, n, piece, profile, _across(profile, mesh, step.mesh_dim))
    if step.kind in ("slice", "make_partial"):
        out = sum(_nbytes(v.type) for v in op.outputs if v.is_tensor)
        return CommCost(local=profile.pointwise.seconds(out + (piece if step.kind == "slice"
                                                               else 0)))
    # a partial's members hold the whole parent piece; shards are padded to the largest
    full = piece if step.kind in ("all_reduce", "reduce_scatter") else n * piece
    nbytes = reshard_bytes(step.src, step.dst, full, n)
    return CommCost(profile.collective_seconds(step.kind, n, nbytes,
                                               _across(profile, mesh, step.mesh_dim)),
                    step.mesh_dim)


def _shift_cost(step: Shift, n: int, piece: float, profile: Profile, across: bool
                ) -> CommCost:
    """A shift's placement does not change, so ``reshard_bytes`` would price it at nothing:
    every rank sends its whole piece to one member and receives one. Priced on the
    ``all_to_all`` fit of the group size: the runtime runs it as one ``all_to_all_single``
    (``runtime.collectives._shift``), the very call that fit measured, whose latency over
    gloo grows with the members (it exchanges the empty blocks too). The ``send_recv`` fit
    times a plain isend/irecv between a pair only: it prices a shift over 4 gloo processes
    well under its time (64 KiB on 2 cores: 1.2 ms, an isend/irecv exchange 0.5 ms). A
    whole turn (k = 0 mod n) is a local copy."""
    if step.shift % n == 0:
        return CommCost(local=profile.pointwise.seconds(2 * piece))
    return CommCost(profile.collective_seconds("all_to_all", n, piece, across), step.mesh_dim)


def _unit_bytes(member_shapes: tuple[tuple[tuple[int, ...], ...], ...], itemsize: int
                ) -> tuple[int, float]:
    """(group size, the padded flat buffer of all members) of a ZeRO unit's collective."""
    n = len(member_shapes[0])
    width = max(sum(_numel(shapes[j]) for shapes in member_shapes) for j in range(n))
    return n, float(n * width * itemsize)


def comm_seconds(spec: Comm, op: Op, profile: Profile, mesh: ProcessMesh | None) -> CommCost:
    """The cost of comm op ``op`` of a local program whose comm spec is ``spec``."""
    if isinstance(spec, StepComm):
        return _step_cost(spec, op, profile, mesh)
    if isinstance(spec, BucketStart):
        dim = spec.steps[0].mesh_dim
        n = mesh.shape[dim] if mesh is not None else 1
        total = sum(_numel(s) for s in spec.shapes) * _itemsize(op)
        nbytes = reshard_bytes(AllReduce(dim).src, AllReduce(dim).dst, total, n)
        return CommCost(profile.collective_seconds("all_reduce", n, nbytes,
                                                   _across(profile, mesh, dim)), dim, True)
    if isinstance(spec, (GatherStart, ScatterStart)):
        step = spec.steps[0]
        n, full = _unit_bytes(spec.member_shapes, _itemsize(op))
        kind = "all_gather" if isinstance(spec, GatherStart) else "reduce_scatter"
        model = (AllGather(step.mesh_dim) if kind == "all_gather"
                 else ReduceScatter(step.mesh_dim))
        nbytes = reshard_bytes(model.src, model.dst, full, n)
        return CommCost(profile.collective_seconds(kind, n, nbytes,
                                                   _across(profile, mesh, step.mesh_dim)),
                        step.mesh_dim, True)
    if isinstance(spec, (BucketWait, GatherWait, ScatterWait)):
        return CommCost()
    if isinstance(spec, (Send, Recv)):
        return CommCost(profile.collective_seconds("send_recv", 2, message_bytes(spec, op)),
                        mesh_dim=-1)
    raise TypeError(f"{op.target}: no cost for comm spec {type(spec).__name__}")


def message_bytes(spec: Send | Recv, op: Op) -> float:
    """Bytes of one pipeline message (the tensor sent or received)."""
    if isinstance(spec, Recv):
        return float(_numel(spec.shape) * spec.dtype.itemsize)
    return sum(_nbytes(v.type) for v in _tensors(op))


# --------------------------------------------------------------------------------------
# one program on a clock
# --------------------------------------------------------------------------------------
@dataclass
class _Clock:
    scale: float = 1.0               # compute's contention factor (collectives: none)
    now: float = 0.0
    compute: float = 0.0
    ops: int = 0
    queues: dict[int, float] = field(default_factory=dict)   # mesh dim -> free from
    started: dict[Op, float] = field(default_factory=dict)   # start op -> its end

    def run(self, seconds: float) -> None:
        seconds *= self.scale
        self.now += seconds
        self.compute += seconds

    def collective(self, cost: CommCost, op: Op) -> None:
        begin = max(self.now, self.queues.get(cost.mesh_dim, 0.0))
        end = self.queues[cost.mesh_dim] = begin + cost.seconds
        if cost.started:
            self.started[op] = end
        else:
            self.now = end

    def wait(self, op: Op) -> None:
        start = op.args[0].producer
        self.now = max(self.now, self.started.pop(start, self.now))


def _walk(program: Program, comms: dict[int, Comm], profile: Profile,
          mesh: ProcessMesh | None, messages_free: bool, scale: float) -> _Clock:
    """Play one local program: compute (times ``scale``) on the clock, collectives on their
    queues. ``messages_free``: pipeline messages of schedule jobs are the timeline's
    latency."""
    clock = _Clock(scale)
    for i, op in enumerate(program.ops):
        if op.kind not in (OpKind.CALL, OpKind.COMM):
            continue
        clock.ops += 1
        clock.run(profile.op_overhead_s)
        spec = comms.get(i)
        if spec is None:
            clock.run(op_seconds(op, profile) if op.kind is OpKind.CALL else
                      profile.pointwise.seconds(_moved_bytes(op)))
            continue
        if isinstance(spec, (BucketWait, GatherWait, ScatterWait)):
            clock.wait(op)
            continue
        if messages_free and isinstance(spec, (Send, Recv)):
            # the message's travel is the timeline's latency; posting a send is this job's
            if isinstance(spec, Send) and profile.p2p_send is not None:
                clock.now += profile.p2p_send.seconds(message_bytes(spec, op))
            continue
        cost = comm_seconds(spec, op, profile, mesh)
        clock.run(cost.local)
        if cost.seconds > 0:
            clock.collective(cost, op)
    for end in clock.started.values():        # a start never waited for ends the step
        clock.now = max(clock.now, end)
    return clock


def _accumulate_seconds(program: Program, profile: Profile) -> float:
    """The runtime's sum over micro-batches of what a job exports to an accumulator: one
    add (read both, write one) per exported term."""
    return sum(profile.pointwise.seconds(3 * _nbytes(v.type))
               for slot, v in program.results() if slot.kind == "accumulate")


# --------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessTime:
    """One process's predicted step: ``compute_s`` (ops' own time and the executor's
    overhead), ``comm_s`` (exposed communication: time waiting on collectives and, outside
    the schedule's jobs, pipeline messages), ``ops`` run, and ``finish_s``, when its step
    ends (pipelines: after the schedule's waits for other ranks, ``idle_s`` of them)."""
    compute_s: float
    comm_s: float
    ops: int
    finish_s: float

    @property
    def idle_s(self) -> float:
        return max(0.0, self.finish_s - self.compute_s - self.comm_s)



@dataclass(frozen=True)
class StepTime:
    """A plan's predicted step: per process, and the step's seconds (the slowest process:
    every step ends in collectives or messages that wait for it). ``contention``: the
    factor compute was scaled by for the plan's process count (module docstring)."""
    processes: dict[int, ProcessTime]
    step_s: float
    bubble: float | None = None        # pipelines: the timeline's idle fraction
    contention: float = 1.0

    def __getitem__(self, process: int) -> ProcessTime:
        return self.processes[process]


def profile_cpus(profile: Profile) -> int | None:
    """The cores the profile's machine had (``calibrate`` writes ``N cpus`` into
    ``machine``); None when it does not say."""
    found = re.search(r"(\d+) cpus", profile.machine)
    return int(found.group(1)) if found else None


def contention(processes: int, profile: Profile) -> float:
    """How much slower each process of a ``processes``-process plan runs than the profile's
    measurement did, from the cores they time-share (1 when the profile names no core
    count): a launch over several machines (``devices_per_node``) shares each machine's
    cores among its own processes only."""
    if profile.devices_per_node:
        processes = min(processes, profile.devices_per_node)
    if profile.slowdown:
        return profile.contention(processes)
    cpus = profile_cpus(profile)
    if cpus is None:
        return 1.0

    def sharing(n: int) -> float:
        return max(1.0, n * profile.threads / cpus)
    return sharing(processes) / sharing(profile.processes)


def predict_step(lowered: Lowered, profile: Profile) -> StepTime:
    """The predicted time of one step of ``lowered`` (every process lowered, or one per
    class of identical ranks: ``Lowered.classes``) on the machine ``profile`` measured."""
    every = lowered.every_process()
    scale = contention(len(every), profile)
    if lowered.pipeline is not None:
        return _predict_pipeline(lowered, every, profile, scale)
    return _predict_programs(lowered, every, profile, scale)


def _predict_programs(lowered: Lowered, every: dict, profile: Profile, scale: float
                      ) -> StepTime:
    walked: dict[int, ProcessTime] = {}         # by the lowered process: once per class
    for process, made in every.items():
        if not isinstance(made, RankProgram):
            raise TypeError(f"process {process}: a pipeline process in a plan without a "
                            "pipeline")
        if made.process not in walked:
            clock = _walk(made.program, made.comms, profile, lowered.mesh, False, scale)
            walked[made.process] = ProcessTime(clock.compute, clock.now - clock.compute,
                                               clock.ops, clock.now)
    times = {process: walked[made.process] for process, made in every.items()}
    return StepTime(times, max(t.finish_s for t in times.values()), None, scale)


def _predict_pipeline(lowered: Lowered, every: dict, profile: Profile, scale: float
                      ) -> StepTime:
    schedule = lowered.schedule
    if schedule is None:
        raise ValueError("a pipelined plan without its schedule: lower it with the schedule")
    clocks: dict[int, dict[JobId, _Clock]] = {}       # by the lowered process
    latency = 0.0
    for process, made in lowered.processes.items():
        if not isinstance(made, PipelineProcess):
            raise TypeError(f"process {process}: not a pipeline process in a pipelined plan")
        clocks[process] = {}
        for job in made.order:
            jp = made.programs[job]
            in_schedule = job.phase in (Phase.F, Phase.B, Phase.W)
            clock = _walk(jp.program, jp.comms, profile, lowered.mesh, in_schedule, scale)
            clock.run(_accumulate_seconds(jp.program, profile))
            clock.now += profile.pipeline_job_s    # the runtime's work after every job
            clocks[process][job] = clock
            if in_schedule:
                latency = max([latency] + [
                    profile.collective_seconds("send_recv", 2, message_bytes(spec, op))
                    for i, spec in jp.comms.items() if isinstance(spec, (Send, Recv))
                    for op in (jp.program.ops[i],)])
    # a pp position's job lasts as long as its slowest process
    duration: dict[tuple[int, JobId], float] = {}
    for process, jobs in clocks.items():
        pp = lowered.processes[process].pp
        for job, clock in jobs.items():
            duration[pp, job] = max(duration.get((pp, job), 0.0), clock.now)

    def before(pp: int) -> float:
        return sum(d for (p, job), d in duration.items()
                   if p == pp and job.phase in (Phase.PRE_MB, Phase.PRE))

    firsts = {jobs[0]: pp for pp, jobs in enumerate(schedule.jobs) if jobs}

    def cost(job: Job) -> float:
        pp = job.rank(len(schedule.jobs))
        extra = before(pp) if firsts.get(job) == pp else 0.0
        return duration[pp, JobId(Phase(job.kind), job.stage, job.micro_batch)] + extra

    ranks = len(schedule.jobs)
    per_pp = [0] * ranks
    for made in every.values():
        per_pp[made.pp] += 1
    tail = [duration.get((pp, JobId(Phase.POST)), 0.0)
            + (before(pp) if not schedule.jobs[pp] else 0.0) for pp in range(ranks)]
    sharing = CoreSharing(tuple(per_pp), lambda n: contention(n, profile))
    timeline = play(schedule.jobs, cost, latency, sharing, tail)
    walked = {}
    for process, jobs in clocks.items():
        finish = timeline.finish[lowered.processes[process].pp]
        compute = sum(c.compute for c in jobs.values())
        comm = sum(c.now - c.compute for c in jobs.values())
        walked[process] = ProcessTime(compute, comm, sum(c.ops for c in jobs.values()), finish)
    times = {process: walked[made.process] for process, made in every.items()}
    return StepTime(times, max(t.finish_s for t in times.values()), timeline.bubble(),
                    scale)


def format_step_time(step: StepTime) -> str:
    """A table: one row per process, then the step."""
    lines = ["predicted step time (per process: compute, exposed communication, idle, ops)"]
    rows: dict[str, list[int]] = {}           # ranks with equal rows share one
    for process, t in sorted(step.processes.items()):
        rows.setdefault(f"compute {t.compute_s * 1e3:9.3f} ms  comm {t.comm_s * 1e3:9.3f} ms  "
                        f"idle {t.idle_s * 1e3:9.3f} ms  {t.ops:6d} ops", []).append(process)
    labels = {row: format_ranks(ranks) for row, ranks in rows.items()}
    width = max([3] + [len(label) for label in labels.values()])
    lines += [f"  rank {labels[row]:>{width}}  {row}" for row in rows]
    bubble = f" (pipeline bubble {100 * step.bubble:.1f}%)" if step.bubble is not None else ""
    shared = (f" (compute x{step.contention:.2f} for the cores the processes share)"
              if step.contention != 1.0 else "")
    lines.append(f"  step {step.step_s * 1e3:.3f} ms{bubble}{shared}")
    return "\n".join(lines)
