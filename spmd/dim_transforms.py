"""What a reshape does to each dim, and which shardings survive it.

A row-major reshape never moves data; it only regroups dims. Walking the two shapes left to
right pairs runs of input dims with runs of output dims of equal product (a *group*); each
group reshapes on its own. Every output dim is then one of:

* ``InputDim(i)``   — input dim ``i`` unchanged;
* ``Singleton()``   — a new size-1 dim;
* ``Flatten(dims)`` — several input dims merged into one;
* ``Split(dims, pieces, k)`` — one input dim (or several merged) cut into the output dims
  of sizes ``pieces``; this output dim is piece ``k``.

``(6,12,48) -> (72,6,8)`` is ``[Flatten((0,1)), Split(2,(6,8),0), Split(2,(6,8),1)]`` and
``(4,6) -> (3,8)`` is ``[Split((0,1),(3,8),0), Split((0,1),(3,8),1)]``.

Sharding: a shard of a group's leftmost input dim is a contiguous run of the group's
elements, so it stays a shard of the group's first output dim -- when every shard has the
same size, i.e. the cut divides both dims (torch.chunk pieces of uneven size start at
different element offsets before and after the reshape). Any other input dim of a group
cannot stay sharded: its shards are strided, not contiguous.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from .spec import UNSHARDABLE, Spec, letters

Shape = Sequence[int]
# Data-movement ops commute with every elementwise cross-rank reduction.
MOVE_PARTIALS = frozenset({"sum", "avg", "max", "min"})


@dataclass(frozen=True)
class InputDim:
    dim: int

    @property
    def input_dims(self) -> tuple[int, ...]:
        return (self.dim,)

    def size(self, in_shape: Shape) -> int:
        return in_shape[self.dim]


@dataclass(frozen=True)
class Singleton:
    @property
    def input_dims(self) -> tuple[int, ...]:
        return ()

    def size(self, in_shape: Shape) -> int:
        return 1


@dataclass(frozen=True)
class Flatten:
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))

    @property
    def input_dims(self) -> tuple[int, ...]:
        return self.dims

    def size(self, in_shape: Shape) -> int:
        return math.prod(in_shape[d] for d in self.dims)


@dataclass(frozen=True)
class Split:
    """Piece ``index`` of the input dim(s) ``dims`` (merged first) cut into ``pieces``;
    ``Split(2, (6, 8), 0)`` spells a single input dim as an int."""

    dims: Union[int, tuple[int, ...]]
    pieces: tuple[int, ...]
    index: int

    def __post_init__(self) -> None:
        dims = (self.dims,) if isinstance(self.dims, int) else tuple(self.dims)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "pieces", tuple(self.pieces))

    @property
    def input_dims(self) -> tuple[int, ...]:
        return self.dims

    def size(self, in_shape: Shape) -> int:
        return self.pieces[self.index]


DimTransform = Union[InputDim, Singleton, Flatten, Split]
Group = tuple[tuple[int, ...], tuple[int, ...]]


def view_groups(in_shape: Shape, out_shape: Shape) -> list[Group]:
    """Pair runs of input dims with runs of output dims of equal product, left to right.

    Every input and every output dim lies in exactly one group. Size-1 dims stand alone
    between groups: ``((i,), ())`` is an input dim that vanishes, ``((), (j,))`` a new
    output dim, ``((i,), (j,))`` a size-1 dim facing a size-1 dim (kept as it is).
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if math.prod(in_shape) != math.prod(out_shape):
        raise ValueError(f"cannot view a tensor of shape {list(in_shape)} as {list(out_shape)}")
    if math.prod(in_shape) == 0 and in_shape != out_shape:
        # Products of zero say nothing about which dims correspond: one group of everything.
        return [(tuple(range(len(in_shape))), tuple(range(len(out_shape))))]
    groups: list[Group] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        in_one = i < len(in_shape) and in_shape[i] == 1
        out_one = j < len(out_shape) and out_shape[j] == 1
        if in_one and out_one:
            groups.append(((i,), (j,)))
            i, j = i + 1, j + 1
        elif in_one:
            groups.append(((i,), ()))
            i += 1
        elif out_one:
            groups.append(((), (j,)))
            j += 1
        else:   # both sides at a dim > 1 (equal products leave no other case)
            a, b = [i], [j]
            left, right = in_shape[i], out_shape[j]
            i, j = i + 1, j + 1
            while left != right:   # grow the smaller side until the products agree
                if left < right:
                    a.append(i)
                    left, i = left * in_shape[i], i + 1
                else:
                    b.append(j)
                    right, j = right * out_shape[j], j + 1
            groups.append((tuple(a), tuple(b)))
    return groups


def view_transforms(in_shape: Shape, out_shape: Shape) -> list[DimTransform]:
    """One transform per output dim of reshaping ``in_shape`` to ``out_shape``."""
    result: list[DimTransform] = []
    for ins, outs in view_groups(in_shape, out_shape):
        if not outs:
            continue
        if not ins:
            result.append(Singleton())
        elif len(ins) == 1 and len(outs) == 1:
            result.append(InputDim(ins[0]))
        elif len(outs) == 1:
            result.append(Flatten(ins))
        else:
            pieces = tuple(out_shape[j] for j in outs)
            result.extend(Split(ins, pieces, k) for k in range(len(outs)))
    return result


def view_spec(in_shape: Shape, out_shape: Shape) -> Spec:
    """The sharding spec of a reshape: each group's leftmost input dim lends its letter to
    the group's first output dim (``even`` unless the dim is unchanged); the group's other
    output dims get fresh replicated letters, its other input dims ``1``."""
    names = iter(letters(len(out_shape)))   # at most one letter per output dim
    ins = [UNSHARDABLE] * len(in_shape)
    outs = [UNSHARDABLE] * len(out_shape)
    replicated: set[str] = set()
    even: set[str] = set()
    for in_dims, out_dims in view_groups(in_shape, out_shape):
        if not in_dims or not out_dims:
            continue    # a vanishing or a new size-1 dim is never sharded
        first = next(names)
        ins[in_dims[0]] = outs[out_dims[0]] = first
        if (len(in_dims), len(out_dims)) != (1, 1):
            even.add(first)
        for j in out_dims[1:]:
            outs[j] = next(names)
            replicated.add(outs[j])
    return Spec(("".join(ins),), ("".join(outs),), replicated=frozenset(replicated),
                even=frozenset(even), reduce=None, linear="sum", partial_ops=MOVE_PARTIALS)


__all__ = ["InputDim", "Singleton", "Flatten", "Split", "DimTransform", "view_groups",
           "view_transforms", "view_spec", "MOVE_PARTIALS"]
