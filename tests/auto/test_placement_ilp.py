"""The placement ILP (autopar.auto): on cases whose optimum is known it finds it (Megatron's
column/row pair for big weights and a small batch, data parallel for the reverse), it keeps
user annotations, a memory limit forces sharding, and its plans train like eager torch."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.annotations import param_annotation
from autopar.auto import auto_placements, placed_program, solve_placements
from autopar.auto.ilp_completion import commit_choice
from autopar.auto.tp_plan import tensor_parallel_plan_of
from autopar.cost.profile import AlphaBeta, Curve, Profile
from autopar.ir import Role
from autopar.ir.dist import Replicate, Shard
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.pass_infra.explain import planned_moves

from ..models_zoo import MegatronMLP as MLP
from ..models_zoo import mse as _mse
from ..parity import assert_same_losses, assert_same_params, eager_train, one_thread, twin

pytestmark = pytest.mark.usefixtures("one_thread")
_ = one_thread

MESH = "mesh: {shape: [2], dim_names: [x]}"


def _machine() -> Profile:
    """A fixed machine, so the known optima do not move when the reference profile is
    remeasured: 10 GFLOP/s matrix products, 5 GB/s memory-bound ops, and 2-rank collectives
    of 20 us latency and 1 GB/s per byte a rank sends."""
    def line(per_second: float) -> Curve:
        return Curve(points=[(1.0, 1.0 / per_second), (1e12, 1e12 / per_second)])
    fit = {2: AlphaBeta(alpha_s=20e-6, beta_s_per_byte=1e-9)}
    return Profile(machine="test", processes=2, threads=1, matmul=line(1e10),
                   pointwise=line(5e9), op_overhead_s=0.0,
                   collectives={k: dict(fit) for k in ("all_reduce", "all_gather",
                                                       "reduce_scatter", "all_to_all",
                                                       "broadcast", "send_recv")})


MACHINE = _machine()


def _solve(model, rows, strategy=MESH, **kw):
    d = model.fc1.in_features
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    notes = {n: a for n, p in model.named_parameters() if (a := param_annotation(p))}
    return auto_placements(model, _mse, opt, ap.Strategy.from_yaml_str(strategy),
                           torch.randn(rows, d), torch.randn(rows, d), annotations=notes,
                           profile=MACHINE, **kw)


def _layout(found):
    return {n: tuple(d.placements) for n, d in found.params.items()}


def test_big_weights_small_batch_pick_megatron_column_then_row_and_train_like_eager():
    torch.manual_seed(0)
    model = MLP(512, 2048)
    found = _solve(model, rows=4)
    assert _layout(found) == {"fc1.weight": (Shard(0),), "fc1.bias": (Shard(0),),
                              "fc2.weight": (Shard(1),), "fc2.bias": (Replicate(),)}
    assert all(d.placements == (Replicate(),) for d in found.inputs.values())
    # the plan: the chosen placements as annotations, then the ordinary pipeline
    ref = twin(model)
    for name, p in model.named_parameters():
        ap.shard_tensor(p, found.params[name].mesh, list(found.params[name].placements))
    data = [(torch.randn(512), torch.randn(512)) for _ in range(12)]
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.01),
                       strategy=ap.Strategy.from_yaml_str(MESH + "\ndebug: {simulate: true}"))
    x, y = (torch.stack(t) for t in zip(*data[:4]))
    # the bias goes in on one rank (a free make_partial); fc2's partial sum is all-reduced
    # once, where the loss reads it
    forward = [m.kind for m in planned_moves(engine.prepare(x, y))
               if m.role in (Role.FORWARD.value, Role.LOSS.value)
               and m.kind not in ("make_partial", "slice")]
    assert forward == ["all_reduce"]
    losses = engine.fit(data, batch_size=4, steps_per_epoch=3, verbose=0)["loss"]
    ref_losses = eager_train(ref, _mse, torch.optim.SGD(ref.parameters(), lr=0.01), data,
                             batch_size=4, steps=3)
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)


def test_big_batch_small_weights_pick_data_parallel():
    found = _solve(MLP(64, 64), rows=16384)
    assert set(_layout(found).values()) == {(Replicate(),)}
    assert {tuple(d.placements) for d in found.inputs.values()} == {(Shard(0),)}
    assert found.choice.comm_s > 0      # the gradients' all-reduces


def test_a_user_annotation_is_kept():
    model = MLP(512, 2048)
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    ap.shard_tensor(model.fc1.weight, mesh, [Shard(1)])     # rowwise, not the ILP's colwise
    found = _solve(model, rows=4)
    assert _layout(found)["fc1.weight"] == (Shard(1),)


def test_a_memory_limit_forces_sharding():
    model = MLP(16, 16)
    free = _solve(model, rows=4)
    assert set(_layout(free).values()) == {(Replicate(),)}
    full = free.choice.state_bytes
    limited = _solve(model, rows=4, memory_limit_bytes=0.75 * full)
    assert limited.choice.state_bytes <= 0.75 * full
    assert any(p != (Replicate(),) for p in _layout(limited).values())
    assert limited.choice.objective_s >= free.choice.objective_s
    with pytest.raises(ValueError, match="no placement found within"):
        _solve(model, rows=4, memory_limit_bytes=0.1 * full)


MEGATRON = {f"blocks.{i}.{m}": s for i in range(2) for m, s in (
    ("attn.qkv", "colwise"), ("attn.proj", "rowwise"), ("fc1", "colwise"), ("fc2", "rowwise"))}


def test_gpt_tp2_picks_megatron_with_the_fused_qkv_in_groups_and_trains_like_eager():
    """The fused qkv's colwise ``S(0)x3`` is a candidate (``candidates.fused_shards``), so
    the ILP finds Megatron's plan by itself; it costs no more than configs/tp.yaml's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    free = ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [tp]}")
    program, ctx = placed_program(model, lm_loss, opt, free, x, y)
    auto = solve_placements(program, ctx.state.mesh, MACHINE)
    plain = solve_placements(program, ctx.state.mesh, MACHINE, fused=False)
    hand_program, ctx = placed_program(model, lm_loss, opt,
                                       ap.Strategy.from_yaml("configs/tp.yaml"), x, y)
    hand = solve_placements(hand_program, ctx.state.mesh, MACHINE)
    print(f"auto: {auto.summary()}\nwithout grouped qkv: {plain.summary()}\n"
          f"hand tp.yaml: {hand.summary()}")
    assert auto.objective_s <= hand.objective_s * (1 + 1e-9)
    assert auto.objective_s < plain.objective_s
    assert auto.params["blocks.0.attn.qkv.weight"].placements == (Shard(0, groups=3),)
    assert tensor_parallel_plan_of(program, auto.params, ctx.state.mesh) == (MEGATRON, "")
    ref = twin(model)
    for name, p in model.named_parameters():
        if name in auto.params:
            ap.shard_tensor(p, auto.params[name].mesh, list(auto.params[name].placements))
    data = [(a, b) for a, b in zip(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))]
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           "mesh: {shape: [2], dim_names: [tp]}\ndebug: {simulate: true}"))
    losses = engine.fit(data, batch_size=4, steps_per_epoch=2, verbose=0)["loss"]
    ref_losses = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data,
                             batch_size=4, steps=2)
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)


def test_ilp_completion_commits_the_solution_and_a_shared_move_is_paid_once():
    """The ILP's own completion (auto.ilp_completion) places every value as solved; the step
    then communicates once: fc2's partial sum (x needs no gradient, so no backward one)."""
    model = MLP(512, 2048)
    x, y = torch.randn(4, 512), torch.randn(4, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = ap.Strategy.from_yaml_str(MESH)
    program, ctx = placed_program(model, _mse, opt, strategy, x, y)
    each = solve_placements(program, ctx.state.mesh, MACHINE)
    once = solve_placements(program, ctx.state.mesh, MACHINE, shared_moves=True)
    assert once.objective_s <= each.objective_s * (1 + 1e-9)
    commit_choice(program, once, ctx.state.mesh)
    assert all(v.dist is not None for op in program.ops for v in op.outputs if v.is_tensor)
    moves = [m.kind for m in planned_moves(program) if m.kind not in ("make_partial", "slice")]
    assert moves == ["all_reduce"]


def test_the_megatron_choice_reads_back_as_a_colwise_rowwise_plan():
    found = _solve(MLP(512, 2048), rows=4)
    assert (found.tp_plan, found.tp_plan_why) == ({"fc1": "colwise", "fc2": "rowwise"}, "")
    assert _solve(MLP(64, 64), rows=16384).tp_plan == {}     # data parallel: no TP entries
