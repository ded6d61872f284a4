"""Kernels of pipeline jobs: a micro-batch's piece of a value (the generator's state is
set by ``rng.set_rng_state``)."""
from __future__ import annotations

import torch

from ..dist import chunk_grouped
from ..ops import kernel


@kernel("autopar.micro_batch_slice")
def micro_batch_slice(x: torch.Tensor, dim: int, micro_batches: int, index: int,
                      groups: int = 1) -> torch.Tensor:
    """Micro-batch ``index``'s piece of a value every micro-batch holds whole."""
    return chunk_grouped(x, dim, micro_batches, index, groups)


@kernel("autopar.micro_batch_term")
def micro_batch_term(x: torch.Tensor, op: str, index: int) -> torch.Tensor:
    """Micro-batch ``index``'s term of a value that is to be reduced over micro-batches:
    the first holds it, the others zeros, for a sum; every one holds it otherwise."""
    return x.clone() if op != "sum" or index == 0 else torch.zeros_like(x)
