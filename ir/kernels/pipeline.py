"""Kernels of pipeline jobs: a micro-batch's piece of a value (the generator's state is
set by ``rng.set_rng_state``), and batch norm by a micro-batch's own statistics."""
from __future__ import annotations

import torch

from ..ops import kernel
from ..reference import chunk_grouped


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


# -- batch norm with per-micro-batch statistics (pipeline.batch_norm: per_micro_batch) ------
@kernel("autopar.micro_batch_norm")
def micro_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     momentum: float, eps: float, index: int = 0, micro_batches: int = 1):
    """Training batch norm of micro-batch ``index`` by its own statistics: ``(out, mean,
    invstd, mean_term, var_term)``. The terms are this micro-batch's share of the running
    statistics after all ``micro_batches`` updates in order: ``momentum * stat`` (ATen's
    own update of a zero statistic, the variance unbiased) times ``(1 - momentum)`` per
    later micro-batch; the sum over micro-batches plus ``old * (1 - momentum)**m`` is what
    ``m`` updates one after another leave."""
    mean_term = x.new_zeros(x.shape[1])
    var_term = x.new_zeros(x.shape[1])
    out, mean, invstd = torch.ops.aten.native_batch_norm.default(
        x, weight, bias, mean_term, var_term, True, momentum, eps)
    later = (1.0 - momentum) ** (micro_batches - 1 - index)
    return out, mean, invstd, mean_term * later, var_term * later


@kernel("autopar.micro_batch_norm_backward")
def micro_batch_norm_backward(grad_out: torch.Tensor, x: torch.Tensor,
                              weight: torch.Tensor | None, mean: torch.Tensor,
                              invstd: torch.Tensor, eps: float, output_mask: list[bool]):
    """The backward of ``micro_batch_norm`` on one micro-batch (its saved statistics)."""
    return torch.ops.aten.native_batch_norm_backward.default(
        grad_out, x, weight, None, None, mean, invstd, True, eps, output_mask)
