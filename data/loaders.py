"""Turn what a user passes as data into global batches of ``(inputs, labels)``."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset


def _split_sample(batch: Any) -> tuple[Any, Any]:
    """A batch is ``(inputs, labels)``; anything else is inputs without labels."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return batch[0], batch[1]
    return batch, None


def make_loader(data: Dataset | DataLoader | Any, batch_size: int,
                collate_fn: Callable | None = None, shuffle: bool = False, seed: int = 0,
                pin_memory: bool = False) -> Iterable:
    """The loader of one epoch: the user's own, or one made here over a dataset (shuffling,
    when asked, is seeded); a loader made here pins its batches when ``pin_memory`` (a CUDA
    device reads them)."""
    if isinstance(data, DataLoader):
        return data
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      collate_fn=collate_fn, pin_memory=pin_memory)


def pairs(loaded: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """Each batch as ``(inputs, labels)``."""
    for batch in loaded:
        yield _split_sample(batch)


def on_device(pairs: Iterable[tuple[Any, Any]], device: torch.device
              ) -> Iterator[tuple[Any, Any]]:
    """``pairs`` with every tensor on ``device``, one batch ahead: the next batch's copies
    are issued (without blocking: from pinned memory they run on the copy engine) before the
    current one is handed out, so on CUDA they overlap the current step. On the CPU, as
    they come."""
    if device.type == "cpu":
        yield from pairs
        return
    ahead = None
    for pair in pairs:
        moved = pytree.tree_map(
            lambda t: t.to(device, non_blocking=True)
            if isinstance(t, torch.Tensor) and t.device != device else t, pair)
        if ahead is not None:
            yield ahead
        ahead = moved
    if ahead is not None:
        yield ahead
