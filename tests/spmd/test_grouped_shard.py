"""Grouped shards (``Shard(d, groups=g)``, text ``S(d)xg``): Megatron's interleaved layout of
a fused qkv projection. The arithmetic (pieces, round trips), reshard to and from grouped
shards (reference numerics on 1-D and 2-D meshes), the rules that keep or refuse a grouping,
and the GPT / Hugging Face GPT-2 plans under tp: attention on local heads with no
communication between qkv and proj in forward, trained like single-device eager torch."""
from __future__ import annotations

import copy
import math
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.ir import OpKind, StateKind
from autopar.ir.dist import (
    DistAttr,
    Partial,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    cat_grouped,
    chunk_grouped,
    format_placements,
    local_runs,
    local_shape,
    local_slices,
    parse_placements,
    shard_tensor_local,
)
from autopar.lower.partition import partition
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.reshard import (
    AllGather,
    ReduceScatter,
    Slice,
    apply_steps,
    naive_plan,
    plan_cost,
    plan_reshard,
)
from autopar.spmd.local_forms import LocalContext, UnsupportedLocalForm, local_call, run_local

from .. import models_zoo as zoo

# op_cases imports its siblings by name
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from op_cases import synthetic  # noqa: E402

from autopar.ir.attrs import COMM_TEXT, NAME

from ..parity import assert_same_losses, assert_same_params, eager_train, lm_data
from ..reshard.test_reshard_plan import make_pieces
from ..spmd_util import MESH2, T, forward, make_op, reverse

R = Replicate()
MESH_TP = ProcessMesh([0, 1], dim_names=["tp"])


def mesh_of(*shape: int) -> ProcessMesh:
    return ProcessMesh(np.arange(math.prod(shape)).reshape(shape))


# --------------------------------------------------------------------------- placements


@pytest.mark.parametrize("placement, text", [
    (Shard(0, 3), "S(0)x3"), (Shard(2, groups=2), "S(2)x2"), (Shard(1, 1), "S(1)")])
def test_text_round_trip(placement, text):
    assert str(placement) == text
    assert parse_placements(text) == (placement,)
    assert format_placements((R, placement)) == "{R," + text + "}"


def test_one_group_is_a_plain_shard():
    assert Shard(0, groups=1) == Shard(0) and hash(Shard(0, 1)) == hash(Shard(0))
    with pytest.raises(ValueError, match="groups must be a positive int"):
        Shard(0, groups=0)


def test_a_grouped_piece_holds_its_chunk_of_every_group():
    # [q; k; v] rows 0..11 over 2 ranks: rank 0 holds q0 q1, k0 k1, v0 v1
    x = torch.arange(12)
    assert shard_tensor_local(x, MESH_TP, [Shard(0, 3)], (0,)).tolist() == [0, 1, 4, 5, 8, 9]
    assert shard_tensor_local(x, MESH_TP, [Shard(0, 3)], (1,)).tolist() == [2, 3, 6, 7, 10, 11]
    assert local_runs([12, 5], MESH_TP, [Shard(0, 3)], (1,)) == (
        ((2, 4), (6, 8), (10, 12)), ((0, 5),))
    assert local_shape([12, 5], MESH_TP, [Shard(0, 3)], (1,)) == (6, 5)


def test_offsets_of_a_grouped_shard_are_refused_by_name():
    with pytest.raises(ValueError, match="grouped shard.*local_runs"):
        local_slices([12], MESH_TP, [Shard(0, 3)], (0,))


def test_check_refuses_groups_that_do_not_divide_the_piece():
    DistAttr(MESH2, (Shard(0), Shard(0, 3))).check([12])          # dp pieces of 6
    with pytest.raises(ValueError, match="does not divide into 3 groups"):
        DistAttr(MESH2, (Shard(0), Shard(0, 3))).check([10])     # dp pieces of 5
    with pytest.raises(ValueError, match="does not divide into 3 groups"):
        DistAttr(MESH_TP, (Shard(1, 3),)).check([4, 8])


def reference_pieces(x: torch.Tensor, mesh: ProcessMesh, placements) -> dict:
    """Every rank's piece cut mesh dim by mesh dim with chunk_grouped (the definition)."""
    pieces = {(): x}
    for p, n in zip(placements, mesh.shape):
        pieces = {c + (i,): (chunk_grouped(t, p.dim, n, i, p.groups) if p.is_shard() else t)
                  for c, t in pieces.items() for i in range(n)}
    return pieces


@st.composite
def grouped_cases(draw):
    mesh_shape = draw(st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (3, 2)]))
    rank = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 4)) for _ in range(rank)]
    placements = []
    for n in mesh_shape:
        kind = draw(st.sampled_from(["R", "S", "G"]))
        d = draw(st.integers(0, rank - 1))
        if kind == "R":
            placements.append(R)
            continue
        groups = draw(st.integers(2, 3)) if kind == "G" else 1
        placements.append(Shard(d, groups))
    # make every grouped dim divide: a multiple of the groups of all cuts of it
    for d in range(rank):
        factor = math.prod(p.groups * n for p, n in zip(placements, mesh_shape)
                           if p.is_shard(d))
        shape[d] *= factor
    return mesh_of(*mesh_shape), tuple(shape), tuple(placements)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(grouped_cases())
def test_shard_and_assemble_round_trip_with_groups(case):
    mesh, shape, placements = case
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = reference_pieces(x, mesh, placements)
    pieces = {}
    for c in mesh.coordinates():
        piece = shard_tensor_local(x, mesh, placements, c)
        assert piece.shape == local_shape(shape, mesh, placements, c)
        assert torch.equal(piece, want[c]), (placements, c)
        index = [torch.tensor([i for a, b in runs for i in range(a, b)], dtype=torch.long)
                 for runs in local_runs(shape, mesh, placements, c)]
        by_runs = x
        for d, ix in enumerate(index):
            by_runs = by_runs.index_select(d, ix)
        assert torch.equal(by_runs, piece)
        pieces[c] = piece
    assert torch.equal(assemble(pieces, shape, mesh, placements), x)


def test_chunk_and_cat_grouped_are_inverse_on_uneven_chunks():
    x = torch.randn(9, 4)                 # 3 groups of 3 rows over 2 ranks: 2 + 1 rows
    parts = [chunk_grouped(x, 0, 2, i, 3) for i in range(2)]
    assert [p.shape[0] for p in parts] == [6, 3]
    assert torch.equal(cat_grouped(parts, 0, 3), x)


# --------------------------------------------------------------------------- reshard


def check_reshard(shape, mesh, src, dst, seed=0):
    """Plan src -> dst, run the reference executor, compare with the dst pieces."""
    src_d, dst_d = DistAttr(mesh, src), DistAttr(mesh, dst)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    pieces = make_pieces(x, mesh, src, gen)     # checks assemble(pieces) == x
    steps = plan_reshard(shape, src_d, dst_d)
    out = apply_steps(pieces, shape, mesh, steps)
    for c in mesh.coordinates():
        want = shard_tensor_local(x, mesh, dst, c) if not any(
            isinstance(p, Partial) for p in dst) else None
        if want is not None:
            torch.testing.assert_close(out[c], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(assemble(out, shape, mesh, dst), x, rtol=1e-12, atol=1e-12)
    assert plan_cost(shape, src_d, steps) <= plan_cost(shape, src_d,
                                                       naive_plan(shape, src_d, dst_d)) + 1e-6
    return steps


G3 = Shard(0, 3)


@pytest.mark.parametrize("src, dst, steps", [
    ((G3,), (R,), [AllGather(0, 0, 3)]),
    ((R,), (G3,), [Slice(0, 0, 3)]),
    ((Partial(),), (G3,), [ReduceScatter(0, 0, "sum", 3)]),
    ((Partial("max"),), (G3,), [ReduceScatter(0, 0, "max", 3)]),
    ((G3,), (Shard(0),), [AllGather(0, 0, 3), Slice(0, 0)]),
    ((G3,), (Shard(1),), None),
    ((Shard(1),), (G3,), None),
    ((G3,), (Shard(0, 2),), None),
    ((Shard(1, 2),), (Shard(0, 3),), None),
], ids=lambda v: format_placements(v) if isinstance(v, tuple) else None)
@pytest.mark.parametrize("shape", [(12, 6), (9, 4), (18, 10)], ids=["even", "uneven", "uneven2"])
def test_reshard_grouped_1d(src, dst, steps, shape):
    try:
        DistAttr(MESH_TP, src).check(shape)
        DistAttr(MESH_TP, dst).check(shape)
    except ValueError:
        pytest.skip("the groups do not divide this shape")
    got = check_reshard(shape, MESH_TP, src, dst)
    if steps is not None:
        assert got == steps


@pytest.mark.parametrize("src, dst", [
    ("R,S(0)x3", "R,R"), ("R,R", "R,S(0)x3"), ("S(0),S(0)x3", "R,R"),
    ("R,S(0)x3", "S(0),S(0)x3"), ("S(0),S(0)x3", "R,S(0)x3"), ("S(0)x3,R", "R,S(0)x3"),
    ("P(sum),S(0)x3", "R,S(0)x3"), ("S(1),S(0)x3", "S(0)x3,S(1)"), ("R,P(sum)", "S(1),S(0)x3"),
    ("S(0)x3,S(0)", "R,R"), ("S(0)x3,S(0)", "S(0),S(0)x3"), ("P(sum),P(sum)", "S(0)x3,S(1)x2"),
])
@pytest.mark.parametrize("shape", [(12, 8), (18, 4)], ids=["even", "uneven"])
def test_reshard_grouped_2d(src, dst, shape):
    mesh = mesh_of(2, 2)
    src, dst = parse_placements(src), parse_placements(dst)
    try:
        DistAttr(mesh, src).check(shape)
        DistAttr(mesh, dst).check(shape)
    except ValueError:
        pytest.skip("the groups do not divide this shape's pieces")
    check_reshard(shape, mesh, src, dst, seed=3)


def test_grouped_shards_have_no_all_to_all():
    steps = plan_reshard((12, 6), DistAttr(MESH_TP, (G3,)), DistAttr(MESH_TP, (Shard(1),)))
    assert [s.kind for s in steps] == ["all_gather", "slice"]
    assert str(steps[0]) == "all_gather(dim 0, 3 groups) over tp"


# --------------------------------------------------------------------------- rules


def run_rule_numerically(case, mesh, in_text):
    """The rule's decision from ``in_text`` placements, then every rank's local op on the
    pieces it assigns; each output reassembled must be the global output."""
    from autopar.spmd import lookup
    ins = [None if t is None else DistAttr(mesh, parse_placements(t)) for t in in_text]
    decision = lookup(case.op).forward(case.op, ins, mesh)
    per_rank = {}
    for c in mesh.coordinates():
        ctx = LocalContext(mesh, c, tuple(decision.needs), tuple(decision.outputs))
        tensors = iter(shard_tensor_local(x, mesh, need.placements, c)
                       for x, need in zip(case.inputs, decision.needs))
        values = {v: next(tensors) for v in case.op.inputs if v.is_tensor}
        out = run_local(case.op, ctx, values)
        per_rank[c] = list(out) if isinstance(out, (tuple, list)) else [out]
    for o, (v, d) in enumerate(zip(case.op.outputs, decision.outputs)):
        got = assemble({c: outs[o] for c, outs in per_rank.items()}, v.type.shape, mesh,
                       d.placements)
        torch.testing.assert_close(got, case.outputs[o], rtol=1e-5, atol=1e-5)
    return [",".join(map(str, d.placements)) for d in decision.needs], \
        [",".join(map(str, d.placements)) for d in decision.outputs]


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name, make, ins, needs, outs", [
    ("addmm-keeps-groups", lambda: synthetic("aten.addmm.default", _x(12), _x(8, 6), _x(6, 12)),
     ["R,S(0)x3", "S(0),R", "R,S(1)x3"], ["R,S(0)x3", "S(0),R", "R,S(1)x3"], ["S(0),S(1)x3"]),
    ("mm-contract-grouped", lambda: synthetic("aten.mm.default", _x(4, 12), _x(12, 5)),
     ["R,S(1)x3", "R,S(0)x3"], ["R,S(1)x3", "R,S(0)x3"], ["R,P(sum)"]),
    ("mm-mixed-groups-reshard", lambda: synthetic("aten.mm.default", _x(4, 12), _x(12, 5)),
     ["R,S(1)x3", "R,S(0)"], None, None),
    ("t", lambda: synthetic("aten.t.default", _x(12, 4)), ["S(1),S(0)x3"], ["S(1),S(0)x3"],
     ["S(0),S(1)x3"]),
    ("add-broadcast", lambda: synthetic("aten.add.Tensor", _x(4, 12), _x(12)),
     ["R,S(1)x3", None], ["R,S(1)x3", "R,S(0)x3"], ["R,S(1)x3"]),
    ("sum-other-dim", lambda: synthetic("aten.sum.dim_IntList", _x(8, 12), [0], True),
     ["S(0),S(1)x3"], ["S(0),S(1)x3"], ["P(sum),S(1)x3"]),
    ("sum-grouped-dim", lambda: synthetic("aten.sum.dim_IntList", _x(8, 12), [1]),
     ["R,S(1)x3"], ["R,S(1)x3"], ["R,P(sum)"]),
    ("view-keeps-an-unchanged-dim", lambda: synthetic("aten.view.default", _x(8, 12), [2, 4, 12]),
     ["S(0),S(1)x3"], ["S(0),S(1)x3"], ["S(0),S(2)x3"]),
    ("view-groups-to-a-dim", lambda: synthetic("aten.view.default", _x(2, 12), [2, 3, 4]),
     ["R,S(1)x3"], ["R,S(1)x3"], ["R,S(2)"]),
    ("view-to-heads", lambda: synthetic("aten.view.default", _x(8, 24), [2, 4, 3, 2, 4]),
     ["S(0),S(1)x3"], ["S(0),S(1)x3"], ["S(0),S(3)"]),
    ("view-heads-back-keeps-the-plain-rule",      # an inner shard of a flatten is gathered
     lambda: synthetic("aten.view.default", _x(2, 4, 3, 2, 4), [8, 24]),
     ["S(0),S(3)"], ["S(0),R"], ["S(0),R"]),
    ("view-uneven-rest-refused",
     lambda: synthetic("aten.view.default", _x(2, 36), [2, 3, 3, 4]),
     ["R,S(1)x3"], ["R,R"], ["R,R"]),
    ("split-into-groups", lambda: synthetic("aten.split.Tensor", _x(2, 3, 12), 4, 2),
     ["S(0),S(2)x3"], ["S(0),S(2)x3"], ["S(0),S(2)"] * 3),
    ("split-with-sizes-whole-groups",
     lambda: synthetic("aten.split_with_sizes.default", _x(2, 12), [4, 8], 1),
     ["R,S(1)x3"], ["R,S(1)x3"], ["R,S(1)", "R,S(1)x2"]),
    ("split-across-groups", lambda: synthetic("aten.split.Tensor", _x(2, 12), 6, 1),
     ["R,S(1)x3"], ["R,R"], ["R,R", "R,R"]),
    ("split-plain-shard", lambda: synthetic("aten.split.Tensor", _x(2, 12), 4, 1),
     ["R,S(1)"], ["R,R"], ["R,R"] * 3),
    ("cat-into-groups", lambda: synthetic("aten.cat.default", [_x(2, 4), _x(2, 4, seed=1),
                                                               _x(2, 4, seed=2)], 1),
     ["S(0),S(1)"] * 3, ["S(0),S(1)"] * 3, ["S(0),S(1)x3"]),
    ("cat-uneven-chunks", lambda: synthetic("aten.cat.default", [_x(3, 5), _x(3, 5, seed=1)], 1),
     ["R,S(1)", "R,S(1)"], ["R,S(1)", "R,S(1)"], ["R,S(1)x2"]),
    ("cat-of-groups", lambda: synthetic("aten.cat.default", [_x(2, 8), _x(2, 4, seed=1)], 1),
     ["R,S(1)x2", "R,S(1)"], ["R,S(1)x2", "R,S(1)"], ["R,S(1)x3"]),
    ("cat-unequal-widths", lambda: synthetic("aten.cat.default", [_x(2, 8), _x(2, 4, seed=1)], 1),
     ["R,S(1)", "R,S(1)"], ["R,R", "R,R"], ["R,R"]),
])
def test_rules_on_grouped_shards_compute_the_global_op(name, make, ins, needs, outs):
    case = make()
    got_needs, got_outs = run_rule_numerically(case, MESH2, ins)
    if needs is not None:
        assert (got_needs, got_outs) == (needs, outs)
    else:   # operands of one letter grouped differently: one is resharded to the other's
        assert got_needs != ins
        assert got_needs[0].endswith("x3") == got_needs[1].endswith("x3"), got_needs


def test_a_reshape_that_cuts_a_grouped_dim_across_groups_asks_for_a_reshard():
    op = make_op("aten.view.default", T(4, 12), [4, 6, 2])      # 6 is not the 3 groups
    needs, outs = forward(op, MESH2, "R,S(1)x3")
    assert needs == ["R,R"] and outs == ["R,R"]
    op = make_op("aten.view.default", T(4, 12), [4, 3, 4])
    assert forward(op, MESH2, "S(1)x3,R") == (["S(1)x3,R"], ["S(2),R"])
    three = ProcessMesh([0, 1, 2], dim_names=["tp"])              # 4 per group over 3 ranks
    assert forward(op, three, "S(1)x3") == (["R"], ["R"])


def test_reverse_inference_carries_groups():
    split = make_op("aten.split.Tensor", T(4, 12), 4, 1)
    assert reverse(split, MESH2, "S(0),S(1)", None, None) == ["S(0),S(1)x3"]
    cat = make_op("aten.cat.default", [T(4, 4), T(4, 4), T(4, 4)], 1)
    assert reverse(cat, MESH2, "R,S(1)x3") == ["R,S(1)"] * 3
    t = make_op("aten.t.default", T(12, 4))
    assert reverse(t, MESH2, "R,S(1)x3") == ["R,S(0)x3"]
    heads = make_op("aten.view.default", T(4, 12), [4, 3, 2, 2])
    assert forward(heads, MESH2, "S(0),S(1)x3") == (["S(0),S(1)x3"], ["S(0),S(2)"])
    # a plain hint stays the plain rule's (grouped shards come from the plan)
    assert reverse(heads, MESH2, "S(0),S(2)") == ["S(0),R"]


def test_a_local_form_that_reads_offsets_refuses_a_grouped_shard():
    ids = torch.randint(0, 12, (3, 5), generator=torch.Generator().manual_seed(0))
    case = synthetic("aten.embedding.default", _x(12, 4), ids)
    place = lambda *p: DistAttr(MESH_TP, p)  # noqa: E731
    ctx = LocalContext(MESH_TP, (0,), (place(Shard(0, 3)), place(R)), (place(Partial()),))
    with pytest.raises(UnsupportedLocalForm, match="grouped shard.*no single offset"):
        local_call(case.op, ctx)


# --------------------------------------------------------------------------- GPT plans


def _gpt(sdpa: bool = True, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16,
                         dropout=dropout, sdpa=sdpa))


def _strategy(config: str, simulate: bool = False) -> ap.Strategy:
    strategy = ap.Strategy.from_yaml(config)
    if simulate:
        strategy = strategy.model_copy(update={
            "debug": ap.Strategy(debug={"simulate": True}).debug})
    return strategy


def _produced_in(program, modules) -> set:
    return {v for op in program.ops if op.module in modules and op.role.value == "fwd"
            for v in op.outputs}


def test_gpt_tp_plan_runs_attention_on_local_heads_without_forward_communication():
    model = _gpt()
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=_strategy("configs/tp.yaml"))
    x = torch.randint(0, 64, (4, 16))
    program = engine.prepare(x, x)
    states = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.bias"):
        assert states[name].dist.placements == (Shard(0, 3),), name
        assert "3 groups" in states[name].why.text
    assert states["blocks.0.fc1.weight"].dist.placements == (Shard(0),)   # no split after it
    inside = _produced_in(program, {"blocks.0.attn", "blocks.0.attn.qkv",
                                    "blocks.1.attn", "blocks.1.attn.qkv"})
    moved = [op for op in program.ops if op.kind is OpKind.COMM and op.role.value == "fwd"
             and op.args[0] in inside]
    assert moved == [], [f"{op.target} {op.attrs.get(COMM_TEXT)}" for op in moved]
    sdpa = [op for op in program.ops
            if op.target == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert len(sdpa) == 2
    local = partition(program, engine.planner.last("train").facts.mesh, (1,))
    for op in sdpa:
        assert all(v.dist.placements == (Shard(1),) for v in op.inputs if v.is_tensor)
        i = program.ops.index(op)
        assert [v.type.shape for v in local.ops[i].inputs if v.is_tensor] == [(4, 2, 16, 8)] * 3


@pytest.mark.parametrize("config", ["configs/tp.yaml", "configs/dp_tp.yaml"])
def test_gpt_head_parallel_trains_like_eager_for_10_steps(config):
    model = _gpt(sdpa=False, dropout=0.1 if config.endswith("/tp.yaml") else 0.0)
    ref = copy.deepcopy(model)
    data = lm_data(40, 16, 64)
    want = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                       data, batch_size=4, steps=10)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1,
                                                       momentum=0.9),
                       strategy=_strategy(config, simulate=True))
    losses = engine.fit(data, batch_size=4, verbose=0)["loss"]
    program = next(iter(engine.planner.steps.values())).program
    qkv = next(op.result for op in program.states(StateKind.PARAM)
               if op.attrs[NAME] == "blocks.0.attn.qkv.weight")
    assert Shard(0, 3) in qkv.dist.placements
    assert_same_losses(losses, want)
    assert_same_params(model, ref)


def test_hugging_face_gpt2_fused_c_attn_trains_like_eager_under_tp2():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.hf_gpt2("sdpa", 97).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 97, (12, 16), generator=torch.Generator().manual_seed(0))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    want = []
    for step, x in enumerate(ids.split(4)):
        torch.manual_seed(step)
        out = reference(input_ids=x, labels=x)
        ref_opt.zero_grad()
        out.loss.backward()
        ref_opt.step()
        want.append(out.loss.item())
    plan = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
            "transformer.wte": "vocab"}
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]},
                           tensor_parallel={"axis": "tp", "plan": plan},
                           debug={"simulate": True})
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       strategy=strategy)
    history = engine.fit([({"input_ids": x}, x.clone()) for x in ids], batch_size=4, verbose=0)
    program = next(iter(engine.planner.steps.values())).program
    placed = {op.attrs[NAME]: op.result.dist.placements
              for op in program.states(StateKind.PARAM)}
    # Conv1D stores [in, 3C]: the fused dim is 1
    assert placed["transformer.h.0.attn.c_attn.weight"] == (Shard(1, 3),)
    assert placed["transformer.h.0.attn.c_attn.bias"] == (Shard(0, 3),)
    assert placed["transformer.h.0.mlp.c_fc.weight"] == (Shard(1),)
    assert_same_losses(history["loss"], want)
    assert_same_params(model, reference)
