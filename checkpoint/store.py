"""A checkpoint directory's lifecycle: written under a temporary name and made visible by
one rename once every process has finished, found again (the newest complete one), pruned
to the last K, and read back without unpickling arbitrary objects.

DCP writes its ``.metadata`` last, but its data files in place: a directory is a
checkpoint only once complete, so every save writes ``<name>.partial`` and the coordinator
renames it after DCP returned on every process (DCP gathers every process's write result
before writing ``.metadata``, and raises on every process when one failed). A crash at any
point leaves the previous checkpoints as they were; ``latest_checkpoint`` skips partial
ones.

DCP unpickles ``.metadata`` with plain ``pickle``; ``SafeReader`` reads it with an
unpickler that resolves only DCP's own metadata classes and torch's dtypes and sizes (as
``torch.load(weights_only=True)`` refuses arbitrary globals). Tensor data is read by DCP
with ``weights_only=True``; the engine's own non-tensor state is JSON.
"""
from __future__ import annotations

import os
import pathlib
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint import metadata as _metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["CheckpointDir", "SafeReader", "latest_checkpoint", "is_checkpoint",
           "PARTIAL_SUFFIX"]

PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"^step_(\d+)$")

_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_metadata.__name__, name): getattr(_metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")},
    (_filesystem.__name__, "_StorageInfo"): _filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    # maps a layout's name ("torch.strided") to the layout, nothing else
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("pathlib", name): getattr(pathlib, name) for name in (
        "Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
            "metadata: refusing to unpickle it (a checkpoint from an untrusted source?)")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds {type(metadata).__name__}, not DCP "
                                         "metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A complete checkpoint: a directory with DCP's ``.metadata``, not a partial one."""
    path = Path(path)
    return not path.name.endswith(PARTIAL_SUFFIX) and (path / ".metadata").is_file()


def latest_checkpoint(save_dir: str | os.PathLike) -> Path | None:
    """The complete ``step_<N>`` checkpoint with the highest N under ``save_dir``."""
    found = [(int(m.group(1)), p) for p in Path(save_dir).glob("step_*")
             if (m := _STEP_DIR.match(p.name)) and is_checkpoint(p)]
    return max(found)[1] if found else None


class CheckpointDir:
    """The directories of one save: DCP writes into ``partial``; ``commit`` makes it
    ``final`` (replacing an older checkpoint of that name only once the new one is
    complete)."""

    def __init__(self, final: str | os.PathLike):
        self.final = Path(final)
        self.partial = self.final.with_name(self.final.name + PARTIAL_SUFFIX)

    def prepare(self) -> None:
        """Coordinator, before anyone writes: clear a partial directory a crash left."""
        if self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True)

    def commit(self) -> None:
        """Coordinator, after every process wrote: the one step that makes it visible."""
        old = self.final.with_name(self.final.name + ".old")
        if self.final.exists():
            self.final.rename(old)
        self.partial.rename(self.final)
        if old.exists():
            shutil.rmtree(old)


def prune(save_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete ``step_<N>`` checkpoints (and any
    partial one older than the newest complete one); returns what was removed."""
    steps = sorted((int(m.group(1)), p) for p in Path(save_dir).glob("step_*")
                   if (m := _STEP_DIR.match(p.name)) and is_checkpoint(p))
    doomed = [p for _, p in steps[:-keep_last]] if keep_last > 0 else []
    newest = steps[-1][0] if steps else None
    for p in Path(save_dir).glob(f"step_*{PARTIAL_SUFFIX}"):
        m = _STEP_DIR.match(p.name[:-len(PARTIAL_SUFFIX)])
        if m and newest is not None and int(m.group(1)) < newest:
            doomed.append(p)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
