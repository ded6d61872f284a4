"""Kernels that read and set the CPU generator: a recomputed random op (passes/recompute.py)
redraws what its original drew, and a pipeline job's random op draws what eager draws at it
(lower/job_programs.py)."""
from __future__ import annotations

import torch

from ..core import OpaqueType
from ..ops import kernel

__all__ = ["RNG_STATE", "get_rng_state", "set_rng_state"]

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
