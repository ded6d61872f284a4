"""Forward and reverse sharding inference over an einsum-like Spec (Paddle's method).

Forward: per mesh dim, list the placements the determined inputs suggest (a sharded letter,
a partial that passes through a linear op, or replicate), price each by the bytes the inputs
would have to move to agree with it, and take the cheapest. A sharded letter absent from an
output makes that output Partial. Inputs with no placement yet move for free and so follow.

Reverse: from the placements wanted for the outputs, the placements the inputs should take,
so a value with no placement of its own can be given the one its consumers want.

Grouped shards (``Shard(d, groups=g)``) keep their groups through every letter that means
one axis of one size in every tensor (elementwise, permutations, the free letters of a
matmul): each rank holds the same indices of it everywhere. A contraction over a grouped
letter is Partial like a plain one, since every operand is asked for the same grouping. A
letter whose sizes differ (a reshape's ``even`` letters) or that is cut on another mesh dim
too cannot keep a grouping: the option is not offered, so the input is resharded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

from ..ir.core import TensorType
from ..ir.dist import (
    DistAttr,
    Groups,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    group_total,
)
from ..ir.reason import REPLICATE, MeshDimChoice, Option
from ..reshard.traffic import reshard_bytes
from .spec import UNSHARDABLE, Spec


class SpecError(ValueError):
    """A spec does not fit the op it was written for (arity or rank)."""


@dataclass(frozen=True)
class Decision:
    needs: tuple[DistAttr, ...]               # placement each tensor input must have
    outputs: tuple[DistAttr | None, ...]      # placement of each output (None: not a tensor)
    choices: tuple[MeshDimChoice, ...]


def check_spec(spec: Spec, in_types: Sequence[TensorType],
               out_types: Sequence[TensorType | None], what: str) -> None:
    if len(spec.inputs) != len(in_types) or len(spec.outputs) != len(out_types):
        raise SpecError(f"{what}: spec {spec} has {len(spec.inputs)} inputs/"
                        f"{len(spec.outputs)} outputs, the op has {len(in_types)} tensor "
                        f"inputs/{len(out_types)} outputs")
    for letters, t in zip((*spec.inputs, *spec.outputs), (*in_types, *out_types)):
        if (letters is None) != (t is None) or (t is not None and len(letters) != len(t.shape)):
            raise SpecError(f"{what}: spec {spec} letters {letters!r} do not fit a value "
                            f"of type {t}")


def letter_sizes(spec: Spec, in_types, out_types) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for letters, t in zip((*spec.inputs, *spec.outputs), (*in_types, *out_types)):
        if letters is None:
            continue
        for c, n in zip(letters, t.shape):
            if c != UNSHARDABLE:
                sizes.setdefault(c, n)
    return sizes


class _Inference:
    """Shared bookkeeping of one forward or reverse inference."""

    def __init__(self, spec: Spec, mesh: ProcessMesh, in_types, out_types):
        self.spec, self.mesh = spec, mesh
        self.in_types, self.out_types = list(in_types), list(out_types)
        self.sizes = letter_sizes(spec, in_types, out_types)
        self.assigned: dict[str, list[int]] = {}
        self.needs = [[Replicate()] * mesh.ndim for _ in in_types]
        self.outs = [None if t is None else [Replicate()] * mesh.ndim for t in out_types]
        self._full: dict[tuple[int, int], float] = {}

    def shardable(self, letter: str, m: int) -> bool:
        if not self.spec.shardable(letter):
            return False
        if letter in self.spec.even:
            cut = math.prod(self.mesh.shape[k] for k in self.assigned.get(letter, []) + [m])
            # Every size the letter has must divide, not just the first: a reshape letter can
            # name dims of different sizes (48 split into (6, 8) keeps its letter on the 6).
            return all(n % cut == 0 for n in self.all_sizes(letter))
        return True

    def groupable(self, letter: str, groups: Groups) -> bool:
        """Whether a shard of ``letter`` may keep ``groups``: one size everywhere, divisible
        into the groups, not a reshape letter, and not cut by another mesh dim."""
        if groups == 1:
            return True
        sizes = set(self.all_sizes(letter))
        return (letter not in self.spec.even and not self.assigned.get(letter)
                and len(sizes) == 1 and sizes.pop() % group_total(groups) == 0)

    def all_sizes(self, letter: str) -> list[int]:
        return [n for letters, t in zip((*self.spec.inputs, *self.spec.outputs),
                                        (*self.in_types, *self.out_types))
                if letters is not None for c, n in zip(letters, t.shape) if c == letter]

    def required(self, option: Option, i: int, in_dists) -> Placement:
        """What input ``i`` must hold on the current mesh dim under ``option``."""
        letters = self.spec.inputs[i]
        if option.kind == "shard":
            return (Shard(letters.index(option.arg), option.groups) if option.arg in letters
                    else Replicate())
        if option.kind == "partial" and self.spec.is_linear_input(i):
            if self.spec.linear == "sum" or i == self._partial_carrier(option, in_dists):
                return Partial(option.arg)
        return Replicate()

    def _partial_carrier(self, option: Option, in_dists) -> int | None:
        """For an op linear in each input separately, the one input that stays partial."""
        m = self._m
        for i, d in enumerate(in_dists):
            if d is not None and self.spec.is_linear_input(i) \
                    and d.placements[m] == Partial(option.arg):
                return i
        return next((i for i in range(len(self.in_types)) if self.spec.is_linear_input(i)), None)

    def produced(self, option: Option, o: int) -> Placement:
        letters = self.spec.outputs[o]
        if option.kind == "shard":
            if option.arg in letters:
                return Shard(letters.index(option.arg), option.groups)
            if option.arg in self.spec.input_letters():
                return Partial(self.spec.reduce[o])
            return Replicate()
        if option.kind == "partial":
            return Partial(option.arg)
        return Replicate()

    def apply(self, option: Option, m: int, in_dists) -> None:
        self._m = m
        if option.kind == "shard":
            self.assigned.setdefault(option.arg, []).append(m)
        for i in range(len(self.in_types)):
            self.needs[i][m] = self.required(option, i, in_dists)
        for o, out in enumerate(self.outs):
            if out is not None:
                out[m] = self.produced(option, o)

    def full_bytes(self, i: int, dist: DistAttr, m: int) -> float:
        """Bytes of input ``i`` as mesh dim ``m`` sees it: cut by the other mesh dims."""
        key = (i, m)
        if key not in self._full:
            t = self.in_types[i]
            size = t.numel * t.dtype.itemsize
            for k, (n, p) in enumerate(zip(self.mesh.shape, dist.placements)):
                if k != m and isinstance(p, Shard):
                    size /= n
            self._full[key] = size
        return self._full[key]

    def dists(self, rows) -> tuple:
        return tuple(None if r is None else DistAttr(self.mesh, tuple(r)) for r in rows)


def infer_forward(spec: Spec, mesh: ProcessMesh, in_types: Sequence[TensorType],
                  out_types: Sequence[TensorType | None],
                  in_dists: Sequence[DistAttr | None], what: str = "op",
                  available: Sequence[Collection[DistAttr]] | None = None,
                  owe: bool = True) -> Decision:
    """Placements for the outputs, and those the inputs need, from the inputs' placements
    (``None``: no placement yet, follows for free). ``available``: per input, placements
    it is already being moved to for another consumer, which this op may reuse for free.
    ``owe=False`` prices moves only, not the reductions partial results leave owing (to
    replay given needs: which mesh dims do they make Partial)."""
    check_spec(spec, in_types, out_types, what)
    inf = _Inference(spec, mesh, in_types, out_types)
    inf.available = available or [()] * len(in_types)
    inf.owe, inf.in_dists = owe, in_dists
    choices = []
    for m in range(mesh.ndim):
        inf._m = m
        priced = [(opt, _price(inf, opt, m, in_dists)) for opt in _options(inf, m, in_dists)]
        best, cost = min(priced, key=lambda oc: oc[1])     # stable: earlier options win ties
        inf.apply(best, m, in_dists)
        choices.append(MeshDimChoice(m, best, cost, tuple(p for p in priced if p[0] != best)))
    return Decision(inf.dists(inf.needs), inf.dists(inf.outs), tuple(choices))


def _options(inf: _Inference, m: int, in_dists) -> list[Option]:
    """Candidates in tie-break order: keep a shard, then replicate, then a partial (on a
    tie a partial only defers a reduction)."""
    options: list[Option] = []
    for i, d in enumerate(in_dists):
        if d is None:
            continue
        p = d.placements[m]
        if isinstance(p, Shard):
            letter = inf.spec.inputs[i][p.dim]
            if inf.shardable(letter, m) and inf.groupable(letter, p.groups):
                options.append(Option("shard", letter, p.groups))
        elif isinstance(p, Partial) and inf.spec.is_linear_input(i) \
                and p.op in inf.spec.partial_ops:
            options.append(Option("partial", p.op))
    options.append(REPLICATE)
    rank = {"shard": 0, "replicate": 1, "partial": 2}
    return sorted(dict.fromkeys(options), key=lambda o: rank[o.kind])


def _price(inf: _Inference, option: Option, m: int, in_dists) -> float:
    """Bytes the inputs move to agree with ``option`` on mesh dim ``m`` (from wherever is
    cheapest: the value's own placement or one it is already moved to). Only
    communication is priced; ties go to the earlier option, so compute is not duplicated
    where moving data costs the same."""
    n = inf.mesh.shape[m]
    total = 0.0
    for i, d in enumerate(in_dists):
        if d is not None:
            want = inf.required(option, i, in_dists)
            total += min(reshard_bytes(src.placements[m], want, inf.full_bytes(i, d, m), n)
                         for src in (d, *inf.available[i]))
    return total + (_owed(inf, option, m) if inf.owe and option.kind == "partial" else 0.0)


# Carrying a partial on where the result is as big as what it came from costs the same
# reduction later as now: prefer later (a consumer may reduce-scatter it, or sum several).
DEFER_ON_TIES = 1 - 1e-9


def _owed(inf: _Inference, option: Option, m: int) -> float:
    """The all-reduces carrying a partial on leaves owing: every output it makes Partial
    on mesh dim ``m`` must be reduced by someone later, where reducing the input now (the
    replicate option) settles the same debt at its own size. So a partial is carried on
    only where the result is no bigger than what it came from: carrying one through a
    layer-norm backward (three partial results) or into a 4x wider matmul result would
    force dearer moves downstream than reducing it first, as Megatron does. A partial a
    contraction creates (a row-parallel matmul, a data-parallel weight gradient) is the
    plan, not a choice to defer, and owes nothing here."""
    n, owed = inf.mesh.shape[m], 0.0
    for o, t in enumerate(inf.out_types):
        produced = inf.produced(option, o) if t is not None else None
        if isinstance(produced, Partial):
            owed += reshard_bytes(produced, Replicate(),
                                  t.numel * t.dtype.itemsize / _output_cut(inf, o, m), n)
    return owed * DEFER_ON_TIES


def _output_cut(inf: _Inference, o: int, m: int) -> int:
    """How many pieces the other mesh dims cut output ``o`` into: as decided for the mesh
    dims before ``m``; for those after, as the inputs are cut (not decided yet)."""
    cut = 1
    for k, size in enumerate(inf.mesh.shape):
        if k < m and isinstance(inf.outs[o][k], Shard):
            cut *= size
        elif k > m and any(d is not None and isinstance(d.placements[k], Shard)
                           for d in inf.in_dists):
            cut *= size
    return cut


def infer_reverse(spec: Spec, mesh: ProcessMesh, in_types: Sequence[TensorType],
                  out_types: Sequence[TensorType | None],
                  out_hints: Sequence[DistAttr | None], what: str = "op"
                  ) -> tuple[DistAttr, ...]:
    """Placements for the inputs that make the op produce the wanted output placements
    (as far as the spec allows; the rest replicated)."""
    check_spec(spec, in_types, out_types, what)
    inf = _Inference(spec, mesh, in_types, out_types)
    for m in range(mesh.ndim):
        inf._m = m
        wanted = next((h.placements[m] for h in out_hints if h is not None), Replicate())
        inf.apply(_reverse_option(inf, out_hints, wanted, m), m, [None] * len(in_types))
    return inf.dists(inf.needs)


def _reverse_option(inf: _Inference, out_hints, wanted: Placement, m: int) -> Option:
    if isinstance(wanted, Shard):
        o = next(o for o, h in enumerate(out_hints) if h is not None)
        letter = inf.spec.outputs[o][wanted.dim]
        if (letter in inf.spec.input_letters() and inf.shardable(letter, m)
                and inf.groupable(letter, wanted.groups)):
            return Option("shard", letter, wanted.groups)
    if isinstance(wanted, Partial) and inf.spec.linear != "none" \
            and wanted.op in inf.spec.partial_ops:
        return Option("partial", wanted.op)
    return REPLICATE


__all__ = ["infer_forward", "infer_reverse", "Decision", "MeshDimChoice", "Option", "SpecError",
           "check_spec", "letter_sizes"]
