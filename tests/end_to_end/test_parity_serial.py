"""The main proof: autopar's serial training equals eager torch, step for step.

20 steps, fp32, same init and data: every step's loss and the final parameters (and the
optimizer state) within rtol 1e-5 / atol 1e-6.
"""
import pytest
import torch

import autopar as ap
from autopar.models import GPT, MLP, GPTConfig
from autopar.models.gpt import lm_loss

from ..parity import (
    assert_same_losses,
    assert_same_params,
    eager_train,
    lm_data,
    regression_data,
    twin,
)

STEPS = 20


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _groups(model, **base):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.05},
            {"params": no_decay, "weight_decay": 0.0, "lr": base["lr"] * 0.5}]


OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                              weight_decay=1e-3),
    "sgd_nesterov_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.8,
                                                        nesterov=True),
    "sgd_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                               dampening=0.3),
    "sgd_plain": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "adam_amsgrad_wd": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01,
                                                  amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
    "adamw_groups": lambda m: torch.optim.AdamW(_groups(m, lr=2e-3), lr=2e-3),
}


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)), lm_loss, \
        lm_data(STEPS * 4, 16, 64)


def _mlp():
    torch.manual_seed(0)
    return MLP(16, 32, 8, depth=2), _mse, regression_data(STEPS * 4, 16, 8)


MODELS = {"gpt": _gpt, "mlp": _mlp}


def _run_both(model_name, opt_name, max_norm=None, schedule=None):
    model, loss_fn, data = MODELS[model_name]()
    ref = twin(model)
    ref_opt = OPTIMIZERS[opt_name](ref)
    ref_sched = schedule(ref_opt) if schedule else None
    ref_losses = eager_train(ref, loss_fn, ref_opt, data, 4, STEPS, max_norm, ref_sched)

    opt = OPTIMIZERS[opt_name](model)
    strategy = ap.Strategy(grad_clip={"max_norm": max_norm}) if max_norm else ap.Strategy()
    engine = ap.Engine(model, loss_fn, opt, strategy=strategy,
                       lr_scheduler=schedule(opt) if schedule else None)
    history = engine.fit(data, batch_size=4, steps_per_epoch=STEPS, verbose=0)
    return engine, model, ref, opt, ref_opt, history["loss"], ref_losses


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_parity(model_name, opt_name):
    _, model, ref, opt, ref_opt, losses, ref_losses = _run_both(model_name, opt_name)
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_parity_with_scheduler_and_clipping(model_name):
    schedule = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-3, total_steps=STEPS)  # noqa: E731
    engine, model, ref, opt, ref_opt, losses, ref_losses = _run_both(
        model_name, "adamw", max_norm=0.5, schedule=schedule)
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)
    # OneCycle also cycles betas: the live param_group is what the kernels read
    assert engine.history["lr"][0] != engine.history["lr"][-1]


def test_clipping_changes_the_update():
    """Clipping is really applied: a tiny max_norm gives other parameters than none."""
    _, clipped, *_ = _run_both("mlp", "sgd_plain", max_norm=1e-3)
    _, unclipped, *_ = _run_both("mlp", "sgd_plain")
    assert not torch.allclose(clipped.head.weight, unclipped.head.weight)


def test_optimizer_state_matches_eager():
    _, model, ref, opt, ref_opt, _, _ = _run_both("mlp", "adamw")
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for key in theirs["state"]:
        for name, value in theirs["state"][key].items():
            torch.testing.assert_close(ours["state"][key][name], value, rtol=1e-5, atol=1e-7)
