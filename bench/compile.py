"""Compiled autopar (``compile: {enable: true}``) vs uncompiled autopar vs eager torch vs
``torch.compile`` of the whole eager training step, one device, same run.

The four steps of the same GPT (same init, same batch) are interleaved, so machine noise
hits them alike; each round reports the median step times, and the ratios over the rounds
are printed with their spread (``compiled / uncompiled`` autopar: < 1 is the compiler's
gain; ``compiled / torch.compile``: < 1 beats the compiled torch peer). Compile times (first
call, once per program) are printed too. Rows on several processes come from the paired
benchmarks with ``--compile`` (``make bench`` runs them): ``bench/dp_vs_ddp.py`` (dp2 vs
DDP + torch.compile), ``bench/tp_vs_dtensor.py`` (tp2 vs DTensor + torch.compile),
``bench/zero_vs_fsdp2.py`` (ZeRO-3 vs FSDP2 with compiled blocks).

Memory (``--memory``, in a child process whose allocator returns freed blocks to the
system, ``MALLOC_MMAP_THRESHOLD_``, so resident memory follows live tensors): each step's
peak resident bytes above those before it (Linux's high-water mark, reset before the
step), after warm-up: uncompiled and compiled autopar, eager and torch.compile, and
compiled autopar with full recompute of the blocks next to uncompiled (Inductor must not
merge the recomputed ops back into their originals).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


RECOMPUTE = {"recompute": {"enable": True, "modules": ["blocks.*"], "policy": "full"}}
AUTOPAR = {"autopar": {}, "compiled": {"compile": {"enable": True}},
           "autopar recompute": RECOMPUTE,
           "compiled recompute": {**RECOMPUTE, "compile": {"enable": True}}}


def _steps(layers: int, width: int, batch: int, seq: int,
           names: tuple[str, ...] = ("autopar", "compiled", "eager", "torch")) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=seq, n_layer=layers, n_head=4,
                          n_embd=width))
    models = {name: copy.deepcopy(model) for name in names}
    x = torch.randint(0, 128, (batch, seq))
    y = torch.randint(0, 128, (batch, seq))
    steps = {}
    for name in (n for n in names if n in AUTOPAR):
        strategy = ap.Strategy(**AUTOPAR[name])
        engine = ap.Engine(models[name], lm_loss,
                           torch.optim.AdamW(models[name].parameters(), lr=1e-3),
                           strategy=strategy)
        steps[name] = lambda engine=engine: engine.train_step(x, y)
    for name in (n for n in names if n in ("eager", "torch")):
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
    for name, values in ratios.items() if rounds else ():
        print(f"{name}: {statistics.median(values):.3f} (rounds {min(values):.3f}-"
              f"{max(values):.3f})")


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _peak_bytes(fn) -> int:
    """Resident bytes ``fn`` reached above what was resident before it (Linux)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")                   # resets the high-water mark to what is resident
    before = _kib("VmRSS")
    fn()
    return (_kib("VmHWM") - before) * 1024


def memory(layers: int, width: int, batch: int, seq: int) -> None:
    """Each step's peak bytes above the state, after warm-up (the child process's part)."""
    names = ("autopar", "compiled", "eager", "torch", "autopar recompute",
             "compiled recompute")
    run = _steps(layers, width, batch, seq, names)
    for fn in run.values():
        fn(), fn()                        # compile, and a learning-rate-free warm step
    peaks = {name: statistics.median(_peak_bytes(fn) for _ in range(3))
             for name, fn in run.items()}
    print(f"GPT {layers}x{width}, batch {batch}x{seq}: step peak MiB above the state "
          "(median of 3): " + ", ".join(f"{n} {b / 2**20:.1f}" for n, b in peaks.items()))
    print(f"compiled / uncompiled autopar peak: {peaks['compiled'] / peaks['autopar']:.2f}; "
          f"recompute / none, compiled: "
          f"{peaks['compiled recompute'] / peaks['compiled']:.2f}, uncompiled: "
          f"{peaks['autopar recompute'] / peaks['autopar']:.2f}")


def _memory_child(args: argparse.Namespace) -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    subprocess.run([sys.executable, __file__, "--memory-child", "--layers", str(args.layers),
                    "--width", str(args.width), "--batch", str(args.batch),
                    "--seq", str(args.seq)], env=env, check=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--memory", action="store_true", help="peak memory rows too")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory(args.layers, args.width, args.batch, args.seq)
    else:
        main(args.rounds, args.steps, args.layers, args.width, args.batch, args.seq)
        if args.memory:
            _memory_child(args)
