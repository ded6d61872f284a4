"""HSDP: ``data_parallel: {axis: [rep, shard]}`` with ZeRO over ``shard`` (FSDP2's 2-D mesh).

The batch is cut over both dims, the state over ``shard`` only: each gradient is
reduce-scattered inside a shard group and its piece all-reduced across the replicas, both
asynchronously, a layer at a time; parameters are gathered inside a shard group. On the
simulator and on 4 real gloo ranks, losses, parameters and optimizer state equal eager's
(fp32, rtol 1e-5); bad axis lists are refused before anything runs.
"""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.reshard.comm import BUCKET_STEPS, RESHARD_STEP

from ..multiproc import run_ranks
from ..parity import (  # noqa: F401  (one_thread: a fixture)
    ATOL,
    RTOL,
    eager_train,
    gpt_optimizer,
    lm_data,
    one_thread,
    parity_gpt,
)
from . import test_zero as zero

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 6
MESH = "mesh: {shape: [2, 2], dim_names: [rep, shard]}\n"


def _strategy(stage: int, extra: str = "") -> ap.Strategy:
    return ap.Strategy.from_yaml_str(
        MESH + "data_parallel: {axis: [rep, shard]}\ndebug: {simulate: true}\n"
        f"sharding: {{stage: {stage}, axis: shard}}\n" + extra)


@pytest.mark.parametrize("stage, model, optim", [
    (0, "gpt", "adamw"), (1, "gpt", "adamw"), (2, "mlp", "sgd"), (3, "gpt", "adamw"),
    (3, "gpt", "sgd"), (3, "scaled", "adamw")])
def test_hsdp_trains_like_eager(stage, model, optim, monkeypatch):
    monkeypatch.setattr(zero, "BATCH", 8)      # 2 rows per rank
    zero._fit_both(model, optim, _strategy(stage), steps=STEPS)


def test_hsdp_with_tensor_parallel_inside_and_clipping(monkeypatch):
    monkeypatch.setattr(zero, "BATCH", 8)
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2, 2, 2], dim_names: [rep, shard, tp]}\n"
        "data_parallel: {axis: [rep, shard]}\nsharding: {stage: 3, axis: shard}\n"
        f"tensor_parallel: {{axis: tp, plan: {zero.TP_PLAN}}}\n"
        "grad_clip: {max_norm: 0.5}\ndebug: {simulate: true}\n")
    zero._fit_both("gpt", "adamw", strategy, max_norm=0.5, steps=4)


def test_the_plan_scatters_in_the_shard_group_and_sums_across_replicas():
    model, loss_fn, data = zero.MODELS["gpt"]("adamw", 2)      # 12 rows: 8 taken
    engine = ap.Engine(model, loss_fn, torch.optim.AdamW(model.parameters()),
                       strategy=_strategy(3))
    x, y = (torch.stack(t) for t in zip(*data[:8]))
    engine.train_step(x, y)
    program = engine.planner.plan("train", x, y).program
    mesh_dim = {"rep": 0, "shard": 1}

    def steps_of(op):
        return op.attrs.get(BUCKET_STEPS) or (op.attrs[RESHARD_STEP],)
    starts = {target: [op for op in program.ops if op.target == target]
              for target in ("comm.reduce_scatter_start", "comm.all_reduce_start",
                             "comm.all_gather_start")}
    scatters, sums, gathers = (starts[t] for t in sorted(starts, key=lambda t: (
        "reduce" not in t, "gather" in t)))
    assert scatters and gathers
    assert all(s.mesh_dim == mesh_dim["shard"] for op in scatters + gathers for s in steps_of(op))
    # each reduce-scatter unit's pieces go on to one asynchronous all-reduce over rep
    replica_sums = [op for op in sums if all(s.mesh_dim == mesh_dim["rep"] for s in steps_of(op))
                    and len(op.inputs) > 1]
    assert len(replica_sums) == len([s for s in scatters if len(s.inputs) > 1])
    for op in replica_sums:
        assert op.inputs[0].producer.target == "comm.wait"
        assert op.inputs[0].producer.args[0].producer in scatters
    # no parameter travels across the replicas, no gradient is summed synchronously there
    synchronous = [op for op in program.ops if op.target == "comm.all_reduce"
                   and op.attrs[RESHARD_STEP].mesh_dim == mesh_dim["rep"]
                   and op.inputs[0].type.numel > 1]
    assert not synchronous


def test_axis_lists_are_checked():
    strategy = _strategy(3)
    assert strategy.data_parallel.mesh_axes == ("rep", "shard")
    assert strategy.degree("data_parallel") == 4 and strategy.degree("sharding") == 2
    assert ap.Strategy.from_yaml_str(
        "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: [dp]}").data_parallel.axis \
        == "dp"
    with pytest.raises(ValueError, match="distinct"):
        ap.Strategy.from_yaml_str(MESH + "data_parallel: {axis: [rep, rep]}")
    with pytest.raises(ValueError, match="data_parallel.axis 'node' .*not one of the mesh"):
        ap.Strategy.from_yaml_str(MESH + "data_parallel: {axis: [node, shard]}")
    with pytest.raises(ValueError, match="tensor_parallel.axis and data_parallel.axis|"
                                         "data_parallel.axis and tensor_parallel.axis"):
        ap.Strategy.from_yaml_str(MESH + "data_parallel: {axis: [rep, shard]}\n"
                                  "tensor_parallel: {axis: shard}")
    with pytest.raises(ValueError, match="HSDP"):
        model = parity_gpt("adamw")
        ap.Engine(model, zero.lm_loss, torch.optim.AdamW(model.parameters()),
                  strategy=ap.Strategy.from_yaml_str(
                      MESH + "data_parallel: {axis: [rep, shard]}\nauto: {devices: 4}\n"
                      "debug: {simulate: true}")).fit(lm_data(8, 16, 64), batch_size=8,
                                                      verbose=0)


@pytest.mark.slow
def test_hsdp_on_four_real_ranks_trains_like_eager():
    results = run_ranks("train_hsdp", 4, "4", "8", timeout=400)
    model = parity_gpt("adamw", vocab=65, dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    losses = eager_train(model, zero.lm_loss, optimizer, lm_data(32, 16, 65), 8, 4,
                         scheduler=scheduler)
    want = model.state_dict()
    for rank, got in enumerate(results):
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(losses),
                                   rtol=RTOL, atol=ATOL)
        for name, value in got["state"].items():
            torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
