"""autopar's per-step overhead on a tiny MLP (one device): what ``Engine.train_step`` costs
beyond its generated step function (the program's kernels, one Python line each), next to
eager torch's whole step on the same model.

    .venv/bin/python bench/overhead.py [--steps 2000] [--profile]

The MLP (16 -> 32 -> 32 -> 1, batch 8, SGD with momentum) is small enough that its kernels
take microseconds, so the step time is almost all framework: eager's autograd engine and
optimizer loop, autopar's engine (feeds, the state handed to the step function and taken
back, the result) around its generated function. Steps alternate between the two (same
init, same batch) and the medians are printed: autopar's step, its generated function, the
difference (the engine's overhead; goal <= 50 us), and eager's step. ``--profile`` prints
cProfile's top entries of the engine's side of a step.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time

import torch

import autopar as ap


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 1))


def main(steps: int, profile: bool) -> None:
    torch.set_num_threads(1)
    model = _mlp()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    loss_fn = torch.nn.functional.mse_loss
    engine = ap.Engine(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)

    def eager_step() -> float:
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        return loss.item()

    for _ in range(3):
        ours, theirs = engine.train_step(x, y), eager_step()
        assert abs(ours - theirs) <= 1e-5 * abs(theirs) + 1e-7, (ours, theirs)
    executor = engine.planner.plan("train", x, y).executor
    inner = executor.fn
    fn_times: list[float] = []

    def timed_fn(*args):
        start = time.perf_counter()
        out = inner(*args)
        fn_times.append(time.perf_counter() - start)
        return out

    walls, eager = [], []
    executor.fn = timed_fn
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.train_step(x, y)
            walls.append(time.perf_counter() - start)
            start = time.perf_counter()
            eager_step()
            eager.append(time.perf_counter() - start)
    finally:
        executor.fn = inner
    wall, fn = statistics.median(walls), statistics.median(fn_times)
    print(f"tiny MLP 16-32-32-1, batch 8, SGD momentum, {steps} interleaved steps, 1 thread")
    print(f"autopar step            {wall * 1e6:8.1f} us")
    print(f"  generated function    {fn * 1e6:8.1f} us")
    print(f"  engine overhead       {(wall - fn) * 1e6:8.1f} us  (goal <= 50 us)")
    print(f"eager step              {statistics.median(eager) * 1e6:8.1f} us")
    print(f"ratio autopar/eager: {wall / statistics.median(eager):.3f}")
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            engine.train_step(x, y)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    main(args.steps, args.profile)
