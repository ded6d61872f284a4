"""autopar mixed precision vs eager torch: training step time of the same GPT on one device,
bf16 O1 and O2 next to fp32, each paired with its eager twin in one run.

Eager twins: fp32 is the plain loop; O1 runs forward and loss under ``torch.autocast``; O2
runs the model on bf16 copies of its fp32 parameters (``functional_call``), the output back
in fp32 for the loss (what autopar's O2 captures). Steps alternate between all six (same
model init, same batches), so machine noise hits each alike; per mode the median step times
and their ratio autopar/eager are printed (< 1: autopar is faster), and the precision's own
cost next to fp32 on each side, then autopar's planned peak activation bytes per precision
(``engine.cost``). Before timing, each pair is checked to train alike (the first step's
loss equal).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

BF16 = torch.bfloat16


def eager_loss(level: str | None) -> Callable:
    """The eager forward + loss of a precision level (None: fp32)."""
    def fp32(model, x, y):
        return lm_loss(model(x), y)

    def o1(model, x, y):
        with torch.autocast(x.device.type, dtype=BF16):
            return lm_loss(model(x), y)

    def o2(model, x, y):
        half = {name: p.to(BF16) for name, p in model.named_parameters()}
        return lm_loss(torch.func.functional_call(model, half, (x,)).float(), y)

    return {None: fp32, "O1": o1, "O2": o2}[level]


def pair(model: torch.nn.Module, level: str | None, x: torch.Tensor, y: torch.Tensor
         ) -> tuple[ap.Engine, Callable[[], float]]:
    """(autopar's engine, eager step) for ``level``, each on its own copy of ``model``."""
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    strategy = ap.Strategy(amp={"enable": True, "level": level}) if level else ap.Strategy()
    engine = ap.Engine(ours, lm_loss, torch.optim.AdamW(ours.parameters(), lr=1e-3),
                       strategy=strategy)
    optimizer, forward = torch.optim.AdamW(ref.parameters(), lr=1e-3), eager_loss(level)

    def eager_step() -> float:
        optimizer.zero_grad()
        loss = forward(ref, x, y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return engine, eager_step


def _timed(fn: Callable[[], float]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(steps: int = 20, warmup: int = 3, batch: int = 8, layers: int = 4, width: int = 128,
         seq: int = 64) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=seq, n_layer=layers, n_head=4,
                          n_embd=width))
    x = torch.randint(0, 128, (batch, seq))
    y = torch.randint(0, 128, (batch, seq))
    levels = (None, "O1", "O2")
    engines, pairs = {}, {}
    for level in levels:
        engines[level], eager_step = pair(model, level, x, y)
        pairs[level] = (lambda e=engines[level]: e.train_step(x, y)), eager_step
    for level, (ours, theirs) in pairs.items():
        first = ours(), theirs()
        if first[0] != first[1]:
            raise AssertionError(f"{level or 'fp32'}: autopar's first loss {first[0]} is not "
                                 f"eager's {first[1]}")
    times = {(level, side): [] for level in levels for side in ("autopar", "eager")}
    for i in range(warmup + steps):
        for level, (ours, theirs) in pairs.items():
            a, b = _timed(ours), _timed(theirs)
            if i >= warmup:
                times[level, "autopar"].append(a)
                times[level, "eager"].append(b)
    median = {key: statistics.median(v) for key, v in times.items()}
    print(f"GPT {layers}x{width}, batch {batch}x{seq}, AdamW, one device, "
          f"{torch.get_num_threads()} threads, median of {steps} steps")
    ratios = {}
    for level in levels:
        name = level or "fp32"
        ratios[name] = median[level, "autopar"] / median[level, "eager"]
        print(f"{name:5} autopar {median[level, 'autopar'] * 1e3:8.2f} ms  eager "
              f"{median[level, 'eager'] * 1e3:8.2f} ms  autopar/eager {ratios[name]:.3f}  "
              f"vs fp32: autopar {median[level, 'autopar'] / median[None, 'autopar']:.2f}x, "
              f"eager {median[level, 'eager'] / median[None, 'eager']:.2f}x")
    for level in levels:
        cost = engines[level].cost(x, y)[0]
        print(f"{level or 'fp32':5} planned peak activations {cost.activations / 2**20:7.2f} MiB, "
              f"peak {cost.peak / 2**20:7.2f} MiB")
    return ratios


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    main(steps=args.steps, batch=args.batch, layers=args.layers, width=args.width)
