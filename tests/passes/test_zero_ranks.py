"""ZeRO stages 1, 2 and 3 on 2 real gloo processes (torchrun, ``tests/multiproc.py``): the
GPT (tied embedding and head, dropout 0.1, an odd vocabulary so the embedding's rows split
33 + 32) trained 20 steps through ``Engine.fit`` equals single-device eager torch: every
step's loss, and after fit ``engine.state_dict()`` and torch's ``optimizer.state_dict()``
hold the whole tensors (gathered from each rank's pieces) equal to eager's, on every rank."""
from __future__ import annotations

import pytest
import torch

from autopar.models.gpt import lm_loss

from ..multiproc import run_ranks
from ..parity import ATOL, RTOL, eager_train, gpt_optimizer, lm_data, parity_gpt

STEPS, BATCH, VOCAB, DROPOUT = 20, 6, 65, 0.1


def _eager(optim: str):
    model = parity_gpt(optim, vocab=VOCAB, dropout=DROPOUT)
    optimizer, scheduler = gpt_optimizer(optim, model)
    losses = eager_train(model, lm_loss, optimizer, lm_data(STEPS * BATCH, 16, VOCAB),
                         batch_size=BATCH, steps=STEPS, scheduler=scheduler)
    return losses, model, optimizer.state_dict()


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_zero_stages_on_two_real_ranks_train_like_eager(optim):
    results = run_ranks("train_zero", 2, optim, str(STEPS), str(BATCH), str(VOCAB),
                        str(DROPOUT), timeout=400)
    losses, ref, ref_optim = _eager(optim)
    want_state = ref.state_dict()
    for rank, by_stage in enumerate(results):
        assert sorted(by_stage) == [1, 2, 3]
        for stage, got in by_stage.items():
            where = f"rank {rank} stage {stage}"
            _close(torch.tensor(got["loss"]), torch.tensor(losses), f"{where} losses")
            # the tied embedding and head are one tensor, under one of their names
            assert got["state"].keys() <= want_state.keys()
            assert {"wte.weight", "blocks.0.fc1.weight"} <= got["state"].keys()
            for name, value in got["state"].items():
                assert value.shape == want_state[name].shape, f"{where} {name}: not whole"
                _close(value, want_state[name], f"{where} {name}")
            optim_state = got["optim"]
            assert optim_state["param_groups"] == ref_optim["param_groups"]
            assert optim_state["state"].keys() == ref_optim["state"].keys()
            for index, state in ref_optim["state"].items():
                assert optim_state["state"][index].keys() == state.keys()
                for key, value in state.items():
                    _close(optim_state["state"][index][key], value,
                           f"{where} optimizer state {index} {key}")
