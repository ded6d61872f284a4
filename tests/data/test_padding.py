"""Batches of many shapes on few plans (``data: {seq_buckets | pad_to_multiple, pad_rows}``):
each batch is padded up to a planned length (token ids with ``pad_id``, labels with
``ignore_index``), so six lengths make one plan, and training equals eager's on the
unpadded batches (fp32, rtol 1e-5): serial and on the simulator's dp2 and tp2. A short last
batch gets ignored rows. Predictions are cut back to the real rows and length. Attention
that would read the padding, lengths past the last bucket and rows that cannot be ignored
are refused by name; the history and the step logs say when a plan is made."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autopar as ap
from autopar.models.gpt import lm_loss
from autopar.passes.refuse_unmasked_padding import PaddingReadError

from ..parity import (  # noqa: F401  (one_thread: a fixture)
    assert_same_losses,
    assert_same_params,
    eager_train,
    one_thread,
    parity_gpt,
    twin,
)

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = (37, 64, 50, 90, 101, 77)
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


def _batches(lengths, rows=4, seed=0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 64, (r, n + 1), generator=g)
              for n, r in zip(lengths, rows if isinstance(rows, list) else [rows] * 99)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _fit(text: str, batches, optim="adamw"):
    make_opt = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1)}[optim]
    model = parity_gpt(optim, seq=128)
    ref = twin(model)
    want = eager_train(ref, lm_loss, make_opt(ref), batches, None, len(batches))
    engine = ap.Engine(model, lm_loss, make_opt(model), strategy=ap.Strategy.from_yaml_str(text))
    history = engine.fit(DataLoader(batches, batch_size=None), verbose=0)
    assert_same_losses(history["loss"], want)
    assert_same_params(model, ref)
    return engine, history


@pytest.mark.parametrize("layout, optim", [
    ("", "adamw"),
    ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
     "debug: {simulate: true}\n", "adamw"),
    (f"mesh: {{shape: [2], dim_names: [tp]}}\ntensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\n"
     "debug: {simulate: true}\n", "sgd"),
], ids=["serial", "dp2", "tp2"])
def test_six_lengths_train_like_eager_on_one_plan_per_bucket(layout, optim):
    engine, history = _fit(layout + "data: {seq_buckets: [64, 128]}\n", _batches(LENGTHS),
                           optim)
    made = engine.planner.made
    assert [m.shapes for m in made] == [((4, 64), (4, 64)), ((4, 128), (4, 128))]
    assert len(history["plan_s"]) == 2 and all(s > 0 for s in history["plan_s"])
    assert "planned the train step for batch shapes [4, 64], [4, 64] in" in str(made[0])


def test_pad_to_multiple_plans_once_per_multiple():
    engine, _ = _fit("data: {pad_to_multiple: 32}\n", _batches(LENGTHS))
    assert sorted({m.shapes[0][1] for m in engine.planner.made}) == [64, 96, 128]
    assert len(engine.planner.made) == 3


def test_a_short_last_batch_gets_ignored_rows():
    batches = _batches((40, 40, 40), rows=[4, 4, 3])
    engine, _ = _fit("data: {pad_rows: true}\n", batches)
    assert [m.shapes for m in engine.planner.made] == [((4, 40), (4, 40))]


def test_predictions_and_evaluation_are_the_unpadded_ones():
    model = parity_gpt("adamw", seq=128).eval()
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                       strategy=ap.Strategy.from_yaml_str(
                           "data: {seq_buckets: [128], pad_rows: true}\n"))
    batches = _batches((50, 50, 70), rows=[3, 3, 2])
    got = engine.predict(DataLoader([x for x, _ in batches], batch_size=None))
    with torch.no_grad():
        for out, (x, y) in zip(got, batches):
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    scores = engine.evaluate(DataLoader(batches, batch_size=None), verbose=0)
    with torch.no_grad():
        losses = [lm_loss(model(x), y).item() * x.shape[0] for x, y in batches]
    assert scores["loss"] == pytest.approx(sum(losses) / 8, rel=1e-5)
    assert len(engine.planner.made) == 2          # predict's and eval's one plan each


class _Bidirectional(torch.nn.Module):
    """Attention over the whole sequence, unmasked: it reads the padding."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, x):
        q, k, v = self.qkv(self.emb(x)).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.head(y)


def test_what_would_read_or_cannot_ignore_the_padding_is_refused():
    model = _Bidirectional()
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str("data: {seq_buckets: [64]}"))
    x, y = _batches((40,))[0]
    with pytest.raises(PaddingReadError, match="neither causal nor masked.*attention_mask"):
        engine.train_step(x, y)
    model = parity_gpt("adamw", seq=128)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str("data: {seq_buckets: [64]}"))
    x, y = _batches((100,))[0]
    with pytest.raises(ValueError, match=r"length 100 is longer than .*\[64\]"):
        engine.train_step(x, y)
    regression = torch.nn.Linear(3, 2)
    engine = ap.Engine(regression, F.mse_loss, torch.optim.SGD(regression.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str("data: {pad_rows: true}"))
    engine.train_step(torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"pad_rows: the fed tensor labels \(torch.float32\)"):
        engine.train_step(torch.randn(3, 3), torch.randn(3, 2))
    with pytest.raises(ValueError, match="give one"):
        ap.Strategy.from_yaml_str("data: {seq_buckets: [64], pad_to_multiple: 8}")
    with pytest.raises(ValueError, match="increasing order"):
        ap.Strategy.from_yaml_str("data: {seq_buckets: [128, 64]}")


def test_a_plan_runs_batches_of_its_shapes_whatever_their_strides():
    """Planned on contiguous labels, fed a view (``tokens[:, 1:]``) of the same shape."""
    model = parity_gpt("adamw", seq=128)
    ref = twin(model)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.randint(0, 64, (2, 4, 41), generator=torch.Generator().manual_seed(0))
    batches = [(tokens[0, :, :-1].clone(), tokens[0, :, 1:].clone()),
               (tokens[1, :, :-1], tokens[1, :, 1:])]
    want = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), batches,
                       None, len(batches))
    assert_same_losses([engine.train_step(x, y) for x, y in batches], want)
    assert_same_params(model, ref)


def test_the_log_says_when_a_plan_is_made(capsys):
    model = parity_gpt("adamw", seq=128)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str("data: {seq_buckets: [64, 128]}"))
    engine.fit(DataLoader(_batches((30, 40, 100)), batch_size=None), verbose=2, log_freq=10)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "planned a new program" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 1/1 step 1", "epoch 1/1 step 3"]
