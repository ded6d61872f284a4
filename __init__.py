"""autopar: a static-graph auto-parallel training engine for PyTorch.

A user's ``nn.Module``, loss and ``torch.optim`` optimizer are captured as one program of the
whole training step, transformed by passes into one program per rank, and run.

``autopar.__version__`` is the installed distribution's version (``importlib.metadata``, as
in pyproject.toml); ``"0.0.0+unknown"`` where autopar is imported without being installed.
"""
from importlib import metadata as _metadata

from .annotations import shard_tensor
from .data import PackedDataset, PackingCollator, pack_documents
from .engine import Engine, callbacks
from .ir.dist import Partial, ProcessMesh, Replicate, Shard
from .strategy import Strategy

try:
    __version__ = _metadata.version("autopar")
except _metadata.PackageNotFoundError:        # imported from a copy of the source, never installed
    __version__ = "0.0.0+unknown"

__all__ = ["Engine", "PackedDataset", "PackingCollator", "Partial", "callbacks", "ProcessMesh",
           "Replicate", "Shard", "Strategy", "pack_documents", "shard_tensor"]
