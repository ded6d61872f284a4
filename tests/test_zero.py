"""ZeRO as placements (``sharding: {stage, axis}``) on the simulator: optimizer state (and for
stage 3 the parameters) ``Shard(0)`` over the axis, each rank updating its piece. Every
step's loss, the final parameters and torch's optimizer state equal eager torch's."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.ir import StateKind
from autopar.ir.attrs import NAME
from autopar.models import MLP
from autopar.models.gpt import lm_loss

from .parity import (
    ATOL,
    RTOL,
    assert_same_losses,
    assert_same_params,
    eager_train,
    gpt_optimizer,
    lm_data,
    parity_gpt,
    regression_data,
    twin,
)

STEPS, BATCH = 4, 6          # 6 rows split unevenly over 4 ranks
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _mlp(optim: str):
    torch.manual_seed(0)
    model = MLP(16, 30, 6, depth=2)        # first dims 30 and 6: uneven over 4 ranks
    return model, _mse, regression_data(STEPS * BATCH, 16, 6)


def _gpt(optim: str):
    model = parity_gpt(optim, vocab=64, seq=8, dropout=0.1)   # tied embedding and head
    return model, lm_loss, lm_data(STEPS * BATCH, 8, 64)


MODELS = {"mlp": _mlp, "gpt": _gpt}


def _strategy(stage: int, dp: int, tp: int = 1, pp: int = 1, extra: str = "") -> ap.Strategy:
    dims = [(n, k) for n, k in (("pp", pp), ("dp", dp), ("tp", tp)) if k > 1]
    names = ", ".join(n for n, _ in dims)
    text = (f"mesh: {{shape: {[k for _, k in dims]}, dim_names: [{names}]}}\n"
            f"data_parallel: {{axis: dp}}\nsharding: {{stage: {stage}, axis: dp}}\n"
            "debug: {simulate: true}\n")
    if tp > 1:
        text += f"tensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\n"
    if pp > 1:
        text += "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 3}\n"
    return ap.Strategy.from_yaml_str(text + extra)


def _fit_both(model_name: str, optim: str, strategy: ap.Strategy, max_norm: float | None = None):
    model, loss_fn, data = MODELS[model_name](optim)
    ref = twin(model)
    opt, scheduler = gpt_optimizer(optim, model, warmup=2)    # SGD momentum or AdamW
    ref_opt, ref_sched = gpt_optimizer(optim, ref, warmup=2)
    want = eager_train(ref, loss_fn, ref_opt, data, BATCH, STEPS, max_norm, ref_sched)
    engine = ap.Engine(model, loss_fn, opt, strategy=strategy, lr_scheduler=scheduler)
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    whole, want_state = engine.state_dict(), ref.state_dict()   # a tied weight under one name
    assert whole and whole.keys() <= want_state.keys()
    for name, value in whole.items():
        torch.testing.assert_close(value, want_state[name], rtol=RTOL, atol=ATOL)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for key, state in theirs["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(ours["state"][key][name], value, rtol=RTOL, atol=ATOL)
    return engine


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("model_name, optim", [("mlp", "sgd"), ("mlp", "adamw"),
                                               ("gpt", "sgd"), ("gpt", "adamw")])
def test_zero_trains_like_eager(stage, dp, model_name, optim):
    _fit_both(model_name, optim, _strategy(stage, dp))


@pytest.mark.parametrize("stage", [2, 3])
def test_dp2_tp2_and_pp2_dp2_shard_over_dp(stage):
    _fit_both("gpt", "adamw", _strategy(stage, 2, tp=2))
    _fit_both("gpt", "sgd", _strategy(stage, 2, pp=2))


@pytest.mark.parametrize("stage", [2, 3])
def test_clipping_takes_the_global_norm_of_sharded_gradients(stage):
    _fit_both("mlp", "adamw", _strategy(stage, 4, extra="grad_clip: {max_norm: 0.05}\n"),
              max_norm=0.05)


def _planned(stage: int, dp: int):
    model, loss_fn, data = _mlp("adamw")
    opt, _ = gpt_optimizer("adamw", model)
    engine = ap.Engine(model, loss_fn, opt, strategy=_strategy(stage, dp))
    x, y = (torch.stack(t) for t in zip(*data[:BATCH]))
    return model, engine.prepare(x, y)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_are_reduce_scattered_and_parameters_all_gathered(stage):
    """Per parameter: one reduce-scatter of its gradient to the rank's piece, one all-gather
    of the updated piece back to the replicated parameter; no gradient is all-reduced (the
    one all-reduce is the loss)."""
    model, program = _planned(stage, 4)
    comms = [op for op in program.ops if op.target.startswith("comm.")]
    count = {t: sum(op.target == t for op in comms)
             for t in ("comm.reduce_scatter", "comm.all_gather", "comm.all_reduce_start")}
    params = len(list(model.parameters()))
    assert count == {"comm.reduce_scatter": params, "comm.all_gather": params,
                     "comm.all_reduce_start": 1}
    assert all(op.role.value == "comm" for op in comms)


@pytest.mark.parametrize("stage", [1, 3])
def test_each_rank_holds_a_quarter_of_the_optimizer_state(stage):
    """Summed over the state pieces of each rank (torch.chunk sizes: 30 rows over 4 ranks
    are 8, 8, 8, 6), each rank's optimizer state (stage 3: and parameters) is 1/4 of serial
    up to the uneven split."""
    from autopar.ir.dist import shard_tensor_local
    model, program = _planned(stage, 4)
    kinds = (StateKind.OPTIM, StateKind.PARAM) if stage == 3 else (StateKind.OPTIM,)
    states = [op.result for kind in kinds for op in program.states(kind) if op.result.type.shape]
    serial = sum(torch.Size(v.type.shape).numel() * 4 for v in states)
    per_rank = []
    for rank in range(4):
        per_rank.append(sum(
            shard_tensor_local(torch.empty(v.type.shape), v.dist.mesh, v.dist.placements,
                               (rank,)).nbytes for v in states))
    assert sum(per_rank) == serial
    assert max(per_rank) <= serial / 4 * 1.1 and per_rank[0] > serial / 4
    names = {op.attrs[NAME] for op in program.states(StateKind.OPTIM)}
    assert "head.weight/exp_avg" in names


def test_stage_3_evaluates_like_the_trained_model():
    model, loss_fn, data = _mlp("sgd")
    ref = twin(model)
    opt, _ = gpt_optimizer("sgd", model)
    engine = ap.Engine(model, loss_fn, opt, strategy=_strategy(3, 4))
    engine.fit(data, batch_size=BATCH, steps_per_epoch=2, verbose=0)
    got = engine.evaluate(data[:BATCH], batch_size=BATCH, verbose=0)["loss"]
    ref.load_state_dict(model.state_dict())
    x, y = (torch.stack(t) for t in zip(*data[:BATCH]))
    assert got == pytest.approx(loss_fn(ref(x), y).item(), rel=RTOL)


def test_a_sharding_axis_missing_from_the_mesh_is_refused():
    with pytest.raises(ValueError, match=r"mesh shape \[2\](.|\n)*sharding.axis 'tp' is "
                                         r"not one of the mesh dim_names"):
        ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                  "data_parallel: {axis: dp}\nsharding: {stage: 2, axis: tp}\n")
