"""Distributed attributes: mesh, placements, chunk arithmetic, shard/assemble round trip."""
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.ir.dist import (
    DistAttr,
    Partial,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    local_offset,
    local_shape,
    local_size,
    local_slices,
    shard_tensor_local,
)

MESH_2X2 = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


# --------------------------------------------------------------------------- printing


@pytest.mark.parametrize("obj, text", [
    (Shard(0), "S(0)"),
    (Shard(2), "S(2)"),
    (Replicate(), "R"),
    (Partial(), "P(sum)"),
    (Partial("avg"), "P(avg)"),
    (Partial("max"), "P(max)"),
    (Partial("min"), "P(min)"),
    (MESH_2X2, "mesh[2,2](dp,tp)=[[0,1],[2,3]]"),
    (ProcessMesh([4, 5, 6]), "mesh[3](d0)=[4,5,6]"),
    (DistAttr(MESH_2X2, (Shard(0), Replicate())), "{S(0),R} @mesh[2,2](dp,tp)"),
    (DistAttr(MESH_2X2, [Partial(), Shard(1)]), "{P(sum),S(1)} @mesh[2,2](dp,tp)"),
    (DistAttr(ProcessMesh([2, 3], ["tp"]), [Replicate()]), "{R} @mesh[2](tp)=[2,3]"),
])
def test_str(obj, text):
    assert str(obj) == text


def test_mesh_short_form():
    assert MESH_2X2.short() == "mesh[2,2](dp,tp)"
    assert ProcessMesh([[4, 5], [6, 7]], ["a", "b"]).short() == "mesh[2,2](a,b)=[[4,5],[6,7]]"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("make, match", [
    (lambda: ProcessMesh([[0, 1], [1, 2]]), "unique"),
    (lambda: ProcessMesh([0, -1]), "non-negative"),
    (lambda: ProcessMesh([[0, 1], [2, 3]], ["dp"]), "1 dim_names for a 2-D"),
    (lambda: ProcessMesh([[0, 1], [2, 3]], ["x", "x"]), "unique non-empty"),
    (lambda: ProcessMesh([[0, 1], [2]]), "rectangular"),
    (lambda: ProcessMesh([]), "non-empty"),
    (lambda: ProcessMesh(3), "non-empty"),
    (lambda: ProcessMesh([0.0, 1.0]), "integer"),
    (lambda: Shard(-1), "non-negative"),
    (lambda: Partial("prod"), "one of"),
    (lambda: DistAttr(MESH_2X2, (Replicate(),)), r"1 placements \{R\} for 2-D mesh\[2,2\]"),
    (lambda: DistAttr(MESH_2X2, (Shard(2), Replicate())).check((4, 4)),
     r"\{S\(2\),R\} on mesh\[2,2\]\(dp,tp\)=\[\[0,1\],\[2,3\]\] shards dim 2 .*\[4, 4\]"),
    (lambda: MESH_2X2.dim_size("pp"), r"mesh\[2,2\].*no mesh dim named 'pp'"),
    (lambda: MESH_2X2.dim_size(2), "out of range"),
    (lambda: MESH_2X2.submesh(dp=0, tp=1), "fixes every dim"),
    (lambda: MESH_2X2.rank_at((2, 0)), "outside"),
    (lambda: local_size(4, 0, 0), "bad index"),
])
def test_validation_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mesh_error_prints_the_mesh():
    with pytest.raises(ValueError, match=r"ids \[\[0,1\],\[1,2\]\]"):
        ProcessMesh([[0, 1], [1, 2]], ["dp", "tp"])


def test_distattr_rejects_non_placements():
    with pytest.raises(TypeError):
        DistAttr(MESH_2X2, ("S(0)", Replicate()))


# --------------------------------------------------------------------------- mesh queries


def test_mesh_properties():
    m = ProcessMesh([[4, 5, 6], [7, 8, 9]], ["dp", "tp"])
    assert (m.shape, m.ndim, m.size, m.dim_names) == ((2, 3), 2, 6, ("dp", "tp"))
    assert m.process_ids == (4, 5, 6, 7, 8, 9)
    assert (m.dim_size("tp"), m.dim_size(0), m.dim_size(-1)) == (3, 2, 3)
    assert m.coordinate(8) == (1, 1) and m.coordinate(0) is None
    assert m.rank_at((1, 2)) == 9 and 9 in m and 3 not in m
    assert m.tolist() == [[4, 5, 6], [7, 8, 9]]
    assert m.submesh(dp=1) == ProcessMesh([7, 8, 9], ["tp"])
    assert m.sub_mesh("tp", 0) == ProcessMesh([4, 7], ["dp"])
    assert m.group_of(8, "dp") == [5, 8] and m.group_of(8, "tp") == [7, 8, 9]
    assert ProcessMesh(torch.tensor([[0, 1]])).shape == (1, 2)


def test_mesh_identity():
    a = ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    assert a == MESH_2X2 and hash(a) == hash(MESH_2X2)
    assert a != ProcessMesh([[0, 1], [2, 3]], ["x", "tp"])
    assert a != ProcessMesh([0, 1, 2, 3], ["dp"])
    assert a != ProcessMesh([[0, 2], [1, 3]], ["dp", "tp"])
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a._shape = (4,)
    assert len({DistAttr(a, (Shard(0), Replicate())),
                DistAttr(MESH_2X2, [Shard(0), Replicate()])}) == 1


@pytest.mark.parametrize("ids, names, dim, groups", [
    ([3, 1, 7], ["x"], "x", [[3, 1, 7]]),
    ([[4, 5], [6, 7]], ["dp", "tp"], "tp", [[4, 5], [6, 7]]),
    ([[4, 5], [6, 7]], ["dp", "tp"], "dp", [[4, 6], [5, 7]]),
    ([[10, 11, 12], [20, 21, 22]], ["dp", "tp"], 0, [[10, 20], [11, 21], [12, 22]]),
    ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["pp", "dp", "tp"], "pp",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["pp", "dp", "tp"], "dp",
     [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["pp", "dp", "tp"], "tp",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ([[[9, 8]], [[7, 6]]], ["a", "b", "c"], "b", [[9], [8], [7], [6]]),
])
def test_groups_order(ids, names, dim, groups):
    mesh = ProcessMesh(ids, names)
    assert mesh.groups(dim) == groups
    for g in groups:  # every group varies only along `dim`
        for r in g:
            assert mesh.group_of(r, dim) == g


# --------------------------------------------------------------------------- chunk arithmetic


@pytest.mark.parametrize("n", range(0, 12))
@pytest.mark.parametrize("k", range(1, 7))
def test_chunk_matches_torch_chunk(n, k):
    chunks = list(torch.arange(n).chunk(k))
    for i in range(k):
        want = chunks[i] if i < len(chunks) else torch.empty(0, dtype=torch.long)
        assert local_size(n, k, i) == want.numel(), (n, k, i)
        if want.numel():
            assert local_offset(n, k, i) == int(want[0]), (n, k, i)
        got = torch.arange(n)[local_offset(n, k, i):][:local_size(n, k, i)]
        assert torch.equal(got, want)


@pytest.mark.parametrize("n, k, sizes", [
    (5, 4, [2, 2, 1, 0]),
    (4, 3, [2, 2, 0]),
    (1, 3, [1, 0, 0]),
    (7, 2, [4, 3]),
    (0, 2, [0, 0]),
])
def test_uneven_and_empty_chunks(n, k, sizes):
    assert [local_size(n, k, i) for i in range(k)] == sizes


def test_nested_sharding_in_mesh_dim_order():
    # S(0) on both mesh dims: dp cuts first, tp cuts dp's piece.
    placements = (Shard(0), Shard(0))
    assert local_slices((8, 3), MESH_2X2, placements, (1, 0)) == (slice(4, 6), slice(0, 3))
    assert local_shape((5, 3), MESH_2X2, placements, (0, 1)) == (1, 3)  # 5 -> 3 -> [2, 1]
    assert local_shape((5, 3), MESH_2X2, placements, (1, 1)) == (1, 3)  # 5 -> 2 -> [1, 1]
    assert local_slices((5, 3), MESH_2X2, placements, (1, 0)) == (slice(3, 4), slice(0, 3))


def test_partial_local_piece():
    t = torch.arange(4.0)
    mesh = ProcessMesh([0, 1], ["dp"])
    assert torch.equal(shard_tensor_local(t, mesh, [Partial("sum")], (0,)), t)
    assert torch.equal(shard_tensor_local(t, mesh, [Partial("sum")], (1,)), torch.zeros(4))
    for op in ("avg", "max", "min"):
        assert torch.equal(shard_tensor_local(t, mesh, [Partial(op)], (1,)), t)


def test_local_piece_is_not_a_view():
    t = torch.zeros(4)
    shard_tensor_local(t, ProcessMesh([0, 1]), [Shard(0)], (0,)).add_(1)
    assert torch.equal(t, torch.zeros(4))


def test_assemble_reports_missing_and_misshaped_pieces():
    mesh = ProcessMesh([0, 1])
    with pytest.raises(ValueError, match=r"no piece for coordinate \(1,\)"):
        assemble({(0,): torch.zeros(2)}, (4,), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"expected \[2\]"):
        assemble({(0,): torch.zeros(2), (1,): torch.zeros(3)}, (4,), mesh, [Shard(0)])


# --------------------------------------------------------------------------- round trip


@st.composite
def _cases(draw):
    mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    size = 1
    for s in mesh_shape:
        size *= s
    ids = draw(st.permutations(range(size + draw(st.integers(0, 3)))))[:size]
    mesh = ProcessMesh(torch.tensor(ids).reshape(mesh_shape), [f"m{i}" for i in
                                                               range(len(mesh_shape))])
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    placement = st.one_of(st.builds(Shard, st.integers(0, len(shape) - 1)),
                          st.just(Replicate()),
                          st.builds(Partial, st.sampled_from(["sum", "avg", "max", "min"])))
    placements = tuple(draw(st.lists(placement, min_size=mesh.ndim, max_size=mesh.ndim)))
    return mesh, placements, shape, draw(st.integers(0, 2**16))


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_shard_then_assemble_round_trips(case):
    mesh, placements, shape, seed = case
    t = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(seed)).float()
    attr = DistAttr(mesh, placements).check(shape)
    pieces = {}
    for c in mesh.coordinates():
        pieces[c] = shard_tensor_local(t, mesh, placements, c)
        assert tuple(pieces[c].shape) == attr.local_shape(shape, c)
        assert torch.equal(pieces[c], t[local_slices(shape, mesh, placements, c)]) or any(
            p.is_partial() for p in placements)
    assert torch.equal(assemble(pieces, shape, mesh, placements), t)
