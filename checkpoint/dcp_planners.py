"""DCP planners over boxes: this process's boxes of each state value out (``BoxSavePlanner``)
and into the boxes of the pieces it holds under any layout (``BoxLoadPlanner``).

DCP's default planners take tensors or DTensors (one chunk per rank). A piece here may be
several boxes (a grouped shard) and a simulated run writes every rank's boxes from one
process, so the planners take the boxes directly: ``Chunk`` pairs a box's place in the
global tensor with the tensor view that holds it. Matching saved and wanted boxes is DCP's
own ``create_read_items_for_chunk_list``; the global save plan and its validation (the boxes
tile each tensor) are DCP's too.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .boxes import Box

__all__ = ["Chunk", "BoxSavePlanner", "BoxLoadPlanner"]


@dataclass(frozen=True)
class Chunk:
    """A box of the value under checkpoint key ``key`` (global shape ``shape``) and the
    tensor holding exactly that box (read from when saving, written into when loading)."""

    key: str
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor

    @property
    def storage(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.box.offsets),
                                    sizes=torch.Size(self.box.sizes))


class BoxSavePlanner(SavePlanner):
    """Writes ``chunks`` (this process's boxes), from the coordinator ``blobs`` (bytes by
    key), and from every process its ``own_blobs`` (keys no other process writes)."""

    def __init__(self, chunks: list[Chunk], blobs: dict[str, bytes],
                 own_blobs: dict[str, bytes] | None = None):
        self.chunks = {(c.key, c.box.offsets): c for c in chunks}
        if len(self.chunks) != len(chunks):
            raise ValueError("a box is listed twice for one checkpoint key")
        self.blobs, self.own_blobs = blobs, dict(own_blobs or {})
        self.is_coordinator = False

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False
                       ) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(c.key, torch.Size(c.box.offsets)),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=c.storage,
                               properties=TensorProperties(dtype=c.tensor.dtype),
                               size=torch.Size(c.shape)))
                 for c in self.chunks.values()]
        written = [*(self.blobs if self.is_coordinator else ()), *self.own_blobs]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                  for key in written]
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans)
        errors = _validate_global_plan(plans, metadata)
        if errors:
            raise ValueError("the boxes written do not tile every tensor exactly once: "
                             + "; ".join(errors)[:2000])
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            key = write_item.index.fqn
            return io.BytesIO(self.own_blobs[key] if key in self.own_blobs else self.blobs[key])
        tensor = self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))].tensor
        tensor = tensor.detach().cpu()
        if tensor.is_contiguous() and tensor.storage_offset() == 0 and \
                tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
            return tensor
        return tensor.clone()    # torch.save of a view would write its whole storage


class BoxLoadPlanner(LoadPlanner):
    """Fills ``chunks`` (the boxes of the pieces this process holds) from the saved boxes
    they overlap, and reads the JSON ``blobs`` named in ``blob_keys``."""

    def __init__(self, chunks: list[Chunk], blob_keys: list[str]):
        self.chunks = chunks
        self.blob_keys = blob_keys
        self.blobs: dict[str, bytes] = {}
        self.metadata: Metadata | None = None

    def set_up_planner(self, state_dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        by_key: dict[str, list[int]] = {}
        for i, chunk in enumerate(self.chunks):
            by_key.setdefault(chunk.key, []).append(i)
        for key, indices in by_key.items():
            reads = create_read_items_for_chunk_list(
                key, saved[key], [self.chunks[i].storage for i in indices])
            for read in reads:   # the local index there counts this key's chunks only
                items.append(_retarget(read, indices[read.dest_index.index]))
        for key in self.blob_keys:
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)),
                                  storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        chunk = self.chunks[read_item.dest_index.index]
        view = chunk.tensor
        for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(d, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The reader copied into the view ``resolve_tensor`` gave: nothing left to do."""


def _retarget(read: ReadItem, chunk_index: int) -> ReadItem:
    """``read`` pointed at ``chunk_index`` of all this process's chunks."""
    index = read.dest_index
    return ReadItem(type=read.type,
                    dest_index=MetadataIndex(index.fqn, index.offset, chunk_index),
                    dest_offsets=read.dest_offsets, storage_index=read.storage_index,
                    storage_offsets=read.storage_offsets, lengths=read.lengths)
