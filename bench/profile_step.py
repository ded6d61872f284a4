"""Where a distributed training step spends its time, for the ``--profile`` option of
``dp_vs_ddp.py`` and ``tp_vs_dtensor.py``. Like the timings, autopar and the baseline are
measured in the same window, step for step interleaved, so load from other processes hits
both alike.

1. The collectives autopar's rank program asks for, grouped by op, local type and phase.
2. Every collective of autopar's generated step is wrapped (in the step function's globals,
   where codegen put the bound collectives) with a wall-clock timer: calls per step, bytes
   each rank hands in, wall time inside (a blocking collective's wait for the slower peer
   included; for an asynchronous bucket, the start and the wait separately).
3. ``torch.profiler`` over interleaved steps, each in a ``record_function`` scope: CPU time
   in outermost aten ops vs the step's wall time (the rest is Python, dispatch, the
   autograd engine, profiler overhead, and waits inside collectives), and the collective
   events (any thread: DDP's all-reduces run on gloo's own thread, overlapped with the
   backward) that start inside each side's steps. A DTensor op's own dispatch (sharding
   propagation, redistribution) runs inside its aten op's event, so for DTensor "aten ops"
   holds that Python too.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from autopar.ir import OpKind

STEPS = 10
COMM_WORDS = ("gloo", "c10d", "allreduce", "all_reduce", "allgather", "all_gather",
              "reduce_scatter", "alltoall")


def _train_plan(engine):
    return next(p for (mode, *_), p in engine.planner.steps.items() if mode == "train")


def _is_collective(obj) -> bool:
    return callable(obj) and (getattr(obj, "__module__", None) or "").endswith(
        "runtime.collectives")


def _bytes(args) -> int:
    """Bytes of the tensors among a collective's arguments (a bucket handle's too)."""
    total = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            total += a.numel() * a.element_size()
        elif isinstance(a, (tuple, list)):
            total += _bytes(a)
    return total


def _size(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f} KiB" if nbytes >= 1024 else f"{nbytes:.0f} B"


class _CommTimer:
    """Times every bound collective of a generated step while installed."""

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.originals = {k: v for k, v in namespace.items() if _is_collective(v)}
        self.calls: list[tuple[str, int, float]] = []     # (kind, bytes in, seconds)

    def _wrap(self, fn: Callable) -> Callable:
        def timed(*args):
            start = time.perf_counter()
            out = fn(*args)
            self.calls.append((fn.__name__, _bytes(args), time.perf_counter() - start))
            return out
        return timed

    def __enter__(self) -> "_CommTimer":
        for k, fn in self.originals.items():
            self.namespace[k] = self._wrap(fn)
        return self

    def __exit__(self, *exc) -> None:
        self.namespace.update(self.originals)


def _comm_table(local) -> list[str]:
    """The rank program's comm ops, grouped by (op, first input's local type, the role of
    the compute op before it): which collectives the plan asks for, and in which phase."""
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    before = "start"
    for op in local.ops:
        if op.kind is OpKind.CALL:
            before = op.role.value
        elif op.kind is OpKind.COMM:
            arg = op.inputs[0]
            more = f" +{len(op.inputs) - 1} more" if len(op.inputs) > 1 else ""
            counts[(op.target, f"{arg.type}{more}", before)] += 1
    return [f"  {n:3d} x {target:<22} {typ:<26} after {role} ops"
            for (target, typ, role), n in counts.items()]


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _comm_timings(engine, ours, theirs, steps: int) -> list[str]:
    """Per-step collective figures of autopar's step, next to both sides' median walls."""
    plan = _train_plan(engine)
    executor, inner = plan.executor, plan.executor.fn
    fn_time: list[float] = []

    def timed_fn(*a):
        start = time.perf_counter()
        out = inner(*a)
        fn_time.append(time.perf_counter() - start)
        return out

    walls, base = [], []
    with _CommTimer(inner.__globals__) as timer:
        executor.fn = timed_fn
        try:
            for _ in range(steps):
                walls.append(_timed(ours))
                base.append(_timed(theirs))
        finally:
            executor.fn = inner
    wall = statistics.median(walls)
    by_kind: dict[str, list] = defaultdict(list)
    for kind, nbytes, secs in timer.calls:
        by_kind[kind].append((nbytes, secs))
    lines = [f"autopar step wall {wall * 1e3:.2f} ms (baseline in the same window "
             f"{statistics.median(base) * 1e3:.2f} ms); generated step function "
             f"{statistics.median(fn_time) * 1e3:.2f} ms, engine glue around it "
             f"{(wall - statistics.median(fn_time)) * 1e3:.2f} ms",
             "collective calls per step, this rank's bytes in, wall inside:"]
    for kind, calls in sorted(by_kind.items()):
        sizes = sorted(b for b, _ in calls)
        lines.append(f"  {kind:<17} {len(calls) // steps:3d}/step {_size(sum(sizes) / steps):>10}"
                     f"/step (each {_size(sizes[0])}..{_size(sizes[-1])}, median "
                     f"{_size(statistics.median(sizes))}) "
                     f"{sum(s for _, s in calls) / steps * 1e3:7.2f} ms/step")
    comm = sum(s for _, _, s in timer.calls) / steps
    lines.append(f"  total {comm * 1e3:.2f} ms/step = {comm / wall:.0%} of the step "
                 "(blocking; the wait for the slower peer included)")
    return lines


def _scope(event) -> str | None:
    """The ``step:<name>`` scope an event runs in (None: outside every step)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("step:"):
            return parent.name
        parent = parent.cpu_parent
    return None


def _outermost_aten(event) -> bool:
    """An aten op not inside another (scopes such as the optimizer's record_function or
    autograd nodes are looked through), so each kernel's time is counted once."""
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _profiled(sides: dict[str, Callable], steps: int) -> list[str]:
    """torch.profiler split of each side's step, steps interleaved."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            for name, fn in sides.items():
                dist.barrier()
                with record_function(f"step:{name}"):
                    fn()
    events = prof.events()
    windows = {name: [] for name in sides}
    for e in events:
        if e.name.startswith("step:"):
            windows[e.name[5:]].append((e.time_range.start, e.time_range.end))
    wall = {n: sum(b - a for a, b in w) * 1e-6 / steps for n, w in windows.items()}
    kernels, calls = defaultdict(float), defaultdict(int)
    comm: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        scope = _scope(e)
        if scope is not None and _outermost_aten(e):
            kernels[scope[5:]] += e.cpu_time_total * 1e-6
            calls[scope[5:]] += 1
        if any(w in e.name.lower() for w in COMM_WORDS) and not e.name.startswith("step:"):
            side = next((n for n, w in windows.items()
                         if any(a <= e.time_range.start <= b for a, b in w)), None)
            if side is not None:
                comm[(side, e.name)][0] += 1
                comm[(side, e.name)][1] += e.cpu_time_total * 1e-6
    lines = []
    for name in sides:
        lines.append(f"{name}: step {wall[name] * 1e3:.2f} ms under the profiler; outermost aten "
                     f"ops {kernels[name] / steps * 1e3:.2f} ms in {calls[name] // steps} calls; "
                     f"rest (Python, dispatch, autograd engine, profiler, waits) "
                     f"{(wall[name] - kernels[name] / steps) * 1e3:.2f} ms")
        for (side, event), (n, secs) in sorted(comm.items()):
            if side == name:
                lines.append(f"  {event:<42} {n // steps:3d}/step {secs / steps * 1e3:8.2f} "
                             "ms/step (CPU, any thread)")
    return lines


def profile_pair(engine, ours: Callable, theirs_name: str, theirs: Callable, rank: int,
                 steps: int = STEPS) -> None:
    """Print (rank 0) where autopar's distributed step and the baseline's spend time."""
    local = _train_plan(engine).lowered.process(rank).program
    ops = sum(op.kind is OpKind.CALL for op in local.ops)
    comm_ops = sum(op.kind is OpKind.COMM for op in local.ops)
    lines = [f"--- profile, rank 0, {steps} steps each, interleaved ---",
             f"autopar rank program: {ops} compute ops, {comm_ops} comm ops:",
             *_comm_table(local)]
    lines += _comm_timings(engine, ours, theirs, steps)
    lines += _profiled({"autopar": ours, theirs_name: theirs}, steps)
    if rank == 0:
        print("\n".join(lines))
