"""Shared plumbing for the distributed benchmarks (``dp_vs_ddp.py``, ``tp_vs_dtensor.py``).

``launch`` re-runs the calling script as ``world`` processes with torchrun's environment on
a free loopback port (gloo, one thread per rank: the benchmarks compare runtimes, not
kernels, and the ranks share the machine's cores). Rank 0 prints; any rank that fails stops
the others and its output is shown. ``paired`` interleaves the steps of autopar and its
torch baseline in the same processes, as ``bench/serial.py`` does on one device.

A distributed step is as slow as its slowest rank, so each step's time is the largest over
the ranks, and every step starts from a barrier, so a rank's wait for a late peer is never
booked against the next step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.ir import StateKind
from autopar.runtime.spawn import free_port, rank_env, wait_ranks

ROOT = Path(__file__).resolve().parent.parent


def in_rank() -> bool:
    """Whether this process is one of the launched ranks (torchrun's environment is set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(script: str, argv: Sequence[str], world: int = 2, timeout: float = 900) -> int:
    """Run ``script argv`` on ``world`` local ranks; returns 0 when every rank succeeded."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(world)]
        procs = []
        for r in range(world):
            # c10d's deprecation notices would bury the figures
            env = rank_env(r, world, port, PYTHONWARNINGS="ignore::FutureWarning")
            out = subprocess.PIPE if r == 0 else logs[r]     # rank 0 prints, filtered
            procs.append(subprocess.Popen([sys.executable, script, *argv], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, text=True))
        relay = threading.Thread(target=_relay, args=(procs[0].stdout,), daemon=True)
        relay.start()
        failure = wait_ranks(procs, timeout)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        relay.join(timeout=5)
        if failure:
            print(f"{Path(script).name} on {world} ranks: {failure}", file=sys.stderr)
            for r, log in enumerate(logs[1:], start=1):
                log.seek(0)
                print(f"--- rank {r} ---\n{log.read()[-3000:]}", file=sys.stderr)
        for log in logs:
            log.close()
        return 1 if failure else 0


def _relay(stream) -> None:
    """Rank 0's output to this terminal, without the profiler's start/stop notices."""
    for line in stream:
        if not line.startswith("USDT:"):
            print(line, end="", flush=True)


def gpt_arguments(doc: str) -> argparse.ArgumentParser:
    """The options both distributed benchmarks take: the GPT, the batch, the steps."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="autopar with compile: {enable: true}, the torch peer under "
                             "torch.compile (its usual recipe); compile times printed")
    return parser


def gpt_and_batch(args: argparse.Namespace, **config) -> tuple:
    """The distributed benchmarks' GPT (``--layers``, ``--width``, ``--seq``; seed 0;
    ``config``: more ``GPTConfig`` fields) and one global batch of token ids (inputs,
    labels) of ``--batch`` rows."""
    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=args.seq, n_layer=args.layers, n_head=4,
                    n_embd=args.width, **config)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    return model, x, y


def compiled_strategy(strategy, compile: bool):
    """``strategy`` with ``compile: {enable: true}`` when ``compile``."""
    if not compile:
        return strategy
    import autopar as ap
    return strategy.model_copy(update={"compile": ap.Strategy(compile={"enable": True}).compile})


def first_steps(steps: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each side's first step alone (where a compiled one compiles), in seconds."""
    times = {}
    for name, step in steps.items():
        dist.barrier()
        times[name] = _timed(step)
    return times


def main(script: str, rank_main: Callable[[], object], world: int = 2) -> None:
    """A benchmark script's entry: as a launched rank, run; otherwise launch ``world``
    ranks."""
    if in_rank():
        rank_main()
    else:
        sys.exit(launch(script, sys.argv[1:], world))


def init() -> tuple[int, int]:
    """Join the launch's gloo group (the baselines need it before autopar's first step)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(steps: dict[str, Callable[[], object]], measured: int, warmup: int
           ) -> dict[str, list[float]]:
    """Each step function run ``warmup + measured`` times, interleaved; the measured
    seconds of each step, the largest over the ranks."""
    times = {name: [] for name in steps}
    for i in range(warmup + measured):
        for name, fn in steps.items():
            t = _timed(fn)
            if i >= warmup:
                times[name].append(t)
    for name, ts in times.items():
        worst = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        times[name] = worst.tolist()
    return times


def report(times: dict[str, list[float]], ours: str, theirs: str) -> float:
    """Print each median step time and the ratio ``ours / theirs``; returns the ratio."""
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    width = max(len(n) for n in medians)
    for name, m in medians.items():
        spread = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else [m, m, m]
        print(f"{name:<{width}} median step {m * 1e3:8.2f} ms  "
              f"(quartiles {spread[0] * 1e3:.2f} .. {spread[2] * 1e3:.2f})")
    ratio = medians[ours] / medians[theirs]
    print(f"ratio {ours}/{theirs}: {ratio:.3f}")
    return ratio


def state_bytes(tensors) -> int:
    """Bytes held by the tensors (None entries, states not created yet, count nothing;
    a DTensor counts its local piece)."""
    return sum(t.numel() * t.element_size() for t in map(local, tensors)
               if isinstance(t, torch.Tensor))


def local(t):
    """A DTensor's local piece; any other value as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def held_state(engine, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ours: str,
               baselines: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
               ) -> dict[str, dict[str, int]]:
    """Bytes of parameters and of optimizer state kept between steps: one device's
    (``model``, ``optimizer``: the eager twin), autopar's pieces on this rank (``engine``,
    named ``ours``) and each baseline's (model, optimizer) on this rank, the largest over
    the ranks (a collective)."""
    params = {n for n, _ in model.named_parameters()}
    pieces = engine.runtime.state.tensors
    sides = {"serial (one device)": (model, optimizer), **baselines}
    figures = {name: (state_bytes(m.parameters()),
                      state_bytes(v for s in opt.state.values() for v in s.values()))
               for name, (m, opt) in sides.items()}
    keys = {n: piece.key for n, piece in engine.runtime.state.pieces.items()}
    figures[ours] = (state_bytes(t for n, t in pieces.items() if n in params),
                     state_bytes(t for n, t in pieces.items()
                                 if keys[n].kind is StateKind.OPTIM))
    out = {}
    for name in [*list(sides)[:1], ours, *baselines]:
        worst = torch.tensor(figures[name], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = {"params": int(worst[0]), "optimizer": int(worst[1])}
    return out


def print_held_state(memory: dict[str, dict[str, int]], world: int) -> None:
    """``held_state``'s figures, each as a share of one device's."""
    serial = sum(memory["serial (one device)"].values())
    width = max(len(name) for name in memory)
    print(f"parameter + AdamW state bytes between steps (largest rank of {world}):")
    for name, m in memory.items():
        total = m["params"] + m["optimizer"]
        print(f"  {name:<{width}} params {m['params'] / 2**20:7.3f} MiB + optimizer "
              f"{m['optimizer'] / 2**20:7.3f} MiB = {total / 2**20:7.3f} MiB "
              f"({total / serial:.0%} of serial)")


def finish() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
