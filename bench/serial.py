"""autopar vs eager torch: training step time of the same GPT, paired in one run.

Steps alternate between the two (same model init, same batches), so machine noise hits
both alike; the ratio of median step times is printed (< 1 means autopar is faster).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(steps: int = 40, warmup: int = 5, batch: int = 8, layers: int = 4, width: int = 128,
         seq: int = 64) -> float:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=seq, n_layer=layers, n_head=4, n_embd=width)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    x = torch.randint(0, 128, (batch, seq))
    y = torch.randint(0, 128, (batch, seq))

    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def eager_step():
        ref_opt.zero_grad()
        lm_loss(ref(x), y).backward()
        ref_opt.step()

    def autopar_step():
        engine.train_step(x, y)

    ours, theirs = [], []
    for i in range(warmup + steps):
        a, b = _timed(autopar_step), _timed(eager_step)
        if i >= warmup:
            ours.append(a)
            theirs.append(b)
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"GPT {layers}x{width}, batch {batch}x{seq}, AdamW, {torch.get_num_threads()} threads")
    print(f"eager   median step {statistics.median(theirs) * 1e3:8.2f} ms")
    print(f"autopar median step {statistics.median(ours) * 1e3:8.2f} ms")
    print(f"ratio autopar/eager: {ratio:.3f}")
    return ratio


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    main(args.steps, layers=args.layers, width=args.width, batch=args.batch)
