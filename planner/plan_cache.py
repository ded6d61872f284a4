"""Planned programs kept on disk (``plan_cache_dir``), so a restarted job, or another
engine over the same model and strategy, skips the passes and the lowering.

The key is everything the passes and the lowering read: the captured program's text (the
model's step as traced on this batch's shapes, so any change to the model's code or
parameters that changes the step changes the key), the strategy, the optimizer's class and
options, the placements given or kept, the processes lowered, the mode, and the versions of
torch and of autopar's own source. A hit loads the planned program, its facts and every
process's lowered program; capture still runs (it makes the key). Files are written
atomically (one per key), so ranks and concurrent jobs may share a directory.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

_SOURCE = Path(__file__).resolve().parents[1]     # the autopar package


@functools.lru_cache(maxsize=1)
def source_version() -> str:
    """A digest of autopar's own source files: a plan made by other code is another plan."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(str(path.relative_to(_SOURCE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _source_files() -> list[Path]:
    """The package's modules: its top-level ones and those of its subpackages (folders
    with an ``__init__.py``), not a checkout's tests, benchmarks or virtual environment."""
    packages = [d for d in _SOURCE.iterdir() if (d / "__init__.py").is_file()
                and d.name not in ("tests", "bench")]
    return sorted([*_SOURCE.glob("*.py"), *(p for d in packages for p in d.rglob("*.py"))])


def _optimizer(optimizer: torch.optim.Optimizer | None) -> str:
    if optimizer is None:
        return "none"
    groups = [(len(g["params"]), sorted((k, repr(v)) for k, v in g.items() if k != "params"))
              for g in optimizer.param_groups]
    return f"{type(optimizer).__qualname__} {groups}"


def plan_key(program_text: str, **inputs: Any) -> str:
    """The cache key of a plan: the captured program and the planning inputs (each turned
    into text by ``repr``; an optimizer by its class and options)."""
    digest = hashlib.sha256(program_text.encode())
    for name in sorted(inputs):
        value = inputs[name]
        text = _optimizer(value) if isinstance(value, torch.optim.Optimizer) else repr(value)
        digest.update(f"\n{name}={text}".encode())
    digest.update(f"\ntorch={torch.__version__} autopar={source_version()}".encode())
    return digest.hexdigest()


class PlanCache:
    """Pickled ``(program, facts, timings, lowered)`` tuples in ``directory``, by key."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.plan"

    def load(self, key: str) -> tuple | None:
        path = self._path(key)
        if not path.exists():
            return None
        with path.open("rb") as stream:
            return pickle.load(stream)

    def save(self, key: str, planned: tuple) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as stream:
                pickle.dump(planned, stream, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
