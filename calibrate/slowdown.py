"""The machine's contention: how much slower P processes computing at once run than one
alone (``slowdown``, P = 1..processes; the predictor scales a plan's compute by it,
``Profile.contention``).

Measured apart from the compute curves, on a few probes timed over long windows (0.1 s:
with 10 ms ones the scheduler's sharing was erratic) with P processes computing together.
"""
from __future__ import annotations

import functools
import statistics

import torch

from .settings import Settings
from .timing import CPU, Probe, barrier, batch_probe, geomean, kernel

__all__ = ["measure_slowdown", "relative_slowdown"]


def _slowdown_probes(settings: Settings, device: torch.device = CPU) -> list[Probe]:
    """What the slowdown is measured on: a small and a large matmul and a pointwise add,
    each over a window of ``slowdown_window_s`` (long enough for the scheduler to share
    the cores fairly among the processes: 10 ms windows gave erratic rates)."""
    mm, add = kernel("aten.mm.default"), kernel("aten.add.Tensor")
    shapes = ((64, 128, 64), (256, 256, 256))
    mms = [(torch.randn(m, k, device=device), torch.randn(n, k, device=device).t())
           for m, k, n in shapes]
    x, y = torch.randn(1 << 16, device=device), torch.randn(1 << 16, device=device)
    window = settings.slowdown_window_s
    return ([batch_probe(functools.partial(mm, a, b), window, device) for a, b in mms]
            + [batch_probe(functools.partial(add, x, y), window, device)])


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
                barrier()
                if rank < active:
                    t = probe()
                    if repeat:
                        mine.append(t)
    return [[statistics.median(m) for m in samples[active]] if rank < active else None
            for active in range(1, world + 1)]


def relative_slowdown(everyone: list[dict]) -> dict[int, float]:
    """P -> the probes' mean (geometric) ratio of P processes' time (median over the
    active ones) to one process's alone (the curves' condition), from every process's
    ``"slowdown"`` measurements."""
    world = len(everyone)

    def times(active: int) -> list[float]:
        rows = [p["slowdown"][active - 1] for p in everyone[:active]]
        return [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    alone = times(1)
    return {active: geomean([t / a for t, a in zip(times(active), alone)])
            for active in range(1, world + 1)}
