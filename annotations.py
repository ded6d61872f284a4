"""``shard_tensor``: the user's placement annotations.

On a parameter (outside ``forward``) it records the placement for planning; inside
``forward`` it traces as the identity op ``autopar::annotate`` that carries the placement,
so completion pins the activation there and reshard moves it if its producer disagrees.
Run eagerly (outside autopar's capture) the call is a no-op, so an annotated model still
runs as plain torch.
"""
from __future__ import annotations

import json
import weakref
from typing import Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .ir.dist import (DistAttr, Placement, ProcessMesh, format_placements, parse_placements)

ANNOTATE_TARGET = "autopar.annotate.default"

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


def encode(dist: DistAttr) -> str:
    """The text a traced annotation op carries: mesh ids, dim names and placements."""
    return json.dumps({"mesh": dist.mesh.tolist(), "dim_names": list(dist.mesh.dim_names),
                       "placements": format_placements(dist.placements)})


def decode(text: str) -> DistAttr:
    data = json.loads(text)
    return DistAttr(ProcessMesh(data["mesh"], data["dim_names"]),
                    parse_placements(data["placements"]))


@torch.library.custom_op("autopar::annotate", mutates_args=())
def _annotate(x: torch.Tensor, dist: str) -> torch.Tensor:
    return x.clone()


@_annotate.register_fake
def _(x: torch.Tensor, dist: str) -> torch.Tensor:
    return torch.empty_like(x)


def _annotate_backward(ctx, grad: torch.Tensor):
    return grad, None   # the gradient is not pinned: completion places it by the rules


_annotate.register_autograd(_annotate_backward)

__all__ = ["shard_tensor", "param_annotation", "encode", "decode", "ANNOTATE_TARGET"]
