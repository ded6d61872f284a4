"""Async checkpoints (issue 29, item 5): the training stall of ``engine.save(dir,
async_save=True)`` against the time of a synchronous ``engine.save(dir)``, GPT 8 x 256 under
dp2 x tp2 (``configs/dp_tp.yaml``) with AdamW, in the same run.

    .venv/bin/python bench/async_checkpoint.py [--layers 8] [--width 256] [--simulate]

By default the script launches 4 gloo ranks (one thread each); ``--simulate`` runs the four
ranks on the simulator in this process instead (one process writes every rank's boxes).
After two warm-up steps, ``--repeats`` times (steps each from a barrier, timed on the
slowest rank):

* control: ``--steps`` training steps without a save (all of them give the median step);
* sync: a synchronous save to a fresh directory (from a barrier, slowest rank);
* async: a background save of the same step to another directory, then ``--steps`` steps,
  then ``wait_for_checkpoint()``. Its stall is what training lost to it: the time the save
  call takes to return (staging the state to CPU memory), plus what the steps after it took
  beyond as many median steps, plus the wait left at the end (zero when the write finished
  within the steps; counted, since the next save would wait for it). The control window's
  own excess over the median is printed beside it: the noise of that figure.

It prints each part, the medians and the ratio stall / sync save (target: <= 0.3). The
first repeat's two checkpoints hold the same step: each is loaded back in place and the
step after it must give the same loss, bit for bit. DCP's writer fsyncs every file;
``--dir`` (default: a temporary directory, removed afterwards) puts the checkpoints on
another file system.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import ROOT, finish, in_rank, init, launch  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

WORLD = 4


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--steps", type=int, default=6, help="steps after each async save")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind")
    parser.add_argument("--simulate", action="store_true",
                        help="the 4 ranks on the simulator, in this process")
    parser.add_argument("--dir", default=None, help="where the checkpoints go")
    return parser.parse_args(argv)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes from a barrier, on the slowest rank (a collective)."""
    if _distributed():
        dist.barrier()
    start = time.perf_counter()
    fn()
    worst = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    if _distributed():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def shared_dir(args: argparse.Namespace) -> Path:
    made = [None]
    if not _distributed() or dist.get_rank() == 0:
        if args.dir:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        made[0] = tempfile.mkdtemp(prefix="async_ckpt_bench_", dir=args.dir)
    if _distributed():
        dist.broadcast_object_list(made, src=0)
    return Path(made[0])


def make_engine(args: argparse.Namespace) -> tuple[ap.Engine, GPT]:
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=4, n_embd=args.width)
    torch.manual_seed(0)
    model = GPT(cfg)
    data = yaml.safe_load((ROOT / "configs" / "dp_tp.yaml").read_text())
    if args.simulate:
        data.setdefault("debug", {})["simulate"] = True
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy(**data))
    return engine, model


def measure(args: argparse.Namespace, engine: ap.Engine, root: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
             for _ in range(2)]

    def step() -> float:
        return engine.train_step(*batch)
    for _ in range(2):
        step()
    out: dict = {"plain": [], "control": [], "sync": [], "call": [], "extra": [], "left": []}
    windows = []
    for i in range(args.repeats):
        control = [timed(step) for _ in range(args.steps)]     # the same steps, no save
        out["plain"] += control
        out["sync"].append(timed(lambda: engine.save(root / f"sync_{i}")))
        out["call"].append(timed(lambda: engine.save(root / f"async_{i}", async_save=True)))
        windows.append((control, [timed(step) for _ in range(args.steps)]))
        out["left"].append(timed(engine.wait_for_checkpoint))
    base = statistics.median(out["plain"])
    # what the steps after a save took beyond as many median steps (a window without a
    # save, measured alike, shows the noise of that figure)
    for control, after in windows:
        out["control"].append(sum(control) - base * len(control))
        out["extra"].append(sum(after) - base * len(after))
    out["check"] = _check(engine, root / "sync_0", root / "async_0", batch)
    return out


def _check(engine: ap.Engine, sync: Path, background: Path, batch) -> str:
    """The sync and the async checkpoint of one step, each loaded in place: the step after
    each must give the same loss, bit for bit."""
    engine.load(sync)
    want = engine.train_step(*batch)
    engine.load(background)
    got = engine.train_step(*batch)
    if got != want:
        raise AssertionError(f"{background}: the step after loading it gave {got!r}, after "
                             f"{sync} {want!r}")
    return f"sync and async checkpoints of one step, loaded in place: next loss {got:.7f} both"


def report(args: argparse.Namespace, model: GPT, out: dict) -> None:
    params = sum(p.numel() for p in model.parameters())
    where = ("the simulator (4 ranks in 1 process)" if args.simulate else
             f"{WORLD} gloo ranks, 1 thread each")
    print(f"GPT {args.layers}x{args.width}, vocab {args.vocab} ({params / 1e6:.2f} M params), "
          f"AdamW, batch {args.batch}x{args.seq}, dp2 x tp2 on {where}; "
          f"{os.cpu_count()} CPU core(s)")
    stalls = [c + e + w for c, e, w in zip(out["call"], out["extra"], out["left"])]
    base, sync, stall = (statistics.median(v) for v in (out["plain"], out["sync"], stalls))
    print(f"step without a save: median {base:.3f} s of {len(out['plain'])}")
    print(f"sync save: median {sync:.3f} s ({_each(out['sync'])})")
    print(f"async save call: {_each(out['call'])}; steps' extra over {args.steps} steps: "
          f"{_each(out['extra'])} (windows without a save: {_each(out['control'])}); "
          f"wait left: {_each(out['left'])}")
    print(f"async stall: median {stall:.3f} s ({_each(stalls)})")
    print(f"stall / sync save = {stall / sync:.2f} (target <= 0.3)")
    print(out["check"])


def _each(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def main(args: argparse.Namespace) -> None:
    if args.simulate:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:
        init()
    engine, model = make_engine(args)
    root = shared_dir(args)
    out = measure(args, engine, root)
    if not _distributed() or dist.get_rank() == 0:
        report(args, model, out)
        if args.dir is None:
            shutil.rmtree(root)
    engine.close()
    if not args.simulate:
        finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    options = _args()
    if options.simulate or in_rank():
        main(options)
    else:
        sys.exit(launch(__file__, sys.argv[1:], world=WORLD))
