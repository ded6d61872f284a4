"""Writes through views into tensors the step makes itself (T5's shifted decoder inputs)
become out-of-place scatters: every later reader (also of a view taken before the write)
sees the written values, the SPMD rules keep the batch sharded through them, and training
under data parallelism equals eager torch, with strict planning (no op without a rule)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar as ap
from autopar.ir import OpKind

V = 16


class ShiftRight(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(V, 8), nn.Linear(8, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        early = shifted[:, :2]                  # taken before the writes, read after them
        shifted[:, 1:] = ids[:, :-1].clone()    # copy_ into a slice
        shifted[:, 0] = 3                       # fill_ of a select
        shifted.masked_fill_(shifted == 5, 0)   # in place on the base itself
        column = shifted.t()[1]                 # add_ through a transpose and a select
        column += 1
        x = self.emb(shifted) + self.emb(early).sum(1, keepdim=True)
        return self.fc(x)


def ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (8, 6), generator=g)
    return [(x, x.roll(1)) for x in ids]


def _eager(model, data):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for k in range(2):
        x = torch.stack([a for a, _ in data[4 * k:4 * k + 4]])
        y = torch.stack([b for _, b in data[4 * k:4 * k + 4]])
        loss = ce(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mesh", ["[1]", "[2]", "[4]"])
def test_writes_through_views_train_like_eager_with_the_batch_sharded(mesh):
    torch.manual_seed(0)
    model = ShiftRight()
    reference = copy.deepcopy(model)
    strategy = ap.Strategy.from_yaml_str(
        f"mesh: {{shape: {mesh}, dim_names: [dp]}}\ndata_parallel: {{axis: dp}}\n"
        "debug: {simulate: true, strict_rules: true}\n")
    engine = ap.Engine(model, ce, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    data = _data()
    got = engine.fit(data, batch_size=4, verbose=0)["loss"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_eager(reference, data)),
                               rtol=1e-5, atol=1e-6)
    program = engine.programs()["train0"]
    targets = {op.target for op in program.ops_of(OpKind.CALL)}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default"} <= targets
    assert not targets & {"aten.copy_.default", "aten.fill_.Scalar", "aten.add_.Tensor",
                          "aten.masked_fill_.Scalar"}
    if mesh != "[1]":     # the batch stays sharded: no gather of the ids or what is built
        assert not [op for op in program.ops if op.target == "comm.all_gather"]


def test_a_write_into_a_batch_input_is_left_in_place():
    """Writing into the caller's tensor is a state change, not rewritten: it still runs."""
    class WritesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            x[:, 0] = 0.0
            return self.fc(x)

    torch.manual_seed(0)
    model = WritesInput()
    engine = ap.Engine(model, lambda out, y: F.mse_loss(out, y),
                       torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    loss = engine.train_step(x.clone(), y)
    torch.manual_seed(0)
    reference = WritesInput()
    want = F.mse_loss(reference(x.clone()), y).item()
    assert loss == pytest.approx(want, rel=1e-6)
