"""How calibration times a call: the probes every measurement is made of.

A probe is one timed sample (seconds per call). On the CPU a sample is timed with the host
clock; on CUDA with CUDA events (``Timer``: a call returns at launch, the host clock would
time launches). A compute sample is back-to-back calls for a window of ``batch_s``
(``batch_probe``); a collective's sample is a short compute (``lead``) and then one call
(``call_probe``). The rounds sweep all probes (``sweep``), so a burst of other load spoils
one sample of many points rather than every sample of one; a point is the median over
rounds.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..ir.ops import resolve

__all__ = ["CPU", "Probe", "Timer", "barrier", "batch_probe", "call_probe", "sweep", "kernel",
           "geomean", "lead"]

CPU = torch.device("cpu")

Probe = Callable[[], float]     # one timed sample: seconds per call


def barrier() -> None:
    """Wait for every process of the launch (nothing without one)."""
    if dist.is_initialized():
        dist.barrier()


class Timer:
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


def batch_probe(fn: Callable[[], object], batch_s: float, device: torch.device = CPU) -> Probe:
    """A probe timing back-to-back calls of ``fn`` until ``batch_s`` has passed (at least
    one call; warmed up once). A window of fixed length, not a fixed count of calls: the
    processes measured together start behind a barrier and all stay busy to the end of
    the window, so each sample is taken under the full contention of all of them (with a
    fixed count the first process done leaves the cores to the others, and the measured
    sharing depended on the batch length: 0.46 to 0.92 for one process alone). ``device``:
    where ``fn`` computes (its time: ``Timer``; the window is host time)."""
    fn()
    timer = Timer(device)

    def probe() -> float:
        deadline, calls = timer.start() + batch_s, 0
        while True:
            fn()
            calls += 1
            now = time.perf_counter()
            if now >= deadline:
                return timer.stop(now) / calls
    return probe


def call_probe(fn: Callable[[torch.Tensor], object], x: torch.Tensor,
               lead: Callable[[], object]) -> Probe:
    """A probe timing ``lead`` and then one call of a collective on ``x`` (warmed up), on
    ``x``'s device (``Timer``)."""
    fn(x)
    timer = Timer(x.device)

    def probe() -> float:
        timer.start()
        lead()
        fn(x)
        return timer.stop()
    return probe


def sweep(probes: list[Probe], rounds: int, together: bool = True) -> list[float]:
    """Each probe's median over ``rounds`` sweeps of all of them: a burst of someone
    else's load hits one sample of many points, not every sample of one. ``together``:
    every sample behind a barrier (every process sweeps); else this process alone."""
    samples: list[list[float]] = [[] for _ in probes]
    for _ in range(rounds):
        for probe, mine in zip(probes, samples):
            if together:
                barrier()
            mine.append(probe())
    return [statistics.median(mine) for mine in samples]


def kernel(target: str) -> Callable:
    """The callable the generated code calls for ``target``."""
    fn = resolve(target)
    return getattr(fn, "_op", fn)


def geomean(values: list[float]) -> float:
    """The geometric mean: rates of sizes far apart count alike."""
    return math.exp(statistics.fmean(math.log(v) for v in values))


def lead(device: torch.device = CPU) -> Callable[[], object]:
    """The compute a collective or a pipeline message follows in a sample: ten 128^3
    matmuls (~1 ms here)."""
    a, mm = torch.randn(128, 128, device=device), kernel("aten.mm.default")

    def lead() -> None:
        for _ in range(10):
            mm(a, a)
    return lead
