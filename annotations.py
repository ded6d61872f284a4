"""``shard_tensor``: the user's placement annotations.

On a parameter (outside ``forward``) it records the placement for planning; inside
``forward`` it traces as the identity op ``autopar::annotate`` that carries the placement,
so completion pins the activation there and reshard moves it if its producer disagrees.
Run eagerly (outside autopar's capture) the call is a no-op, so an annotated model still
runs as plain torch.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .ir.annotation import encode, param_annotation, record_param_annotation
from .ir.dist import DistAttr, Placement, ProcessMesh


def shard_tensor(tensor: torch.Tensor, mesh: ProcessMesh,
                 placements: Sequence[Placement]) -> torch.Tensor:
    """Place ``tensor`` on ``mesh``: one placement per mesh dim (``Shard(d)``,
    ``Replicate()``, ``Partial()``). Returns the tensor (an annotated activation inside a
    traced ``forward``)."""
    dist = DistAttr(mesh, tuple(placements)).check(tuple(tensor.shape))
    if get_proxy_mode() is not None:      # inside autopar's capture: an IR annotation op
        return torch.ops.autopar.annotate(tensor, encode(dist))
    if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        record_param_annotation(tensor, dist)
    return tensor


__all__ = ["shard_tensor", "param_annotation"]
