"""autopar data parallel vs torch DistributedDataParallel: training step time of the same
GPT on 2 gloo ranks, paired in one run.

    .venv/bin/python bench/dp_vs_ddp.py [--steps 30] [--profile]

The script launches its own ranks (torchrun's environment on a free loopback port, one
thread each). autopar runs ``configs/dp.yaml`` through ``Engine.train_step`` on the global
batch (the engine cuts this rank's half); DDP runs a copy of the same model with the same
AdamW on the rank's half. Both start from the same init; their losses are checked equal
for a few steps before timing, then the steps alternate (warm-up first) and rank 0 prints
the median step times (each step: the slowest rank) and the ratio autopar/DDP (< 1 means
autopar is faster). ``--bucket-mb`` overrides the yaml's gradient bucket size (DDP keeps
its defaults); ``--profile`` adds where autopar's step and DDP's spend their time
(``bench/profile_step.py``). ``--compile``: autopar with ``compile: {enable: true}`` (forward,
backward, update and the bucketed all-reduces in one Inductor graph) vs
``torch.compile(DDP(model))`` (DDP's own recipe: Dynamo's DDPOptimizer cuts the graph at the
buckets).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import (  # noqa: E402
    ROOT,
    compiled_strategy,
    finish,
    first_steps,
    gpt_and_batch,
    gpt_arguments,
    init,
    main,
    paired,
    report,
)

import autopar as ap  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

CHECKED_STEPS = 3


def _args(argv=None) -> argparse.Namespace:
    parser = gpt_arguments(__doc__)
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="data_parallel.bucket_mb for autopar (default: configs/dp.yaml's)")
    return parser.parse_args(argv)


def strategy(bucket_mb: float | None) -> ap.Strategy:
    """``configs/dp.yaml``, with its gradient bucket size replaced when one is given."""
    config = yaml.safe_load((ROOT / "configs" / "dp.yaml").read_text())
    if bucket_mb is not None:
        config.setdefault("data_parallel", {})["bucket_mb"] = bucket_mb
    return ap.Strategy(**config)


def rank_main(args: argparse.Namespace) -> None:
    rank, world = init()
    model, x, y = gpt_and_batch(args)
    ref = copy.deepcopy(model)
    rows = slice(*(rank * args.batch // world, (rank + 1) * args.batch // world))

    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=compiled_strategy(strategy(args.bucket_mb), args.compile))
    ddp = DistributedDataParallel(ref)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    forward = torch.compile(ddp) if args.compile else ddp

    def ddp_step() -> torch.Tensor:
        ddp_opt.zero_grad()
        loss = lm_loss(forward(x[rows]), y[rows])
        loss.backward()
        ddp_opt.step()
        return loss.detach()

    def autopar_step() -> float:
        return engine.train_step(x, y)

    first = first_steps({"autopar": autopar_step, "DDP": ddp_step})
    _check_losses(autopar_step, ddp_step, world)
    times = paired({"autopar": autopar_step, "DDP": ddp_step}, args.steps, args.warmup)
    if rank == 0:
        print(f"GPT {args.layers}x{args.width}, global batch {args.batch}x{args.seq}, AdamW, "
              f"data parallel on {world} gloo ranks, {torch.get_num_threads()} thread(s) each, "
              f"autopar bucket_mb {engine.strategy.data_parallel.bucket_mb:g}"
              + (f"; compiled both (first step: autopar {first['autopar']:.1f} s, DDP + "
                 f"torch.compile {first['DDP']:.1f} s)" if args.compile else ""))
        report(times, "autopar", "DDP")
    if args.profile:
        from profile_step import profile_pair
        profile_pair(engine, autopar_step, "DDP", ddp_step, rank)
    finish()


def _check_losses(ours, theirs, world: int) -> None:
    """The two runs train the same model alike: global-batch losses equal step for step
    (fp32, rtol 1e-5, as the parity tests), so the timing compares equal work."""
    for step in range(CHECKED_STEPS):
        a = torch.tensor(ours())
        b = theirs()
        dist.all_reduce(b, op=dist.ReduceOp.AVG)      # DDP's loss is the rank's half
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"step {step}: autopar loss {a.item():.6f} != DDP loss "
                                 f"{b.item():.6f} (global-batch mean over {world} ranks)")


if __name__ == "__main__":
    main(__file__, lambda: rank_main(_args()))
