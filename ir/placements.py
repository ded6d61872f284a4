"""Placements: how a tensor lies along one mesh dim, and their text.

``Shard(d)`` / ``Replicate()`` / ``Partial(op)`` — one placement per mesh dim, the same
vocabulary as DTensor and OneFlow SBP. Besides sum/avg/max/min, ``Partial(norm_partial(p))``
(text ``P(norm2)``, ``P(norm1)``, ``P(norminf)``) is DTensor's ``_NormPartial``: each rank
holds the p-norm of its piece and the value is the p-norm of those terms.
``Shard(d, groups=g)`` is a grouped shard (DTensor's ``_StridedShard``, Megatron's
interleaved fused qkv; layouts: ``shard_groups.py``): dim ``d`` is viewed as ``(g, n/g)``
and the inner part is chunked, so a rank holds its chunk of every group, in group order.

Also the checks a set of placements must pass on a mesh and for a tensor's shape, shared by
``DistAttr`` and the chunk arithmetic (which checks without building one).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from .mesh import ProcessMesh
from .shard_groups import Groups, format_groups, normalize_groups

__all__ = ["Placement", "Shard", "Replicate", "Partial", "PARTIAL_OPS", "norm_partial",
           "norm_order", "is_grouped", "format_placements", "parse_placements",
           "check_on_mesh", "check_shard_dims"]


PARTIAL_OPS = ("sum", "avg", "max", "min")
# The norm family: ``norm<p>`` for any order p > 0 (``norminf`` for the max-norm). A term is
# the p-norm of a rank's piece, so terms are never negative; the value is their p-norm.
_NORM = "norm"


def norm_partial(p: float) -> str:
    """The Partial op of a p-norm: ``norm2``, ``norm1``, ``norminf``, ``norm1.5`` (one
    spelling per order, so ``Partial`` equality is order equality)."""
    p = float(p)
    if not p > 0:
        raise ValueError(f"a norm partial needs an order p > 0 (got {p}): the terms of "
                         "smaller orders do not combine by the same norm")
    if math.isinf(p):
        return f"{_NORM}inf"
    return f"{_NORM}{int(p)}" if p.is_integer() else f"{_NORM}{p!r}"


def norm_order(op: str) -> float | None:
    """The order p of a norm partial op (``norm2`` -> 2.0), None for sum/avg/max/min."""
    if not op.startswith(_NORM):
        return None
    try:
        p = float(op[len(_NORM):])
    except ValueError:
        return None
    return p if p > 0 else None


@dataclass(frozen=True)
class Placement:
    """How a tensor lies along one mesh dim. Subclasses: Shard, Replicate, Partial."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim ``dim`` is cut into ``torch.chunk`` pieces along the mesh dim.

    ``dim`` is non-negative: a negative dim would make ``Shard(-1)`` and ``Shard(1)`` unequal
    spellings of one placement; normalise with ``dim % ndim`` first.

    ``groups=g`` views the dim as ``g`` consecutive equal parts and chunks each: the rank
    holds its chunk of each part, parts in order (a fused ``[q; k; v]`` weight cut so that
    every rank holds its heads of q, k and v). ``groups=(w0, w1, ...)`` gives the parts'
    relative widths (grouped-query attention's fused ``[q; k; v]`` with fewer kv heads:
    ``(2, 1, 1)``, text ``S(d)x2:1:1``). Widths are stored divided by their gcd, and equal
    widths are the count, so one layout has one spelling. ``Shard(d)`` is
    ``Shard(d, groups=1)``.
    """

    dim: int
    groups: Groups = 1

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim!r}): dim must be a non-negative int")
        object.__setattr__(self, "groups", normalize_groups(self.groups, f"Shard(dim={self.dim})"))

    @property
    def grouped(self) -> bool:
        return self.groups != 1

    def __str__(self) -> str:
        groups = "" if self.groups == 1 else f"x{format_groups(self.groups)}"
        return f"S({self.dim}){groups}"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank along the mesh dim holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a term; the tensor is the ``op``-reduction over the mesh dim:
    one of ``PARTIAL_OPS`` or a norm (``norm_partial(p)``: the p-norm of the terms)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        order = norm_order(self.op) if isinstance(self.op, str) else None
        if order is not None:
            object.__setattr__(self, "op", norm_partial(order))   # norm2.0 is norm2
        elif self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial(op={self.op!r}): op must be one of {PARTIAL_OPS} or "
                             "norm<p> for an order p > 0 (norm2, norm1, norminf)")

    @property
    def norm_order(self) -> float | None:
        """p for a norm partial, None otherwise."""
        return norm_order(self.op)

    def __str__(self) -> str:
        return f"P({self.op})"


def format_placements(placements: Iterable[Placement]) -> str:
    """``{S(0),R}`` — the placement part of a DistAttr's text."""
    return "{" + ",".join(str(p) for p in placements) + "}"


_PLACEMENT_TEXT = re.compile(r"^(?:S\((\d+)\)(?:x(\d+(?::\d+)*))?|R|"
                             r"P(?:\((sum|avg|max|min|norm(?:inf|[0-9.e+-]+))\))?)$")


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Inverse of ``format_placements``: ``"S(0),R"``, ``"{S(0),P(sum)}"``, ``"S(0)x3"``,
    ``"S(1)x2:1:1"``, ``"P(norm2)"``."""
    items = [t.strip() for t in text.strip().strip("{}").split(",") if t.strip()]
    placements: list[Placement] = []
    for item in items:
        match = _PLACEMENT_TEXT.match(item)
        if match is None:
            raise ValueError(f"cannot read placement {item!r} in {text!r}: expected S(<dim>), "
                             "S(<dim>)x<groups>, S(<dim>)x<w0>:<w1>:..., R or "
                             "P(sum|avg|max|min|norm<p>)")
        shard, groups, op = match.groups()
        widths = tuple(int(w) for w in (groups or "1").split(":"))
        placements.append(Shard(int(shard), widths if len(widths) > 1 else widths[0])
                          if shard is not None
                          else Replicate() if item == "R" else Partial(op or "sum"))
    return tuple(placements)


def is_grouped(placements: Iterable[Placement]) -> bool:
    """Whether any placement is a grouped shard (``Shard(d, groups>1)``)."""
    return any(isinstance(p, Shard) and p.grouped for p in placements)


def check_on_mesh(mesh: ProcessMesh, placements: tuple[Placement, ...]) -> None:
    """Raise unless ``mesh`` is a mesh and ``placements`` are one placement per mesh dim."""
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"DistAttr: mesh must be a ProcessMesh, got {mesh!r}")
    bad = [p for p in placements if not isinstance(p, Placement)]
    if bad:
        raise TypeError(f"DistAttr on {mesh}: not placements: {bad!r}")
    if len(placements) != mesh.ndim:
        raise ValueError(f"DistAttr: {len(placements)} placements "
                         f"{format_placements(placements)} for {mesh.ndim}-D {mesh}")


def check_shard_dims(mesh: ProcessMesh, placements: Sequence[Placement],
                     shape: Sequence[int]) -> None:
    """Raise ValueError unless every Shard dim exists in a tensor of ``shape``."""
    bad = [p for p in placements if p.is_shard() and p.dim >= len(shape)]
    if bad:
        raise ValueError(f"DistAttr {format_placements(placements)} on {mesh} "
                         f"shards dim {bad[0].dim} of a tensor of shape {list(shape)} "
                         f"({len(shape)} dims)")
