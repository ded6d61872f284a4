"""Reshard planner + reference executor: planned step kinds, exact numerics, cost bound."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.ir.dist import (
    PARTIAL_OPS,
    DistAttr,
    Partial,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    chunk_grouped,
    norm_order,
    parse_placements,
    shard_tensor_local,
)
from autopar.reshard import (
    AllGather,
    AllToAll,
    apply_steps,
    naive_plan,
    plan_cost,
    plan_reshard,
    step_is_valid,
)

R, P = Replicate(), Partial


def mesh_of(*shape, names=None):
    return ProcessMesh(np.arange(math.prod(shape)).reshape(shape), names)


def split_terms(x, op, n, gen):
    """n terms whose op-reduction is x (random, so a wrong reduction shows)."""
    noise = torch.rand((n, *x.shape), generator=gen, dtype=x.dtype)
    order = norm_order(op)
    if order is not None:       # terms of a norm are never negative; their p-norm is |x|
        weights = noise + 0.1
        if math.isinf(order):
            winner = torch.randint(n, x.shape, generator=gen)
            index = torch.arange(n).view(n, *([1] * x.dim()))
            return list(torch.where(index == winner, x.abs(), x.abs() * noise))
        return list(weights / torch.linalg.vector_norm(weights, order, dim=0) * x.abs())
    if op in ("sum", "avg"):
        scale = 1 if op == "sum" else n
        terms = torch.cat([noise[:-1], (scale * x - noise[:-1].sum(0))[None]])
    else:
        base = x - noise if op == "max" else x + noise
        winner = torch.randint(n, x.shape, generator=gen)
        index = torch.arange(n).view(n, *([1] * x.dim()))
        terms = torch.where(index == winner, x, base)
    return list(terms)


def make_pieces(glob, mesh, placements, gen):
    """Every rank's piece of glob under placements, cutting mesh dim 0 first (nesting)."""
    pieces = {(): glob}
    for p, n in zip(placements, mesh.shape):
        nxt = {}
        for c, x in pieces.items():
            if isinstance(p, Shard):      # grouped shards too (tests/spmd/test_grouped_shard.py)
                parts = [chunk_grouped(x, p.dim, n, i, p.groups) for i in range(n)]
            elif isinstance(p, Partial):
                parts = split_terms(x, p.op, n, gen)
            else:
                parts = [x] * n
            nxt.update({c + (i,): t.clone() for i, t in enumerate(parts)})
        pieces = nxt
    assert torch.allclose(assemble(pieces, glob.shape, mesh, placements), glob)
    return pieces


def check_reshard(shape, mesh, src, dst, seed=0):
    """Plan, simulate, compare with the reference placement semantics; returns the plan."""
    src, dst = DistAttr(mesh, tuple(src)), DistAttr(mesh, tuple(dst))
    steps = plan_reshard(shape, src, dst)
    state = src.placements
    for step in steps:
        assert step_is_valid(step, shape, mesh, state), (step, state)
        state = step.advance(state)
    assert state == dst.placements
    gen = torch.Generator().manual_seed(seed)
    glob = torch.randn(shape, generator=gen, dtype=torch.float64)
    out = apply_steps(make_pieces(glob, mesh, src.placements, gen), shape, mesh, steps)
    if dst.partial_mesh_dims():
        assert torch.allclose(assemble(out, shape, mesh, dst.placements), glob)
    else:
        for c in mesh.coordinates():
            want = shard_tensor_local(glob, mesh, dst.placements, c)
            assert out[c].shape == want.shape and torch.allclose(out[c], want), c
    naive = plan_cost(shape, src, naive_plan(shape, src, dst))
    assert plan_cost(shape, src, steps) <= naive + 1e-5  # the planner ties at 1e-6 bytes
    return steps


# (src, dst, kinds when evenly divisible, kinds when uneven) on one mesh dim
CATALOGUE = [
    (P("sum"), R, ["all_reduce"], ["all_reduce"]),
    (P("avg"), R, ["all_reduce"], ["all_reduce"]),
    (P("max"), R, ["all_reduce"], ["all_reduce"]),
    (P("min"), R, ["all_reduce"], ["all_reduce"]),
    (P("sum"), Shard(0), ["reduce_scatter"], ["reduce_scatter"]),
    (P("sum"), Shard(1), ["reduce_scatter"], ["reduce_scatter"]),
    (P("max"), Shard(1), ["reduce_scatter"], ["reduce_scatter"]),
    (Shard(0), R, ["all_gather"], ["all_gather"]),
    (Shard(1), R, ["all_gather"], ["all_gather"]),
    (R, Shard(0), ["slice"], ["slice"]),
    (R, Shard(1), ["slice"], ["slice"]),
    (Shard(0), Shard(1), ["all_to_all"], ["all_gather", "slice"]),
    (Shard(1), Shard(0), ["all_to_all"], ["all_gather", "slice"]),
    (R, P("sum"), ["make_partial"], ["make_partial"]),
    (R, P("max"), ["make_partial"], ["make_partial"]),
    (Shard(0), P("sum"), ["all_gather", "make_partial"], ["all_gather", "make_partial"]),
    (P("sum"), P("max"), ["all_reduce", "make_partial"], ["all_reduce", "make_partial"]),
]
EVEN, UNEVEN = (12, 12, 5), (7, 5, 5)
LAYOUTS = [  # (mesh shape, mesh dim under test, placement of the other mesh dim)
    ((2,), 0, None), ((3,), 0, None), ((4,), 0, None),
    ((2, 2), 0, R), ((2, 2), 1, R), ((2, 2), 1, Shard(2)), ((2, 2), 0, Shard(2)),
    ((2, 3), 0, R), ((2, 3), 1, Shard(2)), ((2, 3), 1, P("sum")), ((2, 2), 1, P("max")),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("src,dst,even_kinds,uneven_kinds", CATALOGUE,
                         ids=[f"{s}->{d}" for s, d, _, _ in CATALOGUE])
@pytest.mark.parametrize("shape", [EVEN, UNEVEN], ids=["even", "uneven"])
def test_catalogue_transition(layout, src, dst, even_kinds, uneven_kinds, shape):
    mesh_shape, d, other = layout
    place = lambda p: tuple(p if i == d else other for i in range(len(mesh_shape)))  # noqa
    steps = check_reshard(shape, mesh_of(*mesh_shape), place(src), place(dst))
    assert [s.kind for s in steps] == (even_kinds if shape == EVEN else uneven_kinds)
    assert all(s.mesh_dim == d for s in steps)


NESTED = [  # (src, dst, shape, kinds or None: numerics and cost bound only)
    ("S(0),S(0)", "R,S(0)", (7, 3), ["all_gather", "all_gather", "slice"]),
    ("S(0),S(0)", "R,R", (7, 3), ["all_gather", "all_gather"]),
    ("S(0),S(0)", "R,S(0)", (8, 8), None),
    ("S(0),S(1)", "S(1),S(0)", (8, 8), None),
    ("S(0),S(1)", "S(1),S(0)", (7, 5), None),
    ("P,S(0)", "S(0),R", (8, 8), None),
    ("P,S(0)", "S(0),R", (7, 5), None),
    ("S(0),P", "R,R", (7, 5), None),  # uneven: RS + 2 AG can beat AR + AG on padded bytes
    ("S(0),P", "R,R", (8, 8), None),
    ("P(sum),P(max)", "R,P(max)", (6, 4), None),
    ("P(max),P(sum)", "R,R", (5, 3), None),
    ("P(max),P(sum)", "R,P(sum)", (6, 4), None),  # max must not fold before the sum
    ("P(avg),P(sum)", "S(1),S(1)", (5, 7), None),
    ("R,S(0)", "S(0),S(0)", (7, 3), None),
    ("S(1),P(min)", "P(sum),S(1)", (4, 9), None),
]


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2)], ids=str)
@pytest.mark.parametrize("src,dst,shape,kinds", NESTED, ids=[f"{a}->{b}" for a, b, *_ in NESTED])
def test_nested(mesh_shape, src, dst, shape, kinds):
    steps = check_reshard(shape, mesh_of(*mesh_shape), parse_placements(src),
                          parse_placements(dst))
    if kinds is not None:
        assert [s.kind for s in steps] == kinds


def test_unnesting_gathers_the_inner_cut_first():
    mesh = mesh_of(2, 2, names=["dp", "tp"])
    src = DistAttr(mesh, parse_placements("S(0),S(0)"))
    steps = plan_reshard((8, 3), src, DistAttr(mesh, parse_placements("R,S(0)")))
    assert [str(s) for s in steps] == ["all_gather(dim 0) over tp",
                                       "all_gather(dim 0) over dp", "slice(dim 0) over tp"]
    assert not step_is_valid(AllGather(0, 0), (8, 3), mesh, src.placements)


def test_all_to_all_only_when_blocks_split_evenly():
    mesh = mesh_of(2)
    assert step_is_valid(AllToAll(0, 0, 1), (4, 6), mesh, (Shard(0),))
    assert not step_is_valid(AllToAll(0, 0, 1), (4, 5), mesh, (Shard(0),))


def test_same_placement_is_an_empty_plan_and_size_one_dims_are_free():
    mesh = mesh_of(1, 3)
    attr = DistAttr(mesh, (Shard(0), P("sum")))
    assert plan_reshard((3, 3), attr, attr) == []
    steps = check_reshard((3, 3), mesh, (Shard(0), R), (Shard(1), R))
    assert plan_cost((3, 3), DistAttr(mesh, (Shard(0), R)), steps) == 0


def test_errors_name_mesh_placements_and_shape():
    a, b = mesh_of(2), mesh_of(2, names=["tp"])
    with pytest.raises(ValueError, match=r"between meshes.*mesh\[2\]"):
        plan_reshard((4,), DistAttr(a, (R,)), DistAttr(b, (R,)))
    with pytest.raises(ValueError, match=r"shards dim 1 .*shape \[4\]"):
        plan_reshard((4,), DistAttr(a, (R,)), DistAttr(a, (Shard(1),)))
    with pytest.raises(ValueError, match=r"missing \[\(1,\)\]"):
        apply_steps({(0,): torch.zeros(2)}, (4,), a, [])


def test_step_text():
    assert str(AllGather(1, 1, axis="tp")) == "all_gather(dim 1) over tp"
    assert str(AllToAll(0, 0, 2)) == "all_to_all(dim 0 -> dim 2) over mesh dim 0"


def _placement(ndim):
    return st.one_of(st.just(R), st.builds(Shard, st.integers(0, ndim - 1)),
                     st.builds(Partial, st.sampled_from(PARTIAL_OPS)))


@st.composite
def reshard_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    placements = st.lists(_placement(len(shape)), min_size=len(mesh_shape),
                          max_size=len(mesh_shape))
    return shape, mesh_of(*mesh_shape), draw(placements), draw(placements)


@settings(derandomize=True, max_examples=600, deadline=None)
@given(reshard_cases(), st.integers(0, 2**16))
def test_random_reshards_are_exact_and_no_dearer_than_naive(case, seed):
    shape, mesh, src, dst = case
    check_reshard(shape, mesh, src, dst, seed)
