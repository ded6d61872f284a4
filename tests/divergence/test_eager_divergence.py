"""``engine.locate_divergence(reference="eager")``: the plan's global program next to the
user's model run eagerly. A correct plan (serial, and dp2 x tp2 with dropout) has no
divergence; a capture-level bug planted in the captured program (one LayerNorm's eps
changed) is reported at its module, with the plan's ops inside it; a rewrite that breaks
only the backward is reported at the first module, in backward order, whose gradients
differ. The plan's own reference cannot see any of them:
both of its sides share the bug."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.models.gpt import lm_loss
from autopar.planner import step_planner as planner_module

from ..parity import lm_data, one_thread, parity_gpt  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
DP_TP = """
mesh: {shape: [2, 2], dim_names: [dp, tp]}
data_parallel: {axis: dp}
tensor_parallel: {axis: tp, plan: {"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}}
debug: {simulate: true}
"""


def _engine(text: str = "", dropout: float = 0.0) -> ap.Engine:
    model = parity_gpt("adamw", dropout=dropout)
    return ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     strategy=ap.Strategy.from_yaml_str(text or "{}"))


def _batch():
    x, y = zip(*lm_data(4, 16, 64))
    return torch.stack(x), torch.stack(y)


def _planting(monkeypatch, change):
    """Capture as usual, then ``change(op)`` every op of the captured program."""
    capture = planner_module.capture

    def planted(*args, **kwargs):
        captured = capture(*args, **kwargs)
        for op in captured.program.ops:
            change(op)
        return captured
    monkeypatch.setattr(planner_module, "capture", planted)


@pytest.mark.parametrize("text,dropout", [("", 0.0), (DP_TP, 0.1)], ids=["serial", "dp_tp"])
def test_a_correct_plan_computes_what_eager_does(text, dropout):
    assert _engine(text, dropout).locate_divergence(*_batch(), reference="eager") is None


def test_a_capture_bug_is_reported_at_its_module(monkeypatch):
    def wider_eps(op):
        if op.target == "aten.native_layer_norm.default" and op.module == "blocks.1.ln2":
            op.args = (*op.args[:4], 1e-1)
    _planting(monkeypatch, wider_eps)
    engine = _engine(DP_TP)
    found = engine.locate_divergence(*_batch(), reference="eager")
    assert found is not None and found.module == "blocks.1.ln2"
    assert found.what == "forward output"
    assert "aten.native_layer_norm (blocks.1.ln2)" in str(found)
    assert "beyond float32's rtol 1.3e-06, atol 1e-05" in str(found)
    assert engine.locate_divergence(*_batch()) is None      # the plan's own reference: blind


def test_a_backward_only_bug_is_reported_at_its_gradients(monkeypatch):
    """Block 1's GELU backward rewritten as a plain product of its inputs: every forward
    output and the loss agree, fc2's gradients too (they come before it), fc1's differ."""
    def wrong_gelu_backward(op):
        if op.target == "aten.gelu_backward.default" and op.module == "blocks.1":
            op.target, op.kwargs = "aten.mul.Tensor", {}
    _planting(monkeypatch, wrong_gelu_backward)
    found = _engine().locate_divergence(*_batch(), reference="eager")
    assert found is not None and found.module == "blocks.1.fc1"
    assert found.what.startswith("gradient of blocks.1.fc1.")
    assert "the plan's backward ops inside it" in str(found)


def test_an_unknown_reference_and_amp_o2_are_refused():
    engine = _engine()
    with pytest.raises(ValueError, match="reference='gpu' is not 'plan'"):
        engine.locate_divergence(*_batch(), reference="gpu")
    o2 = _engine("amp: {enable: true, dtype: bfloat16, level: O2}")
    with pytest.raises(ValueError, match="amp level O2 casts the parameters"):
        o2.locate_divergence(*_batch(), reference="eager")


def test_hf_llama_in_bf16_o1_called_positionally_matches_eager_autocast():
    """The case issue 31 reported (a 2.4e-5 drift from the second step, HF Llama in bf16 O1
    called positionally, cross-entropy on ``.logits`` outside the model): the losses equal
    eager autocast's bit for bit, and the eager reference finds nothing at step 2."""
    pytest.importorskip("transformers")
    import copy

    import torch.nn.functional as F

    from ..models_zoo import hf_llama
    torch.manual_seed(0)
    model = hf_llama("sdpa", 64)
    ref = copy.deepcopy(model)

    def loss(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16),
                                                                     generator=g))
            for _ in range(3)]
    engine = ap.Engine(model, loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(
                           "amp: {enable: true, dtype: bfloat16, level: O1}"))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(data):
        if step == 1:
            assert engine.locate_divergence(x, y, reference="eager",
                                            seed=engine.strategy.seed + step) is None
        got = engine.train_step(x, y)
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = loss(ref(x), y)
        want.backward()
        ref_opt.step()
        assert got == want.item()
