"""A streaming ``safetensors`` writer: the header is computed up front from each tensor's
name, shape and dtype, then the tensors are written one at a time, in header order, as
they arrive, so no caller ever holds more than one whole tensor.

``safetensors.torch.save_file`` takes every tensor at once: exporting a model gathered from
its pieces would hold the whole model in memory. The format (safetensors' own spec): an
8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
plus ``__metadata__`` (string values), padded with spaces to 8-byte alignment, then each
tensor's raw little-endian bytes, back to back, at its ``data_offsets`` (relative to the end
of the header). The file is written under ``<name>.partial`` and renamed once complete, so a
crash never leaves a truncated file under the final name.
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Iterable, Mapping

import torch

__all__ = ["TensorEntry", "SafetensorsWriter", "safetensors_path", "DTYPES", "PT_METADATA"]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
# what ``safetensors.torch.save_file`` writes; Hugging Face's loaders check it
PT_METADATA = {"format": "pt"}
FILE_NAME = "model.safetensors"
_METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file, as its header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def safetensors_path(path: str | os.PathLike) -> Path:
    """Where an export to ``path`` goes: ``path`` itself when it names a file, else
    ``path/model.safetensors`` (a directory, or a name without a suffix: Hugging Face's
    ``from_pretrained`` reads that file from a model directory)."""
    path = Path(path)
    return path / FILE_NAME if path.is_dir() or not path.suffix else path


def header_bytes(entries: Iterable[TensorEntry], metadata: Mapping[str, str] | None) -> bytes:
    """The length prefix and the padded JSON header for ``entries``, in that data order."""
    header: dict[str, object] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(v, str)}
        if bad:
            raise TypeError(f"safetensors metadata values must be strings: {bad}")
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for e in entries:
        if e.name == _METADATA_KEY or e.name in header:
            raise ValueError(f"safetensors: tensor name {e.name!r} is "
                             + ("reserved" if e.name == _METADATA_KEY else "listed twice"))
        if e.dtype not in DTYPES:
            raise TypeError(f"safetensors: tensor {e.name!r} has dtype {e.dtype}, which the "
                            f"format has no code for (supported: "
                            f"{', '.join(str(d) for d in DTYPES)})")
        header[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """Writes ``entries`` to ``path``: ``write(name, tensor)`` for each, in order, then
    ``close()`` (or use it as a context manager: an exception inside removes the partial
    file). A tensor that is not the next entry, or not of its shape and dtype, is refused
    with its name."""

    def __init__(self, path: str | os.PathLike, entries: Iterable[TensorEntry],
                 metadata: Mapping[str, str] | None = PT_METADATA):
        if sys.byteorder != "little":
            raise RuntimeError("safetensors stores little-endian bytes; this host is "
                               f"{sys.byteorder}-endian")
        self.path = Path(path)
        self.entries = list(entries)
        header = header_bytes(self.entries, metadata)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.partial, "wb")
        self._file.write(header)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next entry's value (moved to the CPU if it is elsewhere)."""
        if self._next >= len(self.entries):
            raise ValueError(f"safetensors {self.path}: tensor {name!r} after the last "
                             f"entry ({len(self.entries)} tensors listed)")
        entry = self.entries[self._next]
        if name != entry.name:
            raise ValueError(f"safetensors {self.path}: got tensor {name!r}, expected "
                             f"{entry.name!r} next (tensors are written in header order)")
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(f"safetensors {self.path}: tensor {name!r} is "
                             f"{tensor.dtype} {list(tensor.shape)}, the header says "
                             f"{entry.dtype} {list(entry.shape)}")
        if tensor.is_meta:
            raise ValueError(f"safetensors {self.path}: tensor {name!r} is on the meta "
                             "device (no values to write)")
        data = tensor.detach().to("cpu").contiguous()
        if entry.nbytes:
            # the tensor's own memory as a buffer: no copy, and no numpy (no bfloat16 there)
            self._file.write((ctypes.c_char * entry.nbytes).from_address(data.data_ptr()))
        self._next += 1

    def close(self) -> Path:
        """Every entry written: flush to disk and move the file to its final name."""
        missing = [e.name for e in self.entries[self._next:]]
        if missing:
            self.abort()
            raise ValueError(f"safetensors {self.path}: closed with {len(missing)} tensor(s) "
                             f"not written: {', '.join(missing[:20])}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file (the final name is left as it was)."""
        self._file.close()
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
