"""Lowering table: IR op target -> the Python callable that runs it.

ATen targets resolve to their ``torch.ops`` overload by name; other targets (optimizer
updates, later collectives) register here with ``@kernel``. A target with no entry fails
naming the op and this table.
"""
from __future__ import annotations

from typing import Callable

import torch

KERNELS: dict[str, Callable] = {}


def kernel(target: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        if target in KERNELS:
            raise ValueError(f"kernel for {target!r} registered twice")
        KERNELS[target] = fn
        return fn
    return register


def resolve(target: str) -> Callable:
    if target in KERNELS:
        return KERNELS[target]
    namespace, _, rest = target.partition(".")
    opname, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except AttributeError as exc:
        raise KeyError(f"no kernel for op {target!r}: not an ATen overload and not in "
                       "autopar.runtime.kernels.KERNELS") from exc
