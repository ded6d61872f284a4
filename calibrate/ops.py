"""The probed ops' points: each op the class curves get badly wrong timed on its own
(``op_probes.py``: gelu, layer norm, softmax, SDPA and their backwards, AdamW per
parameter), and one view op's cost, all in one sweep.
"""
from __future__ import annotations

import statistics

import torch

from ..cost.predict import op_size
from . import op_probes
from .settings import HALF, Settings, dtype_name
from .timing import CPU, batch_probe, sweep

__all__ = ["measure_ops"]


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
    """The probed ops' points (``op_probes.py``), all in one sweep: ``"op:<target>:
    <dtype>"`` -> seconds of one call (per parameter for an optimizer's group call) and
    ``"opsize:..."`` -> its ``op_size``; and ``"view"``: one view op's seconds."""
    probes, keys, sizes, calls = [], [], [], []
    for dtype in (torch.float32, *HALF):
        count = settings.op_sizes if dtype == torch.float32 else settings.half_op_sizes
        for target, per, (fn, op) in _op_cases(dtype, count, device):
            probes.append(batch_probe(fn, settings.batch_s, device))
            keys.append(f"{target}:{dtype_name(dtype)}")
            sizes.append(op_size(op))
            calls.append(per)
    with device:
        views = op_probes.view_cases()
    probes += [batch_probe(fn, settings.batch_s, device) for fn in views]
    seconds = sweep(probes, settings.repeats, False)
    out: dict[str, list[float]] = {}
    for key, size, per, t in zip(keys, sizes, calls, seconds):
        out.setdefault("op:" + key, []).append(t / per)
        out.setdefault("opsize:" + key, []).append(size)
    out["view"] = [statistics.median(seconds[len(keys):])]
    return out
