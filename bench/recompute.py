"""Activation recompute: peak activation bytes and step time of an 8-layer GPT with full
recompute of ``blocks.*``, against the same plan without, next to eager torch with and
without ``torch.utils.checkpoint`` on the same blocks.

    .venv/bin/python bench/recompute.py [--layers 8] [--width 128] [--batch 8] [--seq 128]
                                        [--steps 20]

Memory (one device, simulated op by op under ``runtime.memory_meter.MemoryMeter``): the measured
peak of live bytes other than the state (parameters, AdamW state): activations and the
gradients in flight at the peak; and the plan's own estimate (``engine.cost``,
``activations``). Target: full recompute holds <= 0.4x of the activations without.

Time: four steps alternate (autopar with / without recompute, eager with / without
checkpoint; warm-up first, same init, same batches, dropout 0.1), and the ratio of median
step times is printed for each pair: the price of recomputing, autopar's next to eager's.
Before timing, autopar with recompute and without must give equal losses (bit for bit).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.runtime.memory_meter import meter_step

RECOMPUTE = "recompute: {enable: true, modules: ['blocks.*'], policy: full}\n"


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    return parser.parse_args(argv)


def gpt(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                         n_head=4, n_embd=args.width, dropout=0.1))


def engine(model: GPT, recompute: bool) -> ap.Engine:
    text = RECOMPUTE if recompute else ""
    return ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     strategy=ap.Strategy.from_yaml_str(text))


def activations(args, x, y, recompute: bool) -> tuple[int, int]:
    """(measured, planned) peak bytes of live values other than the state."""
    eng = engine(gpt(args), recompute)
    planned = eng.cost(x, y)[0].activations
    eng.train_step(x, y)                            # the optimizer state exists from here on
    step = eng.planner.plan("train", x, y)
    meter = meter_step(step.lowered, eng._feeds(x, y, "train"), dict(eng.state.tensors))
    held = meter.held()[0]
    state = held["params"] + held["optimizer_state"] + held["buffers"]
    return meter.peaks()[0] - state, planned


class Eager:
    """One eager training step of a GPT, its blocks under ``checkpoint`` or not."""

    def __init__(self, model: GPT, checkpointed: bool):
        self.model, self.checkpointed = model, checkpointed
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.wte(idx) + m.wpe(torch.arange(idx.size(1)))
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return m.head(m.ln_f(x))

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = lm_loss(self.forward(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def timed(step, x, y) -> float:
    start = time.perf_counter()
    step(x, y)
    return time.perf_counter() - start


def main() -> None:
    args = _args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    print(f"GPT {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, "
          "dropout 0.1, AdamW, full recompute of blocks.*")

    (off, plan_off), (on, plan_on) = (activations(args, x, y, r) for r in (False, True))
    fits = on <= 0.4 * off
    print(f"peak activation bytes, measured: {off / 2**20:.2f} MiB without, "
          f"{on / 2**20:.2f} MiB with recompute: {on / off:.3f}x (target <= 0.4x: "
          f"{'yes' if fits else 'NO'})")
    print(f"peak activation bytes, planned:  {plan_off / 2**20:.2f} MiB without, "
          f"{plan_on / 2**20:.2f} MiB with: {plan_on / plan_off:.3f}x")

    base = gpt(args)
    sides = {"autopar": engine(copy.deepcopy(base), False).train_step,
             "autopar recompute": engine(copy.deepcopy(base), True).train_step,
             "eager": Eager(copy.deepcopy(base), False).train_step,
             "eager checkpoint": Eager(copy.deepcopy(base), True).train_step}
    plain = [sides["autopar"](x, y) for _ in range(3)]
    again = [sides["autopar recompute"](x, y) for _ in range(3)]
    if plain != again:
        raise SystemExit(f"autopar with and without recompute differ: {plain} vs {again}")
    for step in ("eager", "eager checkpoint"):
        sides[step](x, y)                                  # warm-up
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.steps):
        for name, step in sides.items():
            times[name].append(timed(step, x, y))
    median = {k: statistics.median(v) for k, v in times.items()}
    for name, t in median.items():
        print(f"  {name:<18} median step {t * 1e3:8.1f} ms")
    print(f"step time overhead: autopar recompute / no recompute = "
          f"{median['autopar recompute'] / median['autopar']:.3f}; eager checkpoint / no "
          f"checkpoint = {median['eager checkpoint'] / median['eager']:.3f}")


if __name__ == "__main__":
    main()
