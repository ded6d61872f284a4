"""Kernels that read and set the CPU generator: a recomputed random op (passes/recompute.py)
redraws what its original drew, and a pipeline job's random op draws what eager draws at it
(lower/job_programs.py)."""
from __future__ import annotations

import torch

from ..core import OpaqueType
from ..ops import kernel

__all__ = ["RNG_STATE", "get_rng_state", "set_rng_state", "functional_target"]

# the generator's state as an IR value: a byte tensor torch gives and takes, never computed on
RNG_STATE = OpaqueType("!rng.state")


@kernel("autopar.get_rng_state")
def get_rng_state() -> torch.Tensor:
    """The CPU generator's state here (before a random op that is recomputed later)."""
    return torch.default_generator.get_state()


@kernel("autopar.set_rng_state", mutates=True)
def set_rng_state(state: torch.Tensor) -> None:
    """Put the CPU generator back where it was at a random op: a recomputed one draws again
    what its original drew; a pipeline rank does not run the random ops of other stages,
    which eager drew before this one."""
    torch.default_generator.set_state(state)


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
