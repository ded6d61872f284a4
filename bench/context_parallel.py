"""Context parallelism: activation bytes per rank of a long-sequence GPT, serial against
``context_parallel: {axis: cp, method: allgather | ring}`` on cp2 and cp4 (the simulator),
planned (``Engine.cost``) and measured (the runtime's meter over one simulated step,
``runtime.memory_meter``).

    .venv/bin/python bench/context_parallel.py [--seq 4096] [--width 64] [--layers 2]

Each rank holds its chunk of the sequence of every activation; attention gathers the keys
and values (the ``allgather`` method), so a rank also holds the whole keys and values of
the layer it computes: the target is about 1/cp of serial's activations plus that. Ring
attention passes one chunk of the keys and values at a time, so no rank ever holds more
than two chunks of them (its own and the one in flight).
"""
from __future__ import annotations

import argparse

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.runtime.memory_meter import measure_step

MIB = 2 ** 20


def _engine(args: argparse.Namespace, cp: int, method: str) -> tuple[ap.Engine, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=args.seq, n_layer=args.layers,
                          n_head=4, n_embd=args.width, sdpa=True))
    text = "{}" if cp == 1 else (f"mesh: {{shape: [{cp}], dim_names: [cp]}}\n"
                                 f"context_parallel: {{axis: cp, method: {method}}}\n"
                                 "debug: {simulate: true}\n")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                       strategy=ap.Strategy.from_yaml_str(text))
    x = torch.randint(0, 128, (args.batch, args.seq))
    return engine, x


def _measure(args: argparse.Namespace, cp: int, method: str) -> tuple[float, float, float]:
    """(planned activation MiB per rank, planned peak MiB, measured peak MiB) of the
    largest rank."""
    engine, x = _engine(args, cp, method)
    engine.train_step(x, x)
    planned = engine.cost(x, x)
    step = engine.planner.plan("train", x, x)
    measured = measure_step(step.lowered, engine._feeds(x, x, "train"),
                            dict(engine.state.tensors))
    worst = max(planned.values(), key=lambda e: e.peak)
    return worst.activations / MIB, worst.peak / MIB, max(measured.values()) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(f"GPT {args.layers} x {args.width}, 4 heads, batch {args.batch} x seq {args.seq}, "
          "AdamW; per rank, the largest:")
    print(f"{'layout':>14} {'activations':>12} {'/ serial':>9} {'peak (plan)':>12} "
          f"{'peak (measured)':>16}")
    serial = None
    for cp, method in ((1, ""), (2, "allgather"), (2, "ring"), (4, "allgather"), (4, "ring")):
        activations, peak, measured = _measure(args, cp, method)
        serial = serial or activations
        name = "serial" if cp == 1 else f"cp{cp} {method}"
        print(f"{name:>14} {activations:>10.1f}Mi {activations / serial:>9.2f} "
              f"{peak:>10.1f}Mi {measured:>14.1f}Mi")


if __name__ == "__main__":
    main()
