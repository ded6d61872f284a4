"""autopar ZeRO-1 and ZeRO-2 vs autopar's plain data parallel: training step time of the
same GPT on 2 gloo ranks, paired in one run (the goal: ZeRO-1/2 at data-parallel speed,
as DeepSpeed's and FSDP-style ZeRO-1/2 run at DDP's).

    .venv/bin/python bench/zero_vs_dp.py [--steps 30] [--world 2] [--profile]

The script launches its own ranks (one thread each). Each side is an engine on
``configs/dp.yaml`` (``sharding: {stage: 1 | 2, axis: dp}`` for the ZeRO sides) training a
copy of the same model with the same AdamW on the same global batch; their losses are
checked equal for a few steps (fp32, rtol 1e-5), then the steps alternate (warm-up first)
and rank 0 prints the median step times and the ratios ZeRO-k / dp (target <= 1.15).
``--profile`` adds where ZeRO-1's step and dp's spend their time.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import (  # noqa: E402,E501
    ROOT,
    compiled_strategy,
    finish,
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


def strategy(stage: int, world: int) -> ap.Strategy:
    """``configs/dp.yaml`` over ``world`` ranks, with ZeRO ``stage`` over its dp axis (0:
    none)."""
    config = yaml.safe_load((ROOT / "configs" / "dp.yaml").read_text())
    config["mesh"]["shape"] = [world]
    if stage:
        config["sharding"] = {"stage": stage, "axis": "dp"}
    return ap.Strategy(**config)


def rank_main(args: argparse.Namespace) -> None:
    rank, world = init()
    model, x, y = gpt_and_batch(args)
    steps, engines = {}, {}
    for name, stage in (("dp", 0), ("ZeRO-1", 1), ("ZeRO-2", 2)):
        mine = copy.deepcopy(model)
        engine = ap.Engine(mine, lm_loss, torch.optim.AdamW(mine.parameters(), lr=1e-3),
                           strategy=compiled_strategy(strategy(stage, world), args.compile))
        steps[name] = lambda engine=engine: engine.train_step(x, y)
        engines[name] = engine
    for step in range(CHECKED_STEPS):
        losses = {name: fn() for name, fn in steps.items()}
        if not all(abs(v - losses["dp"]) <= 1e-5 * abs(losses["dp"]) + 1e-6
                   for v in losses.values()):
            raise AssertionError(f"step {step}: losses differ: {losses}")
    times = paired(steps, args.steps, args.warmup)
    if rank == 0:
        print(f"GPT {args.layers}x{args.width}, global batch {args.batch}x{args.seq}, AdamW, "
              f"data parallel on {world} gloo ranks, {torch.get_num_threads()} thread(s) each"
              + (", compiled" if args.compile else ""))
        report({"ZeRO-1": times["ZeRO-1"], "dp": times["dp"]}, "ZeRO-1", "dp")
        report({"ZeRO-2": times["ZeRO-2"], "dp": times["dp"]}, "ZeRO-2", "dp")
    if args.profile:
        from profile_step import profile_pair
        profile_pair(engines["ZeRO-1"], steps["ZeRO-1"], "dp", steps["dp"], rank)
    finish()


def arguments() -> argparse.Namespace:
    parser = gpt_arguments(__doc__)
    parser.add_argument("--world", type=int, default=2, help="data-parallel ranks")
    return parser.parse_args()


if __name__ == "__main__":
    main(__file__, lambda: rank_main(arguments()), world=arguments().world)
