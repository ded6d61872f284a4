"""ZeRO memory per rank: bytes of parameters + gradients + optimizer state for ZeRO stages
0-3 on dp2 and dp4, next to one device, for GPTs of a few sizes (AdamW), predicted by the
plan and measured by the runtime.

    .venv/bin/python bench/zero_memory.py [--sizes 2x64 4x128 8x256] [--batch 8] [--seq 32]

One process, every rank simulated (``debug: {simulate: true}``): for each GPT and each
configuration (serial; dp2, dp4 with ``sharding: {stage: s, axis: dp}``, stage 0 meaning no
``sharding`` section) the engine plans a training step and ``engine.cost(x, y)`` gives
each rank's predicted parameters, gradients and optimizer state (and peak); then one step
trains (the optimizer state exists from then on) and a second runs under
``runtime.memory_meter.MemoryMeter``, which counts the state pieces each simulated process really
holds (by kind), the gradient tensors its update ops read, and its peak of live bytes.
Rank 0's figures are printed (the largest rank's where the ranks differ), in MiB.

The target check (the issue's): stage 3 holds at most 1/N of serial's parameters +
gradients + optimizer state plus the largest gathered layer (the biggest module's own
parameters at full size: what one all-gather brings in).
"""
from __future__ import annotations

import argparse
import os

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.runtime.memory_meter import meter_step

STAGES = (0, 1, 2, 3)
KINDS = ("params", "grads", "optimizer_state")


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["2x64", "4x128", "8x256"],
                        help="GPTs as <layers>x<width>")
    parser.add_argument("--dp", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    return parser.parse_args(argv)


def strategy(dp: int, stage: int) -> ap.Strategy:
    text = "debug: {simulate: true}\n"
    if dp > 1:
        text += (f"mesh: {{shape: [{dp}], dim_names: [dp]}}\ndata_parallel: {{axis: dp}}\n")
    if stage:
        text += f"sharding: {{stage: {stage}, axis: dp}}\n"
    return ap.Strategy.from_yaml_str(text)


def gpt(layers: int, width: int, args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers,
                         n_head=4, n_embd=width))


def measure(model: GPT, dp: int, stage: int, x, y) -> dict[str, dict[str, int]]:
    """Rank 0's (the largest rank's) predicted and measured bytes by kind, and peaks."""
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy(dp, stage))
    estimates = engine.cost(x, y)
    engine.train_step(x, y)
    step = engine.planner.plan("train", x, y)
    state = dict(engine.state.tensors)
    meter = meter_step(step.lowered, engine._feeds(x, y, "train"), state)
    held, peaks = meter.held(), meter.peaks()
    worst = max(estimates, key=lambda p: sum(getattr(estimates[p], k) for k in KINDS))
    plan = {k: getattr(estimates[worst], k) for k in KINDS}
    plan["peak"] = max(e.peak for e in estimates.values())
    got = {k: held[worst][k] for k in KINDS}
    got["peak"] = max(peaks.values())
    return {"plan": plan, "measured": got}


def largest_layer(model: GPT) -> int:
    """Bytes of the biggest module's own parameters (one gather's worth at full size)."""
    return max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
               for m in model.modules())


def _mib(n: int) -> str:
    return f"{n / 2**20:8.3f}"


def run_size(layers: int, width: int, args: argparse.Namespace) -> bool:
    model = gpt(layers, width, args)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    params = sum(p.numel() for p in model.parameters())
    print(f"\nGPT {layers}x{width}, vocab {args.vocab}: {params / 1e6:.2f} M parameters; "
          f"batch {args.batch}x{args.seq}, AdamW; MiB per rank, plan / measured")
    print(f"{'config':<12} {'params':>17} {'grads':>17} {'optim':>17} {'p+g+o':>17} "
          f"{'peak':>17}")
    serial = measure(gpt(layers, width, args), 1, 0, x, y)
    _row("serial", serial)
    total = sum(serial["measured"][k] for k in KINDS)
    ok = True
    for dp in args.dp:
        for stage in STAGES:
            got = measure(gpt(layers, width, args), dp, stage, x, y)
            _row(f"dp{dp} stage {stage}", got)
            if stage == 3:
                bound = total / dp + largest_layer(model)
                held = sum(got["measured"][k] for k in KINDS)
                fits = held <= bound
                ok &= fits
                print(f"  target: stage 3 p+g+o {_mib(held).strip()} <= serial/{dp} + largest "
                      f"layer = {_mib(bound).strip()} MiB: {'yes' if fits else 'NO'} "
                      f"({held / total:.1%} of serial)")
    return ok


def _row(name: str, got: dict[str, dict[str, int]]) -> None:
    cells = []
    for k in (*KINDS, "total", "peak"):
        plan, measured = ((sum(got[s][k] for k in KINDS) for s in ("plan", "measured"))
                          if k == "total" else (got["plan"][k], got["measured"][k]))
        cells.append(f"{plan / 2**20:.3f}/{measured / 2**20:.3f}".rjust(17))
    print(f"{name:<12} " + " ".join(cells))


def main() -> None:
    args = _args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ok = True
    for size in args.sizes:
        layers, width = (int(n) for n in size.split("x"))
        ok &= run_size(layers, width, args)
    print("\nstage 3 within target for every size and dp: " + ("yes" if ok else "NO"))


if __name__ == "__main__":
    main()
