"""The traced form of a placement annotation: ``autopar::annotate(x, "<placement>")``.

``shard_tensor`` (the user's call, ``autopar.annotations``) traces as this identity op
inside ``forward``; the op carries the placement as text, because a traced call's arguments
must be plain data. The annotation passes decode it back to a ``DistAttr``.
"""
from __future__ import annotations

import json
import weakref

import torch

from .dist import DistAttr, ProcessMesh, format_placements, parse_placements

ANNOTATE_TARGET = "autopar.annotate.default"

# Parameters annotated before planning: id(tensor) -> (weak ref, placement). Keyed by id
# (tensors compare elementwise); the weak ref tells a dead tensor from a reused id.
_PARAM_ANNOTATIONS: dict[int, tuple[weakref.ref, DistAttr]] = {}


def record_param_annotation(tensor: torch.Tensor, dist: DistAttr) -> None:
    """``shard_tensor`` on a parameter: its placement, read when a step is planned."""
    key = id(tensor)
    _PARAM_ANNOTATIONS[key] = (weakref.ref(tensor, lambda _: _PARAM_ANNOTATIONS.pop(key, None)),
                               dist)


def param_annotation(tensor: torch.Tensor) -> DistAttr | None:
    """The placement ``shard_tensor`` gave this parameter, if any."""
    ref, dist = _PARAM_ANNOTATIONS.get(id(tensor), (None, None))
    return dist if ref is not None and ref() is tensor else None


def param_annotations(model: torch.nn.Module) -> dict[str, DistAttr]:
    """The annotated parameters of ``model`` by name."""
    found = {name: param_annotation(p) for name, p in model.named_parameters()}
    return {name: dist for name, dist in found.items() if dist is not None}


def encode(dist: DistAttr) -> str:
    """The text a traced annotation op carries: mesh ids, dim names and placements."""
    return json.dumps({"mesh": dist.mesh.tolist(), "dim_names": list(dist.mesh.dim_names),
                       "placements": format_placements(dist.placements)})


def decode(text: str) -> DistAttr:
    data = json.loads(text)
    return DistAttr(ProcessMesh(data["mesh"], data["dim_names"]),
                    parse_placements(data["placements"]))


@torch.library.custom_op("autopar::annotate", mutates_args=())
def annotate_op(x: torch.Tensor, dist: str) -> torch.Tensor:
    return x.clone()


@annotate_op.register_fake
def _(x: torch.Tensor, dist: str) -> torch.Tensor:
    return torch.empty_like(x)


def _annotate_backward(ctx, grad: torch.Tensor):
    return grad, None   # the gradient is not pinned: completion places it by the rules


annotate_op.register_autograd(_annotate_backward)

__all__ = ["ANNOTATE_TARGET", "annotate_op", "encode", "decode", "param_annotation",
           "param_annotations", "record_param_annotation"]
