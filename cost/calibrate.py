"""``python -m autopar calibrate``: measure this machine's profile (cost/profile.py).

Compute is measured by process 0 alone, the other processes idle at a barrier (a gloo
barrier sleeps, it does not spin): one process's curves, with the machine's cores as they
are. How much slower P processes computing at once run (``slowdown``, P = 1..processes)
is measured apart, on a few probes timed over long windows (0.1 s: with 10 ms ones the
scheduler's sharing was erratic) with P processes computing together; the predictor
scales a plan's compute by it (``Profile.contention``).

* compute: ``aten.mm`` over FLOPs (square and activation-by-weight shapes; fp32, fp16,
  bf16) and memory-bound ``aten.add``/``mul``/``gelu`` over bytes read + written, through
  the very callables the generated code calls (``ir.ops.resolve``); and the ops the class
  curves get badly wrong, each its own curve (``cost/op_probes.py``: gelu, layer norm,
  softmax, SDPA and their backwards, AdamW per parameter) and one view op's cost. A sample
  is back-to-back calls for a window of ``batch_s``; the rounds sweep all sizes
  (``sweep``), so a burst of other load spoils one sample of many points rather than
  every sample of one. A point is the median over rounds.
* executor overhead: a generated program (``runtime.codegen.generate``, as every step runs)
  of many tiny adds, per op, minus the same add called directly: what autopar adds per op
  on top of the aten call the curves already include.
* collectives: the runtime's own collectives (``runtime.collectives.bind_step``: the clone,
  padding and ordering they do included) on the groups ``runtime.process_groups`` makes for
  a mesh dim of each group size the launch allows, all groups at once, from ~1 KB to ~16 MB;
  broadcast and send/recv (a ping-pong between pairs, as pipeline messages travel) with
  c10d directly. A sample is a short compute (ten 128^3 matmuls) and then one call, behind
  a barrier, and the point is what the call adds to that compute: what a step pays for a
  collective is more than the call's own time (on 2 cores, 2 gloo ranks, a 4 KB
  all-reduce: 0.5 ms timed alone, back to back or behind a barrier; 1.2 ms timed right
  after compute; 3.4 ms added to a compute loop: waking, skew, gloo's threads). alpha and
  beta are a least-squares line through the median times over the bytes one rank sends
  (``reshard.traffic.reshard_bytes``; broadcast and send/recv: the tensor's bytes), weighted
  by 1/time so small messages count as much as big ones.
* the pipeline runtime: a small 1F1B exchange among all the processes through the runtime's
  ``P2PTransport`` (``cost/pipeline_probe.py``): the mean send call over the message's
  bytes and the prefetch after every job, as a pipelined step pays them.

Everything is measured on the device the launch trains on, picked as the engine picks it
(``runtime.process_groups.resolve_device``: ``auto`` is ``cuda:LOCAL_RANK`` where CUDA
exists; ``$AUTOPAR_CALIBRATE_DEVICE`` = ``auto | cpu | cuda`` overrides), with the backend
the engine would use (gloo or NCCL). On CUDA a sample is timed with CUDA events (``_Timer``:
a call returns at launch, the host clock would time launches); on the CPU with the host
clock. On a launch over several nodes each group size's fit is labelled intra-node or
inter-node (``link_kind``) in the returned measurements (``"links"``): the profile keys a
fit by group size alone.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..ir import Op, OpKind, Program, Slot, StateKey, TensorType, Value
from ..ir.attrs import NAME, SLOTS, STATE
from ..ir.dist import Partial, ProcessMesh, Replicate, Shard
from ..ir.ops import resolve
from ..lower.executable import StepComm
from ..reshard.steps import AllGather, AllReduce, AllToAll, ReduceScatter
from ..reshard.traffic import reshard_bytes
from ..runtime.codegen import generate
from ..runtime.collectives import bind_step
from ..runtime.p2p import P2PTransport
from ..runtime.process_groups import (
    MeshGroups,
    backend_for,
    init_distributed,
    mesh_groups,
    resolve_device,
    shutdown,
)
from . import op_probes
from .pipeline_probe import mean_times, measure_pipeline
from .predict import op_size
from .profile import COLLECTIVE_KINDS, AlphaBeta, Curve, Profile

__all__ = ["Settings", "calibrate", "run", "launch", "summary", "fit_alpha_beta",
           "calibration_device", "link_kind", "default_processes"]

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Settings:
    """What to measure and how long: the default takes about a minute on 2 cores with 4
    processes, ``quick`` a few seconds (tests)."""

    matmul_flops: tuple[float, ...]
    pointwise_bytes: tuple[float, ...]
    collective_bytes: tuple[int, ...]     # the full tensor, before the group cuts it
    batch_s: float                        # one timed batch of compute calls
    repeats: int                          # timed batches of each compute point
    comm_repeats: int                     # timed calls of each collective point
    overhead_ops: int = 256
    half_matmul_flops: tuple[float, ...] = (1e4, 1e6, 1e8)    # half precision: slow on CPU
    half_pointwise_bytes: tuple[float, ...] = (1024.0, 65536.0, 4194304.0)
    op_sizes: int = 4                     # sizes of each probed op (cost/op_probes.py)
    half_op_sizes: int = 2
    slowdown_repeats: int = 6
    slowdown_window_s: float = 0.1
    pipeline_bytes: tuple[int, ...] = (4096, 65536, 1048576)   # pipeline message sizes
    pipeline_micro_batches: int = 8
    pipeline_repeats: int = 5

    @classmethod
    def default(cls) -> Settings:
        return cls(matmul_flops=tuple(10 ** (k / 2) for k in range(6, 19)),
                   pointwise_bytes=tuple(float(4 ** k) for k in range(3, 14)),
                   collective_bytes=tuple(4 ** k for k in range(5, 13)),
                   batch_s=0.01, repeats=9, comm_repeats=31,
                   half_matmul_flops=tuple(10.0 ** k for k in range(3, 9)),
                   half_pointwise_bytes=tuple(float(4 ** k) for k in range(4, 13, 2)))

    @classmethod
    def quick(cls) -> Settings:
        return cls(matmul_flops=(1e3, 1e5, 1e7), pointwise_bytes=(256.0, 16384.0, 1048576.0),
                   collective_bytes=(1024, 65536, 1048576), batch_s=0.004, repeats=3,
                   comm_repeats=3, overhead_ops=64, half_matmul_flops=(1e4, 1e6),
                   half_pointwise_bytes=(1024.0, 65536.0), op_sizes=2, half_op_sizes=1,
                   slowdown_repeats=1, slowdown_window_s=0.02,
                   pipeline_bytes=(4096, 65536), pipeline_micro_batches=2, pipeline_repeats=1)


# ------------------------------------------------------------------------------- timing


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


Probe = Callable[[], float]     # one timed sample: seconds per call


class _Timer:
    """Seconds of the work queued on ``device`` between ``start`` and ``stop``. On the CPU
    a call returns when its work is done: the host clock. On CUDA a call returns when its
    kernel is launched (the host clock would time launches): CUDA events recorded on the
    device's current stream around the work, read once the end event has completed."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.host = 0.0
        self.begin = None

    def start(self) -> float:
        """Start an interval; returns the host clock (a probe's window is host time)."""
        if self.stream is not None:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record(self.stream)
        self.host = time.perf_counter()
        return self.host

    def stop(self, now: float | None = None) -> float:
        """Seconds since ``start``; on the CPU ``now``, a host reading the caller has just
        taken, ends the interval."""
        if self.stream is None:
            return (time.perf_counter() if now is None else now) - self.host
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        end.synchronize()
        return self.begin.elapsed_time(end) / 1e3


def _batch_probe(fn: Callable[[], object], batch_s: float, device: torch.device = CPU) -> Probe:
    """A probe timing back-to-back calls of ``fn`` until ``batch_s`` has passed (at least
    one call; warmed up once). A window of fixed length, not a fixed count of calls: the
    processes measured together start behind a barrier and all stay busy to the end of
    the window, so each sample is taken under the full contention of all of them (with a
    fixed count the first process done leaves the cores to the others, and the measured
    sharing depended on the batch length: 0.46 to 0.92 for one process alone). ``device``:
    where ``fn`` computes (its time: ``_Timer``; the window is host time)."""
    fn()
    timer = _Timer(device)

    def probe() -> float:
        deadline, calls = timer.start() + batch_s, 0
        while True:
            fn()
            calls += 1
            now = time.perf_counter()
            if now >= deadline:
                return timer.stop(now) / calls
    return probe


def sweep(probes: list[Probe], rounds: int, together: bool = True) -> list[float]:
    """Each probe's median over ``rounds`` sweeps of all of them: a burst of someone
    else's load hits one sample of many points, not every sample of one. ``together``:
    every sample behind a barrier (every process sweeps); else this process alone."""
    samples: list[list[float]] = [[] for _ in probes]
    for _ in range(rounds):
        for probe, mine in zip(probes, samples):
            if together:
                _barrier()
            mine.append(probe())
    return [statistics.median(mine) for mine in samples]


def _kernel(target: str) -> Callable:
    """The callable the generated code calls for ``target``."""
    fn = resolve(target)
    return getattr(fn, "_op", fn)


# ------------------------------------------------------------------------------ compute


def _matmul_shapes(flops: float) -> list[tuple[int, int, int]]:
    """(m, k, n) near ``flops`` = 2mkn: a square one and an activation-by-weight one (many
    rows, a 4x wider output, as an MLP's first Linear)."""
    s = max(1, round((flops / 2) ** (1 / 3)))
    d = max(1, round((flops / 128) ** (1 / 3)))
    return [(s, s, s), (16 * d, d, 4 * d)]


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _matmul_curve(settings: Settings, sizes: tuple[float, ...],
                  dtype: torch.dtype = torch.float32, device: torch.device = CPU
                  ) -> list[float]:
    """Seconds of one mm of ``dtype`` of each of ``sizes`` (FLOPs): the shapes' mean
    (geometric) throughput."""
    mm = _kernel("aten.mm.default")
    probes, work = [], []
    for flops in sizes:
        for m, k, n in _matmul_shapes(flops):
            a = torch.randn(m, k, dtype=dtype, device=device)
            b = torch.randn(n, k, dtype=dtype, device=device).t()   # a Linear's weight
            probes.append(_batch_probe(functools.partial(mm, a, b), settings.batch_s, device))
            work.append(2 * m * k * n)
    rates = [w / t for w, t in zip(work, sweep(probes, settings.repeats, False))]
    per = len(rates) // len(sizes)
    return [flops / _geomean(rates[i * per:(i + 1) * per]) for i, flops in enumerate(sizes)]


# (target, tensor inputs, bytes read + written per element, fp32)
POINTWISE = (("aten.add.Tensor", 2, 12), ("aten.mul.Tensor", 2, 12), ("aten.gelu.default", 1, 8))


def _pointwise_curve(settings: Settings, sizes: tuple[float, ...],
                     dtype: torch.dtype = torch.float32, device: torch.device = CPU
                     ) -> list[float]:
    """Seconds of one memory-bound op of ``dtype`` moving each of ``sizes`` (bytes): the
    ops' mean throughput."""
    probes, work = [], []
    scale = dtype.itemsize / 4
    for nbytes in sizes:
        for target, inputs, fp32_per_element in POINTWISE:
            per_element = fp32_per_element * scale
            n = max(1, round(nbytes / per_element))
            args = [torch.randn(n, dtype=dtype, device=device) for _ in range(inputs)]
            probes.append(_batch_probe(functools.partial(_kernel(target), *args),
                                       settings.batch_s, device))
            work.append(n * per_element)
    rates = [w / t for w, t in zip(work, sweep(probes, settings.repeats, False))]
    per = len(POINTWISE)
    return [nbytes / _geomean(rates[i * per:(i + 1) * per]) for i, nbytes in enumerate(sizes)]


HALF = (torch.float16, torch.bfloat16)


def _op_cases(dtype: torch.dtype, sizes: int, device: torch.device) -> list:
    """``op_probes.cases`` with their tensors made on ``device``. On the CPU exactly those;
    elsewhere target by target with ``device`` the default of new tensors (op_probes makes
    them without one), leaving out a target with no kernel there (op_probes' attention is
    the CPU flash kernel)."""
    if device.type == "cpu":
        return op_probes.cases(dtype, sizes)
    out = []
    for target, (make, calls, half) in op_probes.PROBED.items():
        if dtype != torch.float32 and not half:
            continue
        try:
            with device:
                out += [(target, calls, make(i, dtype)) for i in range(sizes)]
        except RuntimeError:          # NotImplementedError too: no kernel on this device
            continue
    return out


def measure_ops(settings: Settings, device: torch.device = CPU) -> dict[str, list[float]]:
    """The probed ops' points (``cost/op_probes.py``), all in one sweep: ``"op:<target>:
    <dtype>"`` -> seconds of one call (per parameter for an optimizer's group call) and
    ``"opsize:..."`` -> its ``op_size``; and ``"view"``: one view op's seconds."""
    probes, keys, sizes, calls = [], [], [], []
    for dtype in (torch.float32, *HALF):
        count = settings.op_sizes if dtype == torch.float32 else settings.half_op_sizes
        for target, per, (fn, op) in _op_cases(dtype, count, device):
            probes.append(_batch_probe(fn, settings.batch_s, device))
            keys.append(f"{target}:{_dtype_name(dtype)}")
            sizes.append(op_size(op))
            calls.append(per)
    with device:
        views = op_probes.view_cases()
    probes += [_batch_probe(fn, settings.batch_s, device) for fn in views]
    seconds = sweep(probes, settings.repeats, False)
    out: dict[str, list[float]] = {}
    for key, size, per, t in zip(keys, sizes, calls, seconds):
        out.setdefault("op:" + key, []).append(t / per)
        out.setdefault("opsize:" + key, []).append(size)
    out["view"] = [statistics.median(seconds[len(keys):])]
    return out


def _slowdown_probes(settings: Settings, device: torch.device = CPU) -> list[Probe]:
    """What the slowdown is measured on: a small and a large matmul and a pointwise add,
    each over a window of ``slowdown_window_s`` (long enough for the scheduler to share
    the cores fairly among the processes: 10 ms windows gave erratic rates)."""
    mm, add = _kernel("aten.mm.default"), _kernel("aten.add.Tensor")
    shapes = ((64, 128, 64), (256, 256, 256))
    mms = [(torch.randn(m, k, device=device), torch.randn(n, k, device=device).t())
           for m, k, n in shapes]
    x, y = torch.randn(1 << 16, device=device), torch.randn(1 << 16, device=device)
    window = settings.slowdown_window_s
    return ([_batch_probe(functools.partial(mm, a, b), window, device) for a, b in mms]
            + [_batch_probe(functools.partial(add, x, y), window, device)])


def measure_slowdown(settings: Settings, world: int, rank: int, device: torch.device = CPU
                     ) -> list[list[float] | None]:
    """For P = 1..world processes computing at once (ranks below P; the others wait at
    the barrier, which does not spin), this process's median seconds of each slowdown
    probe (None: idle). Every round sweeps all P, so a burst of other load hits every P
    alike rather than all samples of one; the first round is a warm-up and is dropped."""
    probes = _slowdown_probes(settings, device)
    samples = {active: [[] for _ in probes] for active in range(1, world + 1)}
    for repeat in range(settings.slowdown_repeats + 1):
        for active in range(1, world + 1):
            for probe, mine in zip(probes, samples[active]):
                _barrier()
                if rank < active:
                    t = probe()
                    if repeat:
                        mine.append(t)
    return [[statistics.median(m) for m in samples[active]] if rank < active else None
            for active in range(1, world + 1)]


def _tiny_add_program(ops: int) -> Program:
    """``ops`` chained adds of a 16-element input and a state tensor, as capture makes them."""
    value = TensorType((16,), torch.float32)
    x = Op(OpKind.INPUT, "input", outputs=[Value(value)], attrs={NAME: "x"})
    w = Op(OpKind.STATE, "state", outputs=[Value(value)],
           attrs={STATE: StateKey.of_param("w"), NAME: "w"})
    program, last = Program(), x.outputs[0]
    program.add(x)
    program.add(w)
    for _ in range(ops):
        op = program.add(Op(OpKind.CALL, "aten.add.Tensor", args=(last, w.outputs[0]),
                            outputs=[Value(value)]))
        last = op.outputs[0]
    program.add(Op(OpKind.OUTPUT, "output", args=(last,),
                   attrs={SLOTS: (Slot("output", "0"),)}))
    return program


def _executor_overhead(settings: Settings, device: torch.device = CPU) -> tuple[float, float]:
    """(executor seconds per tiny op, the same op called directly): batches of the two
    interleaved, so a load that comes and goes shifts both alike; medians. Host time on
    every device: what the executor adds is host work (on CUDA, the time to launch)."""
    ops = settings.overhead_ops
    fn, _ = generate(_tiny_add_program(ops))
    feeds = {"x": torch.randn(16, device=device)}
    state = {"w": torch.randn(16, device=device)}
    add, x, w = _kernel("aten.add.Tensor"), feeds["x"], state["w"]
    fn(feeds, state)
    start = time.perf_counter()
    fn(feeds, state)
    calls = max(1, round(settings.batch_s / max(time.perf_counter() - start, 1e-7)))
    program, direct = [], []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(feeds, state)
        middle = time.perf_counter()
        for _ in range(calls * ops):
            add(x, w)
        program.append((middle - start) / (calls * ops))
        direct.append((time.perf_counter() - middle) / (calls * ops))
    return statistics.median(program), statistics.median(direct)


def measure_compute(settings: Settings, device: torch.device = CPU) -> dict[str, list[float]]:
    """This process's compute measurements on ``device``, in the order of ``settings``."""
    torch.manual_seed(0)
    gc.collect()
    with torch.no_grad():
        out = {"matmul": _matmul_curve(settings, settings.matmul_flops, device=device),
               "pointwise": _pointwise_curve(settings, settings.pointwise_bytes,
                                             device=device)}
        for dtype in HALF:
            name = _dtype_name(dtype)
            out["matmul:" + name] = _matmul_curve(settings, settings.half_matmul_flops, dtype,
                                                  device)
            out["pointwise:" + name] = _pointwise_curve(settings, settings.half_pointwise_bytes,
                                                        dtype, device)
        executor_s, direct_s = _executor_overhead(settings, device)
    out.update(executor=[executor_s], direct=[direct_s])
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def monotone_curve(sizes: tuple[float, ...], seconds: list[float]) -> Curve:
    """A curve through the points, each time raised to the largest before it: a bigger op
    is never predicted faster than a smaller one (noise at the latency-bound end would make
    cutting an op look like a loss)."""
    points, floor = [], 0.0
    for size, t in zip(sizes, seconds):
        floor = max(floor, t)
        points.append((float(size), floor))
    return Curve(points=points)


# -------------------------------------------------------------------------- collectives


def group_sizes(world: int) -> list[int]:
    """Every group size a mesh dim of this launch can have: the divisors of ``world`` > 1."""
    return [n for n in range(2, world + 1) if world % n == 0]


def link_kind(n: int, world: int, local_world: int) -> str:
    """Whether the groups of a mesh dim of ``n`` ranks (``_mesh_dim``'s: ``n`` consecutive
    ranks each) all lie within a node (torchrun puts ``local_world`` consecutive ranks on
    a node): ``"intra-node"``; else ``"inter-node"`` (the groups run at once, and the one
    crossing a node paces the collective)."""
    if n < 2 or world % n or local_world < 1:
        raise ValueError(f"a mesh dim of {n} ranks in a launch of {world} ({local_world} "
                         "per node)")
    within = all(start // local_world == (start + n - 1) // local_world
                 for start in range(0, world, n))
    return "intra-node" if within else "inter-node"


def _links(world: int) -> dict[int, str]:
    """Each group size's ``link_kind`` on this launch (``LOCAL_WORLD_SIZE``: torchrun's
    ranks per node; absent, one node)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {n: link_kind(n, world, local_world) for n in group_sizes(world)}


def _mesh_dim(world: int, n: int) -> tuple[MeshGroups, int]:
    """This process's groups on a mesh with a dim of ``n`` ranks (made as the runtime makes
    them), and that dim: every group along it runs at once, as in training."""
    if n == world:
        return mesh_groups(ProcessMesh(list(range(world)))), 0
    return mesh_groups(ProcessMesh(np.arange(world).reshape(world // n, n).tolist())), 1


def _rows(nbytes: int, n: int, cols: int = 64) -> int:
    """Rows of a (rows, 64) fp32 tensor of about ``nbytes`` that ``n`` ranks cut evenly."""
    return max(n, round(nbytes / (4 * cols) / n) * n)


def _runtime_collective(kind: str, full: tuple[int, int], n: int, dim: int,
                        groups: MeshGroups, device: torch.device = CPU):
    """(the runtime's callable, this rank's input, bytes a rank sends) for one ``kind``."""
    rows, cols = full
    full_bytes = rows * cols * 4
    piece = (rows // n, cols)
    if kind == "all_reduce":
        step, shape, src, dst = AllReduce(dim), full, Partial(), Replicate()
    elif kind == "reduce_scatter":
        step, shape, src, dst = ReduceScatter(dim, tensor_dim=0), full, Partial(), Shard(0)
    elif kind == "all_gather":
        step, shape, src, dst = AllGather(dim, tensor_dim=0), piece, Shard(0), Replicate()
    else:
        step, shape, src, dst = AllToAll(dim, from_dim=0, to_dim=1), piece, Shard(0), Shard(1)
    fn = bind_step(StepComm(step, (shape,) * n), groups)
    return fn, torch.randn(shape, device=device), reshard_bytes(src, dst, full_bytes, n)


def _broadcast(full: tuple[int, int], axis, device: torch.device = CPU):
    x = torch.randn(full, device=device)
    root = axis.ranks[0]
    return (lambda t: dist.broadcast(t, src=root, group=axis.group)), x, float(x.nbytes)


def _ping_pong(full: tuple[int, int], axis, device: torch.device = CPU):
    """Two messages per call between the pair's two ranks: first to second, and back."""
    x = torch.randn(full, device=device)
    first, second = axis.ranks[0], axis.ranks[1]
    me = dist.get_rank()

    def ping_pong(t: torch.Tensor) -> None:
        if me == first:
            dist.isend(t, second).wait()
            dist.irecv(t, second).wait()
        else:
            dist.irecv(t, first).wait()
            dist.isend(t, first).wait()
    return ping_pong, x, float(x.nbytes)


def _lead(device: torch.device = CPU) -> Callable[[], object]:
    """The compute a collective follows in a sample: ten 128^3 matmuls (~1 ms here)."""
    a, mm = torch.randn(128, 128, device=device), _kernel("aten.mm.default")

    def lead() -> None:
        for _ in range(10):
            mm(a, a)
    return lead


def _call_probe(fn: Callable[[torch.Tensor], object], x: torch.Tensor,
                lead: Callable[[], object]) -> Probe:
    """A probe timing ``lead`` and then one call of a collective on ``x`` (warmed up), on
    ``x``'s device (``_Timer``)."""
    fn(x)
    timer = _Timer(x.device)

    def probe() -> float:
        timer.start()
        lead()
        fn(x)
        return timer.stop()
    return probe


def _collective_probe(kind: str, nbytes: int, n: int, groups: MeshGroups, dim: int,
                      lead: Callable[[], object], device: torch.device = CPU
                      ) -> tuple[Probe, float]:
    """(a probe of one ``kind`` call on a tensor of about ``nbytes``, bytes a rank sends)."""
    full = (_rows(nbytes, n), 64)
    if kind == "broadcast":
        fn, x, sent = _broadcast(full, groups[dim], device)
    elif kind == "send_recv":
        fn, x, sent = _ping_pong(full, groups[dim], device)
    else:
        fn, x, sent = _runtime_collective(kind, full, n, dim, groups, device)
    return _call_probe(fn, x, lead), sent


def measure_collectives(settings: Settings, world: int, device: torch.device = CPU
                        ) -> dict[str, dict[int, list]]:
    """kind -> group size -> [(bytes a rank sends, this process's median seconds)]; each
    kind and group size one sweep over the sizes and the lead compute alone. A point is
    what the collective adds to the lead: the median of lead + call less the lead's."""
    out: dict[str, dict[int, list]] = {}
    lead = _lead(device)
    lead_probe = _batch_probe(lead, 0.0, device)
    for n in group_sizes(world):
        groups, dim = _mesh_dim(world, n)
        for kind in COLLECTIVE_KINDS:
            if kind == "send_recv" and n != 2:
                continue                                  # a message has two ends
            _barrier()
            probes, sent = zip(*(_collective_probe(kind, b, n, groups, dim, lead, device)
                                 for b in settings.collective_bytes))
            *both, alone = sweep([*probes, lead_probe], settings.comm_repeats)
            seconds = [max(t - alone, 1e-7) for t in both]
            if kind == "send_recv":                       # a ping-pong is two messages
                seconds = [t / 2 for t in seconds]
            out.setdefault(kind, {})[n] = list(zip(sent, seconds))
    return out


def fit_alpha_beta(points: list[tuple[float, float]]) -> AlphaBeta:
    """Least-squares ``seconds = alpha + beta * bytes``, weighted by 1/seconds (relative
    errors: a small message counts as much as a big one). A negative intercept (the line
    bending under the small points) refits through the origin. ``r2`` on the plain times."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    beta, alpha = np.polyfit(x, y, 1, w=1 / y) if len(points) > 1 else (0.0, y[0])
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(x / y) / np.sum(x * x / (y * y)))
    predicted = alpha + beta * x
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else 1.0
    return AlphaBeta(alpha_s=float(alpha), beta_s_per_byte=max(float(beta), 0.0), r2=r2)


# ------------------------------------------------------------------------------ the run


def calibration_device(choice: str = "auto") -> torch.device:
    """The device this process calibrates, picked as the engine picks the one it trains on
    (``resolve_device``: ``auto`` is ``cuda:LOCAL_RANK`` where CUDA exists)."""
    try:
        return resolve_device(choice, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as err:
        raise ValueError(f"calibrate on device {choice}: {err}; AUTOPAR_CALIBRATE_DEVICE=cpu "
                         "calibrates the CPU") from None


def _transport_on(device: torch.device) -> Callable[..., P2PTransport]:
    """The runtime's transport, made for ``device`` (``measure_pipeline`` asks for a CPU one)."""
    if device.type == "cpu":
        return P2PTransport

    def make(messages, me, peers, shapes, _cpu, **options) -> P2PTransport:
        return P2PTransport(messages, me, peers, shapes, device, **options)
    return make


def _measure_pipeline(settings: Settings, device: torch.device) -> dict[str, list[float]]:
    """``measure_pipeline`` on ``device``: its messages made there (it makes them without a
    device, so ``device`` is the default of new tensors while it runs, off the CPU)."""
    with torch.no_grad(), (device if device.type != "cpu" else contextlib.nullcontext()):
        return measure_pipeline(settings.pipeline_bytes, settings.pipeline_micro_batches,
                                settings.pipeline_repeats, _lead(device), _transport_on(device))


def calibrate(settings: Settings, processes: int, device: torch.device | None = None
              ) -> tuple[Profile, dict] | None:
    """Measure on this process (one of ``processes``) on ``device`` (None:
    ``calibration_device()``); rank 0 returns the profile and the measurements it was made
    from (``"compute"``: medians over processes; ``"collectives"``: kind -> group size ->
    [(bytes sent, median seconds)]; ``"links"``: group size -> intra-node or inter-node;
    ``"device"``), the others None."""
    device = calibration_device() if device is None else device
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    phases = {"start": time.perf_counter()}
    compute: dict[str, list[float]] = {}
    if rank == 0:              # alone: the others wait at the barrier (it does not spin)
        compute = measure_compute(settings, device)
        phases["compute"] = time.perf_counter()
        with torch.no_grad():
            compute.update(measure_ops(settings, device))
        phases["ops"] = time.perf_counter()
    _barrier()
    with torch.no_grad():
        slowdown = measure_slowdown(settings, world, rank, device)
    phases["slowdown"] = time.perf_counter()
    collectives = measure_collectives(settings, world, device) if world > 1 else {}
    phases["collectives"] = time.perf_counter()
    pipeline = _measure_pipeline(settings, device) if world > 1 else {}
    phases["pipeline"] = time.perf_counter()
    mine = {"compute": compute, "collectives": collectives, "slowdown": slowdown,
            "pipeline": pipeline}
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    names = list(phases)
    measured = {"compute": everyone[0]["compute"], "collectives": _median_comm(everyone),
                "slowdown": _slowdown(everyone),
                "pipeline": mean_times([p["pipeline"] for p in everyone]) if world > 1 else {},
                "phases": {b: phases[b] - phases[a] for a, b in zip(names, names[1:])},
                "links": _links(world), "device": str(device),
                "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world))}
    return _profile(settings, processes, measured, device), measured


def _slowdown(everyone: list[dict]) -> dict[int, float]:
    """P -> the probes' mean (geometric) ratio of P processes' time (median over the
    active ones) to one process's alone (the curves' condition)."""
    world = len(everyone)

    def times(active: int) -> list[float]:
        rows = [p["slowdown"][active - 1] for p in everyone[:active]]
        return [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    alone = times(1)
    return {active: _geomean([t / a for t, a in zip(times(active), alone)])
            for active in range(1, world + 1)}


def _median_comm(everyone: list[dict]) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """Each collective's (bytes sent, seconds) points, the median over processes."""
    return {kind: {n: [(sent, statistics.median(p["collectives"][kind][n][i][1]
                                                for p in everyone))
                       for i, (sent, _) in enumerate(points)]
                   for n, points in by_n.items()}
            for kind, by_n in everyone[0]["collectives"].items()}


def _machine(processes: int, device: torch.device) -> str:
    """The profile's machine: host, the GPU on CUDA, cores, torch, the backend."""
    gpu = f"{torch.cuda.get_device_name(device)}, " if device.type == "cuda" else ""
    return (f"{platform.node()}, {gpu}{os.cpu_count()} cpus, torch {torch.__version__}, "
            f"{backend_for(device) if processes > 1 else 'no backend'}")


def _profile(settings: Settings, processes: int, measured: dict, device: torch.device = CPU
             ) -> Profile:
    compute = measured["compute"]
    return Profile(
        machine=_machine(processes, device),
        processes=processes, threads=torch.get_num_threads(),
        matmul=monotone_curve(settings.matmul_flops, compute["matmul"]),
        pointwise=monotone_curve(settings.pointwise_bytes, compute["pointwise"]),
        op_overhead_s=max(0.0, compute["executor"][0] - compute["direct"][0]),
        matmul_dtypes={_dtype_name(d): monotone_curve(settings.half_matmul_flops,
                                                      compute["matmul:" + _dtype_name(d)])
                       for d in HALF},
        pointwise_dtypes={_dtype_name(d): monotone_curve(
            settings.half_pointwise_bytes, compute["pointwise:" + _dtype_name(d)])
            for d in HALF},
        slowdown=measured["slowdown"],
        op_curves=_op_curves(compute), view_s=compute["view"][0],
        **_collective_fits(measured),
        **_pipeline_costs(measured.get("pipeline") or {}))


def _collective_fits(measured: dict) -> dict:
    """The profile's collective fits: of group sizes whose groups stayed on a machine in
    ``collectives``, of those that crossed one in ``inter_node`` (with the machine's
    processes, ``devices_per_node``). A size crossing machines is also kept in
    ``collectives`` when no size stayed on one (a launch of one process per machine)."""
    links, local = measured.get("links", {}), measured.get("local_world")
    fits = {kind: {n: fit_alpha_beta(points) for n, points in by_n.items()}
            for kind, by_n in measured["collectives"].items()}
    if "inter-node" not in links.values():
        return {"collectives": fits}
    intra = {kind: {n: f for n, f in by_n.items() if links.get(n) != "inter-node"}
             for kind, by_n in fits.items()}
    inter = {kind: {n: f for n, f in by_n.items() if links.get(n) == "inter-node"}
             for kind, by_n in fits.items()}
    return {"collectives": {kind: intra[kind] or fits[kind] for kind in fits},
            "inter_node": {kind: by_n for kind, by_n in inter.items() if by_n},
            "devices_per_node": local}


def _pipeline_costs(pipeline: dict[str, float]) -> dict:
    """The profile's pipeline runtime fields from the exchange's medians (none without
    one: a single process has no messages)."""
    sends = sorted((float(k.split(":")[1]), t) for k, t in pipeline.items()
                   if k.startswith("send:") and t > 0)
    if not sends:
        return {}
    return {"p2p_send": fit_alpha_beta(sends), "pipeline_job_s": pipeline["prefetch"]}


def _op_curves(compute: dict[str, list[float]]) -> dict[str, dict[str, Curve]]:
    """target -> dtype -> the probed op's curve (``measure_ops``' points, median over
    processes), made monotone as the class curves are."""
    out: dict[str, dict[str, Curve]] = {}
    for key, seconds in compute.items():
        if key.startswith("op:"):
            target, dtype = key[3:].rsplit(":", 1)
            sizes = tuple(compute["opsize:" + key[3:]])
            out.setdefault(target, {})[dtype] = monotone_curve(sizes, seconds)
    return out


def _fit_error(fit: AlphaBeta, points: list[tuple[float, float]]) -> float:
    """The largest relative error of the fit over the measured points."""
    return max(abs(fit.seconds(sent) - t) / t for sent, t in points)


def _rows_to_show(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return points[::2] if (len(points) - 1) % 2 == 0 else points[::2] + points[-1:]


def summary(profile: Profile, measured: dict, out: str) -> str:
    """What a user reads after calibrating."""
    compute = measured["compute"]
    lines = [f"autopar calibrate: {profile.machine}; {profile.processes} process(es) x "
             f"{profile.threads} thread(s); compute curves: process 0 alone, the others "
             "idle", "matmul (fp32 mm):"]
    for size, t in _rows_to_show(profile.matmul.points):
        lines.append(f"  {size:10.3g} FLOP {t * 1e6:10.1f} us  {size / t / 1e9:7.2f} GFLOP/s")
    lines.append("pointwise (add/mul/gelu; bytes read + written):")
    for size, t in _rows_to_show(profile.pointwise.points):
        lines.append(f"  {size:10.3g} B    {t * 1e6:10.1f} us  {size / t / 1e9:7.2f} GB/s")
    for name, curve in profile.matmul_dtypes.items():
        size, t = curve.points[-1]
        lines.append(f"matmul {name}: {size:.3g} FLOP {size / t / 1e9:.2f} GFLOP/s; pointwise "
                     f"{name}: {profile.pointwise_dtypes[name].throughput(4e6) / 1e9:.2f} "
                     "GB/s at 4 MB")
    lines.append("slowdown (processes computing at once: time relative to one "
                 "alone): " + ", ".join(
                     f"{p}: {s:.2f}" for p, s in sorted(profile.slowdown.items())))
    lines.append("probed ops (size: FLOPs for attention, parameter bytes for AdamW, bytes "
                 "read + written otherwise; smallest and largest point):")
    for target, by_dtype in profile.op_curves.items():
        for dtype, curve in by_dtype.items():
            (s0, t0), (s1, t1) = curve.points[0], curve.points[-1]
            lines.append(f"  {target.removeprefix('aten.'):48s} {dtype:9s} {s0:9.3g}: "
                         f"{t0 * 1e6:8.1f} us  {s1:9.3g}: {t1 * 1e6:9.1f} us")
    lines.append(f"view ops: {profile.view_s * 1e6:.2f} us each")
    lines.append(f"executor: {compute['executor'][0] * 1e6:.2f} us per tiny op in generated "
                 f"code, {compute['direct'][0] * 1e6:.2f} us called directly: overhead "
                 f"{profile.op_overhead_s * 1e6:.2f} us per op")
    lines.append("collectives (bytes = what one rank sends; R^2 and worst relative error of "
                 "the line over the measured sizes):")
    links = measured.get("links", {})
    several_nodes = "inter-node" in links.values()       # else every group is within a node
    for kind, by_n in profile.collectives.items():
        for n, fit in sorted(by_n.items()):
            rate = 1 / fit.beta_s_per_byte / 1e9 if fit.beta_s_per_byte > 0 else math.inf
            error = _fit_error(fit, measured["collectives"][kind][n])
            where = f" ({links[n]})" if several_nodes else ""
            lines.append(f"  {kind:15s} {n} ranks{where}: alpha {fit.alpha_s * 1e6:8.1f} us  "
                         f"1/beta {rate:6.2f} GB/s  R^2 {fit.r2:6.3f}  worst {error:4.0%}")
    if profile.p2p_send is not None:
        fit = profile.p2p_send
        sends = ", ".join(f"{k.split(':')[1]} B {t * 1e6:.0f} us"
                          for k, t in measured["pipeline"].items() if k.startswith("send:"))
        lines.append(f"pipeline runtime (all processes exchanging): send call {sends} "
                     f"(alpha {fit.alpha_s * 1e6:.1f} us, 1/beta "
                     f"{1 / max(fit.beta_s_per_byte, 1e-30) / 1e9:.2f} GB/s); per job "
                     f"{profile.pipeline_job_s * 1e6:.1f} us")
    lines.append("rank 0's time per phase: " + ", ".join(
        f"{name} {seconds:.1f} s" for name, seconds in measured.get("phases", {}).items()))
    lines.append(f"profile written to {out}")
    return "\n".join(lines)


def run(processes: int | None, out: str | None, quick: bool, device: str | None = None
        ) -> None:
    """One process of ``python -m autopar calibrate`` (under torchrun, or alone for one), on
    ``device`` (``auto | cpu | cuda``; None: ``$AUTOPAR_CALIBRATE_DEVICE``, else auto)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    processes = processes or world
    if processes != world:
        raise ValueError(f"calibrate --processes {processes} under a launch of WORLD_SIZE "
                         f"{world}: run it without torchrun, it launches its own processes")
    where = calibration_device(device or os.environ.get("AUTOPAR_CALIBRATE_DEVICE", "auto"))
    if world > 1:
        init_distributed(where, world, world)
    settings = Settings.quick() if quick else Settings.default()
    start = time.perf_counter()
    result = calibrate(settings, processes, where)
    if world > 1:
        shutdown(barrier=True)
    if result is not None:
        profile, measured = result
        path = profile.save(out)
        print(summary(profile, measured, str(path)))
        if os.environ.get("AUTOPAR_CALIBRATE_POINTS"):      # the raw points, for a look
            print(measured)
        print(f"calibration took {time.perf_counter() - start:.1f} s")


def default_processes(device: str | None = None) -> int:
    """Processes a calibration launches by default: one per GPU where it measures CUDA
    (a process per device, as training launches), else 4."""
    choice = device or os.environ.get("AUTOPAR_CALIBRATE_DEVICE", "auto")
    if choice != "cpu" and torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return 4


def launch(argv: list[str], processes: int) -> int:
    """Run ``python -m autopar calibrate argv`` on ``processes`` local ranks through
    torchrun, one thread each unless OMP_NUM_THREADS says otherwise (as the demo trains)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", "-m", "autopar", "calibrate", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(command, env=env).returncode
