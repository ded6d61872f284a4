"""Compiled autopar (``compile: {enable: true}``) vs uncompiled autopar vs eager torch vs
``torch.compile`` of the whole eager training step, one device, same run.

The four steps of the same GPT (same init, same batch) are interleaved, so machine noise
hits them alike; each round reports the median step times, and the ratios over the rounds
are printed with their spread (``compiled / uncompiled`` autopar: < 1 is the compiler's
gain; ``compiled / torch.compile``: < 1 beats the compiled torch peer). Compile times (first
call, once per program) are printed too. Rows on several processes (dp2 vs DDP + compile,
tp2 vs DTensor + compile, ZeRO-3 vs FSDP2 + compile) come with compiled collectives.
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


def _steps(layers: int, width: int, batch: int, seq: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=seq, n_layer=layers, n_head=4,
                          n_embd=width))
    models = {name: copy.deepcopy(model) for name in ("autopar", "compiled", "eager", "torch")}
    x = torch.randint(0, 128, (batch, seq))
    y = torch.randint(0, 128, (batch, seq))
    steps = {}
    for name in ("autopar", "compiled"):
        strategy = ap.Strategy(compile={"enable": name == "compiled"})
        engine = ap.Engine(models[name], lm_loss,
                           torch.optim.AdamW(models[name].parameters(), lr=1e-3),
                           strategy=strategy)
        steps[name] = lambda engine=engine: engine.train_step(x, y)
    for name in ("eager", "torch"):
        optimizer = torch.optim.AdamW(models[name].parameters(), lr=1e-3)

        def step(model=models[name], optimizer=optimizer):
            optimizer.zero_grad()
            lm_loss(model(x), y).backward()
            optimizer.step()
        steps[name] = torch.compile(step) if name == "torch" else step
    return steps


def main(rounds: int = 3, steps: int = 20, layers: int = 4, width: int = 128, batch: int = 8,
         seq: int = 64) -> None:
    run = _steps(layers, width, batch, seq)
    first = {name: _timed(fn) for name, fn in run.items()}     # the compiles happen here
    print(f"GPT {layers}x{width}, batch {batch}x{seq}, AdamW, {torch.get_num_threads()} "
          f"threads; first step (compile): autopar compiled {first['compiled']:.1f} s, "
          f"torch.compile {first['torch']:.1f} s")
    ratios = {"compiled / uncompiled autopar": [], "compiled autopar / torch.compile": [],
              "torch.compile / eager": []}
    for r in range(rounds):
        times = {name: [] for name in run}
        for _ in range(steps):
            for name, fn in run.items():
                times[name].append(_timed(fn))
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"round {r + 1}: median step ms " + ", ".join(
            f"{name} {value * 1e3:.2f}" for name, value in med.items()))
        ratios["compiled / uncompiled autopar"].append(med["compiled"] / med["autopar"])
        ratios["compiled autopar / torch.compile"].append(med["compiled"] / med["torch"])
        ratios["torch.compile / eager"].append(med["torch"] / med["eager"])
    for name, values in ratios.items():
        print(f"{name}: {statistics.median(values):.3f} (rounds {min(values):.3f}-"
              f"{max(values):.3f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    main(args.rounds, args.steps, args.layers, args.width, args.batch)
