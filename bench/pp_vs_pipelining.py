"""autopar pipeline parallel (1F1B) vs ``torch.distributed.pipelining.Schedule1F1B``: training
step time of the same GPT, cut at the same layer, on 2 gloo ranks, paired in one run.

    .venv/bin/python bench/pp_vs_pipelining.py [--steps 30] [--micro-batches 4]

The script launches its own ranks (torchrun's environment on a free loopback port, one
thread each). Both sides cut the GPT before block L/2: stage 0 is the embeddings and the
first half of the blocks, stage 1 the second half, ``ln_f``, the head and the loss. autopar
runs ``mesh: [2] pp``, ``pipeline: {schedule: 1F1B, split: [blocks.<L/2>]}`` through
``Engine.train_step`` on the global batch; torch wraps this rank's stage (an ``nn.Module``
holding the same submodules) in ``PipelineStage`` and ``Schedule1F1B`` with the same number
of micro-batches (``return_outputs=False``: like ``train_step``, the step keeps only the
losses, not the logits). Both use AdamW and start from the same init.

The GPT is built with ``tie_weights=False`` on both sides: tied, ``head.weight`` is
``wte.weight``, a weight of both stages, which autopar keeps on both and updates alike while
two hand-built torch stages would each train their own copy: not the same model.

torch's schedule takes each micro-batch's mean loss and scales the summed gradients by 1/m
(``scale_grads=True``), and the bench averages the m losses it reports; autopar computes the
global batch's mean. With equal micro-batches and no ignored labels the two are the same,
so before timing the losses of a few steps are checked equal (fp32, rtol 1e-5; a mismatch
is printed, and the timing still runs). Then the steps alternate (warm-up first) and rank 0
prints the median step times (each step from a barrier, its time the slowest rank's), the
ratio autopar/torch (< 1 means autopar is faster), and the peak activation bytes each
pipeline rank of autopar held in its last step.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import finish, gpt_arguments, init, main, paired, report  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

CHECKED_STEPS = 3
RTOL, ATOL = 1e-5, 1e-6


def _args(argv=None) -> argparse.Namespace:
    parser = gpt_arguments(__doc__)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args(argv)
    if args.profile:        # bench/profile_step.py reads a non-pipelined rank program
        parser.error("--profile is not available for pipelined steps")
    if args.batch % args.micro_batches:
        parser.error(f"--batch {args.batch} does not split into {args.micro_batches} "
                     "equal micro-batches")
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: two stages need at least 2 layers")
    return args


def strategy(world: int, cut: int, micro_batches: int) -> ap.Strategy:
    """1F1B over ``world`` ranks, the second stage beginning at block ``cut``."""
    return ap.Strategy(mesh={"shape": [world], "dim_names": ["pp"]},
                       pipeline={"axis": "pp", "schedule": "1F1B",
                                 "micro_batches": micro_batches, "split": [f"blocks.{cut}"]})


class Stage(nn.Module):
    """The GPT's layers of one of two stages, by hand: stage 0 embeds tokens and runs
    ``blocks[:cut]``; stage 1 runs ``blocks[cut:]``, ``ln_f`` and the head."""

    def __init__(self, gpt: GPT, index: int, cut: int):
        super().__init__()
        self.first = index == 0
        if self.first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
            self.blocks = nn.ModuleList(gpt.blocks[:cut])
        else:
            self.blocks = nn.ModuleList(gpt.blocks[cut:])
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        return x if self.first else self.head(self.ln_f(x))


def rank_main(args: argparse.Namespace) -> None:
    rank, world = init()
    if world != 2:
        raise ValueError(f"the hand-built torch stages are two; launched on {world} ranks")
    cut = args.layers // 2
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=args.seq, n_layer=args.layers, n_head=4,
                    n_embd=args.width, tie_weights=False)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))

    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy(world, cut, args.micro_batches))
    stage_module = Stage(ref, rank, cut)
    stage = PipelineStage(stage_module, rank, num_stages=world, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=lm_loss)
    torch_opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    last = rank == world - 1

    def torch_step() -> float | None:
        """One step of this rank's stage; the mean of the micro-batch losses (last stage)."""
        torch_opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
        torch_opt.step()
        return float(torch.stack(losses).mean()) if last else None

    def autopar_step() -> float:
        return engine.train_step(x, y)

    _check_losses(autopar_step, torch_step, src=world - 1)
    times = paired({"autopar": autopar_step, "torch": torch_step}, args.steps, args.warmup)
    peaks = engine.peak_activation_bytes()      # a collective: every rank asks
    if rank == 0:
        print(f"GPT {args.layers}x{args.width} (tie_weights=False on both sides), global batch "
              f"{args.batch}x{args.seq}, AdamW, pipeline of {world} gloo ranks, 1F1B, "
              f"{args.micro_batches} micro-batches, stage 1 from blocks.{cut}, "
              f"{torch.get_num_threads()} thread(s) each")
        report(times, "autopar", "torch")
        print("autopar peak activation bytes per pipeline rank (last step): " + ", ".join(
            f"rank {r} {b / 2**20:.3f} MiB" for r, b in enumerate(peaks)))
    finish()


def _check_losses(ours, theirs, src: int) -> None:
    """Both sides train the same model alike: autopar's global-batch mean loss equals the
    mean of torch's per-micro-batch losses (held by the last stage), step for step. A
    mismatch is said, not raised: the timing below still compares the same schedule."""
    rank = dist.get_rank()
    pairs = []
    for _ in range(CHECKED_STEPS):
        a, b = ours(), theirs()
        pair = torch.tensor([a, b if b is not None else float("nan")], dtype=torch.float64)
        dist.broadcast(pair, src=src)          # the last stage's figures, to rank 0
        pairs.append(pair.tolist())
    if rank != 0:
        return
    bad = [i for i, (a, b) in enumerate(pairs) if not abs(a - b) <= ATOL + RTOL * abs(b)]
    shown = ", ".join(f"{a:.6f}/{b:.6f}" for a, b in pairs)
    if bad:
        print(f"LOSSES DIFFER at step(s) {bad} (rtol {RTOL:g}), autopar/torch: {shown}")
    else:
        print(f"losses agree for {CHECKED_STEPS} steps (rtol {RTOL:g}), autopar/torch: {shown}")


if __name__ == "__main__":
    options = _args()           # parsed before the launch too: a bad option fails once
    main(__file__, lambda: rank_main(options))
