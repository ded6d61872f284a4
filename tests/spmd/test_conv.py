"""Convolutional models under data and tensor parallelism: convolution and max pooling
have SPMD rules (tests/spmd/test_spmd_property.py checks them op by op), so a CNN's activations
stay sharded under dp, and a tensor-parallel plan shards a Conv2d by what it does: output
channels for colwise, input channels (a Partial output) for rowwise."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar as ap
from autopar.ir import OpKind
from autopar.ir.attrs import NAME

from ..parity import ATOL, RTOL


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.head(F.relu(self.conv2(x)).flatten(1))


STRATEGIES = {
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "tp2": "mesh: {shape: [2], dim_names: [tp]}\n"
           "tensor_parallel: {axis: tp, plan: {conv1: colwise, conv2: rowwise}}\n",
    "dp2_tp2": "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
               "tensor_parallel: {axis: tp, plan: {conv1: colwise, conv2: rowwise}}\n",
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_cnn_trains_like_eager_without_gathering_activations(name):
    torch.manual_seed(0)
    model = CNN()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    strategy = ap.Strategy.from_yaml_str(STRATEGIES[name]
                                         + "debug: {simulate: true, strict_rules: true}\n")
    engine = ap.Engine(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    program = engine.prepare(x, y)
    gathers = [op for op in program.ops
               if op.kind is OpKind.COMM and "all_gather" in op.target]
    assert gathers == []
    losses = [engine.train_step(x, y) for _ in range(3)]
    engine.sync_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, got in enumerate(losses):
        loss = F.cross_entropy(reference(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.testing.assert_close(got, loss.item(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"step {step}: {m}")
    for (n, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")


def test_a_conv_plan_shards_output_channels_colwise_and_input_channels_rowwise():
    torch.manual_seed(0)
    model = CNN()
    strategy = ap.Strategy.from_yaml_str(STRATEGIES["tp2"])
    engine = ap.Engine(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    program = engine.prepare(torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    dists = {op.attrs[NAME]: op.result.dist for op in program.states()}
    assert dists["conv1.weight"].placements == (ap.Shard(0),)
    assert dists["conv1.bias"].placements == (ap.Shard(0),)
    assert dists["conv2.weight"].placements == (ap.Shard(1),)
    assert dists["conv2.bias"].placements == (ap.Replicate(),)
