"""Lowering table: IR op target -> the Python callable that runs it.

ATen targets resolve to their ``torch.ops`` overload by name; other targets (optimizer
updates, later collectives) register here with ``@kernel``. A target with no entry fails
naming the op and this table.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

KERNELS: dict[str, Callable] = {}
# Optional list-taking versions: a run of ops with one target that share the arguments at
# ``shared`` positions (e.g. one optimizer param group) becomes one call taking lists at the
# other positions, as torch.optim updates a whole param group at once.
BATCHED: dict[str, tuple[Callable, frozenset[int]]] = {}


def kernel(target: str, batched: Callable | None = None,
           shared: Iterable[int] = ()) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        if target in KERNELS:
            raise ValueError(f"kernel for {target!r} registered twice")
        KERNELS[target] = fn
        if batched is not None:
            BATCHED[target] = (batched, frozenset(shared))
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


@kernel("autopar.annotate")
def _annotate(x: torch.Tensor) -> torch.Tensor:
    """A placement annotation; on a rank's local program it is the identity."""
    return x


# -- pipeline jobs ---------------------------------------------------------------------------

@kernel("autopar.set_rng_state")
def _set_rng_state(state: torch.Tensor) -> None:
    """Put the CPU generator where eager's is at a random op (a pipeline rank does not run
    the random ops of other stages, which eager drew before this one)."""
    torch.default_generator.set_state(state)


@kernel("autopar.micro_batch_slice")
def _micro_batch_slice(x: torch.Tensor, dim: int, micro_batches: int, index: int,
                       groups: int = 1) -> torch.Tensor:
    """Micro-batch ``index``'s piece of a value every micro-batch holds whole."""
    from ..ir.dist import chunk_grouped
    return chunk_grouped(x, dim, micro_batches, index, groups)


@kernel("autopar.micro_batch_term")
def _micro_batch_term(x: torch.Tensor, op: str, index: int) -> torch.Tensor:
    """Micro-batch ``index``'s term of a value that is to be reduced over micro-batches:
    the first holds it, the others zeros, for a sum; every one holds it otherwise."""
    return x.clone() if op != "sum" or index == 0 else torch.zeros_like(x)
