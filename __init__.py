"""autopar: a static-graph auto-parallel training engine for PyTorch.

A user's ``nn.Module``, loss and ``torch.optim`` optimizer are captured as one program of the
whole training step, transformed by passes into one program per rank, and run.
"""
from .annotations import shard_tensor
from .engine import Engine, PackedDataset, callbacks
from .ir.dist import Partial, ProcessMesh, Replicate, Shard
from .strategy import Strategy

__all__ = ["Engine", "PackedDataset", "Partial", "callbacks", "ProcessMesh", "Replicate", "Shard",
           "Strategy", "shard_tensor"]
