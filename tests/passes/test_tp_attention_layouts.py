"""Tensor parallelism keeps attention on local heads for two fused q/k/v layouts beyond
Megatron's equal pieces: grouped-query attention's fused projection of unequal pieces
(Hugging Face Phi-3's ``qkv_proj`` output ``[q | k | v]`` sliced apart: a grouped shard of
relative widths, ``S(d)x2:1:1``) and timm's ViT split (``qkv.reshape(B, N, 3, H, hd)
.permute(2, 0, 3, 1, 4).unbind(0)``: ``S(d)x3`` found from the reshape). The arithmetic and
reshard of unequal groups (reference numerics, exact), the slice rules, and the models
under tp2 and dp2 x tp2 trained like eager with no activation gathered between the qkv and
the output projections; a head count that does not divide the tp size is refused by name.
"""
from __future__ import annotations

import copy
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar as ap
from autopar.ir import OpKind, StateKind
from autopar.ir.attrs import NAME
from autopar.ir.dist import (
    DistAttr,
    Partial,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    cat_grouped,
    chunk_grouped,
    local_runs,
    local_shape,
    parse_placements,
    shard_tensor_local,
)
from autopar.pass_infra.pinning import AnnotationError
from autopar.reshard import AllGather, ReduceScatter, Slice, plan_reshard

from ..parity import assert_same_losses, assert_same_params
from ..spmd.test_grouped_shard import check_reshard, run_rule_numerically
from ..spmd_util import MESH2, T, forward, make_op, reverse

# op_cases imports its siblings by name
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from op_cases import synthetic  # noqa: E402

R = Replicate()
TP2 = ProcessMesh([0, 1], dim_names=["tp"])
QKV = Shard(0, (4, 2, 2))              # 4 q heads, 2 kv heads: stored as widths 2:1:1


# --------------------------------------------------------------------------- placements


def test_unequal_groups_have_one_spelling_and_round_trip_as_text():
    assert QKV.groups == (2, 1, 1) and str(QKV) == "S(0)x2:1:1"
    assert Shard(0, (3, 3, 3)) == Shard(0, 3)             # equal widths are a count
    assert parse_placements("R,S(1)x2:1:1") == (R, Shard(1, (2, 1, 1)))
    with pytest.raises(ValueError, match="two or more positive ints"):
        Shard(0, (2,))
    with pytest.raises(ValueError, match="two or more positive ints"):
        Shard(0, (2, 0))


def test_a_piece_holds_its_chunk_of_q_and_of_each_kv_group():
    # columns [q0..q7 | k0..k3 | v0..v3] over 2 ranks: rank 1 holds q4..q7, k2 k3, v2 v3
    x = torch.arange(16)
    assert shard_tensor_local(x, TP2, [QKV], (0,)).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert shard_tensor_local(x, TP2, [QKV], (1,)).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert local_runs([16], TP2, [QKV], (1,)) == (((4, 8), (10, 12), (14, 16)),)
    with pytest.raises(ValueError, match=r"does not divide into groups 2:1:1 \(4 units\)"):
        DistAttr(TP2, (QKV,)).check([10])


@pytest.mark.parametrize("n, size", [(2, 16), (3, 12), (4, 8), (3, 20)])
def test_chunk_and_cat_of_unequal_groups_are_inverse_on_uneven_chunks(n, size):
    x = torch.randn(size, 3)
    parts = [chunk_grouped(x, 0, n, i, (2, 1, 1)) for i in range(n)]
    assert sum(p.shape[0] for p in parts) == size
    assert torch.equal(cat_grouped(parts, 0, (2, 1, 1)), x)


@pytest.mark.parametrize("shape, placements", [
    ((16, 6), "S(0),S(0)x2:1:1"), ((8, 24), "S(1)x3:1,S(0)"), ((24, 4), "S(0)x2:1:1,R"),
    ((4, 48), "P(sum),S(1)x2:1:1"), ((32, 2), "S(0)x2:1:1,S(0)"),
])
def test_shard_and_assemble_round_trip_on_2d_meshes(shape, placements):
    mesh = ProcessMesh(np.arange(4).reshape(2, 2))
    placements = parse_placements(placements)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    pieces = {c: shard_tensor_local(x, mesh, placements, c) for c in mesh.coordinates()}
    for c, piece in pieces.items():
        assert piece.shape == local_shape(shape, mesh, placements, c)
    if not any(isinstance(p, Partial) for p in placements):
        assert torch.equal(assemble(pieces, shape, mesh, placements), x)


# --------------------------------------------------------------------------- reshard


@pytest.mark.parametrize("src, dst, steps", [
    ((QKV,), (R,), [AllGather(0, 0, (2, 1, 1))]),
    ((R,), (QKV,), [Slice(0, 0, (2, 1, 1))]),
    ((Partial(),), (QKV,), [ReduceScatter(0, 0, "sum", (2, 1, 1))]),
    ((QKV,), (Shard(0),), None), ((Shard(1),), (QKV,), None), ((QKV,), (Shard(0, 3),), None),
])
@pytest.mark.parametrize("shape", [(16, 6), (8, 3), (24, 4)])
def test_reshard_to_and_from_unequal_groups_1d(src, dst, steps, shape):
    try:
        DistAttr(TP2, dst).check(shape)
    except ValueError:
        pytest.skip("the groups do not divide this shape")
    got = check_reshard(shape, TP2, src, dst)
    if steps is not None:
        assert got == steps
    assert "2:1:1 groups" in str(plan_reshard(shape, DistAttr(TP2, (QKV,)),
                                              DistAttr(TP2, (R,)))[0])


@pytest.mark.parametrize("src, dst", [
    ("R,S(0)x2:1:1", "R,R"), ("R,R", "R,S(0)x2:1:1"), ("S(1),S(0)x2:1:1", "R,R"),
    ("R,S(0)x2:1:1", "S(1),S(0)x2:1:1"), ("P(sum),P(sum)", "S(1),S(0)x2:1:1"),
    ("S(0)x2:1:1,R", "R,S(0)x2:1:1"), ("S(0)x2:1:1,S(1)", "S(1),S(0)x3"),
])
@pytest.mark.parametrize("shape", [(16, 4), (32, 6)])
def test_reshard_to_and_from_unequal_groups_2d(src, dst, shape):
    mesh = ProcessMesh(np.arange(4).reshape(2, 2))
    src, dst = parse_placements(src), parse_placements(dst)
    try:
        DistAttr(mesh, src).check(shape)
        DistAttr(mesh, dst).check(shape)
    except ValueError:
        pytest.skip("the groups do not divide this shape's pieces")
    check_reshard(shape, mesh, src, dst, seed=5)


# --------------------------------------------------------------------------- rules


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name, make, ins, needs, outs", [
    ("addmm-keeps-unequal-groups",
     lambda: synthetic("aten.addmm.default", _x(16), _x(6, 8), _x(8, 16)),
     ["R,S(0)x2:1:1", "S(0),R", "R,S(1)x2:1:1"], ["R,S(0)x2:1:1", "S(0),R", "R,S(1)x2:1:1"],
     ["S(0),S(1)x2:1:1"]),
    ("slice-q", lambda: synthetic("aten.slice.Tensor", _x(2, 3, 16), 2, 0, 8),
     ["S(0),S(2)x2:1:1"], ["S(0),S(2)x2:1:1"], ["S(0),S(2)"]),
    ("slice-k", lambda: synthetic("aten.slice.Tensor", _x(2, 16), 1, 8, 12),
     ["R,S(1)x2:1:1"], ["R,S(1)x2:1:1"], ["R,S(1)"]),
    ("slice-kv-to-the-end", lambda: synthetic("aten.slice.Tensor", _x(2, 16), 1, 8, 2 ** 62),
     ["R,S(1)x2:1:1"], ["R,S(1)x2:1:1"], ["R,S(1)x2"]),
    ("slice-negative-start", lambda: synthetic("aten.slice.Tensor", _x(2, 16), 1, -4),
     ["R,S(1)x2:1:1"], ["R,S(1)x2:1:1"], ["R,S(1)"]),
    ("slice-across-groups", lambda: synthetic("aten.slice.Tensor", _x(2, 16), 1, 0, 10),
     ["R,S(1)x2:1:1"], ["R,R"], ["R,R"]),
    ("slice-with-a-step", lambda: synthetic("aten.slice.Tensor", _x(2, 16), 1, 0, 8, 2),
     ["R,S(1)x2:1:1"], ["R,R"], ["R,R"]),
    ("split-with-sizes-unequal",
     lambda: synthetic("aten.split_with_sizes.default", _x(2, 16), [8, 4, 4], 1),
     ["R,S(1)x2:1:1"], ["R,S(1)x2:1:1"], ["R,S(1)"] * 3),
    ("split-with-sizes-kv-together",
     lambda: synthetic("aten.split_with_sizes.default", _x(2, 16), [8, 8], 1),
     ["R,S(1)x2:1:1"], ["R,S(1)x2:1:1"], ["R,S(1)", "R,S(1)x2"]),
    ("add-keeps-unequal-groups", lambda: synthetic("aten.add.Tensor", _x(4, 16), _x(16)),
     ["R,S(1)x2:1:1", None], ["R,S(1)x2:1:1", "R,S(0)x2:1:1"], ["R,S(1)x2:1:1"]),
])
def test_rules_on_unequal_groups_compute_the_global_op(name, make, ins, needs, outs):
    assert run_rule_numerically(make(), MESH2, ins) == (needs, outs)


def test_gradients_of_cuts_of_whole_groups_are_grouped_as_the_forward_input_was():
    # reverse: a grouped output asks each input for the groups it covers
    cat = make_op("aten.cat.default", [T(4, 8), T(4, 4), T(4, 4)], 1)
    assert reverse(cat, MESH2, "R,S(1)x2:1:1") == ["R,S(1)"] * 3
    # forward without a forward op: pieces of unequal widths are not one grouping
    assert forward(cat, MESH2, "R,S(1)", "R,S(1)", "R,S(1)")[1] == ["R,R"]
    # the cat that differentiates a split of S(1)x2:1:1 (and the slice_backward of a slice)
    # regroups: its forward op's need says how
    split = make_op("aten.split_with_sizes.default", T(4, 16), [8, 4, 4], 1)
    split.needs = (DistAttr(MESH2, parse_placements("R,S(1)x2:1:1")),)
    cat.forward_op = split
    assert forward(cat, MESH2, "R,S(1)", "R,S(1)", "R,S(1)") == (
        ["R,S(1)"] * 3, ["R,S(1)x2:1:1"])
    sliced = make_op("aten.slice.Tensor", T(4, 16), 1, 8, 12)
    sliced.needs = split.needs
    grad = make_op("aten.slice_backward.default", T(4, 4), [4, 16], 1, 8, 12, 1)
    assert forward(grad, MESH2, "S(0),S(1)") == (["S(0),R"], ["S(0),R"])
    grad.forward_op = sliced
    assert forward(grad, MESH2, "S(0),S(1)") == (["S(0),S(1)"], ["S(0),S(1)x2:1:1"])


# --------------------------------------------------------------------------- models


VOCAB, SEQ, BATCH, STEPS = 64, 12, 4, 3


def _phi3(heads: int = 4, kv_heads: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)).train()


PHI3_PLAN = {"*.qkv_proj": "colwise", "*.o_proj": "rowwise", "*.gate_up_proj": "colwise",
             "*.down_proj": "rowwise"}


class TimmAttention(nn.Module):
    """timm's ``Attention``: one fused qkv, split by reshape + permute + unbind."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, heads)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), \
            nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """A small timm-style ViT: patch embedding, class token, position embedding, blocks,
    final norm and a linear head on the class token."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2, classes: int = 5,
                 patch: int = 4, image: int = 16):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


VIT_PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
            "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


def _vit(heads: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return ViT(dim=24 if heads == 3 else 32, heads=heads).train()


def _strategy(plan: dict, mesh: str = "tp2", simulate: bool = True) -> ap.Strategy:
    layout = {"tp2": dict(mesh={"shape": [2], "dim_names": ["tp"]}),
              "tp4": dict(mesh={"shape": [4], "dim_names": ["tp"]}),
              "dp2_tp2": dict(mesh={"shape": [2, 2], "dim_names": ["dp", "tp"]},
                              data_parallel={"axis": "dp"})}[mesh]
    return ap.Strategy(**layout, tensor_parallel={"axis": "tp", "plan": plan},
                       debug={"simulate": simulate})


def _lm_data():
    ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return [({"input_ids": x}, x.clone()) for x in ids]


def _image_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, 16, 16, generator=g), int(torch.randint(0, 5, (), generator=g)))
            for _ in range(STEPS * BATCH)]


def _eager(model: nn.Module, data, loss) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        rows = data[step * BATCH:(step + 1) * BATCH]
        x, y = torch.utils.data.default_collate(rows)
        torch.manual_seed(step)
        value = model(**x, labels=y).loss if loss is None else loss(model(x), y)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    return losses


def _train(model: nn.Module, data, loss, strategy: ap.Strategy) -> tuple[list, ap.Engine]:
    reference = copy.deepcopy(model)
    want = _eager(reference, data, loss)
    engine = ap.Engine(model, loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       strategy=strategy)
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, reference)
    return got, engine


def _gathers_between(engine: ap.Engine, first: str, last: str) -> dict[str, list[str]]:
    """Per rank, the all_gather / all_to_all ops of its lowered program in the forward
    between the first op of module ``first`` and the first op of module ``last``
    (``{}`` keys: layer number), with the modules they run for."""
    step = engine.planner.last("train")
    found = {}
    for process, rank in step.lowered.processes.items():
        ops = rank.program.ops
        for layer in range(2):
            a = next(i for i, op in enumerate(ops) if op.module == first.format(layer))
            b = next(i for i, op in enumerate(ops) if op.module == last.format(layer))
            assert a < b
            found[(process, layer)] = [f"{op.target} {op.module}" for op in ops[a:b]
                                       if op.kind is OpKind.COMM and op.target in
                                       ("comm.all_gather", "comm.all_to_all")]
    return found


def _placed(engine: ap.Engine) -> dict:
    program = engine.planner.last("train").program
    return {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}


def test_phi3_fused_grouped_query_qkv_trains_like_eager_on_local_heads_under_tp2():
    _, engine = _train(_phi3(), _lm_data(), None, _strategy(PHI3_PLAN))
    placed = _placed(engine)
    qkv = placed["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dist.placements == (Shard(0, (2, 1, 1)),)      # 32 q | 16 k | 16 v rows
    assert "2:1:1 groups (its output is sliced into pieces of 32/16/16)" in qkv.why.text
    assert placed["model.layers.1.mlp.gate_up_proj.weight"].dist.placements == (Shard(0, 2),)
    gathers = _gathers_between(engine, "model.layers.{}.self_attn.qkv_proj",
                               "model.layers.{}.self_attn.o_proj")
    assert len(gathers) == 4 and not any(gathers.values()), gathers
    # nothing is gathered anywhere: the backward keeps the groups too (slice_backward)
    program = engine.planner.last("train").program
    assert not [op for op in program.ops if op.target in ("comm.all_gather", "comm.slice")]


def test_phi3_on_local_heads_under_dp2_x_tp2():
    _, engine = _train(_phi3(), _lm_data(), None, _strategy(PHI3_PLAN, "dp2_tp2"))
    assert _placed(engine)["model.layers.0.self_attn.qkv_proj.weight"].dist.placements == (
        R, Shard(0, (2, 1, 1)))
    gathers = _gathers_between(engine, "model.layers.{}.self_attn.qkv_proj",
                               "model.layers.{}.self_attn.o_proj")
    assert len(gathers) == 8 and not any(gathers.values()), gathers


def _vit_loss(out, y):
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("mesh", ["tp2", "dp2_tp2"])
def test_timm_vit_reshape_split_qkv_trains_like_eager_on_local_heads(mesh):
    _, engine = _train(_vit(), _image_data(), _vit_loss, _strategy(VIT_PLAN, mesh))
    qkv = _placed(engine)["blocks.0.attn.qkv.weight"]
    assert Shard(0, 3) in qkv.dist.placements and "viewed as 3 groups of heads" in qkv.why.text
    gathers = _gathers_between(engine, "blocks.{}.attn.qkv", "blocks.{}.attn.proj")
    ranks = {"tp2": 2, "dp2_tp2": 4}[mesh]
    assert len(gathers) == 2 * ranks and not any(gathers.values()), gathers
    # the backward flattens the heads back into the groups: no gather there either
    program = engine.planner.last("train").program
    assert not [op for op in program.ops if op.target == "comm.all_gather"]


def test_kv_heads_that_do_not_divide_the_tp_size_are_refused_by_name():
    model = _phi3()
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=_strategy(PHI3_PLAN, "tp4", simulate=False))
    x = torch.randint(1, VOCAB, (BATCH, SEQ))
    with pytest.raises(AnnotationError, match=r"(?s)qkv_proj.*self_attn\).*S\(2\).*2 heads "
                                              r"do not divide over mesh dim 'tp' of size 4"):
        engine.prepare({"input_ids": x}, x)


def test_vit_heads_that_do_not_divide_the_tp_size_are_refused_by_name():
    model = _vit(heads=3)
    engine = ap.Engine(model, _vit_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=_strategy(VIT_PLAN, "tp2", simulate=False))
    with pytest.raises(AnnotationError, match=r"(?s)blocks.0.attn.qkv.*S\(2\)x3.*as 3 groups "
                                              r"of 3 heads.*size 2"):
        engine.prepare(torch.randn(BATCH, 3, 16, 16), torch.zeros(BATCH, dtype=torch.long))


class SplitGQA(nn.Module):
    """Grouped-query attention whose fused projection is cut by ``split`` into unequal
    sizes (4 query heads, 2 key/value heads)."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.emb = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        B, N, C = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.hd, self.kv_heads * self.hd,
                                     self.kv_heads * self.hd], dim=-1)
        q, k, v = (t.view(B, N, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(B, N, C)))


def test_a_fused_projection_split_into_unequal_pieces_trains_on_local_heads():
    torch.manual_seed(0)
    data = [(x["input_ids"], y) for x, y in _lm_data()]
    strategy = _strategy({"qkv": "colwise", "proj": "rowwise"})
    _, engine = _train(SplitGQA(), data, lambda out, y: F.cross_entropy(
        out.flatten(0, 1), y.flatten()), strategy)
    assert _placed(engine)["qkv.weight"].dist.placements == (Shard(0, (2, 1, 1)),)
    program = engine.planner.last("train").program
    assert not [op for op in program.ops if op.target in ("comm.all_gather", "comm.slice")]


LLAMA_PLAN = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
              "*.o_proj": "rowwise", "*.gate_proj": "colwise", "*.up_proj": "colwise",
              "*.down_proj": "rowwise"}


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
def test_separate_qkv_projections_with_two_kv_heads_keep_working_under_tp2(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).train()
    _, engine = _train(model, _lm_data(), None, _strategy(LLAMA_PLAN))
    assert _placed(engine)["model.layers.0.self_attn.k_proj.weight"].dist.placements == (
        Shard(0),)
    gathers = _gathers_between(engine, "model.layers.{}.self_attn.q_proj",
                               "model.layers.{}.self_attn.o_proj")
    assert not any(gathers.values()), gathers


def test_explicit_attention_matmuls_keep_the_heads_local_under_tp2():
    """``q @ k.transpose(-2, -1)`` and ``att @ v`` on ``[B, H, T, hd]`` run as ``bmm`` on
    ``[B*H, T, hd]`` views: those reshapes keep the heads' shard as a grouped one
    (``regroup_flattens``: read only by batched matmuls of activations), so under the
    Megatron plan nothing is gathered or cut anywhere in the step (before: every head
    all-gathered to every rank, forward and backward). Trains like eager."""
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32,
                          sdpa=False))
    plan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
            "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1),
                        generator=torch.Generator().manual_seed(0))
    data = [(row[:-1], row[1:]) for row in ids]
    _, engine = _train(model, data, lm_loss, _strategy(plan))
    program = engine.planner.last("train").program
    assert any(op.target == "aten.bmm.default" for op in program.ops)
    moved = [f"{op.target} {op.module}" for op in program.ops
             if op.target in ("comm.all_gather", "comm.slice", "comm.all_to_all")]
    assert not moved, moved
