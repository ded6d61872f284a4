"""The compute class curves: ``aten.mm`` over FLOPs and memory-bound ops over bytes.

Compute is measured by process 0 alone, the other processes idle at a barrier (a gloo
barrier sleeps, it does not spin): one process's curves, with the machine's cores as they
are (how much slower several processes computing at once run: ``slowdown.py``).

``aten.mm`` over FLOPs (square and activation-by-weight shapes; fp32, fp16, bf16) and
memory-bound ``aten.add``/``mul``/``gelu`` over bytes read + written, through the very
callables the generated code calls (``ir.ops.resolve``); and the executor's per-op
overhead (``executor.py``). The ops these class curves get badly wrong are timed one by
one (``ops.py``).
"""
from __future__ import annotations

import functools
import gc

import torch

from .executor import executor_overhead
from .settings import HALF, Settings, dtype_name
from .timing import CPU, batch_probe, geomean, kernel, sweep

__all__ = ["measure_compute", "POINTWISE"]

# (target, tensor inputs, bytes read + written per element, fp32)
POINTWISE = (("aten.add.Tensor", 2, 12), ("aten.mul.Tensor", 2, 12), ("aten.gelu.default", 1, 8))


def _matmul_shapes(flops: float) -> list[tuple[int, int, int]]:
    """(m, k, n) near ``flops`` = 2mkn: a square one and an activation-by-weight one (many
    rows, a 4x wider output, as an MLP's first Linear)."""
    s = max(1, round((flops / 2) ** (1 / 3)))
    d = max(1, round((flops / 128) ** (1 / 3)))
    return [(s, s, s), (16 * d, d, 4 * d)]


def _matmul_curve(settings: Settings, sizes: tuple[float, ...],
                  dtype: torch.dtype = torch.float32, device: torch.device = CPU
                  ) -> list[float]:
    """Seconds of one mm of ``dtype`` of each of ``sizes`` (FLOPs): the shapes' mean
    (geometric) throughput."""
    mm = kernel("aten.mm.default")
    probes, work = [], []
    for flops in sizes:
        for m, k, n in _matmul_shapes(flops):
            a = torch.randn(m, k, dtype=dtype, device=device)
            b = torch.randn(n, k, dtype=dtype, device=device).t()   # a Linear's weight
            probes.append(batch_probe(functools.partial(mm, a, b), settings.batch_s, device))
            work.append(2 * m * k * n)
    rates = [w / t for w, t in zip(work, sweep(probes, settings.repeats, False))]
    per = len(rates) // len(sizes)
    return [flops / geomean(rates[i * per:(i + 1) * per]) for i, flops in enumerate(sizes)]


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
            probes.append(batch_probe(functools.partial(kernel(target), *args),
                                      settings.batch_s, device))
            work.append(n * per_element)
    rates = [w / t for w, t in zip(work, sweep(probes, settings.repeats, False))]
    per = len(POINTWISE)
    return [nbytes / geomean(rates[i * per:(i + 1) * per]) for i, nbytes in enumerate(sizes)]


def measure_compute(settings: Settings, device: torch.device = CPU) -> dict[str, list[float]]:
    """This process's compute measurements on ``device``, in the order of ``settings``."""
    torch.manual_seed(0)
    gc.collect()
    with torch.no_grad():
        out = {"matmul": _matmul_curve(settings, settings.matmul_flops, device=device),
               "pointwise": _pointwise_curve(settings, settings.pointwise_bytes,
                                             device=device)}
        for dtype in HALF:
            name = dtype_name(dtype)
            out["matmul:" + name] = _matmul_curve(settings, settings.half_matmul_flops, dtype,
                                                  device)
            out["pointwise:" + name] = _pointwise_curve(settings, settings.half_pointwise_bytes,
                                                        dtype, device)
        executor_s, direct_s = executor_overhead(settings, device)
    out.update(executor=[executor_s], direct=[direct_s])
    return out
