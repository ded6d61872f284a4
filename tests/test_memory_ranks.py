"""The plan-time memory estimate against what a real gloo rank holds: each of 2 processes
plans with ``engine.cost`` and then counts its live tensors over a training step
(``runtime.memory.RankMeter``: the rank's own program op by op, on its own pieces, with
real collectives), and every storage a step of its compiled program allocates
(``AllocationMeter``: temporaries inside an op included)."""
from __future__ import annotations

from autopar.models.gpt import lm_loss

from .multiproc import run_ranks
from .parity import assert_same_losses, eager_train, gpt_optimizer, lm_data, parity_gpt

ZERO3_DP2 = ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
             "sharding: {stage: 3, axis: dp}\n")


def test_zero3_dp2_estimate_within_10_percent_on_real_ranks():
    ranks = run_ranks("memory_peak", 2, ZERO3_DP2)
    for rank, got in enumerate(ranks):
        predicted = got["predicted"]
        for how in ("measured", "allocated"):
            assert abs(predicted - got[how]) <= 0.1 * got[how], (
                f"rank {rank}: predicted {predicted} B, {how} {got[how]} B")
        # the pieces the rank really holds: half of every parameter, of its gradient and
        # of its AdamW state (every first dim of this GPT is even)
        est = got["estimate"]
        assert got["held"] == {"params": est.params, "grads": est.grads,
                               "optimizer_state": est.optimizer_state, "buffers": est.buffers}
    # the metered step (op by op) trains like eager: the first step compiled, the second
    # metered, both on the same batch
    model = parity_gpt("adamw")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert ranks[0]["held"]["params"] == ranks[1]["held"]["params"] == full // 2
    optimizer, _ = gpt_optimizer("adamw", model)
    data = lm_data(8, 16, 64)
    want = eager_train(model, lm_loss, optimizer, data + data, batch_size=8, steps=2)
    for got in ranks:
        assert_same_losses(got["loss"], want)
