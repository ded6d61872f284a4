"""``shard_tensor``: the user's placement annotations.

On a parameter (outside ``forward``) it records the placement for planning; inside
``forward`` it traces as the identity op ``autopar::annotate`` that carries the placement,
so completion pins the activation there and reshard moves it if its producer disagrees.
Run eagerly (outside autopar's capture) the call is a no-op, so an annotated model still
runs as plain torch.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .ir.annotation import encode
from .ir.dist import DistAttr, Placement, ProcessMesh

# Parameters annotated before planning: id(tensor) -> (weak ref, placement). Keyed by id
# (tensors compare elementwise); the weak ref tells a dead tensor from a reused id.
_PARAM_ANNOTATIONS: dict[int, tuple[weakref.ref, DistAttr]] = {}


def shard_tensor(tensor: torch.Tensor, mesh: ProcessMesh,
                 placements: Sequence[Placement]) -> torch.Tensor:
    """Place ``tensor`` on ``mesh``: one placement per mesh dim (``Shard(d)``,
    ``Replicate()``, ``Partial()``). Returns the tensor (an annotated activation inside a
    traced ``forward``)."""
    dist = DistAttr(mesh, tuple(placements)).check(tuple(tensor.shape))
    if get_proxy_mode() is not None:      # inside autopar's capture: an IR annotation op
        return torch.ops.autopar.annotate(tensor, encode(dist))
    if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        key = id(tensor)
        _PARAM_ANNOTATIONS[key] = (weakref.ref(tensor, lambda _: _PARAM_ANNOTATIONS.pop(key, None)),
                                   dist)
    return tensor


def param_annotation(tensor: torch.Tensor) -> DistAttr | None:
    ref, dist = _PARAM_ANNOTATIONS.get(id(tensor), (None, None))
    return dist if ref is not None and ref() is tensor else None


__all__ = ["shard_tensor", "param_annotation"]
