"""ZeRO as placements (``sharding: {stage, axis}``) on the simulator: optimizer state (stage
2: and the gradients the update reads, stage 3: and the parameters) ``Shard(0)`` over the
axis, each rank updating its piece. For 20 steps every step's loss, the final parameters,
``engine.state_dict()`` and torch's ``optimizer.state_dict()`` equal eager torch's (fp32,
rtol 1e-5): stages 1-3 on dp2 and dp4, dp2 x tp2, pp2 x dp2, with SGD + momentum and AdamW,
on a GPT with dropout and a tied embedding and head, and on an MLP whose first dims split
unevenly (31 rows over 2 and 4 ranks; 5 rows over 4 leave rank 3 an empty piece). Strategies
ZeRO cannot honour are refused before anything runs, naming the stage, the axis and the
mesh; a ``memory_limit_gb`` stage 0 exceeds is met by stage 3 of the same model."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.ir import StateKind
from autopar.ir.attrs import NAME
from autopar.lower.memory_estimate import MemoryLimitError
from autopar.models import MLP
from autopar.models.gpt import lm_loss

from ..parity import (
    ATOL,
    RTOL,
    assert_same_losses,
    assert_same_params,
    eager_train,
    gpt_optimizer,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
    regression_data,
    twin,
)

STEPS, BATCH = 20, 6         # 6 rows split unevenly over 4 ranks
SHORT = 6                    # steps of the combinations beyond the matrix
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


pytestmark = pytest.mark.usefixtures("one_thread")      # tiny ops: one thread is faster


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _mlp(optim: str, steps: int = STEPS):
    torch.manual_seed(0)
    model = MLP(16, 31, 5, depth=2)        # first dims 31 and 5: uneven over 2 and 4 ranks
    return model, _mse, regression_data(steps * BATCH, 16, 5)


def _gpt(optim: str, steps: int = STEPS):
    model = parity_gpt(optim, vocab=64, seq=8, dropout=0.1)   # tied embedding and head
    return model, lm_loss, lm_data(steps * BATCH, 8, 64)


class _Scaled(torch.nn.Module):
    """The MLP times a learnt scalar: a 0-dim parameter (and 0-dim optimizer state)."""

    def __init__(self):
        super().__init__()
        self.mlp, self.scale = MLP(16, 31, 5, depth=2), torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.mlp(x) * self.scale


def _scaled(optim: str, steps: int = STEPS):
    torch.manual_seed(0)
    return _Scaled(), _mse, regression_data(steps * BATCH, 16, 5)


MODELS = {"mlp": _mlp, "gpt": _gpt, "scaled": _scaled}


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


def _fit_both(model_name: str, optim: str, strategy: ap.Strategy, max_norm: float | None = None,
              steps: int = STEPS):
    model, loss_fn, data = MODELS[model_name](optim, steps)
    ref = twin(model)
    opt, scheduler = gpt_optimizer(optim, model, warmup=2)    # SGD momentum or AdamW
    ref_opt, ref_sched = gpt_optimizer(optim, ref, warmup=2)
    want = eager_train(ref, loss_fn, ref_opt, data, BATCH, steps, max_norm, ref_sched)
    engine = ap.Engine(model, loss_fn, opt, strategy=strategy, lr_scheduler=scheduler)
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=steps, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    whole, want_state = engine.state_dict(), ref.state_dict()   # a tied weight under one name
    assert whole and whole.keys() <= want_state.keys()
    for name, value in whole.items():
        torch.testing.assert_close(value, want_state[name], rtol=RTOL, atol=ATOL)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]     # the scheduler's lr too
    assert ours["state"].keys() == theirs["state"].keys()
    for key, state in theirs["state"].items():
        assert ours["state"][key].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(ours["state"][key][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"optimizer state {key} {name}: {m}")
    return engine


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("model_name, optim", [("mlp", "sgd"), ("mlp", "adamw"),
                                               ("gpt", "sgd"), ("gpt", "adamw")])
def test_zero_trains_like_eager(stage, dp, model_name, optim):
    _fit_both(model_name, optim, _strategy(stage, dp))


@pytest.mark.parametrize("stage, optim, steps", [(3, "adamw", STEPS), (3, "sgd", STEPS),
                                                 (1, "adamw", SHORT), (2, "sgd", SHORT)])
def test_dp2_tp2_shards_over_dp(stage, optim, steps):
    """Megatron pairs on tp, ZeRO on dp: a rowwise weight's rows cut by dp, a colwise one
    (rows cut by tp) on its columns, a slice of the tp piece."""
    _fit_both("gpt", optim, _strategy(stage, 2, tp=2), steps=steps)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_cuts_a_colwise_weight_on_a_dim_tp_leaves_whole(stage):
    """Each rank's ZeRO piece is a slice of its tensor-parallel piece (Megatron's
    distributed optimizer): no all-to-all moves pieces between tp ranks (nested on dim 0,
    ZeRO's cut came first and every colwise weight took two all-to-alls a step)."""
    model, loss_fn, data = _gpt("adamw")
    engine = ap.Engine(model, loss_fn, torch.optim.AdamW(model.parameters()),
                       strategy=_strategy(stage, 2, tp=2))
    x, y = (torch.stack(t) for t in zip(*data[:BATCH]))
    program = engine.prepare(x, y)
    assert not [op for op in program.ops if op.target == "comm.all_to_all"]
    states = {op.attrs[NAME]: op.result.dist for op in program.states()}
    assert str(states["blocks.0.fc1.weight/exp_avg"]).startswith("{S(1),S(0)}")   # colwise
    assert str(states["blocks.0.fc2.weight/exp_avg"]).startswith("{S(0),S(1)}")   # rowwise


@pytest.mark.parametrize("stage, optim, steps", [(2, "sgd", STEPS), (2, "adamw", STEPS),
                                                 (3, "sgd", SHORT), (1, "adamw", SHORT)])
def test_pp2_dp2_shards_over_dp(stage, optim, steps):
    """A 1F1B pipeline of two stages, each stage's state sharded over its dp ranks (the tied
    embedding and head live on both stages)."""
    _fit_both("gpt", optim, _strategy(stage, 2, pp=2), steps=steps)


@pytest.mark.parametrize("stage", [2, 3])
def test_clipping_takes_the_global_norm_of_sharded_gradients(stage):
    _fit_both("mlp", "adamw", _strategy(stage, 4, extra="grad_clip: {max_norm: 0.05}\n"),
              max_norm=0.05)


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_zero_over_an_axis_no_section_splits_the_batch_on(model_name):
    """Sharding over a mesh dim on which every rank computes the same batch (here ``x`` of a
    dp2 x x2 mesh) is ZeRO without data parallelism there: gradients are whole on each rank
    and sliced for free; the pieces are still gathered and the training is eager's."""
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2, 2], dim_names: [dp, x]}\ndata_parallel: {axis: dp}\n"
        "sharding: {stage: 3, axis: x}\ndebug: {simulate: true}\n")
    _fit_both(model_name, "adamw", strategy, steps=SHORT)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_scalar_parameter_stays_replicated(stage):
    _fit_both("scaled", "adamw", _strategy(stage, 2), steps=SHORT)


@pytest.mark.filterwarnings("ignore::autopar.capture.step.CaptureNote")   # dense dispatch
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_experts_split_over_the_data_parallel_ranks(stage):
    """Mixtral with its experts on the dp axis (tokens reach them by all-to-all) and ZeRO on
    the same axis: the experts' state is each rank's own already and stays so, the rest is
    sharded; SGD with momentum trains as eager does."""
    pytest.importorskip("transformers")
    from .test_moe import BATCH as MOE_BATCH
    from .test_moe import _batch, _built, _data
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
        f"expert_parallel: {{axis: dp}}\nsharding: {{stage: {stage}, axis: dp}}\n"
        "debug: {simulate: true}\n")
    data, model, ref = _data(), _built("mixtral"), _built("mixtral")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    want = []
    for rows in (data[i:i + MOE_BATCH] for i in range(0, len(data), MOE_BATCH)):
        inputs, labels = _batch(rows)
        loss = ref(**inputs, labels=labels).loss
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    engine = ap.Engine(model, None, opt, strategy=strategy)
    assert_same_losses(engine.fit(data, batch_size=MOE_BATCH, verbose=0)["loss"], want)
    assert_same_params(model, ref)
    for key, state in ref_opt.state_dict()["state"].items():
        torch.testing.assert_close(opt.state_dict()["state"][key]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=RTOL, atol=ATOL)


def _planned(stage: int, dp: int):
    model, loss_fn, data = _mlp("adamw")
    opt, _ = gpt_optimizer("adamw", model)
    engine = ap.Engine(model, loss_fn, opt, strategy=_strategy(stage, dp))
    x, y = (torch.stack(t) for t in zip(*data[:BATCH]))
    return model, engine.prepare(x, y)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_are_reduce_scattered_and_parameters_all_gathered(stage):
    """Per parameter: its gradient reduce-scattered to the rank's piece (a layer's gradients
    as one asynchronous collective, right after the backward makes them), the updated
    piece all-gathered back to the replicated parameter (a layer's pieces as one
    asynchronous collective, started right after its last update); no gradient is
    all-reduced (the one all-reduce is the loss)."""
    model, program = _planned(stage, 4)
    comms = [op for op in program.ops if op.target.startswith("comm.")]
    moved = {t: sum(len(op.args) for op in comms if op.target == t)
             for t in ("comm.reduce_scatter_start", "comm.all_gather_start")}
    params = len(list(model.parameters()))
    assert moved == {"comm.reduce_scatter_start": params, "comm.all_gather_start": params}
    assert [op.target for op in comms if op.target.startswith("comm.all_reduce")] == \
        ["comm.all_reduce_start"]
    assert not any(op.target in ("comm.all_gather", "comm.reduce_scatter") for op in comms)
    position = {op: i for i, op in enumerate(program.ops)}
    for start in (op for op in comms if op.target == "comm.all_gather_start"):
        updates = [v.producer for v in start.args]
        assert all(u.target.startswith("optim.") for u in updates)
        assert position[start] == max(position[u] for u in updates) + 1
    assert all(op.role.value == "comm" for op in comms)


@pytest.mark.parametrize("stage", [1, 3])
def test_each_rank_holds_a_quarter_of_the_optimizer_state(stage):
    """Summed over the state pieces of each rank (torch.chunk sizes: 31 rows over 4 ranks
    are 8, 8, 8, 7; 5 rows are 2, 2, 1, 0), each rank's optimizer state (stage 3: and
    parameters) is 1/4 of serial up to the uneven split."""
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


# ---- refused before anything runs -------------------------------------------------------

def _yaml(mesh: str, sections: str) -> str:
    return f"mesh: {mesh}\n{sections}debug: {{simulate: true}}\n"


@pytest.mark.parametrize("text, facts", [
    # the axis is not in the mesh (or there is no mesh)
    (_yaml("{shape: [2], dim_names: [dp]}", "data_parallel: {axis: dp}\n"
           "sharding: {stage: 2, axis: tp}\n"),
     ["mesh shape [2], dim_names ['dp']", "sharding.axis 'tp' (ZeRO stage 2) is not one of "
      "the mesh dim_names"]),
    ("sharding: {stage: 1, axis: dp}\n",
     ["no mesh: serial, one device", "sharding.axis 'dp' (ZeRO stage 1) is not one of"]),
    # a stage that does not exist
    (_yaml("{shape: [2], dim_names: [dp]}", "sharding: {stage: 4, axis: dp}\n"),
     ["sharding.stage", "sharding stage 4: a stage must be less than or equal to 3",
      "3 (and parameters)"]),
    (_yaml("{shape: [2], dim_names: [dp]}", "sharding: {stage: -1, axis: dp}\n"),
     ["sharding stage -1: a stage must be greater than or equal to 0"]),
    # the axis of a section whose ranks hold different parameters
    (_yaml("{shape: [2, 2], dim_names: [dp, tp]}", "data_parallel: {axis: dp}\n"
           f"tensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\nsharding: {{stage: 3, axis: tp}}\n"),
     ["mesh shape [2, 2], dim_names ['dp', 'tp']", "tensor_parallel.axis and sharding.axis "
      "are both 'tp'", "ZeRO stage 3 shards state", "tensor_parallel axis 'tp' hold different "
      "pieces of the parameters"]),
    (_yaml("{shape: [2, 2], dim_names: [pp, dp]}", "data_parallel: {axis: dp}\n"
           "pipeline: {axis: pp}\nsharding: {stage: 2, axis: pp}\n"),
     ["mesh shape [2, 2], dim_names ['pp', 'dp']", "pipeline.axis and sharding.axis are both "
      "'pp'", "ZeRO stage 2 shards state", "pipeline axis 'pp' hold different stages' "
      "parameters"]),
    (_yaml("{shape: [2, 2], dim_names: [dp, ep]}", "data_parallel: {axis: dp}\n"
           "expert_parallel: {axis: ep}\nsharding: {stage: 1, axis: ep}\n"),
     ["sharding.axis and expert_parallel.axis are both 'ep'", "ZeRO stage 1 shards state",
      "hold different experts"]),
])
def test_a_strategy_zero_cannot_honour_is_refused_naming_stage_axis_and_mesh(text, facts):
    with pytest.raises(ValueError) as err:
        ap.Strategy.from_yaml_str(text)
    for fact in facts:
        assert fact in str(err.value)


LIMIT_GB = 0.0016              # 1.6 MiB: between stage 0's and stage 3's predicted peak


def _big_mlp(stage: int) -> tuple[torch.nn.Module, ap.Engine]:
    """Parameters, gradients and AdamW state dominate: three 256 x 256 layers, 6 rows."""
    torch.manual_seed(0)
    model = MLP(16, 256, 5, depth=3)
    opt, _ = gpt_optimizer("adamw", model)
    strategy = _strategy(stage, 4, extra=f"memory_limit_gb: {LIMIT_GB}\n")
    return model, ap.Engine(model, _mse, opt, strategy=strategy)


def test_a_memory_limit_stage_0_exceeds_is_met_by_stage_3_of_the_same_model():
    data = regression_data(2 * BATCH, 16, 5)
    x, y = (torch.stack(t) for t in zip(*data[:BATCH]))
    model, engine = _big_mlp(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(MemoryLimitError) as err:
        engine.train_step(x, y)
    text = str(err.value)
    assert f"exceeds memory_limit_gb={LIMIT_GB}" in text and "4 of 4 ranks over" in text
    assert "on mesh[4](dp)" in text and "no ZeRO sharding: sharding: {stage: 1|2|3" in text
    # the biggest holders: whole weights and their AdamW moments on every rank
    assert "layers.1.weight (layers.1) shape [256, 256]" in text
    assert "layers.1.weight/exp_avg_sq (layers.1) shape [256, 256]" in text
    assert engine.global_step == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    # stage 3 holds a quarter of each on a rank: it plans under the limit and trains as eager
    model, engine = _big_mlp(3)
    limit = LIMIT_GB * 2**30
    assert all(e.peak <= limit for e in engine.cost(x, y).values())
    ref = twin(model)
    ref_opt, _ = gpt_optimizer("adamw", ref)
    want = eager_train(ref, _mse, ref_opt, data, BATCH, 2)
    assert_same_losses(engine.fit(data, batch_size=BATCH, verbose=0)["loss"], want)
    assert_same_params(model, ref)
