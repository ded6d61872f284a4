"""The data feed: how the user's data reaches a planned step, and where it stands.

``Feed`` is what the engine asks for batches. It turns the user's data into global batches of
``(inputs, labels)`` (``loaders``), pads them to a planned shape (``data:``, ``padding``),
reads a stream in shards on real processes (``streams``), keeps the data position a
checkpoint records and a resume replays (``data_position``), hands the step its feeds on
the device, and gives the planned outputs back in the model's own structure, cut to the rows
and lengths the user gave. A new data feature is a change here, not in the engine.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils import _pytree as pytree

from ..capture import StepSpec, batch_paths, batch_size_of, flatten_batch
from ..ir import ProcessMesh
from ..strategy import Strategy
from .data_position import (
    DataPosition,
    EpochReader,
    loader_generators,
    position_between_epochs,
)
from .loaders import make_loader, on_device, pairs
from .padding import Fit, cut_outputs, fit_batch
from .streams import (
    Fitting,
    ReadShard,
    agreed,
    fed_rows,
    joined,
    shard_loader,
    stand_in,
    stream_shards,
)

__all__ = ["FEED_SECTIONS", "Feed"]

# the strategy sections the feed honours itself
FEED_SECTIONS: frozenset[str] = frozenset({"data"})

Batch = tuple[Any, Any]


class Feed:
    """Batches for one engine: ``strategy`` (its ``data:`` section and batch dim), the
    ``device`` steps run on, the processes' ``mesh``, and on real processes this one's
    ``rank`` and ``gather`` (every process's object: the agreement on a stream's next
    batch); both None when every rank is in this process."""

    def __init__(self, strategy: Strategy, device: torch.device, mesh: ProcessMesh | None,
                 rank: int | None = None, gather: Callable[[Any], list[Any]] | None = None):
        self.device, self.rank, self.gather = device, rank, gather
        self.use(strategy, mesh)
        self.planned_rows: dict[str, int] = {}    # ``data.pad_rows``: each mode's first rows
        self.train_data: Any = None                # fit's data: where it stands is recorded
        self.reader: EpochReader | None = None     # the current epoch's reader
        self.reading: ReadShard | None = None      # a real process's shard of a stream

    def use(self, strategy: Strategy, mesh: ProcessMesh | None) -> None:
        """Feed the plans of ``strategy`` on ``mesh`` (the one ``auto`` chose, from then on)."""
        self.strategy, self.mesh = strategy, mesh

    @property
    def batch_dim(self) -> int | dict[str, int]:
        return self.strategy.batch_dim

    def rows(self, inputs: Any) -> int:
        """The batch's rows (along the strategy's batch dim)."""
        return batch_size_of(inputs, self.batch_dim)

    # -- shapes -----------------------------------------------------------------------------
    def shaped(self, mode: str, inputs: Any, labels: Any) -> tuple[Any, Any, Fit]:
        """The batch padded to a planned shape (``data:``), its tensors contiguous: a plan
        is traced on one batch's layout (a ``view`` of a contiguous label tensor) and must
        run every batch of its shapes, whatever their strides (``y = tokens[:, 1:]``)."""
        data = self.strategy.data
        inputs, labels = pytree.tree_map(
            lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, (inputs, labels))
        if not data.is_enabled:
            return inputs, labels, Fit()
        rows = self.planned_rows.setdefault(mode, self.rows(inputs)) if data.pad_rows else None
        return fit_batch(inputs, labels, seq_dim=data.seq_dim, buckets=data.seq_buckets,
                         multiple=data.pad_to_multiple, rows=rows, pad_id=data.pad_id,
                         ignore_index=data.ignore_index, batch_dim=self.batch_dim)

    def planning_batch(self, inputs: Any, labels: Any) -> Batch:
        """What a training step is planned from: the batch, or on a process reading its
        shard of a stream, a stand-in of the global batch's shapes."""
        if self.reading is None:
            return inputs, labels
        return stand_in(inputs, labels, self.reading, self.batch_dim)

    # -- the step's feeds and results ---------------------------------------------------------
    def feeds(self, inputs: Any, labels: Any, param_groups: list[dict] | None = None,
              shard: bool = False) -> dict[str, Any]:
        """The step's feeds: the batch's tensors on the device (copied without blocking: from
        pinned memory the copy overlaps the host's next work), the param groups when
        training. ``shard``: the batch is this process's rows of the global one (a stream
        read in shards)."""
        leaves = [_on(t, self.device) for t in flatten_batch(inputs, labels)[0]]
        if shard and self.reading is not None:
            leaves = fed_rows(leaves, batch_paths(inputs, labels), self.reading,
                              self.batch_dim)
        feeds = {f"batch/{i}": t for i, t in enumerate(leaves)}
        feeds.update({f"param_groups/{i}": g for i, g in enumerate(param_groups or [])})
        return feeds

    def outputs(self, spec: StepSpec, leaves: list[Any], fit: Fit) -> Any:
        """The step's outputs in the model's own structure, cut back to the rows and
        lengths the batch had before it was padded."""
        return cut_outputs(_rebuild(spec, leaves), fit, self.batch_dim)

    # -- loaders ----------------------------------------------------------------------------
    def batches(self, data: Any, batch_size: int, collate_fn: Callable | None
                ) -> Iterator[Batch]:
        """Global batches on the device, each copied while the step before runs
        (``evaluate``, ``predict``)."""
        loader = make_loader(data, batch_size, collate_fn, pin_memory=self._pin)
        return on_device(pairs(loader), self.device)

    def begin(self, data: Any, saved: bytes | None, resumed_at: tuple[int, int] | None,
              logging_rank: bool) -> DataPosition | None:
        """``fit`` starts on ``data``: the data position a loaded checkpoint ``saved`` (its
        first epoch resumes from it), None when there is none."""
        self.train_data = data
        position = DataPosition.from_bytes(saved) \
            if resumed_at is not None and saved is not None else None
        if resumed_at is not None and resumed_at != (0, 0) and position is None:
            _warn_unseeded_loader(data, logging_rank)
        return position

    def epoch(self, data: Any, batch_size: int, collate_fn: Callable | None, shuffle: bool,
              epoch: int, skip: int, resume: DataPosition | None
              ) -> tuple[Iterator[Batch], int]:
        """One epoch's global batches on the device, and the index of the first: resuming,
        the first ``skip`` were trained before the checkpoint: replayed from the epoch's
        start (the first is 1), or, by a loader that continues from its own state, not read
        again (the first is ``skip + 1``)."""
        loader = self._epoch_loader(data, batch_size, collate_fn, shuffle, epoch)
        self.reader = EpochReader(loader, _own_generators(data), resume)
        first = skip + 1 if self.reader.continues else 1
        read = pairs(self.reader.batches(first))
        if self.reading is not None:     # a real process's shard: while every one has one
            read = agreed(read, self._fitting(), self.gather)
        return on_device(read, self.device), first

    def position(self, batch_in_epoch: int) -> bytes | None:
        """Where ``fit``'s data stands after ``batch_in_epoch`` batches of the current
        epoch, for a checkpoint (None before any fit)."""
        if self.train_data is None:
            return None
        if batch_in_epoch and self.reader is not None:
            position = self.reader.position(batch_in_epoch)
        else:
            position = position_between_epochs(self.train_data,
                                               _own_generators(self.train_data))
        return position.to_bytes() if position is not None else None

    def _epoch_loader(self, data: Any, batch_size: int, collate_fn: Callable | None,
                      shuffle: bool, epoch: int) -> Iterable:
        """One epoch's loader. A stream (an ``IterableDataset``) is read in shards by the
        data-parallel processes (``streams``): a real process reads its own, one process
        running every rank (simulated, serial) reads them all side by side."""
        self.reading = None
        if not isinstance(data, torch.utils.data.IterableDataset):
            return make_loader(data, batch_size, collate_fn, shuffle,
                               self.strategy.seed + epoch, self._pin)
        if shuffle:
            raise ValueError("fit(shuffle=True): a stream (IterableDataset) has no index to "
                             "shuffle; shuffle inside the dataset (a seeded buffer)")
        dp = self.strategy.data_parallel
        axes = dp.mesh_axes if dp is not None and self.strategy.auto is None else ()
        shards = stream_shards(axes, self.mesh, self.rank, batch_size)
        if len(shards) == 1:
            self.reading = shards[0] if shards[0].count > 1 else None
            return shard_loader(data, shards[0], collate_fn, self._pin)
        return joined([shard_loader(data, s, collate_fn, self._pin) for s in shards],
                      self.batch_dim, self._fitting())

    def _fitting(self) -> Fitting:
        """How the shards of a stream meet on one shape: padded as ``data:`` says."""
        data = self.strategy.data
        return Fitting(lambda x, y, n: fit_batch(
            x, y, seq_dim=data.seq_dim, buckets=(n,), multiple=None, rows=None,
            pad_id=data.pad_id, ignore_index=data.ignore_index,
            batch_dim=self.batch_dim)[:2], data.seq_dim, data.pads_sequence)

    @property
    def _pin(self) -> bool:
        """A loader made here pins its batches when a CUDA device reads them."""
        return self.device.type == "cuda"


def steps_in(data: Any, batch_size: int, limit: int | None) -> int | None:
    """Steps per epoch for the progress display, when the data has a length."""
    try:
        batches_in_data = len(data) if isinstance(data, torch.utils.data.DataLoader) \
            else -(-len(data) // batch_size)
    except TypeError:
        return limit
    return batches_in_data if limit is None else min(limit, batches_in_data)


def _own_generators(data: Any) -> list[torch.Generator]:
    """The generators a user's loader draws its order from (one made here over a dataset is
    seeded by its epoch)."""
    return loader_generators(data) if isinstance(data, torch.utils.data.DataLoader) else []


def _warn_unseeded_loader(data: Any, logging_rank: bool) -> None:
    """Resuming from a checkpoint without a data position (written before autopar kept
    one) replays an epoch's order up to its batch: a DataLoader that shuffles with the
    global generator draws another order in a new process."""
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None \
            and logging_rank:
        warnings.warn("resuming with a DataLoader that shuffles with torch's global generator: "
                      "its order differs from the interrupted run's; give it "
                      "generator=torch.Generator().manual_seed(...), or pass the dataset "
                      "and fit(shuffle=True), which seeds each epoch", stacklevel=4)


def _on(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def _rebuild(spec: StepSpec, leaves: list[Any]) -> Any:
    if spec.output_spec is None:
        return None
    tree = pytree.tree_unflatten(leaves, spec.output_spec)
    kind = spec.output_type
    if dataclasses.is_dataclass(kind) and isinstance(tree, dict):
        return kind(**tree)
    return tree
