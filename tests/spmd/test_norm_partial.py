"""Norm partials (``P(norm2)``, DTensor's ``_NormPartial``): gradient clipping takes the
global norm over sharded gradients without gathering them.

Each rank holds the p-norm of its piece; the value is the p-norm of those terms, so a norm
over a sharded dim is one scalar all-reduce away from the whole's. The reshard planner and
its reference semantics reduce them exactly (property, below); under ZeRO stage 2/3 and
dp x tp the clip's norms stay partial through the stack of per-gradient norms and the total
norm, and training equals eager ``clip_grad_norm_`` for norm types 2, 1 and inf.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.ir.dist import (
    DistAttr,
    Partial,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    format_placements,
    norm_partial,
    parse_placements,
    shard_tensor_local,
)
from autopar.models import MLP
from autopar.models.gpt import lm_loss
from autopar.reshard import AllReduce, MakePartial, apply_steps, naive_plan, plan_cost, plan_reshard
from autopar.reshard.comm import BUCKET_STEPS, RESHARD_STEP

from ..parity import (
    ATOL,
    RTOL,
    assert_same_losses,
    assert_same_params,
    gpt_optimizer,
    lm_data,
    parity_gpt,
    regression_data,
    twin,
)

NORM2, NORM1, NORMINF = (Partial(norm_partial(p)) for p in (2, 1, math.inf))
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')
STEPS, BATCH = 4, 6         # 6 rows split unevenly over 4 ranks


# ---------------------------------------------------------------------------- placement text
def test_norm_partial_text_round_trips():
    for text in ("P(norm2)", "P(norm1)", "P(norminf)", "P(norm1.5)", "{S(0),P(norm2)}",
                 "{P(norm2),P(norminf),R}"):
        placements = parse_placements(text)
        assert parse_placements(format_placements(placements)) == placements
    assert parse_placements("P(norm2)") == (NORM2,)
    assert Partial("norm2.0") == NORM2 and str(NORM2) == "P(norm2)"
    assert str(NORMINF) == "P(norminf)" and NORM1.norm_order == 1.0
    assert Partial("sum").norm_order is None


@pytest.mark.parametrize("bad", ["norm0", "norm-2", "normx", "l2"])
def test_a_norm_partial_needs_a_positive_order(bad):
    with pytest.raises(ValueError, match=rf"Partial\(op='{bad}'\).*norm<p>"):
        Partial(bad)
    with pytest.raises(ValueError, match="norm<p>"):
        parse_placements(f"{{S(0),P({bad})}}")


# ---------------------------------------------------------------------------- planner property
def _norm_terms(value: torch.Tensor, order: float, n: int, gen: torch.Generator
                ) -> list[torch.Tensor]:
    """n non-negative terms whose p-norm is ``value`` (never negative, as norms are)."""
    if math.isinf(order):
        owner = torch.randint(0, n, value.shape, generator=gen)
        return [torch.where(owner == k, value, value * torch.rand(value.shape, generator=gen))
                for k in range(n)]
    weights = torch.rand((n, *value.shape), generator=gen) + 0.1
    weights = weights / torch.linalg.vector_norm(weights, order, dim=0)
    return [w * value for w in weights]


def _pieces(value: torch.Tensor, dist: DistAttr, gen: torch.Generator) -> dict:
    """Every rank's piece of ``value`` placed at ``dist``: partial mesh dims split it into
    random terms (outer mesh dims first, as ``assemble`` folds inner ones first)."""
    terms = {(): value}
    for m, p in enumerate(dist.placements):
        if isinstance(p, Partial):
            n = dist.mesh.shape[m]
            split = (lambda v: _norm_terms(v, p.norm_order, n, gen)) if p.norm_order else \
                (lambda v: [v] + [torch.zeros_like(v)] * (n - 1))
            terms = {key + (i,): t for key, v in terms.items() for i, t in enumerate(split(v))}
    partial = [m for m, p in enumerate(dist.placements) if isinstance(p, Partial)]
    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in dist.placements)
    return {c: shard_tensor_local(terms[tuple(c[m] for m in partial)], dist.mesh, whole, c)
            for c in dist.mesh.coordinates()}


PLACEMENTS = [Replicate(), Shard(0), Shard(1), NORM2, NORM2, NORM1, NORMINF, Partial("sum")]


@st.composite
def norm_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=2, max_size=2)))
    mesh_shape = draw(st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (3, 2)]))
    mesh = ProcessMesh(torch.arange(math.prod(mesh_shape)).reshape(mesh_shape).tolist())
    src = tuple(draw(st.sampled_from(PLACEMENTS)) for _ in mesh_shape)
    # the value of a norm partial is a norm; a plan may only move it to whole or sharded
    # placements, or to the same norm partial
    norms = {p for p in src if p.is_partial() and p.norm_order}
    dst_options = [Replicate(), Shard(0), Shard(1), *norms]
    dst = tuple(draw(st.sampled_from(dst_options)) for _ in mesh_shape)
    return shape, mesh, src, dst


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(norm_cases(), st.integers(0, 2**16))
def test_norm_partial_reshards_are_exact(case, seed):
    """From any placement with norm partials (nested with shards and sum partials) to
    whole, sharded or the same norm partials: the planned steps run by the reference
    executor give exactly the pieces of the target placement, never dearer than naive."""
    shape, mesh, src, dst = case
    gen = torch.Generator().manual_seed(seed)
    value = torch.rand(shape, generator=gen) + 0.5            # a norm is never negative
    src_dist, dst_dist = DistAttr(mesh, src), DistAttr(mesh, dst)
    steps = plan_reshard(shape, src_dist, dst_dist)
    assert plan_cost(shape, src_dist, steps) <= plan_cost(
        shape, src_dist, naive_plan(shape, src_dist, dst_dist)) + 1e-6
    out = apply_steps(_pieces(value, src_dist, gen), shape, mesh, steps)
    got = assemble(out, shape, mesh, dst)
    torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{format_placements(src)} -> "
                                             f"{format_placements(dst)} via "
                                             f"{[str(s) for s in steps]}: {m}")
    if not any(p.is_partial() for p in dst):      # whole values: every piece exactly
        for c in mesh.coordinates():
            torch.testing.assert_close(out[c], shard_tensor_local(value, mesh, dst, c),
                                       rtol=1e-6, atol=1e-6)


def test_norm_partial_to_replicate_is_one_all_reduce_per_mesh_dim():
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    steps = plan_reshard((), DistAttr(mesh, (NORM2, NORM2)), DistAttr.replicated(mesh))
    assert [type(s) for s in steps] == [AllReduce, AllReduce]
    assert {s.op for s in steps} == {"norm2"} and str(steps[0]).startswith("all_reduce(norm2)")
    # a replicated norm joins norm terms on one rank: the stack of per-gradient norms
    steps = plan_reshard((), DistAttr(mesh, (NORM2, Replicate())), DistAttr(mesh, (NORM2, NORM2)))
    assert steps == [MakePartial(1, "norm2")]
    # a norm and a sum do not commute: the inner sum is reduced first
    steps = plan_reshard((3,), DistAttr(mesh, (NORM2, Partial("sum"))), DistAttr.replicated(mesh))
    assert steps[0].mesh_dim == 1 and steps[0].op == "sum"


def test_norm_partials_never_live_on_micro_batches():
    """A pipeline's micro-batch dim accumulates over time with sums, maxima and minima
    only: no norm step is planned over it."""
    mesh = ProcessMesh([[0, 1]], dim_names=["mb", "dp"])
    with pytest.raises(RuntimeError, match="no reshard plan"):
        plan_reshard((4,), DistAttr(mesh, (Replicate(), Replicate())),
                     DistAttr(mesh, (NORM2, Replicate())))


# ---------------------------------------------------------------------------- planned programs
def _mlp():
    torch.manual_seed(0)
    model = MLP(16, 30, 6, depth=2)        # first dims 30 and 6: uneven over 4 ranks
    return model, torch.nn.functional.mse_loss, regression_data(STEPS * BATCH, 16, 6)


def _gpt():
    model = parity_gpt("adamw", vocab=64, seq=8, dropout=0.0)
    return model, lm_loss, lm_data(STEPS * BATCH, 8, 64)


def _strategy(stage: int, dp: int, tp: int = 1, norm_type: float = 2.0,
              dump: str | None = None) -> ap.Strategy:
    names = "dp, tp" if tp > 1 else "dp"
    shape = [dp, tp] if tp > 1 else [dp]
    norm = ".inf" if math.isinf(norm_type) else norm_type
    text = (f"mesh: {{shape: {shape}, dim_names: [{names}]}}\n"
            f"data_parallel: {{axis: dp}}\nsharding: {{stage: {stage}, axis: dp}}\n"
            f"grad_clip: {{max_norm: 0.05, norm_type: {norm}}}\n"
            f"debug: {{simulate: true{', dump_dir: ' + dump if dump else ''}}}\n")
    if tp > 1:
        text += f"tensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\n"
    return ap.Strategy.from_yaml_str(text)


def _planned(make, strategy: ap.Strategy):
    model, loss_fn, data = make()
    opt, _ = gpt_optimizer("adamw", model)
    engine = ap.Engine(model, loss_fn, opt, strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*data[:BATCH]))
    return model, engine.prepare(x, y)


def _comms(program, target: str) -> list:
    return [op for op in program.ops if op.target == target]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_clipping_moves_only_scalar_norms(stage):
    """ZeRO over dp4 with clipping: each gradient is reduce-scattered to its piece, never
    gathered; the clip's norms are P(norm2) up to one all-reduce of a scalar; the updated
    pieces are all-gathered (stage 2: a unit at a time) or stay sharded (stage 3: gathered
    before use)."""
    model, program = _planned(_mlp, _strategy(stage, 4))
    params = len(list(model.parameters()))
    scattered = _comms(program, "comm.reduce_scatter") + \
        _comms(program, "comm.reduce_scatter_start")        # a layer's, as one collective
    assert sum(len(op.args) for op in scattered) == params
    assert all(step.op == "sum" for op in scattered
               for step in op.attrs.get(BUCKET_STEPS, (op.attrs.get(RESHARD_STEP),)))
    reduced = _comms(program, "comm.all_reduce")
    assert [(op.attrs[RESHARD_STEP].op, op.args[0].type.shape) for op in reduced] == \
        [("norm2", ())]
    gradients = {v for op in scattered for v in op.args}
    gathered = _comms(program, "comm.all_gather")
    moved = [v for op in program.ops if op.target.startswith("comm.all_gather")
             for v in op.args]
    assert not any(v in gradients or v.producer.target == "aten.mul.Tensor" for v in moved)
    if stage == 2:    # the updated pieces, gathered back into the replicated parameters
        gathered += _comms(program, "comm.all_gather_start")     # a unit's, as one collective
        updated = [v for op in gathered for v in op.args]
        assert len(updated) == params
        assert all(v.producer.target.startswith("optim.") for v in updated)
    norms = [op for op in program.ops if op.target == "aten.linalg_vector_norm.default"]
    assert len(norms) == params + 1 and all(str(op.result.dist).startswith("{P(norm2)}")
                                             for op in norms)
    buckets = _comms(program, "comm.all_reduce_start")       # the loss only
    assert [v.type.shape for op in buckets for v in op.args] == [()]
    kinds = {op.target for op in program.ops if op.target.startswith("comm.")}
    assert kinds <= {"comm.reduce_scatter", "comm.all_reduce", "comm.all_gather", "comm.slice",
                     "comm.all_reduce_start", "comm.all_gather_start", "comm.reduce_scatter_start",
                     "comm.wait"}


def test_dp_tp_clipping_is_one_scalar_all_reduce_per_mesh_dim():
    """dp2 x tp2 (Megatron plan), ZeRO stage 2: tensor-parallel gradients' norms are partial
    on both mesh dims, replicated ones join them on one tp rank (make_partial, local), and
    the total norm is reduced once over dp and once over tp."""
    _, program = _planned(_gpt, _strategy(2, 2, tp=2))
    norm_steps = [op.attrs[RESHARD_STEP] for op in program.ops
                  if op.target == "comm.all_reduce" and op.attrs[RESHARD_STEP].op == "norm2"]
    assert sorted(s.axis for s in norm_steps) == ["dp", "tp"]
    total = [op for op in program.ops if op.target == "aten.linalg_vector_norm.default"][-1]
    assert str(total.result.dist).startswith("{P(norm2),P(norm2)}")
    joined = [op for op in _comms(program, "comm.make_partial")
              if op.attrs[RESHARD_STEP].op == "norm2"]
    assert joined and all(op.args[0].type.shape == () for op in joined)


def test_dump_shows_norm_partials(tmp_path):
    _planned(_mlp, _strategy(2, 4, dump=str(tmp_path)))
    completion = next(p for p in sorted(tmp_path.rglob("*completion*.txt"))
                      if "explain" not in p.name)
    text = completion.read_text()
    assert "{P(norm2)} @mesh[4](dp) = aten.linalg_vector_norm" in text
    assert "{P(norm2)} @mesh[4](dp) = aten.stack" in text
    reshard = next(p for p in sorted(tmp_path.rglob("*reshard*.txt")))
    assert "all_reduce(norm2) over dp: {P(norm2)} -> {R}" in reshard.read_text()


# ---------------------------------------------------------------------------- parity
def _eager(model, loss_fn, opt, data, norm_type: float) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = (torch.stack(t) for t in zip(*data[step * BATCH:(step + 1) * BATCH]))
        torch.manual_seed(step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type)
        assert total > 0.05, "the test must clip"
        opt.step()
        losses.append(loss.item())
    return losses


def _fit_both(make, strategy: ap.Strategy, norm_type: float) -> None:
    model, loss_fn, data = make()
    ref = twin(model)
    opt, _ = gpt_optimizer("adamw", model)
    ref_opt, _ = gpt_optimizer("adamw", ref)
    want = _eager(ref, loss_fn, ref_opt, data, norm_type)
    engine = ap.Engine(model, loss_fn, opt, strategy=strategy)
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    for key, state in ref_opt.state_dict()["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(opt.state_dict()["state"][key][name], value,
                                       rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stage, norm_type", [(2, 2.0), (2, 1.0), (2, math.inf), (3, 2.0),
                                              (3, math.inf)])
def test_zero_dp4_clipping_trains_like_eager(stage, norm_type):
    _fit_both(_mlp, _strategy(stage, 4, norm_type=norm_type), norm_type)


@pytest.mark.parametrize("stage, norm_type", [(2, 2.0), (3, 1.0)])
def test_dp2_tp2_clipping_trains_like_eager(stage, norm_type):
    _fit_both(_gpt, _strategy(stage, 2, tp=2, norm_type=norm_type), norm_type)
