"""Capture through the public Engine: every feature a real model uses trains with exactly
eager torch's losses, parameters and buffers (fp32, same init, same data)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autopar as ap
from autopar.capture.step import CaptureError, call_model, capture, loss_from_output
from autopar.ir import OpKind, Role, StateKind
from autopar.ir.attrs import CONST, NAME
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

from .. import models_zoo as zoo

TOL = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# harness: the same steps through the Engine and in eager torch
# --------------------------------------------------------------------------------------
def eager_losses(model, loss_fn, data, batch_size, steps, make_opt, seed=None):
    """The reference: plain torch, fed exactly as the engine feeds the model. With
    ``seed`` the RNG is seeded ``seed + step`` before each step, as the engine does."""
    opt = make_opt(model)
    losses = []
    for step, (x, y) in enumerate(DataLoader(data, batch_size=batch_size)):
        if step == steps:
            break
        if seed is not None:
            torch.manual_seed(seed + step)
        args, kwargs = call_model(model, x, y, loss_fn)
        out = model(*args, **kwargs)
        loss = loss_fn(out, y) if loss_fn is not None else loss_from_output(out)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_parity(model, loss_fn, data, *, batch_size=4, steps=3, make_opt=None, dropout=False):
    """Train ``model`` through the Engine and a deep copy eagerly; assert equal losses,
    parameters and buffers. Returns the engine-trained model and its initial copy."""
    make_opt = make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    initial = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    engine = ap.Engine(model, loss_fn, make_opt(model))
    history = engine.fit(data, batch_size=batch_size, epochs=1, steps_per_epoch=steps, verbose=0)
    seed = engine.strategy.seed if dropout else None
    expected = eager_losses(reference, loss_fn, data, batch_size, steps, make_opt, seed)
    assert len(history["loss"]) == steps
    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(expected), **TOL)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"parameter {name}: {m}")
    for (name, got), (_, want) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"buffer {name}: {m}")
    return model, initial


def token_data(n=16, T=8, vocab=zoo.VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, T), generator=g)
    y = torch.randint(0, vocab, (n, T), generator=g)
    return list(zip(x, y))


def dense_data(n=16, d=8, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return list(zip(x, y))


def adam(m):
    return torch.optim.Adam(m.parameters(), lr=1e-2)


def small_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=zoo.VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16)
    return GPT(GPTConfig(**{**cfg, **overrides}))


# --------------------------------------------------------------------------------------
# parity, one feature per test
# --------------------------------------------------------------------------------------
def test_shape_dependent_code_explicit_causal_mask():
    # torch.ones(T, T) with T from x.size(1): the trace specialises it to the batch shape
    check_parity(small_gpt(sdpa=False), lm_loss, token_data(), make_opt=adam)


def test_scaled_dot_product_attention():
    check_parity(small_gpt(sdpa=True), lm_loss, token_data(), make_opt=adam)


def test_tied_weights_get_the_summed_gradient():
    model = small_gpt(sdpa=True, tie_weights=True)
    assert model.head.weight is model.wte.weight
    # SGD makes the update exactly -lr * (grad via embedding + grad via head)
    model, initial = check_parity(model, lm_loss, token_data(), steps=4)
    assert model.head.weight is model.wte.weight
    assert "head.weight" not in dict(model.named_parameters())   # one parameter, one update
    assert not torch.equal(model.wte.weight, initial.wte.weight)


def test_registered_buffer():
    torch.manual_seed(0)
    model = zoo.TinyLM(zoo.MaskBufferAttention())
    check_parity(model, lm_loss, token_data(), make_opt=adam)
    assert torch.equal(model.attn.mask, torch.ones(16, 16, dtype=torch.bool).tril())


def test_plain_tensor_attribute_is_a_constant():
    torch.manual_seed(0)
    model = zoo.TinyLM(zoo.RotaryAttention())
    assert "inv_freq" not in dict(model.named_buffers())
    check_parity(model, lm_loss, token_data(), make_opt=adam)
    # one constant state, named after the attribute, read by every use (fwd and bwd)
    x = torch.randint(0, zoo.VOCAB, (2, 8))
    program = capture(model, lm_loss, x, x, mode="train").program
    consts = program.states(StateKind.CONST)
    assert [op.attrs[NAME].split("@")[0] for op in consts] == ["const/attn.inv_freq"]
    assert torch.equal(consts[0].attrs[CONST], model.attn.inv_freq)


def test_dict_output_with_loss_inside():
    torch.manual_seed(0)
    data = [({"input_ids": x}, y) for x, y in token_data()]
    check_parity(zoo.DictLossLM(), None, data, make_opt=adam)


def test_dataclass_output_with_loss_inside():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = list(zip(torch.randn(16, 8, generator=g), torch.randn(16, generator=g)))
    check_parity(zoo.DataclassLossNet(), None, data, steps=4)


def test_dropout_matches_eager_seeded_per_step():
    torch.manual_seed(0)
    check_parity(zoo.DropoutNet(p=0.1), F.cross_entropy, dense_data(), steps=4, dropout=True)


def test_dropout_in_gpt_matches_eager_seeded_per_step():
    check_parity(small_gpt(sdpa=False, dropout=0.1), lm_loss, token_data(), make_opt=adam,
                 dropout=True)


@pytest.mark.parametrize("make_opt", [lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                                momentum=0.9), adam],
                         ids=["sgd", "adam"])
def test_unused_and_frozen_parameters_do_not_change(make_opt):
    torch.manual_seed(0)
    model, initial = check_parity(zoo.FrozenUnusedNet(), F.cross_entropy, dense_data(),
                                  make_opt=make_opt)
    for name in ("frozen.weight", "frozen.bias", "unused.weight", "unused.bias"):
        assert torch.equal(model.get_parameter(name), initial.get_parameter(name)), name
    assert not torch.equal(model.fc.weight, initial.fc.weight)


def test_batchnorm_running_stats_follow_eager():
    torch.manual_seed(0)
    model, initial = check_parity(zoo.BatchNormNet(), F.cross_entropy, dense_data(), steps=4,
                                  make_opt=adam)
    assert int(model.bn.num_batches_tracked) == 4
    assert not torch.equal(model.bn.running_mean, initial.bn.running_mean)


# --------------------------------------------------------------------------------------
# what capture records: module paths, roles, backward links; and its errors
# --------------------------------------------------------------------------------------
def test_ops_carry_module_paths_roles_and_backward_links():
    model = small_gpt(sdpa=True)
    x, y = torch.randint(0, zoo.VOCAB, (2, 8)), torch.randint(0, zoo.VOCAB, (2, 8))
    program = capture(model, lm_loss, x, y, mode="train").program
    calls = list(program.ops_of(OpKind.CALL))

    fc1 = [op for op in calls if op.module == "blocks.0.fc1" and op.role is Role.FORWARD]
    assert any(op.target.startswith(("aten.addmm", "aten.mm", "aten.linear")) for op in fc1), \
        [op.target for op in fc1]
    assert {op.role for op in calls} == {Role.FORWARD, Role.LOSS, Role.BACKWARD}
    assert any(op.role is Role.LOSS and "log_softmax" in op.target for op in calls)

    backward = [op for op in calls if op.role is Role.BACKWARD]
    linked = [op for op in backward if op.forward_op is not None]
    assert len(linked) > len(backward) // 2
    for op in linked:
        assert op.forward_op.role in (Role.FORWARD, Role.LOSS)
        assert op.module == op.forward_op.module
    assert any(op.forward_op.module == "blocks.0.fc1" for op in linked)
    assert any(op.forward_op.module == "blocks.1.attn.qkv" for op in linked)

    # every parameter (the tied one once) gets one gradient result
    grads = {s.name for s, _ in program.results() if s.kind == "grad"}
    assert grads == {n for n, _ in model.named_parameters()}


def test_eval_and_predict_capture_have_no_backward():
    model = small_gpt()
    x, y = torch.randint(0, zoo.VOCAB, (2, 8)), torch.randint(0, zoo.VOCAB, (2, 8))
    for mode in ("eval", "predict"):
        program = capture(model, lm_loss, x, y if mode == "eval" else None, mode=mode).program
        roles = {op.role for op in program.ops_of(OpKind.CALL)}
        assert Role.BACKWARD not in roles
        kinds = [s.kind for s, _ in program.results()]
        assert kinds == (["loss", "output"] if mode == "eval" else ["output"])


def test_data_dependent_control_flow_names_the_module():
    torch.manual_seed(0)
    model = zoo.GatedNet()
    engine = ap.Engine(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    data = list(zip(torch.randn(8, 8), torch.randn(8, 8)))
    with pytest.raises(CaptureError) as info:
        engine.fit(data, batch_size=4, epochs=1, verbose=0)
    message = str(info.value)
    assert "blocks.1.gate" in message
    assert "torch.cond" in message


# --------------------------------------------------------------------------------------
# eval and predict after training: state and constants carry over, outputs rebuild
# --------------------------------------------------------------------------------------
def test_evaluate_after_fit_uses_trained_batchnorm_stats():
    torch.manual_seed(0)
    data = dense_data()
    model, _ = check_parity(zoo.BatchNormNet(), F.cross_entropy, data, steps=2)
    engine = ap.Engine(model, F.cross_entropy)
    reference = copy.deepcopy(model).eval()
    x, y = (torch.stack(t) for t in zip(*data))
    with torch.no_grad():
        want = F.cross_entropy(reference(x), y).item()
    got = engine.evaluate(data, batch_size=len(data))["loss"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert model.training   # capture restores the module's mode


def test_constants_are_not_confused_between_train_and_eval_programs():
    torch.manual_seed(0)
    model = zoo.ModeConstantsNet()
    data = dense_data()
    engine = ap.Engine(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.fit(data, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    reference = copy.deepcopy(model).eval()
    x, y = (torch.stack(t) for t in zip(*data))
    with torch.no_grad():
        want = F.cross_entropy(reference(x), y).item()
    assert engine.evaluate(data, batch_size=len(data))["loss"] == pytest.approx(want, rel=1e-5)


def test_predict_rebuilds_dataclass_with_none_fields():
    torch.manual_seed(0)
    model = zoo.DataclassLossNet()
    x = torch.randn(6, 8)
    engine = ap.Engine(model, None)
    outputs = engine.predict([(xi, torch.tensor(0.0)) for xi in x], batch_size=3)
    assert [type(o) for o in outputs] == [zoo.RegressionOutput] * 2
    assert all(o.loss is None for o in outputs)
    with torch.no_grad():
        want = model.eval()(x).prediction
    torch.testing.assert_close(torch.cat([o.prediction for o in outputs]), want, **TOL)


def test_opaque_output_object_is_a_clear_error():
    model = zoo.OpaqueOutputNet()
    with pytest.raises(CaptureError, match=r"output\['cache'\] is a Cache"):
        capture(model, None, torch.randn(2, 8), None, mode="predict")


def test_one_tensor_as_input_and_label_still_gives_two_feeds():
    """prepare(x, x) plans the program later batches reuse: it must read the labels it is
    fed, not the inputs again."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    ref = copy.deepcopy(model)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 32, (2, 8))
    engine.prepare(x, x)
    y = torch.randint(0, 32, (2, 8))
    assert engine.train_step(x, y) == pytest.approx(lm_loss(ref(x), y).item(), rel=1e-6)
