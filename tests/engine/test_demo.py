"""The demo's helpers on tiny inputs: seeded top-k / temperature sampling through a
``predict`` that returns fixed logits, and the loss CSV / PNG writer."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from autopar.demo import draw, generate, loss_rows, write_loss_curve

from ..parity import one_thread  # noqa: F401  (the fixture, by name)

pytestmark = pytest.mark.usefixtures("one_thread")


def draws(logits, temperature, top_k, seed, n=400):
    generator = torch.Generator().manual_seed(seed)
    return [draw(logits, temperature, top_k, generator) for _ in range(n)]


def test_draw_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])
    assert set(draws(logits, 1.0, 2, seed=0)) == {1, 3}
    assert set(draws(logits, 5.0, 1, seed=0)) == {1}


def test_draw_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = draws(logits, 0.05, None, seed=1)
    hot = draws(logits, 100.0, None, seed=1)
    assert cold.count(0) == len(cold)
    # near-uniform at high temperature: every token drawn often (expected 133 of 400 each)
    assert min(hot.count(i) for i in range(3)) > 90


def test_draw_matches_softmax_frequencies():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    counts = torch.bincount(torch.tensor(draws(logits, 1.0, None, seed=2, n=4000)), minlength=3)
    assert torch.allclose(counts / 4000, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


class FixedLogits:
    """``predict`` of a model whose next-character distribution depends on the window's
    last character: after 'a' only 'b' and 'c', after anything else only 'a'."""

    def __init__(self):
        self.windows = []

    def predict(self, data, batch_size):
        (window,) = data
        self.windows.append(window.clone())
        logits = torch.full((1, len(window), 128), -1e9)
        if int(window[-1]) == ord("a"):
            logits[0, -1, ord("b")] = logits[0, -1, ord("c")] = 0.0
        else:
            logits[0, -1, ord("a")] = 0.0
        return [logits]


def test_generate_is_seeded_and_feeds_a_fixed_window():
    engine = FixedLogits()
    text = generate(engine, "x", 12, block=4, seed=3)
    assert text == generate(FixedLogits(), "x", 12, block=4, seed=3)
    assert text[0] == "x" and len(text) == 13
    assert all(text[i] == "a" for i in range(1, 13, 2))
    assert {text[i] for i in range(2, 13, 2)} == {"b", "c"}
    assert {len(w) for w in engine.windows} == {4}
    assert engine.windows[0].tolist() == [ord("\n")] * 3 + [ord("x")]
    assert generate(FixedLogits(), "x", 12, block=4, seed=4) != text


def test_loss_rows_interleave_train_and_validation():
    rows = loss_rows([3.0, 2.5, 2.0, 1.5], [4.0, 2.2, 1.4], [0, 2, 4])
    assert rows == [(0, None, 4.0), (1, 3.0, None), (2, 2.5, 2.2), (3, 2.0, None),
                    (4, 1.5, 1.4)]
    with pytest.raises(ValueError):
        loss_rows([3.0], [4.0, 2.0], [0])


def test_write_loss_curve_csv_and_png(tmp_path):
    rows = loss_rows([3.0, 2.5, 2.0, 1.5], [4.0, 2.2, 1.4], [0, 2, 4])
    csv_path, png_path = write_loss_curve(rows, tmp_path / "out")
    with csv_path.open() as f:
        table = list(csv.reader(f))
    assert table[0] == ["step", "train_loss", "valid_loss"]
    assert table[1] == ["0", "", "4.000000"]
    assert table[3] == ["2", "2.500000", "2.200000"]
    assert len(table) == 6
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 5000


def test_the_demo_checkpoints_and_resumes_with_more_steps(tmp_path, capsys):
    """``--resume`` continues from the newest checkpoint: the first run's 4 steps are not
    trained again, the resumed run trains the 2 it adds and prints the command."""
    from autopar.demo import main
    serial = str(Path(__file__).resolve().parents[2] / "configs" / "serial.yaml")
    main(steps=4, batch_size=4, dump_dir=str(tmp_path), strategy_path=serial, valid_every=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004"]
    assert "--steps 204 --resume" in capsys.readouterr().out
    again = main(steps=6, batch_size=4, dump_dir=str(tmp_path), strategy_path=serial,
                 valid_every=2, resume=True)
    assert len(again["history"]["loss"]) == 2
    assert "resumed from" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / "step_00000006").is_dir()
