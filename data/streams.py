"""Streaming datasets, read in shards by the data-parallel processes.

An ``IterableDataset`` given to ``fit`` is a stream: it has no length and no index, and
may be too large to hold. On real processes with the batch cut over data-parallel axes,
each of the ``count`` data-parallel groups reads only its shard of it, ``batch_size /
count`` rows per step (torchtitan's and Megatron's data loading): the global batch is the
shards' batches side by side, in data-parallel order. A dataset that shards itself (a
``shard(num_shards, index)`` method: Hugging Face ``datasets``) is asked for its shard;
any other is read round-robin (shard ``i`` keeps items ``i, i + count, ...``; each reader
iterates the stream but collates only its own items). Processes that differ only in their
tensor- or pipeline-parallel coordinates read the same shard. The simulator and a serial
run read all shards and put their batches side by side, so a plan sees the same global
batches wherever it runs.

Shards need not end together, nor hold equal lengths: each step the processes exchange
whether they still have a batch and its shapes (a small all-gather). The epoch ends for
all when one shard does; shapes that differ are padded to the longest one's bucket with
``data:`` padding, and refused by name without it. Each shard drops its last incomplete
batch (the rows per process are planned).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..capture import batch_dim_of, batch_paths, flatten_batch
from ..runtime import FedRows

__all__ = ["Fitting", "ReadShard", "RoundRobin", "StreamError", "agreed", "fed_rows", "joined",
           "shard_loader", "shard_stream", "stand_in", "stream_shards"]


class StreamError(ValueError):
    pass


class RoundRobin(IterableDataset):
    """Every ``count``-th item of ``dataset``, from item ``index``."""

    def __init__(self, dataset: Iterable, count: int, index: int):
        self.dataset, self.count, self.index = dataset, count, index

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self.dataset):
            if i % self.count == self.index:
                yield item


def shard_stream(dataset: Iterable, count: int, index: int) -> Iterable:
    """Shard ``index`` of ``count``: the dataset's own sharding when it has one (Hugging
    Face's ``shard(num_shards, index)``), round-robin otherwise."""
    if count == 1:
        return dataset
    own = getattr(dataset, "shard", None)
    if callable(own):
        return own(num_shards=count, index=index)
    return RoundRobin(dataset, count, index)


@dataclass(frozen=True)
class ReadShard:
    """Which shard of a stream a process reads: ``index`` of ``count`` (its position among
    the data-parallel groups), ``rows`` per step."""

    index: int
    count: int
    rows: int

    def global_rows(self) -> int:
        return self.rows * self.count


def shard_loader(dataset: Iterable, shard: ReadShard, collate_fn: Callable | None = None,
                 pin_memory: bool = False) -> DataLoader:
    """A loader of one shard's batches (its last incomplete one dropped)."""
    return DataLoader(shard_stream(dataset, shard.count, shard.index), batch_size=shard.rows,
                      drop_last=True, collate_fn=collate_fn, pin_memory=pin_memory)


def joined(loaders: list[Iterable], batch_dim: int | dict[str, int], fit: Fitting
           ) -> Iterator[Any]:
    """The shards' batches side by side along the batch dim (every shard read in this
    process: the simulator, a serial run), until one ends; fitted to one shape as the
    processes of a real run fit theirs (``agreed``)."""
    for parts in zip(*loaders):
        pairs = [_as_pair(p) for p in parts]
        shapes = [_shapes(*pair) for pair in pairs]
        if len(set(shapes)) > 1:
            longest = fit.longest(shapes)
            pairs = [fit.pad_to(*pair, longest) for pair in pairs]
        leaves = [flatten_batch(*pair)[0] for pair in pairs]
        _, rebuild = flatten_batch(*pairs[0])
        paths = batch_paths(*pairs[0])
        glued = [torch.cat(same, dim=batch_dim_of(batch_dim, path, tuple(same[0].shape)))
                 if same[0].dim() > 0 else same[0]
                 for path, same in zip(paths, zip(*leaves))]
        yield _from_pair(parts[0], rebuild(glued))


@dataclass(frozen=True)
class Fitting:
    """How shards' batches of different sequence lengths meet: ``pad_to(inputs, labels,
    length)`` pads one to ``length`` at ``seq_dim`` (``data:`` padding), when ``pads``."""

    pad_to: Callable[[Any, Any, int], tuple[Any, Any]]
    seq_dim: int
    pads: bool

    def longest(self, shapes: list[Any]) -> int:
        """The length every batch is padded to, or the refusal (shapes by rank)."""
        if not self.pads:
            raise StreamError(_disagreement(shapes))
        return max(s[self.seq_dim] for each in shapes for s in each if len(s) > self.seq_dim)


def _as_pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return batch[0], batch[1]
    return batch, None


def _from_pair(like: Any, pair: tuple[Any, Any]) -> Any:
    if isinstance(like, (list, tuple)) and len(like) == 2 and not hasattr(like, "_fields"):
        return type(like)(pair) if isinstance(like, tuple) else list(pair)
    return pair[0]


def _shapes(inputs: Any, labels: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in flatten_batch(inputs, labels)[0])


def agreed(pairs: Iterable[tuple[Any, Any]], fit: Fitting,
           gather: Callable[[Any], list[Any]]) -> Iterator[tuple[Any, Any]]:
    """This process's batches while every process has one, each fitted to the shape all
    processes agree on (padded to the longest one's length), or refused on every process
    when they cannot agree. ``gather``: every process's value (a collective)."""
    source = iter(pairs)
    while True:
        pair = next(source, None)
        everyone = gather(None if pair is None else _shapes(*pair))
        if any(s is None for s in everyone):
            return
        yield pair if len(set(everyone)) == 1 else fit.pad_to(*pair, fit.longest(everyone))


def _disagreement(everyone: list[Any]) -> str:
    seen = {}
    for rank, shapes in enumerate(everyone):
        seen.setdefault(shapes, []).append(rank)
    told = "; ".join(f"ranks {ranks}: {[list(s) for s in shapes]}" for shapes, ranks in
                     seen.items())
    return (f"a sharded stream's processes read batches of different shapes this step "
            f"({told}): every process runs one plan, so they must agree; pad them to "
            "planned lengths (data: {seq_buckets: [...]} or {pad_to_multiple: N})")


def stream_shards(data_axes: tuple[str, ...], mesh: Any, rank: int | None, batch_size: int
                  ) -> list[ReadShard]:
    """The shards this process reads of a stream: its own one on a real process (``rank``),
    every one when a single process runs them all (``rank`` None). ``mesh``: the strategy's
    (None: serial); ``data_axes``: the mesh dims the batch is cut over, in order."""
    sizes = [] if mesh is None else [mesh.shape[mesh.dim_names.index(a)]
                                     for a in data_axes if a in mesh.dim_names]
    count = int(torch.tensor(sizes).prod()) if sizes else 1
    if batch_size % count:
        raise StreamError(f"a stream sharded over data-parallel axes {list(data_axes)} "
                          f"({count} readers) needs batch_size divisible by {count}, got "
                          f"{batch_size}")
    rows = batch_size // count
    if rank is None or count == 1:
        return [ReadShard(i, count, rows) for i in range(count)]
    coordinate = mesh.coordinate(rank)
    index = 0
    for axis in data_axes:
        dim = mesh.dim_names.index(axis)
        index = index * mesh.shape[dim] + coordinate[dim]
    return [ReadShard(index, count, rows)]


def stand_in(inputs: Any, labels: Any, shard: ReadShard, batch_dim: int | dict[str, int]
             ) -> tuple[Any, Any]:
    """A global batch of this process's batch's shapes, to plan with (its rows repeated)."""
    leaves, rebuild = flatten_batch(inputs, labels)
    paths = batch_paths(inputs, labels)
    wide = [torch.cat([t] * shard.count, dim=batch_dim_of(batch_dim, p, tuple(t.shape)))
            if t.dim() > 0 else t for p, t in zip(paths, leaves)]
    return rebuild(wide)


def fed_rows(leaves: list[torch.Tensor], paths: list[str], shard: ReadShard,
             batch_dim: int | dict[str, int]) -> list[Any]:
    """This process's tensors as the rows of the global batch it holds."""
    return [FedRows(t, d, shard.index * t.shape[d], t.shape[d] * shard.count)
            if t.dim() > 0 else t
            for t, p in zip(leaves, paths)
            for d in [batch_dim_of(batch_dim, p, tuple(t.shape)) if t.dim() > 0 else 0]]
