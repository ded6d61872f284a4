"""Variable sequence lengths: six batches of six lengths through ``Engine.train_step``,
without and with ``data: {seq_buckets}``, against eager torch on the same batches and
against six steps of one planned shape, in one run (one process, one thread).

    .venv/bin/python bench/variable_lengths.py [--layers 2] [--width 64] [--rows 4]

Rows (seconds for the six batches, and the ratio to six steps of one planned shape):

* ``eager``: torch on the unpadded batches (the baseline a user compares with);
* ``no buckets``: every length plans its own program (capture and every pass);
* ``buckets, first pass``: ``seq_buckets: [128]``, the one plan made on the first batch;
* ``buckets, planned``: six new lengths once the bucket's plan exists (a later epoch, or
  any batch after the first): padding only;
* ``buckets, restarted``: a new engine (a restarted job) with ``plan_cache_dir`` holding
  the plan an earlier one made: it captures the step (the cache's key) and loads the rest;
* ``one shape``: six steps of one planned shape (the issue's yardstick).

Every autopar run's losses are checked against eager's (rtol 1e-5) before it is timed.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

LENGTHS = (37, 64, 50, 90, 101, 77)
OTHER = (45, 99, 58, 120, 33, 81)


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=128, n_layer=args.layers, n_head=4,
                         n_embd=args.width, dropout=0.0))


def _batches(lengths, rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 128, (rows, n + 1), generator=g) for n in lengths]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _timed(step, batches) -> tuple[float, list[float]]:
    start = time.perf_counter()
    losses = [step(x, y) for x, y in batches]
    return time.perf_counter() - start, losses


def _eager(args, batches) -> tuple[float, list[float]]:
    model = _model(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return _timed(step, batches)


def _engine(args, text: str) -> ap.Engine:
    model = _model(args)
    return ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                     strategy=ap.Strategy.from_yaml_str(text))


def _check(name: str, got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{name}: losses differ from eager's: {m}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    first, later = _batches(LENGTHS, args.rows, 0), _batches(OTHER, args.rows, 1)
    eager_s, want = _eager(args, first)
    rows = [("eager (torch)", eager_s)]

    plain = _engine(args, "{}")
    seconds, got = _timed(plain.train_step, first)
    _check("no buckets", got, want)
    rows.append(("no buckets", seconds))

    bucketed = _engine(args, "data: {seq_buckets: [128]}")
    seconds, got = _timed(bucketed.train_step, first)
    _check("buckets", got, want)
    rows.append(("buckets, first pass", seconds))
    seconds, _ = _timed(bucketed.train_step, later)
    rows.append(("buckets, planned", seconds))
    assert len(bucketed.planner.made) == 1, bucketed.planner.made
    with tempfile.TemporaryDirectory() as cache:
        text = f"data: {{seq_buckets: [128]}}\nplan_cache_dir: {cache!r}\n"
        _engine(args, text).train_step(*first[0])
        restarted = _engine(args, text)
        seconds, got = _timed(restarted.train_step, first)
        _check("restarted", got, want)
        assert restarted.planner.made[0].cached
    rows.append(("buckets, restarted", seconds))

    one = _engine(args, "{}")
    one.train_step(*first[4])                         # plan the shape first
    seconds, _ = _timed(one.train_step, [first[4]] * 6)
    rows.append(("one shape", seconds))
    print(f"GPT {args.layers} x {args.width}, {args.rows} rows, lengths {list(LENGTHS)} "
          f"then {list(OTHER)}; SGD; seconds for six batches, and / one planned shape:")
    for name, s in rows:
        print(f"{name:>22} {s:8.3f} s {s / rows[-1][1]:8.2f}x")
    print(f"plans made: no buckets {len(plain.planner.made)}, buckets "
          f"{len(bucketed.planner.made)} ({bucketed.planner.made[0].seconds:.2f} s); "
          f"restarted from the plan cache in {restarted.planner.made[0].seconds:.2f} s")


if __name__ == "__main__":
    main()
