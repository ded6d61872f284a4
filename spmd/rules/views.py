"""View-family and other data-movement ops. None of them computes, so every Partial passes
through (``linear="sum"`` with all four reduce ops) and no letter may vanish into a
reduction (``reduce=None``). A dim the op cuts, pads, gathers, repeats or reverses is
replicated; reshapes come from dim transforms (``dim_transforms.py``).

A grouped shard (``S(d)xg``: each rank holds its chunk of each of g equal parts of dim d;
``S(d)x2:1:1``: of parts of relative widths 2, 1, 1) survives a cut along d that falls on
group boundaries: ``split`` into pieces of whole groups gives each piece the groups it
covers (``S(d)x3`` split in 3 -> three plain ``S(d)``: a fused qkv projection's q, k, v
keep their heads sharded), as does a step-1 ``slice`` of whole groups (Phi-3's
``qkv[..., :q]``); its gradient, ``slice_backward``, is grouped as the forward slice's input
was. ``cat`` of pieces whose groups are all as wide gives the groups of all of them (the
backward of an equal split). Any other cut of a sharded dim still replicates it. A reshape
of ``S(d)xg`` into ``(g, rest...)`` (``qkv.view(B, T, 3, H, hd)``) is a plain shard of
``rest``'s first dim: each rank holds its chunk of every group. The inverse (flattening
``(g, a, ...)`` with ``a`` sharded) is ``S(d)xg`` again only where the flatten is the
gradient of such a regrouping (its forward op says so): any inner shard of a flatten would
otherwise become a grouped shard (a sequence-parallel ``[B, T, C] -> [B*T, C]`` as
``S(0)xB``), so other flattens keep the view spec's rule (the inner shard is gathered).

Letters follow the op's own semantics (what ``unsqueeze(dim)`` does to a local piece), not
its output shape: a size-1 dim that is sharded holds size 0 on some ranks, and a local
unsqueeze/squeeze must still line up with the global one.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Callable, Sequence

from ...ir.attrs import REGROUP_DIMS
from ...ir.core import Op
from ...ir.dist import (
    DistAttr,
    Groups,
    ProcessMesh,
    Replicate,
    Shard,
    group_widths,
    normalize_groups,
)
from ..dim_transforms import MOVE_PARTIALS, view_groups, view_spec
from ..einsum import Decision, MeshDimChoice, Option, infer_forward, infer_reverse
from ..rule_registry import describe, output_types, register, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters
from .common import schema_args
from .reduction import norms_of_every_input


def _move(inputs: Sequence[str], outputs: Sequence[str], replicated: Sequence[str] = ()) -> Spec:
    return Spec(tuple(inputs), tuple(outputs), replicated=frozenset(replicated),
                reduce=None, linear="sum", partial_ops=MOVE_PARTIALS)


def _param(op: Op, index: int, name: str, default: Any = None) -> Any:
    """An op argument by its schema name, given by position or keyword or omitted (its
    schema default; ``default`` where the schema has none)."""
    value = schema_args(op)[name]
    return default if value is None else value


def _shape(op: Op, i: int = 0) -> tuple[int, ...]:
    return tuple(tensor_inputs(op)[i].type.shape)


def _out_shape(op: Op, o: int = 0) -> tuple[int, ...]:
    return tuple(op.outputs[o].type.shape)


def _dim(d: int, ndim: int) -> int:
    """Normalise a possibly negative dim; a 0-d tensor accepts 0 and -1."""
    return d % max(ndim, 1)


def _drop(s: str, d: int) -> str:
    return s[:d] + s[d + 1:]


def _insert(s: str, d: int, c: str = UNSHARDABLE) -> str:
    return s[:d] + c + s[d:]


# --------------------------------------------------------------------- reshapes

def view(op: Op) -> Spec:
    # Shapes from the value types: the size argument may hold -1.
    return view_spec(_shape(op), _out_shape(op))


@register("aten.unsqueeze.default")
def unsqueeze(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [_insert(a, _dim(_param(op, 1, "dim"), len(a) + 1))])


@register("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims")
def squeeze(op: Op) -> Spec:
    shape = _shape(op)
    a = letters(len(shape))
    if op.target == "aten.squeeze.default":
        targeted = set(range(len(shape)))
    else:
        dims = _param(op, 1, "dim")
        dims = [dims] if isinstance(dims, int) else list(dims)
        targeted = {_dim(d, len(shape)) for d in dims} if shape else set()
    # A targeted dim of size 1 vanishes. A targeted dim of another size stays, but a shard
    # of it may have size 1 on some rank, where a local squeeze would drop it: replicated.
    ins = "".join(UNSHARDABLE if d in targeted and n == 1 else c
                  for d, (c, n) in enumerate(zip(a, shape)))
    out = "".join(c for d, c in enumerate(ins) if not (d in targeted and shape[d] == 1))
    return _move([ins], [out], [a[d] for d in targeted if shape[d] != 1])


@register("aten.expand.default")
def expand(op: Op) -> Spec:
    shape, out_shape = _shape(op), _out_shape(op)
    out = letters(len(out_shape))
    offset = len(out_shape) - len(shape)
    # New leading dims and broadcast size-1 dims are output-only letters: the input has
    # nothing to shard there, but a consumer may ask for the output sharded.
    ins = "".join(out[offset + i] if n == out_shape[offset + i] else UNSHARDABLE
                  for i, n in enumerate(shape))
    return _move([ins], [out])


@register("aten.repeat.default")
def repeat(op: Op) -> Spec:
    shape, repeats = _shape(op), list(_param(op, 1, "repeats"))
    out = letters(len(repeats))
    offset = len(repeats) - len(shape)
    # A repeated dim holds copies of the whole input dim, not of one shard.
    tiled = [out[offset + i] for i, r in enumerate(repeats[offset:]) if r != 1]
    leading = "".join(UNSHARDABLE for _ in range(offset))
    return _move([out[offset:]], [leading + out[offset:]], tiled)


# --------------------------------------------------------------------- permutations

@register("aten.transpose.int")
def transpose(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    if not a:
        return _move([a], [a])
    d0, d1 = _dim(_param(op, 1, "dim0"), len(a)), _dim(_param(op, 2, "dim1"), len(a))
    out = list(a)
    out[d0], out[d1] = a[d1], a[d0]
    return _move([a], ["".join(out)])


@register("aten.t.default")
def t(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [a[::-1]])


@register("aten.permute.default")
def permute(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], ["".join(a[_dim(d, len(a))] for d in _param(op, 1, "dims"))])


@register("aten.clone.default", "aten.alias.default", "aten.lift_fresh.default")
def identity(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [a])


@register("aten.flip.default")
def flip(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [a], [a[_dim(d, len(a))] for d in _param(op, 1, "dims")])


@register("aten.roll.default")
def roll(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    dims = list(_param(op, 2, "dims", []) or [])
    # Without dims, roll shifts the flattened tensor: every dim moves.
    rolled = [a[_dim(d, len(a))] for d in dims] if dims else list(a)
    return _move([a], [a], rolled)


# --------------------------------------------------------------------- cutting and joining

def split(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 2, "dim", 0), len(a))
    return _move([a], [a] * len(op.outputs), [a[d]])


@register("aten.unbind.int")
def unbind(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(a))
    return _move([a[:d] + UNSHARDABLE + a[d + 1:]], [_drop(a, d)] * len(op.outputs))


def cat(op: Op) -> Spec:
    out = letters(len(_out_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(out))
    # Legacy code may cat a 1-D empty tensor onto n-D ones; torch skips it.
    ins = [UNSHARDABLE if t.type.shape == (0,) and len(out) != 1 else out
           for t in tensor_inputs(op)]
    return _move(ins, [out], [out[d]] if out else [])


def stack(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(a) + 1)
    return _move([a] * len(tensor_inputs(op)), [_insert(a, d)])


class Stack:
    """``stack`` is a move: every partial passes through, and a norm partial
    (``P(norm2)``) too where every stacked value holds it on some mesh dim (gradient
    clipping stacks the per-gradient norms of sharded gradients: their total norm stays
    one partial)."""

    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        norms = norms_of_every_input(op, in_dists)
        spec = replace(stack(op), partial_ops=stack(op).partial_ops | norms)
        # Norms are scalars: their reductions cost latency, not bytes, and one reduction of
        # the stacked norms replaces one per partial input, so carrying the partial is not
        # priced by the (bigger) stack it leaves owing. So for any stack of scalars (loss
        # scaling's per-gradient inf/nan probes: a replicated one joins as a term, free)
        scalars = all(v.type.shape == () for v in tensor_inputs(op))
        return infer_forward(spec, mesh, [v.type for v in tensor_inputs(op)], output_types(op),
                             in_dists, describe(op), available, owe=not (norms or scalars))

    def reverse(self, op, out_hints, mesh):
        return infer_reverse(stack(op), mesh, [v.type for v in tensor_inputs(op)],
                             output_types(op), out_hints, describe(op))


register("aten.stack.default")(Stack())


def slice_(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(a))
    # A slice that keeps the whole dim (start <= 0, end >= size, any step on a size <= 1
    # dim) slices every local piece whole too; any other slice cuts across shards.
    full = _shape(op)[d] == _out_shape(op)[d]
    return _move([a], [a], [] if full else [a[d]])


def slice_backward(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 2, "dim"), len(a))
    full = _shape(op)[d] == _out_shape(op)[d]
    return _move([a], [a], [] if full else [a[d]])


@register("aten.select.int")
def select(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim"), len(a))
    return _move([a[:d] + UNSHARDABLE + a[d + 1:]], [_drop(a, d)])


@register("aten.select_backward.default")
def select_backward(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 2, "dim"), len(a) + 1)
    return _move([a], [_insert(a, d)])


# --------------------------------------------------------------------- cuts along groups

def _only_cut(dist: DistAttr | None, d: int) -> tuple[int, Shard] | None:
    """(mesh dim, shard) when exactly one mesh dim of more than one rank cuts dim ``d``."""
    if dist is None:
        return None
    cuts = [(m, p) for m, p in enumerate(dist.placements) if p.is_shard(d)]
    return cuts[0] if len(cuts) == 1 and dist.mesh.shape[cuts[0][0]] > 1 else None


def _groups_of(sizes: Sequence[int], width: int) -> list[int] | None:
    """How many groups of ``width`` each size holds, or None where one does not divide."""
    if width <= 0 or any(n % width for n in sizes):
        return None
    return [n // width for n in sizes]


def _masked(dist: DistAttr | None, m: int) -> DistAttr | None:
    return None if dist is None else dist.with_placement(m, Replicate())


class GroupedCut:
    """``split`` / ``slice`` / ``cat`` / ``slice_backward`` along a dim: the spec's rule
    (the cut dim replicated), except on a mesh dim where the cut falls on the boundaries of
    a grouped shard. There the cut dim keeps its shard at no cost and the other mesh dims
    infer as the spec says.

    ``groups_of(op, placement, input)`` -> (groups each input needs, groups each output
    gets) from one tensor's shard of the cut dim, or None where the cut does not fit it.
    """

    def __init__(self, spec_of: Callable[[Op], Spec], cut_dim: Callable[[Op], int],
                 groups_of: Callable[[Op, Shard, int | None], tuple[list, list] | None]):
        self.spec_of, self.cut_dim, self.groups_of = spec_of, cut_dim, groups_of

    def spec(self, op: Op) -> Spec:
        return self.spec_of(op)

    def _types(self, op: Op):
        return [v.type for v in tensor_inputs(op)], output_types(op)

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available=None) -> Decision:
        d, ins, outs = self.cut_dim(op), *self._types(op)
        found = next(((i, c) for i, dist in enumerate(in_dists)
                      if (c := _only_cut(dist, d)) is not None), None)
        fit = found and self.groups_of(op, found[1][1], found[0])
        if fit and all(dist is None or _only_cut(dist, d) == (found[1][0], Shard(d, g))
                       for dist, g in zip(in_dists, fit[0])):
            m = found[1][0]
            decision = infer_forward(self.spec_of(op), mesh, ins, outs,
                                     [_masked(x, m) for x in in_dists], describe(op),
                                     available)
            return self._keep(decision, m, d, fit, found[1][1])
        return infer_forward(self.spec_of(op), mesh, ins, outs, in_dists, describe(op),
                             available)

    def _keep(self, decision: Decision, m: int, d: int, fit, shard: Shard) -> Decision:
        needs = tuple(x.with_placement(m, Shard(d, g)) for x, g in zip(decision.needs, fit[0]))
        outputs = tuple(None if x is None else x.with_placement(m, Shard(d, g))
                        for x, g in zip(decision.outputs, fit[1]))
        keep = MeshDimChoice(m, Option("shard", f"dim {d} along its groups", shard.groups),
                             0.0, ())
        choices = tuple(keep if c.mesh_dim == m else c for c in decision.choices)
        return replace(decision, needs=needs, outputs=outputs, choices=choices)

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        d, ins, outs = self.cut_dim(op), *self._types(op)
        found = next(((o, c) for o, hint in enumerate(out_hints)
                      if (c := _only_cut(hint, d)) is not None), None)
        fit = found and self.groups_of(op, found[1][1], None)
        if not fit:
            return infer_reverse(self.spec_of(op), mesh, ins, outs, out_hints, describe(op))
        m = found[1][0]
        needs = infer_reverse(self.spec_of(op), mesh, ins, outs,
                              [_masked(h, m) for h in out_hints], describe(op))
        return tuple(x.with_placement(m, Shard(d, g)) for x, g in zip(needs, fit[0]))


_SPLIT_TARGETS = ("aten.split.Tensor", "aten.split_with_sizes.default")


def _split_dim(op: Op) -> int:
    return _dim(_param(op, 2, "dim", 0), len(_shape(op)))


def _split_groups(op: Op, shard: Shard, index: int | None):
    """The input's groups are whole in every piece: piece j gets the groups it covers
    (equal or not). From an output's shard (``index`` None, reverse) the group width is
    that piece's, and only equal groups can be inferred."""
    d = _split_dim(op)
    pieces = [o.type.shape[d] for o in op.outputs]
    if index is not None:
        covered = _cover(shard.groups, _shape(op)[d], pieces)
        return None if covered is None else ([shard.groups], covered)
    if not isinstance(shard.groups, int):
        return None
    first = next(o for o in op.outputs if o.is_tensor)
    width = first.type.shape[d] // shard.groups
    groups = _groups_of(pieces, width)
    total = _groups_of([_shape(op)[d]], width)
    return None if groups is None or total is None else (total, groups)


def _cover(groups: Groups, size: int, pieces: Sequence[int], start: int = 0
           ) -> list[Groups] | None:
    """The groups each of the consecutive ``pieces`` (from ``start``) of a dim of ``size``
    cut by ``groups`` covers, or None where a piece does not begin and end on group
    boundaries."""
    try:
        widths = group_widths(groups, size)
    except ValueError:
        return None
    bounds = list(itertools.accumulate(widths, initial=0))
    out, lo = [], start
    for n in pieces:
        if lo not in bounds or lo + n not in bounds or n == 0:
            return None
        a, b = bounds.index(lo), bounds.index(lo + n)
        out.append(normalize_groups(widths[a:b]) if b - a > 1 else 1)
        lo += n
    return out


def _cat_dim(op: Op) -> int:
    return _dim(_param(op, 1, "dim", 0), len(_out_shape(op)))


def _cat_groups(op: Op, shard: Shard, index: int | None):
    """Every piece is whole groups of one width (an input's), or whole groups of the
    output's (reverse); or the cat is the gradient of a split of whole groups, grouped as
    the split's input was (``_split_gradient``). The output holds all of them."""
    d = _cat_dim(op)
    tensors = tensor_inputs(op)
    if any(len(t.type.shape) != len(_out_shape(op)) for t in tensors):
        return None                 # a legacy empty 1-D input: the spec's rule
    sizes = [t.type.shape[d] for t in tensors]
    if index is None:
        covered = _cover(shard.groups, _out_shape(op)[d], sizes)
        return None if covered is None else (covered, [shard.groups])
    if not isinstance(shard.groups, int):
        return None
    groups = _groups_of(sizes, sizes[index] // shard.groups
                        if sizes[index] % shard.groups == 0 else 0)
    return (groups, [sum(groups)]) if groups is not None else _split_gradient(op, d, sizes)


def _split_gradient(op: Op, d: int, sizes: list[int]):
    """The cat that differentiates a split of a grouped shard into pieces of whole groups
    (q, k and v of unequal widths): the pieces keep the groups they covered, the output
    is grouped as the split's input was (the forward split's need says how)."""
    fwd = op.forward_op
    if fwd is None or fwd.target not in _SPLIT_TARGETS or not fwd.needs or \
            _shape(fwd) != _out_shape(op) or _split_dim(fwd) != d:
        return None
    for p in fwd.needs[0].placements:
        covered = _cover(p.groups, _shape(fwd)[d], sizes) if p.is_shard(d) else None
        if covered is not None and p.grouped:
            return covered, [p.groups]
    return None


def _slice_dim(op: Op) -> int:
    return _dim(_param(op, 1, "dim", 0), len(_shape(op)))


def _slice_start(op: Op, size: int) -> int | None:
    """Where a step-1 slice starts in a dim of ``size`` (None for another step)."""
    if _param(op, 4, "step", 1) != 1:
        return None
    start = _param(op, 2, "start", 0)
    return min(max(start + size if start < 0 else start, 0), size)


def _slice_groups(op: Op, shard: Shard, index: int | None):
    """A step-1 slice of whole groups (the q, k or v columns of a fused projection) keeps
    the groups it covers. Only forward: a piece's shard says nothing of the other groups."""
    d = _slice_dim(op)
    start = _slice_start(op, _shape(op)[d])
    if index is None or start is None:
        return None
    covered = _cover(shard.groups, _shape(op)[d], [_out_shape(op)[d]], start)
    return None if covered is None else ([shard.groups], covered)


def _slice_backward_groups(op: Op, shard: Shard, index: int | None):
    """The gradient of a slice of whole groups (``slice_backward``: zeros around the piece)
    is grouped as the slice's input was, on the mesh dim that kept its groups: the forward
    slice's need says which groups. Only forward, and only with that forward slice."""
    fwd = op.forward_op
    if index is None or fwd is None or fwd.target != "aten.slice.Tensor" or not fwd.needs \
            or _shape(fwd) != _out_shape(op) or _out_shape(fwd) != _shape(op):
        return None
    d = _slice_dim(fwd)
    start = _slice_start(fwd, _shape(fwd)[d])
    if start is None or _dim(_param(op, 2, "dim"), len(_out_shape(op))) != d:
        return None
    for p in fwd.needs[0].placements:
        if p.is_shard(d) and p.grouped and \
                _cover(p.groups, _shape(fwd)[d], [_out_shape(fwd)[d]], start) == [shard.groups]:
            return [shard.groups], [p.groups]
    return None


register(*_SPLIT_TARGETS)(GroupedCut(split, _split_dim, _split_groups))
register("aten.slice.Tensor")(GroupedCut(slice_, _slice_dim, _slice_groups))
register("aten.slice_backward.default")(
    GroupedCut(slice_backward, lambda op: _dim(_param(op, 2, "dim"), len(_out_shape(op))),
               _slice_backward_groups))
register("aten.cat.default")(GroupedCut(cat, _cat_dim, _cat_groups))


# --------------------------------------------------------------------- reshapes of groups

def _regrouped(src: Sequence[int], dst: Sequence[int], dist: DistAttr | None
               ) -> tuple[int, Shard, Shard] | None:
    """(mesh dim, its shard of ``src``, the shard of ``dst`` it becomes) for the first mesh
    dim whose grouped shard a reshape ``src -> dst`` cuts into ``(groups, rest...)`` with
    ``rest``'s first dim divisible by the mesh dim (module docstring), else None."""
    if dist is None:
        return None
    for m, p in enumerate(dist.placements):
        cut = _only_cut(dist, p.dim) if p.is_shard() else None
        if cut is None or cut[0] != m:
            continue
        n = dist.mesh.shape[m]
        ins, outs = next(g for g in view_groups(src, dst) if p.dim in g[0])
        # only equal groups can become a dim of their own
        if isinstance(p.groups, int) and p.groups > 1 and ins == (p.dim,) and \
                len(outs) >= 2 and dst[outs[0]] == p.groups and dst[outs[1]] % n == 0:
            return m, p, Shard(outs[1])
    return None


def _flattened(src: Sequence[int], dst: Sequence[int], dist: DistAttr | None,
               allowed: Sequence[int]) -> tuple[int, Shard, Shard] | None:
    """(mesh dim, its shard of ``src``, the grouped shard of ``dst``) for the first mesh dim
    in ``allowed`` (``passes/regroup_flattens.py``: dims that shard no weight) whose plain
    shard of a dim a reshape merges with the dims before it: ``[T, B, E] -> [T*B, E]`` with
    ``B`` sharded is ``S(0)xT``, each rank holding its ``B`` chunk of every ``t``. The dim
    must split evenly (a group's chunk is then the dim's chunk times the dims after it),
    and no other dim of the merge may be cut."""
    if dist is None:
        return None
    for m in allowed:
        p = dist.placements[m]
        cut = _only_cut(dist, p.dim) if p.is_shard() else None
        if cut is None or cut[0] != m or p.groups != 1 or src[p.dim] % dist.mesh.shape[m]:
            continue
        ins, outs = next(g for g in view_groups(src, dst) if p.dim in g[0])
        others_cut = any(q.is_shard() and q.dim in ins and q.dim != p.dim
                         for q in dist.placements)
        if len(outs) == 1 and ins[0] != p.dim and not others_cut:
            return m, p, Shard(outs[0], math.prod(src[i] for i in ins if i < p.dim))
    return None


def _ungrouped(op: Op, dist: DistAttr | None) -> tuple[int, Shard, Shard] | None:
    """(mesh dim, the input's shard, the grouped shard of the output) where ``op`` undoes
    its forward op's regrouping (the gradient of ``qkv.view(B, T, 3, H, hd)`` flattened
    back): the output is grouped as the forward view's input was. Known from the forward
    op only, so a flatten of any other shard keeps the view spec's rule."""
    fwd = op.forward_op
    if dist is None or fwd is None or not fwd.needs or fwd.target not in RESHAPES or \
            _shape(fwd) != _out_shape(op) or _out_shape(fwd) != _shape(op):
        return None
    hit = _regrouped(_shape(fwd), _out_shape(fwd), fwd.needs[0])
    if hit is None or dist.placements[hit[0]] != hit[2] or _only_cut(dist, hit[2].dim) is None:
        return None
    return hit[0], hit[2], hit[1]


class GroupedView:
    """A reshape: the view spec's rule, except on the mesh dim whose grouped shard it cuts
    into its groups (``_regrouped``), or whose regrouping it undoes in the backward
    (``_ungrouped``): that mesh dim keeps its shard at no cost."""

    def spec(self, op: Op) -> Spec:
        return view(op)

    def _types(self, op: Op):
        return [v.type for v in tensor_inputs(op)], output_types(op)

    def forward(self, op: Op, in_dists: Sequence[DistAttr | None], mesh: ProcessMesh,
                available=None) -> Decision:
        ins, outs = self._types(op)
        hit = _regrouped(_shape(op), _out_shape(op), in_dists[0]) or \
            _ungrouped(op, in_dists[0]) or \
            _flattened(_shape(op), _out_shape(op), in_dists[0], op.attrs.get(REGROUP_DIMS, ()))
        if hit is None:
            return infer_forward(view(op), mesh, ins, outs, in_dists, describe(op), available)
        m, before, after = hit
        d = infer_forward(view(op), mesh, ins, outs, [_masked(in_dists[0], m)],
                          describe(op), available)
        keep = MeshDimChoice(m, Option("shard", f"dim {before.dim} regrouped as "
                                       f"{after}", after.groups), 0.0, ())
        return replace(d, needs=(d.needs[0].with_placement(m, before),),
                       outputs=(d.outputs[0].with_placement(m, after),),
                       choices=tuple(keep if c.mesh_dim == m else c for c in d.choices))

    def reverse(self, op: Op, out_hints: Sequence[DistAttr | None], mesh: ProcessMesh
                ) -> tuple[DistAttr, ...]:
        # A plain hint is never turned into a grouped input: that would change what every
        # reshape of plain shards asks of its producer (grouped shards come from the plan).
        ins, outs = self._types(op)
        return infer_reverse(view(op), mesh, ins, outs, out_hints, describe(op))


RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
          "aten._reshape_alias.default")
register(*RESHAPES)(GroupedView())


# Complex values have no max or min: only sums and means pass through these moves.
_COMPLEX_PARTIALS = frozenset({"sum", "avg"})


def _complex_move(inputs: Sequence[str], outputs: Sequence[str],
                  replicated: Sequence[str] = ()) -> Spec:
    return replace(_move(inputs, outputs, replicated), partial_ops=_COMPLEX_PARTIALS)


@register("aten.view_as_complex.default")
def view_as_complex(op: Op) -> Spec:
    # [..., 2] real pairs -> [...] complex: the pair dim is read whole
    a = letters(len(_shape(op)))
    return _complex_move([a], [a[:-1]], [a[-1]])


@register("aten.view_as_real.default")
def view_as_real(op: Op) -> Spec:
    # [...] complex -> [..., 2]: a new (real, imaginary) dim of its own
    a = letters(len(_shape(op)))
    return _complex_move([a], [a + UNSHARDABLE])


@register("aten._conj.default", "aten.conj_physical.default")
def conj(op: Op) -> Spec:
    # ``_conj`` returns a lazily conjugated view (the conj bit): partial terms are summed
    # first rather than trusted to carry the bit through the reduction
    a = letters(len(_shape(op)))
    return replace(_complex_move([a], [a]), linear="none")
