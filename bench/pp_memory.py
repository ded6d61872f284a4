"""Measured peak activation memory of autopar's pipeline schedules: 1F1B vs F-then-B (and
interleaved VPP, zero-bubble H1) at 4 stages and 8 micro-batches, next to the closed forms.

    .venv/bin/python bench/pp_memory.py [--layers 8] [--micro-batches 8] [--stages 4]

One process: the strategy simulates the pipeline ranks (``debug: {simulate: true}``, mesh
``[p] pp``, ``split: auto``). For each schedule a fresh GPT (8 layers x 128 wide by default,
the same init and the same global batch) runs one ``Engine.train_step``, and
``engine.peak_activation_bytes()`` gives each pipeline rank's high-water mark of the
per-micro-batch values held between its jobs.

The bytes one micro-batch leaves on rank r are F-then-B's peak / m (it holds all m), so each
peak is also shown as micro-batches held, beside the closed form: F-then-B m; 1F1B
min(m, p - r); VPP with v chunks per rank min(v m, 2 (p - r - 1) + (v - 1) p + 1) chunks of
1/v of the rank's layers (Megatron's warm-up + 1); ZB-H1 has no closed form here: rank r
holds 1F1B's p - r micro-batches plus, for each B whose W is deferred, what that W reads
(the layers' inputs and output gradients, a fraction of a micro-batch's activations), so it
is shown next to 1F1B's p. A peak is taken at the end of each job, before the values that
job read for the last time are freed (they are all alive then). The last rank's micro-batch
also holds the logits and the loss, so the max over ranks sits there for F-then-B and on
rank 0 for the others, and the max ratio 1F1B/F-then-B comes out below the closed form's
p/m; a VPP rank's chunks are counted as equal halves, which the last rank's (one with the
head) are not. The first step's losses of every schedule are checked equal (the same model
and batch).
"""
from __future__ import annotations

import argparse
import time

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

RTOL, ATOL = 1e-5, 1e-6


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--stages", type=int, default=4, help="pipeline ranks p")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--vpp-chunks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1, help="train steps per schedule")
    return parser.parse_args(argv)


def schedules(args: argparse.Namespace) -> dict[str, dict]:
    """The pipeline sections to measure, by the label printed; VPP only where the model has
    a layer for every chunk and the micro-batches divide among the ranks."""
    out = {"FThenB": {"schedule": "FThenB"}, "1F1B": {"schedule": "1F1B"}}
    v = args.vpp_chunks
    if args.layers >= args.stages * v and args.micro_batches % args.stages == 0:
        out[f"VPP v={v}"] = {"schedule": "VPP", "vpp_chunks": v}
    else:
        print(f"(VPP v={v} left out: it needs >= {args.stages * v} layers and micro-batches "
              f"divisible by {args.stages})")
    out["ZBH1"] = {"schedule": "ZBH1"}
    return out


def closed_form(label: str, p: int, m: int, v: int, r: int) -> str:
    """Micro-batches of activations rank r holds at its peak, by the schedule's formula."""
    if label == "FThenB":
        return f"{m}"
    if label == "1F1B":
        return f"{min(m, p - r)}"
    if label.startswith("VPP"):
        return f"{min(v * m, 2 * (p - r - 1) + (v - 1) * p + 1) / v:g}"
    return f"~{p}"


def measure(args: argparse.Namespace, pipeline: dict, x, y) -> tuple[list[int], float, float]:
    """(peak activation bytes per pipeline rank, first-step loss, seconds) of one schedule."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=args.seq, n_layer=args.layers, n_head=4,
                          n_embd=args.width))
    strategy = ap.Strategy(mesh={"shape": [args.stages], "dim_names": ["pp"]},
                           pipeline={"axis": "pp", "micro_batches": args.micro_batches,
                                     "split": "auto", **pipeline},
                           debug={"simulate": True})
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    start = time.perf_counter()
    losses = [engine.train_step(x, y) for _ in range(args.steps)]
    return engine.peak_activation_bytes(), losses[0], time.perf_counter() - start


def main(args: argparse.Namespace) -> None:
    p, m, v = args.stages, args.micro_batches, args.vpp_chunks
    torch.set_num_threads(1)    # the figures are bytes; one thread stays quick on a busy machine
    torch.manual_seed(1)
    x = torch.randint(0, 128, (args.batch, args.seq))
    y = torch.randint(0, 128, (args.batch, args.seq))
    print(f"GPT {args.layers}x{args.width}, global batch {args.batch}x{args.seq}, AdamW, "
          f"{p} pipeline ranks (simulated), {m} micro-batches, split auto, "
          f"{args.steps} train step(s) each")
    peaks, losses = {}, {}
    for label, pipeline in schedules(args).items():
        peaks[label], losses[label], secs = measure(args, pipeline, x, y)
        print(f"  {label:<8} planned and run in {secs:5.1f} s, first-step loss "
              f"{losses[label]:.6f}")
    want = losses["FThenB"]
    off = [k for k, loss in losses.items() if not abs(loss - want) <= ATOL + RTOL * abs(want)]
    print("first-step losses " + (f"DIFFER from FThenB's: {off}" if off else
                                  f"agree across schedules (rtol {RTOL:g})"))

    per_mb = [b / m for b in peaks["FThenB"]]       # one micro-batch's bytes on each rank
    print("\npeak activation memory per pipeline rank, MiB (micro-batches held: measured "
          "peak / (FThenB peak / m) | closed form)")
    print(f"{'schedule':<9}" + "".join(f"{'rank ' + str(r):>22}" for r in range(p))
          + f"{'max':>10}{'max/FThenB':>12}")
    top = max(peaks["FThenB"])
    for label, ranks in peaks.items():
        cells = "".join(f"{b / 2**20:9.3f} ({b / per_mb[r]:4.2f} | "
                        f"{closed_form(label, p, m, v, r):>4})" for r, b in enumerate(ranks))
        print(f"{label:<9}{cells}{max(ranks) / 2**20:10.3f}{max(ranks) / top:12.3f}")

    ratios = [a / b for a, b in zip(peaks["1F1B"], peaks["FThenB"])]
    print("\n1F1B / FThenB peak activation bytes (closed form (p - r) / m in brackets):")
    print("  " + ", ".join(f"rank {r} {q:.3f} [{min(m, p - r) / m:.3f}]"
                           for r, q in enumerate(ratios)))
    target = " (target <= 0.55 at p=4, m=8)" if (p, m) == (4, 8) else ""
    print(f"  max over ranks {max(peaks['1F1B']) / top:.3f} [{min(m, p) / m:.3f}]{target}")


if __name__ == "__main__":
    main(_args())
