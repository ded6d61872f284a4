"""``python -m autopar export CKPT_DIR OUT``: the model of a checkpoint (``Engine.save``)
consolidated into one ``safetensors`` file, without the model or the strategy it was
trained under.

Each ``model.<fqn>`` value is read whole from whatever boxes the writing processes saved
(``BoxLoadPlanner``: DCP matches the saved boxes to one whole-tensor box) and streamed into
the file (``safetensors_file``), a few tensors per DCP load, so memory stays bounded by
``budget_bytes`` (or the largest tensor). Keys are the checkpoint's ``model.*`` keys
without the prefix. Without the model a tied weight's aliases cannot be known: the file has
them where the checkpoint stores them, else the canonical name only (Hugging Face
``from_pretrained`` re-ties the aliases itself; for a plain module that wants every
``state_dict`` key, ``Engine.save(path, format="full")``).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .boxes import MODEL, Box
from .dcp_planners import BoxLoadPlanner, Chunk
from .safetensors_file import SafetensorsWriter, TensorEntry, safetensors_path
from .store import SafeReader, is_checkpoint

__all__ = ["consolidate_model", "model_entries"]

DEFAULT_BUDGET = 1 << 30


def consolidate_model(checkpoint: str | os.PathLike, out: str | os.PathLike,
                budget_bytes: int = DEFAULT_BUDGET) -> Path:
    """Write the checkpoint's model tensors to ``out`` (a ``.safetensors`` file, or
    ``out/model.safetensors`` for a directory or a name without a suffix); returns the
    file."""
    checkpoint = Path(checkpoint)
    if not is_checkpoint(checkpoint):
        raise FileNotFoundError(f"export: {checkpoint} is not a complete checkpoint (a "
                                "directory with DCP's .metadata, not a .partial one)")
    entries = model_entries(checkpoint)
    with SafetensorsWriter(safetensors_path(out), entries) as writer:
        for batch in _batches(entries, budget_bytes):
            values = _read_whole(checkpoint, batch)
            for entry in batch:
                writer.write(entry.name, values.pop(entry.name))
    return writer.path


def model_entries(checkpoint: Path) -> list[TensorEntry]:
    """The checkpoint's ``model.*`` tensors, named without the prefix, in its order."""
    saved = SafeReader(checkpoint).read_metadata().state_dict_metadata
    entries = [TensorEntry(key[len(MODEL):], tuple(meta.size), meta.properties.dtype)
               for key, meta in saved.items()
               if key.startswith(MODEL) and isinstance(meta, TensorStorageMetadata)]
    if not entries:
        raise ValueError(f"export: {checkpoint} holds no model tensors ({MODEL}* keys)")
    return entries


def _batches(entries: list[TensorEntry], budget_bytes: int) -> Iterator[list[TensorEntry]]:
    """Consecutive entries of at most ``budget_bytes`` together (a larger tensor alone)."""
    batch: list[TensorEntry] = []
    size = 0
    for entry in entries:
        if batch and size + entry.nbytes > budget_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.nbytes
    if batch:
        yield batch


def _read_whole(checkpoint: Path, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Each entry's whole tensor, assembled from the saved boxes by one DCP load."""
    values = {e.name: torch.empty(e.shape, dtype=e.dtype) for e in entries}
    chunks = [Chunk(MODEL + e.name, e.shape,
                    Box((0,) * len(e.shape), e.shape, (0,) * len(e.shape)), values[e.name])
              for e in entries if e.nbytes]
    if chunks:
        with warnings.catch_warnings():
            # DCP warns that no process group exists: one process reads, as planned
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=SafeReader(checkpoint),
                     planner=BoxLoadPlanner(chunks, []), no_dist=True)
    return values
