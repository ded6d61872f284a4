"""Kernels that read and set the generator a process's random ops draw from: a recomputed
random op (passes/recompute.py) redraws what its original drew, and a pipeline job's random
op draws what eager draws at it (lower/job_programs.py).

That generator is the CPU's, or the current CUDA device's when the process computes on CUDA
(a random op draws from the generator of the device its tensors are on; every op of a
process runs on the one device the engine chose, ``use_device``)."""
from __future__ import annotations

import torch

from ..core import OpaqueType
from ..ops import kernel

__all__ = ["RNG_STATE", "get_rng_state", "set_rng_state", "functional_target", "use_device",
           "compute_device", "draw_generator"]

# the generator's state as an IR value: a byte tensor torch gives and takes, never computed on
RNG_STATE = OpaqueType("!rng.state")

_COMPUTE = [torch.device("cpu")]     # the device this process computes (and draws) on


def use_device(device: torch.device) -> None:
    """Set the device this process's programs compute on (the runtime, when it starts)."""
    _COMPUTE[0] = torch.device(device)


def compute_device() -> torch.device:
    return _COMPUTE[0]


def draw_generator() -> torch.Generator:
    """The generator this process's random ops draw from."""
    device = _COMPUTE[0]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


@kernel("autopar.get_rng_state")
def get_rng_state() -> torch.Tensor:
    """The generator's state here (before a random op that is recomputed later)."""
    return draw_generator().get_state()


@kernel("autopar.set_rng_state", mutates=True)
def set_rng_state(state: torch.Tensor) -> None:
    """Put the generator back where it was at a random op: a recomputed one draws again
    what its original drew; a pipeline rank does not run the random ops of other stages,
    which eager drew before this one."""
    draw_generator().set_state(state)


# in-place random overloads whose functional form is not the same name without "_"
_FUNCTIONAL = {"aten.bernoulli_.float": "aten.bernoulli.p",
               "aten.normal_.default": "aten.normal_functional.default"}


def functional_target(target: str) -> str:
    """The functional form of an in-place ATen draw (``aten.uniform_.default`` ->
    ``aten.uniform.default``; itself for any other): a compiled program draws from a given
    generator state with ``run_with_rng_state``, under which Inductor draws wrong numbers
    for an in-place op. Same numbers as the in-place form."""
    if target in _FUNCTIONAL:
        return _FUNCTIONAL[target]
    namespace, name, overload = (target.split(".") + ["default"])[:3]
    if namespace != "aten" or not name.endswith("_"):
        return target
    return f"{namespace}.{name[:-1]}.{overload}"
