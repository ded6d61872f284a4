"""autopar ZeRO-3 vs FSDP2 (``torch.distributed.fsdp.fully_shard``): training step time of
the same GPT on 2 gloo ranks (data parallel, parameters, gradients and optimizer state
sharded over both), paired in one run, and each rank's parameter + optimizer bytes.

    .venv/bin/python bench/zero_vs_fsdp2.py [--steps 30] [--profile]

The script launches its own ranks (torchrun's environment on a free loopback port, one
thread each). autopar runs ``configs/dp.yaml`` with ``sharding: {stage: 3, axis: dp}``
through ``Engine.train_step`` on the global batch (the engine cuts this rank's half); FSDP2
wraps a copy of the same model, ``fully_shard`` on each transformer block and then on the
root (FSDP's usual wrapping: the embeddings, the final norm and the tied head in the root's
group), with the same AdamW, and trains on the rank's half of the same batch (gradients
averaged over the ranks, FSDP2's default). Both start from the same init.

Before timing, both sides' global-batch losses (FSDP2's: the mean of the ranks' half-batch
losses) are checked equal to single-device eager torch on the whole batch for a few steps
(fp32, rtol 1e-5), so the comparison is between two correct implementations of the same
training. Then the steps alternate (warm-up first) and rank 0 prints the median step
times (each step from a barrier, its time the slowest rank's), the ratio autopar/FSDP2
(< 1 means autopar is faster) and the bytes of state each rank holds between steps.
``--profile`` adds where each side's step spends its time (``bench/profile_step.py``).
``--compile``: autopar with ``compile: {enable: true}`` vs FSDP2 with each block compiled
(torchtitan's recipe: ``block.compile()`` before ``fully_shard``).

``--hsdp``: 4 ranks on a 2-D mesh ``[rep, shard]`` of [2, 2]: autopar's
``data_parallel: {axis: [rep, shard]}`` + ``sharding: {stage: 3, axis: shard}`` vs FSDP2's
HSDP (``fully_shard(mesh=<2-D mesh>)``: sharded in a ``shard`` group, replicated across
the groups); each rank trains on its quarter of the batch.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import (  # noqa: E402
    ROOT,
    compiled_strategy,
    finish,
    first_steps,
    gpt_and_batch,
    gpt_arguments,
    held_state,
    init,
    main,
    paired,
    print_held_state,
    report,
)

import autopar as ap  # noqa: E402
from autopar.models import GPT  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

CHECKED_STEPS = 3
RTOL, ATOL = 1e-5, 1e-6


def _args(argv=None) -> argparse.Namespace:
    parser = gpt_arguments(__doc__)
    parser.add_argument("--hsdp", action="store_true",
                        help="4 ranks: HSDP on a [rep, shard] mesh against FSDP2's HSDP")
    return parser.parse_args(argv)


def strategy(hsdp: bool = False) -> ap.Strategy:
    """``configs/dp.yaml`` with ZeRO stage 3 over its dp axis; ``hsdp``:
    ``configs/hsdp.yaml`` (stage 3 over ``shard`` of a [rep, shard] mesh)."""
    if hsdp:
        return ap.Strategy.from_yaml(ROOT / "configs" / "hsdp.yaml")
    config = yaml.safe_load((ROOT / "configs" / "dp.yaml").read_text())
    config["sharding"] = {"stage": 3, "axis": "dp"}
    return ap.Strategy(**config)


def fsdp_model(model: GPT, compile: bool = False, hsdp: bool = False) -> GPT:
    """FSDP2 the usual way: each block its own group (compiled first, with ``compile``, as
    torchtitan does), then the root; ``hsdp``: on a 2-D [rep, shard] mesh of 2 x 2."""
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        where = "cuda" if next(model.parameters()).is_cuda else "cpu"
        mesh = init_device_mesh(where, (2, 2), mesh_dim_names=("rep", "shard"))
    for block in model.blocks:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rank_main(args: argparse.Namespace) -> None:
    rank, world = init()
    model, x, y = gpt_and_batch(args)
    eager, theirs = copy.deepcopy(model), fsdp_model(copy.deepcopy(model), args.compile,
                                                     args.hsdp)
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)

    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=compiled_strategy(strategy(args.hsdp), args.compile))
    fsdp_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)

    def fsdp_step() -> torch.Tensor:
        fsdp_opt.zero_grad()
        loss = lm_loss(theirs(x[rows]), y[rows])
        loss.backward()
        fsdp_opt.step()
        return loss.detach()

    def autopar_step() -> float:
        return engine.train_step(x, y)

    def eager_step() -> float:
        eager_opt.zero_grad()
        loss = lm_loss(eager(x), y)
        loss.backward()
        eager_opt.step()
        return loss.item()

    first = first_steps({"autopar": autopar_step, "FSDP2": fsdp_step})
    eager_step()
    _check_losses(autopar_step, fsdp_step, eager_step)
    times = paired({"autopar": autopar_step, "FSDP2": fsdp_step}, args.steps, args.warmup)
    memory = held_state(engine, eager, eager_opt, "autopar ZeRO-3, per rank",
                        {"FSDP2, per rank": (theirs, fsdp_opt)})
    if rank == 0:
        layout = "HSDP [rep 2, shard 2]" if args.hsdp else "ZeRO-3 / FSDP2"
        print(f"GPT {args.layers}x{args.width}, global batch {args.batch}x{args.seq}, AdamW, "
              f"{layout} on {world} gloo ranks, {torch.get_num_threads()} thread(s) each"
              + (f"; compiled both (first step: autopar {first['autopar']:.1f} s, FSDP2 + "
                 f"compiled blocks {first['FSDP2']:.1f} s)" if args.compile else ""))
        report(times, "autopar", "FSDP2")
        print_held_state(memory, world)
    if args.profile:
        from profile_step import profile_pair
        profile_pair(engine, autopar_step, "FSDP2", fsdp_step, rank)
    engine.close()
    finish()


def _check_losses(ours, theirs, eager) -> None:
    """Both sides' global-batch losses equal single-device eager's, step for step."""
    for step in range(CHECKED_STEPS):
        want = torch.tensor(eager())
        a = torch.tensor(ours())
        b = theirs()
        dist.all_reduce(b, op=dist.ReduceOp.AVG)      # FSDP2's loss is the rank's half
        for name, got in (("autopar", a), ("FSDP2", b)):
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                raise AssertionError(f"step {step}: {name} loss {got.item():.7f} != eager "
                                     f"{want.item():.7f}")


if __name__ == "__main__":
    main(__file__, lambda: rank_main(_args()), world=4 if "--hsdp" in sys.argv else 2)
