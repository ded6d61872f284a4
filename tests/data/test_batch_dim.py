"""A batch dim other than 0: ``nn.TransformerEncoder`` in torch's default ``[seq, batch,
feature]`` layout, and a seq-first MLP, fed ``[seq, batch]`` token ids, trained with
``batch_dim: 1`` under data parallelism and a 1F1B pipeline equal eager torch and move no
activation (the rows of a seq-first Linear keep the batch chunk of every position as a
grouped shard); per-tensor batch dims by path (``{inputs: 1, labels: 0}``). A batch dim that
names no tensor or no dim is refused, and so is micro-batching such rows when dp cuts the
batch too, naming the reshape."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import autopar as ap
from autopar.ir import OpKind

V, T, B, STEPS = 32, 6, 4, 3
TOL = dict(rtol=1e-5, atol=1e-6)


class SeqFirstMLP(nn.Module):
    """Residual GELU blocks on ``[seq, batch, feature]``; the loss reads ``[batch, classes,
    seq]``, so the batch dim is never merged with the sequence."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + F.gelu(block(h))
        return self.head(h).permute(1, 2, 0)


def seq_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y.t())


class SeqFirstLM(nn.Module):
    """Embedding, two encoder layers (dropout 0.1) and a head, all ``[seq, batch, ...]``;
    ``classify`` pools over the sequence into one ``[batch, classes]`` row per sample."""

    def __init__(self, classify: bool = False):
        super().__init__()
        self.classify = classify
        self.emb = nn.Embedding(V, 16)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1), 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.emb(ids))
        return self.head(h.mean(0) if self.classify else h)


def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def _loader(classify: bool) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (STEPS * B, T), generator=g)
    samples = [(x, x[0] if classify else x.roll(1)) for x in ids]

    def seq_first(rows):       # [seq, batch] ids; labels [seq, batch] or [batch]
        xs, ys = zip(*rows)
        return torch.stack(xs, 1), torch.stack(ys, 0 if classify else 1)
    return DataLoader(samples, batch_size=B, collate_fn=seq_first)


def _eager(model: nn.Module, loader: DataLoader, loss_fn=ce) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, (x, y) in enumerate(loader):
        torch.manual_seed(step)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train(text: str, classify: bool = False, mlp: bool = False
           ) -> tuple[ap.Engine, list[float], list[float]]:
    torch.manual_seed(0)
    model = SeqFirstMLP() if mlp else SeqFirstLM(classify)
    loss_fn = seq_ce if mlp else ce
    reference = copy.deepcopy(model)
    engine = ap.Engine(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           text + "debug: {simulate: true, strict_rules: true}\n"))
    got = engine.fit(_loader(classify), verbose=0)["loss"]
    return engine, got, _eager(reference, _loader(classify), loss_fn)


STRATEGIES = {
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp, batch_dim: 1}\n",
    "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
           "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2, batch_dim: 1}\n",
    "dp2_pp2": "mesh: {shape: [2, 2], dim_names: [pp, dp]}\n"
               "data_parallel: {axis: dp, batch_dim: 1}\n"
               "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n",
}


@pytest.mark.parametrize("name,mlp", [("dp2", False), ("dp2", True), ("pp2", False),
                                      ("pp2", True)])
def test_seq_first_models_train_like_eager_with_batch_dim_1(name, mlp):
    engine, got, want = _train(STRATEGIES[name], mlp=mlp)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    program = engine.programs()["train0"]
    ids = next(op for op in program.ops_of(OpKind.INPUT)).outputs[0]
    assert "S(1)" in str(ids.dist)
    # nothing the step computes is gathered: a reshape that merges [seq, batch] into rows
    # keeps the batch chunk of every position (a grouped shard), and so does its inverse
    assert not [op for op in program.ops if op.target in ("comm.all_gather",
                                                          "comm.all_to_all")]


@pytest.mark.parametrize("mlp,where", [(False, "encoder.layers.0.self_attn"), (True, "blocks.0")])
def test_micro_batching_a_merge_of_seq_and_batch_cut_twice_is_refused_by_the_op(mlp, where):
    """A Linear on ``[seq, batch, feature]`` runs as a matmul of ``[seq * batch, feature]``
    rows. With the batch cut by one mesh dim those rows are a grouped shard (the batch chunk
    of every position); cut by two (dp, then the micro-batches) they are not a layout autopar
    has, and the pipeline refuses, naming the reshape."""
    with pytest.raises(ValueError, match=rf"aten.view.default \({where}\) "
                                         r"needs the whole batch.*over mb.*merges the batch"):
        _train(STRATEGIES["dp2_pp2"], mlp=mlp)


def test_a_batch_dim_per_fed_tensor():
    text = ("mesh: {shape: [2], dim_names: [dp]}\n"
            "data_parallel: {axis: dp, batch_dim: {inputs: 1, labels: 0}}\n")
    _, got, want = _train(text, classify=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)


@pytest.mark.parametrize("batch_dim,match", [
    ("{inputs.mask: 1}", r"batch_dim names \['inputs.mask'\].*tensors are \['inputs', 'labels'\]"),
    ("2", r"batch_dim 2 for the fed tensor inputs of shape \[6, 4\]: it has 2 dims"),
])
def test_a_batch_dim_that_does_not_fit_the_batch_is_refused(batch_dim, match):
    text = ("mesh: {shape: [2], dim_names: [dp]}\n"
            f"data_parallel: {{axis: dp, batch_dim: {batch_dim}}}\n")
    with pytest.raises(ValueError, match=match):
        _train(text)
