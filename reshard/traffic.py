"""The reshard cost model: bytes one rank moves to change a placement along one mesh dim.

Small and explicit on purpose: completion compares choices with it, and the reshard
planner picks step sequences with it. Ring algorithms: an all-gather or a
reduce-scatter moves (n-1)/n of the full tensor per rank, an all-reduce twice that, an
all-to-all (n-1)/n of the local piece.

These price placement changes: a ``Shift`` keeps its placement (S(t) -> S(t) is "none",
0 bytes) yet sends its whole piece, so its bytes are ``Shift.cost``'s, never these.
"""
from __future__ import annotations

from ..ir.dist import Partial, Placement, Replicate, Shard

# A local slice costs no communication but is not free: it copies. A tiny weight breaks ties
# toward doing nothing at all.
SLICE_WEIGHT = 1e-3


def collective(src: Placement, dst: Placement) -> str:
    """The collective that turns ``src`` into ``dst`` on one mesh dim (catalogue names)."""
    if src == dst:
        return "none"
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce"
        if isinstance(dst, Shard):
            return "reduce_scatter"
        return "all_reduce+partial"        # P(x) -> P(y) goes through R
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        if isinstance(dst, Shard):
            # a grouped shard has no all-to-all of its own: gather, then slice
            return "all_to_all" if src.groups == dst.groups == 1 else "all_gather+slice"
        return "all_gather+partial"        # S -> P goes through R
    if isinstance(dst, Shard):
        return "slice"
    return "make_partial"                  # R -> P: keep on one rank, zeros elsewhere


def reshard_bytes(src: Placement | None, dst: Placement, full_bytes: float, n: int) -> float:
    """Bytes a rank sends to move a tensor of ``full_bytes`` (its size before this mesh dim
    cuts it) from ``src`` to ``dst`` over a mesh dim of ``n`` ranks. ``src=None`` is a value
    with no placement yet: it can take any placement for free."""
    if src is None or n == 1:
        return 0.0
    kind = collective(src, dst)
    ring = full_bytes * (n - 1) / n
    return {
        "none": 0.0,
        "all_reduce": 2 * ring,
        "reduce_scatter": ring,
        "all_reduce+partial": 2 * ring,
        "all_gather": ring,
        "all_to_all": ring / n,
        "all_gather+partial": ring,
        "all_gather+slice": ring + SLICE_WEIGHT * full_bytes / n,
        "slice": SLICE_WEIGHT * full_bytes / n,
        "make_partial": 0.0,
    }[kind]


__all__ = ["collective", "reshard_bytes", "SLICE_WEIGHT"]
