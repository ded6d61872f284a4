"""The divergence locator: a plan's step on the simulator, op by op, next to one device."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.engine.engine import DivergenceError
from autopar.spmd.local_forms import LOCAL_FORMS, LocalCall

from ..models_zoo import MegatronMLP, mse

DP_TP = ("mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
         "tensor_parallel: {axis: tp, plan: {fc1: colwise, fc2: rowwise}}\n")


def _engine(extra: str = "", sections: str = "") -> ap.Engine:
    torch.manual_seed(0)
    model = MegatronMLP()
    strategy = ap.Strategy.from_yaml_str(DP_TP + sections
                                         + "debug: {simulate: true" + extra + "}\n")
    return ap.Engine(model, mse, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


@pytest.fixture
def wrong_mean(monkeypatch):
    """A planted bug: mse_loss's local form divides each rank's sum by its own count, not
    the global one (each term is then twice too big)."""
    def form(op, ctx):
        if not any(p.is_shard() for p in ctx.needs[0].placements):
            return None
        local = op.args[0].type.numel // 2
        return LocalCall("autopar.global_mean",
                         ("aten.mse_loss.default", local // 2, op.args[0], op.args[1], 2), {},
                         "planted: a local count")
    monkeypatch.setitem(LOCAL_FORMS, "aten.mse_loss.default", form)


def test_a_correct_plan_has_no_divergence():
    assert _engine().locate_divergence(*_batch()) is None


def test_dropout_s_uninitialized_buffer_is_not_a_divergence():
    """Attention dropout allocates its mask with empty_like before bernoulli_ fills it:
    those bits differ between any two runs, so they are never compared."""
    from autopar.models.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16,
                          dropout=0.5))
    strategy = ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                         "data_parallel: {axis: dp}\ndebug: {simulate: true}\n")
    engine = ap.Engine(model, lm_loss,
                       torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    assert engine.locate_divergence(tokens[:, :-1], tokens[:, 1:]) is None


def test_a_planted_bug_is_located_at_its_op(wrong_mean):
    found = _engine().locate_divergence(*_batch())
    assert found is not None
    assert (found.target, found.role) == ("aten.mse_loss", "loss")
    assert found.op.startswith("%")                     # the op as the dump names it
    assert found.inputs[0].endswith("{S(0),R}") and found.outputs[0].endswith("{P(sum),R}")
    assert any("all_reduce(sum) over tp" in text for text in found.fed_by)
    assert found.max_rel == pytest.approx(3.0)          # each term 4x: a quarter's count
    assert str(found).startswith(f"first divergence from one device: {found.op} = "
                                 "aten.mse_loss (<loss>, loss)")


AMP = {"O1": "amp: {enable: true, dtype: bfloat16, level: O1}\n",
       "O2": "amp: {enable: true, dtype: bfloat16, level: O2}\n",
       "O2 bf16 reduce": "amp: {enable: true, dtype: bfloat16, level: O2, "
                         "reduce_dtype: bfloat16}\n"}


@pytest.mark.parametrize("amp", AMP)
def test_amp_plans_are_judged_at_their_precision(amp):
    """bf16 partial sums round differently from one device's whole sums: ops that read or
    make bf16 are compared at bf16's scale, each on the values the ranks gave it."""
    assert _engine(sections=AMP[amp]).locate_divergence(*_batch()) is None


def test_a_planted_bug_is_located_under_amp(wrong_mean):
    found = _engine(sections=AMP["O1"]).locate_divergence(*_batch())
    assert found is not None and found.target == "aten.mse_loss"


def test_the_debug_flag_checks_a_plan_s_first_step_before_it_runs(wrong_mean):
    x, y = _batch()
    with pytest.raises(DivergenceError, match="first divergence.*aten.mse_loss"):
        _engine(", locate_divergence: true").fit(list(zip(x, y)), batch_size=4, verbose=0)


def test_the_debug_flag_lets_a_correct_plan_train():
    x, y = _batch()
    losses = _engine(", locate_divergence: true").fit(list(zip(x, y)), batch_size=4,
                                                     verbose=0)["loss"]
    assert len(losses) == 1


PP_TP = ("mesh: {shape: [2, 2], dim_names: [pp, tp]}\n"
         "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n"
         "tensor_parallel: {axis: tp, plan: {fc1: colwise, fc2: rowwise}}\n")


@pytest.mark.parametrize("planted", [False, True])
def test_the_locator_checks_pipelined_plans(planted, request):
    """A pipeline's step (stages, micro-batches over ``mb``, tp inside each stage) is checked
    op by op too: a correct plan has no divergence, the planted bug (each micro-batch's loss
    divided by its own row count) is found at its op."""
    if planted:
        request.getfixturevalue("wrong_mean")
    torch.manual_seed(0)
    model = MegatronMLP()
    engine = ap.Engine(model, mse, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(PP_TP + "debug: {simulate: true}\n"))
    found = engine.locate_divergence(*_batch())
    if not planted:
        assert found is None
    else:
        assert found is not None and found.target == "aten.mse_loss"
        assert found.mesh == "mesh[2,2](tp,mb)" and f"on {found.mesh}" in str(found)
        assert found.inputs[0].endswith("{R,S(0)}")      # the loss reads its micro-batch
