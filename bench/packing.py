"""Packing: real (non-padding) tokens per second of our GPT trained through ``Engine.fit``
(serial, one thread) on documents of random lengths, packed several to a row
(``data/packing.py``: rows of ``--row`` tokens, attention kept inside each document)
against the same documents one per row, each batch padded to its longest document and the
engine's ``data: {seq_buckets}`` padding it on to a bucket; each next to eager torch on the
same batches in the same run.

    .venv/bin/python bench/packing.py [--docs 96] [--rows 4] [--layers 2] [--width 64]

Each side first trains one epoch (the engine plans its shapes there), its losses checked
against eager's (rtol 1e-5); then ``--rounds`` epochs are timed, eager's and autopar's
alternating, and the median epoch gives the tokens per second. The table: tokens per second
of eager and autopar, autopar's epoch time over eager's (< 1: autopar faster), the tokens
computed per real token (padding) by each, and packed over padded throughput.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autopar as ap
from autopar.data.packing import IGNORE_INDEX, PackedDataset
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

VOCAB = 128


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=args.row, n_layer=args.layers, n_head=4,
                         n_embd=args.width, dropout=0.0))


def _documents(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.shortest, args.row + 1, (args.docs,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _padded(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One document per row, padded to the batch's longest; labels shifted in the row."""
    longest = max(len(d) for d in docs)
    ids = torch.stack([F.pad(d, (0, longest - len(d))) for d in docs])
    labels = torch.stack([F.pad(torch.cat([d[1:], d.new_full((1,), IGNORE_INDEX)]),
                                (0, longest - len(d)), value=IGNORE_INDEX) for d in docs])
    return ids, labels


def _loaders(args, docs) -> dict[str, DataLoader]:
    return {"packed": DataLoader(PackedDataset(docs, args.row), batch_size=args.rows),
            "padded": DataLoader(docs, batch_size=args.rows, collate_fn=_padded)}


class _Eager:
    def __init__(self, args):
        self.model = _model(args)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def epoch(self, loader: DataLoader) -> list[float]:
        losses = []
        for x, y in loader:
            self.opt.zero_grad()
            out = self.model(**x) if isinstance(x, dict) else self.model(x)
            loss = lm_loss(out, y)
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
        return losses


def _engine(args, mode: str) -> ap.Engine:
    model = _model(args)
    buckets = _buckets(args)
    # packed: a short last batch gets ignored rows (one plan); padded: one plan per bucket
    text = "data: {pad_rows: true}\n" if mode == "packed" else f"data: {{seq_buckets: {buckets}}}\n"
    return ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                     strategy=ap.Strategy.from_yaml_str(text))


def _measure(args, mode: str, loader: DataLoader) -> tuple[float, float, ap.Engine]:
    """Median epoch seconds of eager and of autopar, alternating, after a checked epoch."""
    eager, engine = _Eager(args), _engine(args, mode)
    want = eager.epoch(loader)
    got = engine.fit(loader, epochs=1, verbose=0)["loss"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{mode}: losses differ from eager's: {m}")
    eager_s, ours_s = [], []
    for r in range(args.rounds):
        start = time.perf_counter()
        eager.epoch(loader)
        eager_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.fit(loader, epochs=r + 2, verbose=0)
        ours_s.append(time.perf_counter() - start)
    return statistics.median(eager_s), statistics.median(ours_s), engine


def _buckets(args) -> list[int]:
    return [args.row // 4 * k for k in range(1, 5)]


def _computed(args, mode: str, loader: DataLoader) -> tuple[int, int]:
    """Tokens eager and autopar run the model on per epoch, padding included: autopar pads
    a packed short last batch with rows, a padded batch on to its bucket."""
    shapes = [(x["idx"] if isinstance(x, dict) else x).shape for x, _ in loader]
    eager = sum(rows * n for rows, n in shapes)
    if mode == "packed":
        return eager, len(shapes) * args.rows * args.row
    return eager, sum(rows * min(b for b in _buckets(args) if b >= n) for rows, n in shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=96)
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--row", type=int, default=256, help="packed row length, longest doc")
    parser.add_argument("--rows", type=int, default=4, help="rows per batch")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    docs = _documents(args)
    real = sum(len(d) for d in docs)
    results = {}
    for mode, loader in _loaders(args, docs).items():
        eager_s, ours_s, engine = _measure(args, mode, loader)
        results[mode] = (eager_s, ours_s, *_computed(args, mode, loader),
                         len(engine.planner.made))
    print(f"GPT {args.layers} x {args.width}, {args.docs} documents of {args.shortest}.."
          f"{args.row} tokens ({real} real tokens), {args.rows} rows a batch, SGD, one thread; "
          f"median of {args.rounds} epochs")
    print(f"{'':>8} {'eager tok/s':>12} {'autopar tok/s':>14} {'autopar/eager':>14} "
          f"{'computed/real: eager':>21} {'autopar':>8} {'plans':>6}")
    for mode, (eager_s, ours_s, eager_n, ours_n, plans) in results.items():
        print(f"{mode:>8} {real / eager_s:12.0f} {real / ours_s:14.0f} {ours_s / eager_s:13.2f}x "
              f"{eager_n / real:20.2f}x {ours_n / real:7.2f}x {plans:6d}")
    packed, padded = results["packed"], results["padded"]
    print(f"packed / padded throughput: eager {padded[0] / packed[0]:.2f}x, "
          f"autopar {padded[1] / packed[1]:.2f}x (autopar's padded rows run to the bucket)")


if __name__ == "__main__":
    main()
