"""Grouped shard layouts: how ``Shard(d, groups=...)`` views a dim as consecutive parts.

A layout is a count of equal parts (``3``) or the parts' relative widths (``(2, 1, 1)``:
grouped-query attention's fused ``[q | k | v]`` with half as many kv heads). One layout has
one spelling (``normalize_groups``) and one text (``format_groups``: ``3``, ``2:1:1``).
"""
from __future__ import annotations

import math

__all__ = ["Groups", "normalize_groups", "group_total", "group_widths", "group_starts",
           "format_groups"]


# A grouped shard's parts: a count of equal parts, or the parts' relative widths.
Groups = int | tuple[int, ...]


def normalize_groups(groups: object, what: str = "Shard") -> Groups:
    """The one spelling of a group layout: a positive count, or relative widths (two or
    more positive ints) divided by their gcd; equal widths become their count."""
    if isinstance(groups, (tuple, list)):
        widths = tuple(groups)
        if len(widths) < 2 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
                                  for w in widths):
            raise ValueError(f"{what}, groups={groups!r}: group widths must be two or more "
                             "positive ints")
        if len(set(widths)) == 1:
            return len(widths)
        g = math.gcd(*widths)
        return tuple(w // g for w in widths)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{what}, groups={groups!r}: groups must be a positive int or a "
                         "tuple of relative widths")
    return groups


def group_total(groups: Groups) -> int:
    """The sum of a layout's relative widths: a dim it cuts must be a multiple of it."""
    return groups if isinstance(groups, int) else sum(groups)


def group_widths(groups: Groups, size: int, what: str = "") -> tuple[int, ...]:
    """The parts' absolute widths in a dim of ``size``; ValueError when they are not whole."""
    total = group_total(groups)
    if size % total:
        layout = f"{total} groups" if isinstance(groups, int) else \
            f"groups {format_groups(groups)} ({total} units)"
        raise ValueError(f"{what + ': ' if what else ''}a piece of size {size} does not "
                         f"divide into {layout}")
    unit = size // total
    return (unit,) * groups if isinstance(groups, int) else tuple(w * unit for w in groups)


def format_groups(groups: Groups) -> str:
    """``3`` for equal parts, ``2:1:1`` for relative widths."""
    return str(groups) if isinstance(groups, int) else ":".join(map(str, groups))


def group_starts(groups: Groups, size: int, what: str = "") -> list[tuple[int, int]]:
    """(start, width) of each group of a dim of ``size``."""
    widths = group_widths(groups, size, what)
    return [(sum(widths[:k]), w) for k, w in enumerate(widths)]
