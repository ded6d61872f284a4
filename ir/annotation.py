"""The traced form of a placement annotation: ``autopar::annotate(x, "<placement>")``.

``shard_tensor`` (the user's call, ``autopar.annotations``) traces as this identity op
inside ``forward``; the op carries the placement as text, because a traced call's arguments
must be plain data. The annotation passes decode it back to a ``DistAttr``.
"""
from __future__ import annotations

import json

import torch

from .dist import DistAttr, ProcessMesh, format_placements, parse_placements

ANNOTATE_TARGET = "autopar.annotate.default"


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

__all__ = ["ANNOTATE_TARGET", "annotate_op", "encode", "decode"]
