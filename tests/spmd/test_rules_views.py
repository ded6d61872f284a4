"""View-family rules and the dim-transform system.

Tables of (op, mesh, placements) -> expected placements, forward and reverse; every case is
also run numerically: the global inputs are sharded as the rule needs, the op runs on each
rank's piece (shape arguments rewritten to the local output shape), and the pieces,
reassembled per the output placements, must equal the global result.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from autopar.ir.core import Value
from autopar.ir.dist import (
    Partial,
    ProcessMesh,
    assemble,
    local_shape,
    local_slices,
    parse_placements,
)
from autopar.ir.ops import resolve
from autopar.spmd.dim_transforms import (
    Flatten,
    InputDim,
    Singleton,
    Split,
    view_groups,
    view_spec,
    view_transforms,
)
from autopar.spmd.rule_registry import tensor_inputs

from ..spmd_util import MESH1, MESH2, T, forward, make_op, reverse

BIG = 9223372036854775807   # what a trace records for an open-ended slice


# --------------------------------------------------------------------- numeric check

# Ops whose argument at this position is the output shape: the local op gets the local one.
SHAPE_ARG = {"aten.view.default": 1, "aten._unsafe_view.default": 1, "aten.reshape.default": 1,
             "aten._reshape_alias.default": 1, "aten.expand.default": 1,
             "aten.slice_backward.default": 1, "aten.select_backward.default": 1}


def _contiguous_strides(shape):
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _local_input(x: torch.Tensor, mesh: ProcessMesh, text: str, coord) -> torch.Tensor:
    """The rank's piece of ``x``; along a Partial mesh dim every rank holds a different
    term (so a rule that drops a Partial is caught), the terms reducing to the piece."""
    placements = parse_placements(text)
    piece = x[local_slices(x.shape, mesh, placements, coord)].clone()
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            k, n = coord[m], mesh.shape[m]
            weight = (k + 1) / (n * (n + 1) / 2)          # weights over the mesh dim sum to 1
            if p.op in ("sum", "avg"):
                piece = piece * weight * (n if p.op == "avg" else 1)
            else:                                         # rank 0 holds the extreme term
                piece = piece + (k if p.op == "min" else -k)
    return piece


def check_numerically(op, mesh: ProcessMesh, needs: list, outs: list) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(v.type.shape, generator=gen) for v in tensor_inputs(op)]

    def call(tensors, shape=None):
        it = iter(tensors)
        args, kwargs = pytree.tree_map(lambda a: next(it) if isinstance(a, Value) else a,
                                       (op.args, op.kwargs))
        if shape is not None and op.target in SHAPE_ARG:
            args = list(args)
            args[SHAPE_ARG[op.target]] = list(shape)
            if op.target == "aten._reshape_alias.default":
                args[2] = _contiguous_strides(shape)
        out = resolve(op.target)(*args, **kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    expected = call(inputs)
    pieces = [{} for _ in expected]
    out_places = [parse_placements(o) for o in outs]
    for coord in mesh.coordinates():
        local = [_local_input(x, mesh, p, coord) for x, p in zip(inputs, needs)]
        shape = local_shape(expected[0].shape, mesh, out_places[0], coord)
        for o, r in enumerate(call(local, shape)):
            pieces[o][coord] = r
    for o, want in enumerate(expected):
        got = assemble(pieces[o], want.shape, mesh, out_places[o])
        torch.testing.assert_close(got, want, msg=lambda m: f"{op.target} output {o}: {m}")


# --------------------------------------------------------------------- forward table

V, R_ = "aten.view.default", "aten.reshape.default"
F = [
    # (id, target, args, mesh, input placements, expected needs, expected outputs)
    ("flatten-even", V, (T(8, 6), [48]), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("flatten-uneven-mesh4", V, (T(6, 8), [48]), MESH1, ["S(0)"], ["R"], ["R"]),
    ("flatten-even-mesh2", V, (T(6, 8), [48]), MESH2, ["S(0),R"], ["S(0),R"], ["S(0),R"]),
    ("flatten-size3", V, (T(3, 8), [24]), MESH2, ["S(0),R"], ["R,R"], ["R,R"]),
    ("flatten-inner-dim", V, (T(8, 6), [48]), MESH1, ["S(1)"], ["R"], ["R"]),
    ("split-even", V, (T(48), [8, 6]), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("split-piece0-uneven", V, (T(48), [6, 8]), MESH1, ["S(0)"], ["R"], ["R"]),
    ("split-piece0-mesh2", V, (T(48), [6, 8]), MESH2, ["S(0),R"], ["S(0),R"], ["S(0),R"]),
    ("doc-example", V, (T(6, 12, 48), [72, 6, 8]), MESH2, ["S(0),S(2)"], ["S(0),S(2)"],
     ["S(0),S(1)"]),
    ("doc-example-inner", V, (T(6, 12, 48), [72, 6, 8]), MESH1, ["S(1)"], ["R"], ["R"]),
    ("group-3x8", V, (T(4, 6), [3, 8]), MESH2, ["S(0),R"], ["R,R"], ["R,R"]),
    ("group-2x12", V, (T(4, 6), [2, 12]), MESH2, ["S(0),R"], ["S(0),R"], ["S(0),R"]),
    ("group-2x12-mesh4", V, (T(4, 6), [2, 12]), MESH1, ["S(0)"], ["R"], ["R"]),
    ("keep-uneven-dim", V, (T(5, 6), [5, 2, 3]), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("split-inner", V, (T(5, 6), [5, 2, 3]), MESH2, ["R,S(1)"], ["R,S(1)"], ["R,S(1)"]),
    ("drop-one", V, (T(6, 1, 4), [6, 4]), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("add-one", V, (T(6, 4), [1, 6, 4]), MESH1, ["S(1)"], ["S(1)"], ["S(2)"]),
    ("sharded-one-vanishes", V, (T(1, 8), [8]), MESH1, ["S(0)"], ["R"], ["R"]),
    ("one-moves", V, (T(1, 8), [8, 1]), MESH1, ["S(1)"], ["S(1)"], ["S(0)"]),
    ("nested-even", V, (T(8, 3, 2), [8, 6]), MESH2, ["S(0),S(0)"], ["S(0),S(0)"],
     ["S(0),S(0)"]),
    ("nested-uneven", V, (T(6, 4), [24]), MESH2, ["S(0),S(0)"], ["S(0),R"], ["S(0),R"]),
    ("partial-max", V, (T(8, 6), [48]), MESH2, ["P(max),S(0)"], ["P(max),S(0)"],
     ["P(max),S(0)"]),
    ("reshape-partial", R_, (T(4, 6), [24]), MESH1, ["P(sum)"], ["P(sum)"], ["P(sum)"]),
    ("unsafe-view", "aten._unsafe_view.default", (T(2, 4, 6), [8, 6]), MESH2, ["S(1),S(2)"],
     ["R,S(2)"], ["R,S(1)"]),
    ("minus-one", V, (T(4, 6), [-1]), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("0d-to-11", V, (T(), [1, 1]), MESH1, ["R"], ["R"], ["R"]),
    ("1-to-0d", V, (T(1), []), MESH1, ["S(0)"], ["R"], ["R"]),
    ("reshape-alias", "aten._reshape_alias.default", (T(4, 6), [24], [1]), MESH1, ["S(0)"],
     ["S(0)"], ["S(0)"]),
    # permutations
    ("transpose", "aten.transpose.int", (T(4, 6, 8), 0, 2), MESH2, ["S(0),S(1)"],
     ["S(0),S(1)"], ["S(2),S(1)"]),
    ("transpose-neg", "aten.transpose.int", (T(4, 6), -1, -2), MESH1, ["S(1)"], ["S(1)"],
     ["S(0)"]),
    ("t", "aten.t.default", (T(4, 6),), MESH2, ["S(0),S(1)"], ["S(0),S(1)"], ["S(1),S(0)"]),
    ("t-1d", "aten.t.default", (T(5),), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("permute", "aten.permute.default", (T(2, 3, 4), [2, 0, 1]), MESH2, ["S(0),S(2)"],
     ["S(0),S(2)"], ["S(1),S(0)"]),
    ("permute-uneven", "aten.permute.default", (T(3, 5), [1, 0]), MESH1, ["S(0)"], ["S(0)"],
     ["S(1)"]),
    # expand / repeat
    ("expand-kept", "aten.expand.default", (T(4, 1), [4, 6]), MESH1, ["S(0)"], ["S(0)"],
     ["S(0)"]),
    ("expand-broadcast-dim", "aten.expand.default", (T(4, 1), [4, 6]), MESH1, ["S(1)"], ["R"],
     ["R"]),
    ("expand-new-dim", "aten.expand.default", (T(6), [3, 6]), MESH2, ["S(0),R"], ["S(0),R"],
     ["S(1),R"]),
    # reduced before it is broadcast (3x less to reduce)
    ("expand-partial", "aten.expand.default", (T(6), [3, -1]), MESH1, ["P(sum)"], ["R"],
     ["R"]),
    ("expand-partial-size-one", "aten.expand.default", (T(1, 6), [1, -1]), MESH1, ["P(sum)"],
     ["P(sum)"], ["P(sum)"]),
    ("repeat-tiled", "aten.repeat.default", (T(4, 6), [1, 2]), MESH2, ["S(0),S(1)"],
     ["S(0),R"], ["S(0),R"]),
    ("repeat-new-dim", "aten.repeat.default", (T(4, 6), [3, 1, 1]), MESH1, ["S(1)"], ["S(1)"],
     ["S(2)"]),
    ("repeat-sharded", "aten.repeat.default", (T(4, 6), [2, 1]), MESH1, ["S(0)"], ["R"], ["R"]),
    # unsqueeze / squeeze
    ("unsqueeze", "aten.unsqueeze.default", (T(4, 6), 1), MESH2, ["S(0),S(1)"], ["S(0),S(1)"],
     ["S(0),S(2)"]),
    ("unsqueeze-neg", "aten.unsqueeze.default", (T(4, 6), -1), MESH1, ["S(1)"], ["S(1)"],
     ["S(1)"]),
    ("unsqueeze-sharded-one", "aten.unsqueeze.default", (T(1, 6), 0), MESH1, ["S(0)"],
     ["S(0)"], ["S(1)"]),
    ("unsqueeze-0d", "aten.unsqueeze.default", (T(), 0), MESH1, ["R"], ["R"], ["R"]),
    ("squeeze-dim", "aten.squeeze.dim", (T(4, 1, 6), 1), MESH2, ["S(0),S(2)"], ["S(0),S(2)"],
     ["S(0),S(1)"]),
    ("squeeze-dim-sharded-one", "aten.squeeze.dim", (T(4, 1, 6), 1), MESH1, ["S(1)"], ["R"],
     ["R"]),
    ("squeeze-noop-dim", "aten.squeeze.dim", (T(3, 6), 0), MESH1, ["S(0)"], ["R"], ["R"]),
    ("squeeze-noop-other", "aten.squeeze.dim", (T(3, 6), 0), MESH1, ["S(1)"], ["S(1)"],
     ["S(1)"]),
    ("squeeze-default", "aten.squeeze.default", (T(4, 1, 6),), MESH1, ["S(0)"], ["R"], ["R"]),
    ("squeeze-dims", "aten.squeeze.dims", (T(4, 1, 1, 6), [1, 2]), MESH2, ["S(0),S(3)"],
     ["S(0),S(3)"], ["S(0),S(1)"]),
    # split / unbind / cat / stack
    ("split", "aten.split.Tensor", (T(8, 6), 2, 1), MESH2, ["S(0),S(1)"], ["S(0),R"],
     ["S(0),R"] * 3),
    ("split-cut-dim", "aten.split.Tensor", (T(8, 6), 3), MESH1, ["S(0)"], ["R"], ["R"] * 3),
    ("split-sizes", "aten.split_with_sizes.default", (T(8, 6), [2, 4], 1), MESH1, ["S(0)"],
     ["S(0)"], ["S(0)"] * 2),
    ("unbind", "aten.unbind.int", (T(3, 5), 0), MESH1, ["S(1)"], ["S(1)"], ["S(0)"] * 3),
    ("unbind-cut-dim", "aten.unbind.int", (T(3, 5), 0), MESH1, ["S(0)"], ["R"], ["R"] * 3),
    ("cat", "aten.cat.default", ([T(4, 6), T(4, 2)], 1), MESH2, ["S(0),S(1)", "S(0),R"],
     ["S(0),R", "S(0),R"], ["S(0),R"]),
    ("cat-uneven-other", "aten.cat.default", ([T(5, 6), T(3, 6)], 0), MESH1, ["S(1)", "S(1)"],
     ["S(1)", "S(1)"], ["S(1)"]),
    ("cat-partial", "aten.cat.default", ([T(4, 6), T(4, 6)], 0), MESH1, ["P(sum)", "P(sum)"],
     ["P(sum)", "P(sum)"], ["P(sum)"]),
    ("cat-legacy-empty", "aten.cat.default", ([T(4, 6), T(0)], 0), MESH1, ["S(1)", "R"],
     ["S(1)", "R"], ["S(1)"]),
    ("stack", "aten.stack.default", ([T(4, 6), T(4, 6)], 1), MESH2, ["S(0),R", "S(0),R"],
     ["S(0),R", "S(0),R"], ["S(0),R"]),
    ("stack-last", "aten.stack.default", ([T(4, 6), T(4, 6)], -1), MESH1, ["S(1)", "S(1)"],
     ["S(1)", "S(1)"], ["S(1)"]),
    # slice / select and their backwards
    ("slice-cut", "aten.slice.Tensor", (T(8, 6), 0, 2, 6), MESH1, ["S(0)"], ["R"], ["R"]),
    ("slice-other-dim", "aten.slice.Tensor", (T(8, 6), 1, 0, 4), MESH2, ["S(0),S(1)"],
     ["S(0),R"], ["S(0),R"]),
    ("slice-full", "aten.slice.Tensor", (T(7, 6), 0, 0, BIG), MESH1, ["S(0)"], ["S(0)"],
     ["S(0)"]),
    ("slice-full-neg-start", "aten.slice.Tensor", (T(8, 6), 0, -8), MESH1, ["S(0)"], ["S(0)"],
     ["S(0)"]),
    ("slice-step", "aten.slice.Tensor", (T(8, 6), 1, 0, 6, 2), MESH1, ["S(1)"], ["R"], ["R"]),
    ("slice-backward", "aten.slice_backward.default", (T(8, 4), [8, 6], 1, 0, 4, 1), MESH2,
     ["S(0),S(1)"], ["S(0),R"], ["S(0),R"]),
    ("slice-backward-full", "aten.slice_backward.default", (T(8, 6), [8, 6], 0, 0, BIG, 1),
     MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("select", "aten.select.int", (T(8, 6), 1, 2), MESH2, ["S(0),S(1)"], ["S(0),R"], ["S(0),R"]),
    ("select-neg", "aten.select.int", (T(8, 6), 0, -1), MESH1, ["S(1)"], ["S(1)"], ["S(0)"]),
    ("select-backward", "aten.select_backward.default", (T(8), [8, 6], 1, 2), MESH1, ["S(0)"],
     ["S(0)"], ["S(0)"]),
    ("select-backward-partial-reduced-first", "aten.select_backward.default",
     (T(6), [8, 6], 0, 3), MESH1, ["P(max)"], ["R"], ["R"]),
    # identities and trivial moves
    ("clone", "aten.clone.default", (T(5, 3),), MESH2, ["S(0),P(avg)"], ["S(0),P(avg)"],
     ["S(0),P(avg)"]),
    ("alias", "aten.alias.default", (T(5, 3),), MESH1, ["S(1)"], ["S(1)"], ["S(1)"]),
    ("lift-fresh", "aten.lift_fresh.default", (T(5, 3),), MESH1, ["P(min)"], ["P(min)"],
     ["P(min)"]),
    ("flip", "aten.flip.default", (T(4, 6), [0]), MESH2, ["S(0),S(1)"], ["R,S(1)"], ["R,S(1)"]),
    ("roll", "aten.roll.default", (T(4, 6), [1], [1]), MESH1, ["S(0)"], ["S(0)"], ["S(0)"]),
    ("roll-flat", "aten.roll.default", (T(4, 6), [1]), MESH1, ["S(0)"], ["R"], ["R"]),
]


@pytest.mark.parametrize("target,args,mesh,ins,needs,outs", [c[1:] for c in F],
                         ids=[c[0] for c in F])
def test_forward(target, args, mesh, ins, needs, outs):
    op = make_op(target, *args)
    assert forward(op, mesh, *ins) == (needs, outs)
    check_numerically(op, mesh, needs, outs)


# --------------------------------------------------------------------- reverse table

RV = [
    # (id, target, args, mesh, wanted output placements, expected input placements)
    ("flatten", V, (T(8, 6), [48]), MESH1, ["S(0)"], ["S(0)"]),
    ("flatten-uneven", V, (T(6, 8), [48]), MESH1, ["S(0)"], ["R"]),
    ("split-second-piece", V, (T(48), [6, 8]), MESH2, ["S(0),S(1)"], ["S(0),R"]),
    ("doc-example", V, (T(6, 12, 48), [72, 6, 8]), MESH2, ["S(1),S(0)"], ["S(2),S(0)"]),
    ("nested", V, (T(8, 3, 2), [8, 6]), MESH2, ["S(0),S(0)"], ["S(0),S(0)"]),
    ("partial", V, (T(8, 6), [48]), MESH1, ["P(sum)"], ["P(sum)"]),
    ("transpose", "aten.transpose.int", (T(4, 6), 0, 1), MESH2, ["S(0),S(1)"], ["S(1),S(0)"]),
    ("permute", "aten.permute.default", (T(2, 3, 4), [2, 0, 1]), MESH2, ["S(0),S(1)"],
     ["S(2),S(0)"]),
    ("expand-broadcast", "aten.expand.default", (T(4, 1), [4, 6]), MESH1, ["S(1)"], ["R"]),
    ("expand-kept", "aten.expand.default", (T(4, 1), [4, 6]), MESH1, ["S(0)"], ["S(0)"]),
    ("unsqueeze", "aten.unsqueeze.default", (T(4, 6), 0), MESH1, ["S(2)"], ["S(1)"]),
    ("squeeze", "aten.squeeze.dim", (T(4, 1, 6), 1), MESH1, ["S(1)"], ["S(2)"]),
    ("cat", "aten.cat.default", ([T(4, 6), T(4, 2)], 1), MESH2, ["S(0),S(1)"],
     ["S(0),R", "S(0),R"]),
    ("stack", "aten.stack.default", ([T(4, 6), T(4, 6)], 0), MESH1, ["S(2)"], ["S(1)", "S(1)"]),
    ("select", "aten.select.int", (T(8, 6), 0, 1), MESH1, ["S(0)"], ["S(1)"]),
    ("split", "aten.split.Tensor", (T(8, 6), 2, 1), MESH1, ["S(0)", None, None], ["S(0)"]),
    ("unbind", "aten.unbind.int", (T(3, 4), 0), MESH1, ["S(0)", None, None], ["S(1)"]),
    ("slice-backward", "aten.slice_backward.default", (T(8, 4), [8, 6], 1, 0, 4, 1), MESH1,
     ["S(1)"], ["R"]),
]


@pytest.mark.parametrize("target,args,mesh,wanted,needs", [c[1:] for c in RV],
                         ids=[c[0] for c in RV])
def test_reverse(target, args, mesh, wanted, needs):
    op = make_op(target, *args)
    assert reverse(op, mesh, *wanted) == needs
    # What reverse asks of the inputs must be a valid forward choice, exact on real data.
    fwd_needs, fwd_outs = forward(op, mesh, *needs)
    assert fwd_needs == needs
    check_numerically(op, mesh, fwd_needs, fwd_outs)


# --------------------------------------------------------------------- dim transforms

@pytest.mark.parametrize("in_shape,out_shape,want", [
    ((6, 12, 48), (72, 6, 8), [Flatten((0, 1)), Split(2, (6, 8), 0), Split(2, (6, 8), 1)]),
    ((4, 6), (3, 8), [Split((0, 1), (3, 8), 0), Split((0, 1), (3, 8), 1)]),
    ((4, 6), (4, 6), [InputDim(0), InputDim(1)]),
    ((2, 1, 3), (2, 3), [InputDim(0), InputDim(2)]),
    ((2, 3), (1, 2, 1, 3, 1), [Singleton(), InputDim(0), Singleton(), InputDim(1), Singleton()]),
    ((1, 1), (1,), [InputDim(0)]),
    ((), (1, 1), [Singleton(), Singleton()]),
    ((1, 1), (), []),
    ((), (), []),
    ((24,), (2, 3, 4), [Split(0, (2, 3, 4), k) for k in range(3)]),
    ((2, 3, 4), (24,), [Flatten((0, 1, 2))]),
    ((2, 3, 4, 5), (6, 20), [Flatten((0, 1)), Flatten((2, 3))]),
    ((0, 6), (0, 2, 3), [Split((0, 1), (0, 2, 3), k) for k in range(3)]),
])
def test_view_transforms(in_shape, out_shape, want):
    assert view_transforms(in_shape, out_shape) == want


def test_view_spec_letters():
    spec = view_spec((6, 12, 48), (72, 6, 8))
    assert str(spec) == "a1b->abc"
    assert spec.even == {"a", "b"} and spec.replicated == {"c"}
    assert str(view_spec((4, 6), (4, 6))) == "ab->ab" and not view_spec((4, 6), (4, 6)).even


def test_view_transforms_rejects_numel_mismatch():
    with pytest.raises(ValueError, match="cannot view"):
        view_transforms((2, 3), (7,))


@pytest.mark.parametrize("in_shape,out_shape,dim,n", [
    ((8, 6), (48,), 0, 4), ((6, 12, 48), (72, 6, 8), 0, 2), ((48,), (8, 6), 0, 4),
    ((6, 12, 48), (72, 6, 8), 2, 3), ((4, 6), (2, 12), 0, 2), ((5, 6), (5, 2, 3), 0, 3),
])
def test_chunk_reshape_cat(in_shape, out_shape, dim, n):
    """The spec keeps input ``dim`` sharded on n ranks: chunk, reshape locally, cat."""
    spec = view_spec(in_shape, out_shape)
    letter = spec.inputs[0][dim]
    out_dim = spec.outputs[0].index(letter)
    x = torch.arange(math.prod(in_shape)).reshape(in_shape)
    pieces = []
    for piece in torch.chunk(x, n, dim):
        local = list(out_shape)
        local[out_dim] = piece.shape[dim] * out_shape[out_dim] // in_shape[dim]
        pieces.append(piece.reshape(local))
    assert torch.equal(torch.cat(pieces, out_dim), x.reshape(out_shape))


@st.composite
def reshapes(draw):
    in_shape = tuple(draw(st.lists(st.integers(1, 6), max_size=5)))
    rest, out_shape = math.prod(in_shape), []
    while rest > 1 or draw(st.booleans()):   # factor numel, sprinkling size-1 dims
        if len(out_shape) >= 6:
            out_shape.append(rest)
            break
        divisor = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        out_shape.append(divisor)
        rest //= divisor
    if rest != 1 and len(out_shape) < 6:
        out_shape.append(rest)
    return in_shape, tuple(out_shape)


@settings(max_examples=300, deadline=None)
@given(reshapes())
def test_view_transforms_consistent(shapes):
    in_shape, out_shape = shapes
    transforms = view_transforms(in_shape, out_shape)
    assert [t.size(in_shape) for t in transforms] == list(out_shape)
    groups = view_groups(in_shape, out_shape)
    assert sorted(i for g in groups for i in g[0]) == list(range(len(in_shape)))
    assert sorted(j for g in groups for j in g[1]) == list(range(len(out_shape)))
    for ins, outs in groups:
        assert math.prod(in_shape[i] for i in ins) == math.prod(out_shape[j] for j in outs)
    for t in transforms:
        if isinstance(t, Split):
            assert math.prod(t.pieces) == math.prod(in_shape[d] for d in t.dims)


@settings(max_examples=150, deadline=None)
@given(reshapes(), st.sampled_from([ProcessMesh([0, 1, 2], ["x"]), MESH1, MESH2]),
       st.data())
def test_view_rule_exact(shapes, mesh, data):
    """Whatever the rule keeps sharded reshapes exactly, even and uneven sizes alike."""
    in_shape, out_shape = shapes
    choices = ["R"] + [f"S({d})" for d in range(len(in_shape))]
    placements = ",".join(data.draw(st.sampled_from(choices)) for _ in range(mesh.ndim))
    op = make_op(V, T(*in_shape), list(out_shape))
    needs, outs = forward(op, mesh, placements)
    check_numerically(op, mesh, needs, outs)
