"""The c10d runtime on real gloo processes: collectives with the reference semantics, and
the GPT trained through the public API on 2 and 4 ranks equal to single-device eager torch.
Each test launches its ranks (tests/multiproc.py: free port, kill on failure, time limit)."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.models.gpt import lm_loss

from ..multiproc import run_ranks
from ..parity import ATOL, RTOL, eager_train, gpt_optimizer, lm_data, parity_gpt


@pytest.mark.slow
def test_every_reshard_step_runs_as_a_real_collective_with_reference_semantics():
    results = run_ranks("collectives", 4)
    for rank, result in enumerate(results):
        assert result["errors"] == [], f"rank {rank}: {result['errors'][:5]}"
        assert result["checked"] > 400
    assert results[0]["kinds"] == ["all_gather", "all_reduce", "all_to_all", "make_partial",
                                   "reduce_scatter", "slice"]


def _eager(optim: str, steps: int, batch: int, dropout: float):
    model = parity_gpt(optim, dropout=dropout)
    optimizer, scheduler = gpt_optimizer(optim, model)
    losses = eager_train(model, lm_loss, optimizer, lm_data(steps * batch, 16, 64),
                         batch_size=batch, steps=steps, scheduler=scheduler)
    return losses, model, optimizer


# (strategy, ranks, optimizer, global batch, dropout), 20 steps each
CASES = [("dp", 2, "adamw", 6, 0.1),      # 3 + 3 rows per rank, dropout masks sliced
         ("dp", 2, "sgd", 5, 0.0),        # 3 + 2 rows: uneven shards
         ("tp", 2, "adamw", 4, 0.1),
         ("tp_sp", 2, "adamw", 4, 0.1),   # sequence parallel: reduce-scatter / all-gather
         ("dp_tp", 4, "sgd", 4, 0.0),
         ("cp_ring", 2, "adamw", 4, 0.0)]  # ring attention: keys passed by p2p shifts


@pytest.mark.slow
@pytest.mark.parametrize("config,world,optim,batch,dropout", CASES)
def test_gpt_on_real_ranks_matches_eager(config, world, optim, batch, dropout):
    steps = 20
    results = run_ranks("train_gpt", world, config, optim, str(steps), str(batch), str(dropout))
    ref_losses, ref, ref_opt = _eager(optim, steps, batch, dropout)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank}: {m}")
        for name, p in ref.named_parameters():
            torch.testing.assert_close(result["state"][name], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    # the optimizer's own state_dict holds torch's full state, gathered from the pieces
    want = ref_opt.state_dict()["state"]
    for index, state in want.items():
        for key, value in state.items():
            torch.testing.assert_close(results[0]["optim"][index][key], value, rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"optimizer {index} {key}: {m}")
    # evaluate and predict (eval mode: no dropout) on the first batch, as eager computes them
    x, y = (torch.stack(t) for t in zip(*lm_data(batch, 16, 64)))
    with torch.no_grad():
        logits = ref.eval()(x)
    for result in results:
        assert result["valid"]["loss"] == pytest.approx(lm_loss(logits, y).item(), rel=RTOL)
        torch.testing.assert_close(result["predict"], logits, rtol=RTOL, atol=ATOL)


def test_a_launch_that_does_not_match_the_mesh_fails_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    model = parity_gpt("sgd")
    engine = ap.Engine(model, lm_loss, gpt_optimizer("sgd", model)[0],
                       strategy=ap.Strategy.from_yaml("configs/dp.yaml"))
    x, y = lm_data(2, 16, 64)[0]
    with pytest.raises(ValueError, match=r"mesh has 2 ranks but WORLD_SIZE is 3.*torchrun"):
        engine.train_step(x[None].repeat(2, 1), y[None].repeat(2, 1))


def test_leaving_the_engine_releases_its_process_groups():
    """``with Engine(...)``: every process group the engine made (and the default one it
    created) is destroyed on the way out, so nothing c10d is pending at exit; the ranks'
    training matches eager."""
    results = run_ranks("train_and_close", 2, "dp")
    ref_losses, _, _ = _eager("sgd", 2, 4, 0.0)
    for result in results:
        assert result["initialized"] is False
        torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL)
