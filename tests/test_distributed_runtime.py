"""The c10d runtime on real gloo processes: collectives with the reference semantics, and
the GPT trained through the public API on 2 and 4 ranks equal to single-device eager torch.
Each test launches its ranks (tests/multiproc.py: free port, kill on failure, time limit)."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.models import GPT
from autopar.models.gpt import lm_loss

from .multiproc import run_ranks
from .parity import ATOL, RTOL, eager_train, lm_data
from .rank_main import gpt_config, optimizer_for


def test_every_reshard_step_runs_as_a_real_collective_with_reference_semantics():
    results = run_ranks("collectives", 4)
    for rank, result in enumerate(results):
        assert result["errors"] == [], f"rank {rank}: {result['errors'][:5]}"
        assert result["checked"] > 400
    assert results[0]["kinds"] == ["all_gather", "all_reduce", "all_to_all", "make_partial",
                                   "reduce_scatter", "slice"]


def _eager(optim: str, steps: int, batch: int, dropout: float = 0.0):
    torch.manual_seed(0)
    model = GPT(gpt_config(dropout))
    losses = eager_train(model, lm_loss, optimizer_for(optim, model),
                         lm_data(steps * batch, 16, 64), batch_size=batch, steps=steps)
    return losses, model


@pytest.mark.parametrize("config,world,optim,batch", [
    ("dp", 2, "adamw", 6),          # uneven: 3 + 3 rows... and
    ("dp", 2, "sgd", 5),            # 3 + 2 rows per rank
    ("tp", 2, "adamw", 4),
    ("dp_tp", 4, "sgd", 4),
])
def test_gpt_on_real_ranks_matches_eager(config, world, optim, batch):
    steps = 20 if world == 2 else 8
    results = run_ranks("train_gpt", world, config, optim, str(steps), str(batch))
    ref_losses, ref = _eager(optim, steps, batch)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank}: {m}")
        for name, p in ref.named_parameters():
            torch.testing.assert_close(result["state"][name], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    assert results[0]["valid"] == results[-1]["valid"]


def test_a_launch_that_does_not_match_the_mesh_fails_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    torch.manual_seed(0)
    model = GPT(gpt_config())
    engine = ap.Engine(model, lm_loss, optimizer_for("sgd", model),
                       strategy=ap.Strategy.from_yaml("configs/dp.yaml"))
    x, y = lm_data(2, 16, 64)[0]
    with pytest.raises(ValueError, match=r"mesh has 2 ranks but WORLD_SIZE is 3.*torchrun"):
        engine.train_step(x[None].repeat(2, 1), y[None].repeat(2, 1))
