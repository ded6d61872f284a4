"""Checkpoint save and load: autopar's ``Engine.save`` / ``Engine.load`` under dp2 x tp2
(``configs/dp_tp.yaml``) vs DCP's own ``dcp.save`` / ``dcp.load`` of an FSDP2 model's state,
the same GPT with the same AdamW on the same 4 gloo ranks, measured in the same run.

    .venv/bin/python bench/checkpoint.py [--layers 6] [--width 384] [--vocab 4096] [--dir D]

The script launches its own 4 ranks (torchrun's environment on a free loopback port, one
thread each). Both sides start from the same init and train one step on the same global
batch (FSDP2 on the rank's quarter of it), so the Adam state exists; then:

* save: ``--repeats`` saves per side, alternating, each to a fresh directory. autopar:
  ``engine.save(dir)``; FSDP2: ``get_state_dict(model, optim)`` and ``dcp.save`` of
  ``{"model": ..., "optim": ...}`` (DCP's default planner, which spreads replicated items
  over the ranks that hold them). Every save starts from a barrier; its time is the slowest
  rank's; the median is printed;
* bytes: each rank's ``__<rank>_*.distcp`` files and ``.metadata``, with the tensors the
  metadata lists (keys, and their bytes at full size). The two sides write different
  layouts (dp2 x tp2 boxes vs FSDP2's dim-0 shards over 4 ranks) of the same parameters
  and Adam state, so the totals should about agree;
* load in place: ``engine.load(dir)`` into the engine that has already run a step (its
  pieces are placed: each rank reads its own boxes into them) vs ``get_state_dict``,
  ``dcp.load`` and ``set_state_dict`` into the FSDP2 model and optimizer; median of
  ``--repeats``. Each side then retrains the step after the checkpoint and must get the
  loss it got before loading, bit for bit;
* load into a fresh engine under dp2 x tp2 (another init): ``engine.load`` (on real ranks it
  reads only the trainer record: the pieces are read when the first step places the
  state), then that first step, next to the first step of another fresh engine that loads
  nothing (it cuts its pieces from the model instead), and the time of the read itself
  (the pending load's ``read``, timed from outside);
* resharded load: the dp2 x tp2 checkpoint read in place into an engine under pp2 x dp2
  (``configs/dp_pp.yaml``, 1F1B, 4 micro-batches) that has run a step of its own from
  another init; its next loss must equal the dp2 x tp2 engine's (rtol 1e-5).

The ratios autopar/FSDP2 (< 1: autopar is faster or smaller) are printed for save time,
in-place load time and total bytes. ``--dir`` (default: a new temporary directory, removed
afterwards) puts the checkpoints on another file system. DCP's writer fsyncs each file, so
the figures include the disk, not just the page cache.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import ROOT, finish, in_rank, init, launch  # noqa: E402
from zero_vs_fsdp2 import fsdp_model  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

WORLD = 4
RTOL = 1e-5
SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per side")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: "
                        "a temporary directory, removed afterwards)")
    return parser.parse_args(argv)


def strategy(name: str) -> ap.Strategy:
    return ap.Strategy(**yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text()))


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, from a barrier, on the slowest rank (a collective)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    worst = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


class FSDP2Side:
    """The baseline: the GPT under FSDP2 with AdamW, trained on this rank's rows of the
    global batch, checkpointed with DCP's own state-dict path."""

    def __init__(self, model: GPT, rows: slice):
        self.model = fsdp_model(model)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.rows = rows

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """A training step; returns the global batch's loss (the mean of the ranks')."""
        self.optim.zero_grad()
        loss = lm_loss(self.model(x[self.rows]), y[self.rows])
        loss.backward()
        self.optim.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        return mean.item()

    def state(self) -> dict:
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        dcp.save(self.state(), checkpoint_id=path)

    def load(self, path: Path) -> None:
        state = self.state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def autopar_engine(model: GPT, config: str) -> ap.Engine:
    return ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     strategy=strategy(config))


def shared_dir(args: argparse.Namespace) -> Path:
    """One directory every rank writes under (rank 0 makes it)."""
    made = [None]
    if dist.get_rank() == 0:
        if args.dir:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        made[0] = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    dist.broadcast_object_list(made, src=0)
    return Path(made[0])


def written(path: Path) -> dict:
    """What a checkpoint directory holds: bytes of each rank's ``.distcp`` files, of the
    ``.metadata``, and the tensors the metadata lists (count, bytes at full size)."""
    per_rank = [0] * WORLD
    for f in path.iterdir():
        m = SHARD_FILE.match(f.name)
        if m:
            per_rank[int(m.group(1))] += f.stat().st_size
    tensors = {k: v for k, v in FileSystemReader(path).read_metadata()
               .state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    logical = sum(v.size.numel() * v.properties.dtype.itemsize for v in tensors.values())
    return {"per_rank": per_rank, "total": sum(per_rank),
            "metadata": (path / ".metadata").stat().st_size,
            "tensors": len(tensors), "logical": logical}


def _repeat(n: int, fns: dict[str, Callable[[int], object]]) -> dict[str, list[float]]:
    """Each function timed ``n`` times (called with the repeat's index), alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(n):
        for name, fn in fns.items():
            times[name].append(timed(lambda: fn(i)))
    return times


def _time_reads(pending) -> list[float]:
    """The seconds each ``read`` of the engine's pending load takes (the step that places
    the state reads its pieces there), collected in the list returned."""
    seconds: list[float] = []
    read = pending.read

    def timed_read(wanted):
        start = time.perf_counter()
        out = read(wanted)
        seconds.append(time.perf_counter() - start)
        return out
    pending.read = timed_read
    return seconds


def _same(what: str, got: float, want: float, exact: bool) -> str:
    ok = got == want if exact else abs(got - want) <= RTOL * abs(want)
    if not ok:
        raise AssertionError(f"{what}: loss {got!r} after loading != {want!r} before")
    return f"{what}: loss {got:.7f} = {want:.7f}" + (" (bit for bit)" if exact else "")


def rank_main(args: argparse.Namespace) -> None:
    rank, world = init()
    if world != WORLD:
        raise SystemExit(f"bench/checkpoint.py runs on {WORLD} ranks, not {world}")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=4, n_embd=args.width)
    models = []
    for seed in (0, 1, 2, 1):       # the other inits: the loads must be what sets the state
        torch.manual_seed(seed)
        models.append(GPT(cfg))
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq)) for _ in range(4)]
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    root = shared_dir(args)
    ours, theirs = root / "autopar", root / "fsdp2"

    engine = autopar_engine(models[0], "dp_tp")
    baseline = FSDP2Side(copy.deepcopy(models[0]), rows)
    saves, loads, want, checks = _against_fsdp2(engine, baseline, batches, ours, theirs,
                                                args.repeats)
    fresh, check = _fresh_load(models[3], models[1], f"{ours}_0", batches[2:], want)
    checks.append(check)
    resharded, check = _resharded_load(models[2], f"{ours}_0", batches, want, args.repeats)
    checks.append(check)
    if rank == 0:
        sizes = {"autopar": written(Path(f"{ours}_0")), "FSDP2": written(Path(f"{theirs}_0"))}
        _print(args, cfg, models[0], saves, loads, sizes)
        _print_other_loads(fresh, resharded)
        print("\n".join(checks))
        if args.dir is None:
            shutil.rmtree(root)
    engine.close()
    finish()


def _against_fsdp2(engine: ap.Engine, baseline: FSDP2Side, batches, ours: Path, theirs: Path,
                   repeats: int):
    """One step each, then ``repeats`` saves each to fresh directories ``<ours>_<i>`` and
    ``<theirs>_<i>``, the next step's loss, ``repeats`` in-place loads of the first save,
    and that step again (its loss must repeat, bit for bit). Returns the save and load
    times, autopar's loss after the checkpoint and the checks' lines."""
    x0, y0, x1, y1 = batches
    engine.train_step(x0, y0)
    baseline.step(x0, y0)
    saves = _repeat(repeats, {"autopar": lambda i: engine.save(f"{ours}_{i}"),
                              "FSDP2": lambda i: baseline.save(Path(f"{theirs}_{i}"))})
    want_ours, want_theirs = engine.train_step(x1, y1), baseline.step(x1, y1)
    loads = _repeat(repeats, {"autopar": lambda i: engine.load(f"{ours}_0"),
                              "FSDP2": lambda i: baseline.load(Path(f"{theirs}_0"))})
    checks = [_same("autopar dp2 x tp2, in place", engine.train_step(x1, y1), want_ours, True),
              _same("FSDP2, in place", baseline.step(x1, y1), want_theirs, True)]
    return saves, loads, want_ours, checks


def _fresh_load(model: GPT, twin: GPT, path: str, batch, want: float
                ) -> tuple[dict[str, float], str]:
    """A fresh dp2 x tp2 engine on ``twin`` (the same init as ``model``) steps without a
    load; one on ``model`` loads ``path`` and steps (its loss must be ``want``, bit for
    bit). Seconds of each, and of the pending load's reads (slowest rank)."""
    x1, y1 = batch
    unloaded = autopar_engine(twin, "dp_tp")
    times = {"unloaded step": timed(lambda: unloaded.train_step(x1, y1))}
    unloaded.close()
    fresh = autopar_engine(model, "dp_tp")
    times["load"] = timed(lambda: fresh.load(path))
    reads = _time_reads(fresh.state.pending)
    got: list[float] = []
    times["step"] = timed(lambda: got.append(fresh.train_step(x1, y1)))
    read = torch.tensor(sum(reads), dtype=torch.float64)
    dist.all_reduce(read, op=dist.ReduceOp.MAX)
    times["read"] = read.item()
    fresh.close()
    return times, _same("autopar dp2 x tp2, fresh engine", got[0], want, True)


def _resharded_load(model: GPT, path: str, batches, want: float, repeats: int
                    ) -> tuple[dict[str, object], str]:
    """A pp2 x dp2 engine's first step, then ``repeats`` in-place loads of ``path`` (saved
    under dp2 x tp2) and the step after the checkpoint (loss ``want``, rtol 1e-5)."""
    x0, y0, x1, y1 = batches
    engine = autopar_engine(model, "dp_pp")
    times: dict[str, object] = {"first step": timed(lambda: engine.train_step(x0, y0))}
    times["loads"] = _repeat(repeats, {"pp2 x dp2": lambda i: engine.load(path)})["pp2 x dp2"]
    check = _same("autopar pp2 x dp2, resharded in place", engine.train_step(x1, y1), want,
                  False)
    engine.close()
    return times, check


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def _print(args, cfg, model, saves, loads, sizes) -> None:
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {cfg.n_layer}x{cfg.n_embd}, vocab {cfg.vocab_size} ({params / 1e6:.2f} M "
          f"params), AdamW, global batch {args.batch}x{args.seq}; {WORLD} gloo ranks, "
          f"{torch.get_num_threads()} thread(s) each, {os.cpu_count()} CPU core(s)")
    print("autopar: configs/dp_tp.yaml (dp2 x tp2); FSDP2: fully_shard per block + root over "
          "the 4 ranks. Different layouts of the same parameters + Adam state, so the "
          "totals should about agree.")
    med = {k: {s: statistics.median(v[s]) for s in v} for k, v in
           (("save", saves), ("load", loads))}
    a, f = sizes["autopar"], sizes["FSDP2"]
    rows = [(f"save, median of {args.repeats} (s)", f"{med['save']['autopar']:.3f}",
             f"{med['save']['FSDP2']:.3f}", med["save"]["autopar"] / med["save"]["FSDP2"]),
            (f"load in place, median of {args.repeats} (s)", f"{med['load']['autopar']:.3f}",
             f"{med['load']['FSDP2']:.3f}", med["load"]["autopar"] / med["load"]["FSDP2"])]
    rows += [(f"bytes written, rank {r}", _mib(a["per_rank"][r]), _mib(f["per_rank"][r]), None)
             for r in range(WORLD)]
    rows += [("bytes written, total", _mib(a["total"]), _mib(f["total"]),
              a["total"] / f["total"]),
             (".metadata", f"{a['metadata']} B", f"{f['metadata']} B", None),
             ("tensors listed (full size)", f"{a['tensors']} ({_mib(a['logical'])})",
              f"{f['tensors']} ({_mib(f['logical'])})", None)]
    print(f"{'':<30} {'autopar':>22} {'FSDP2':>22} {'autopar/FSDP2':>14}")
    for name, ours, theirs, ratio in rows:
        print(f"{name:<30} {ours:>22} {theirs:>22} "
              f"{'' if ratio is None else f'{ratio:.2f}':>14}")
    for side, t in (("save", saves), ("load", loads)):
        print(f"  all {side} times (s): " + "; ".join(
            f"{k} " + ", ".join(f"{s:.3f}" for s in v) for k, v in t.items()))


def _print_other_loads(fresh: dict[str, float], resharded: dict[str, object]) -> None:
    print("autopar, other loads of the dp2 x tp2 checkpoint (s, slowest rank):")
    print(f"  fresh dp2 x tp2 engine: load {fresh['load']:.3f} + first step (plans, reads its "
          f"pieces) {fresh['step']:.3f} = {fresh['load'] + fresh['step']:.3f}, of which "
          f"reading the pieces {fresh['read']:.3f}; without the load, another fresh engine's "
          f"first step (plans, cuts its pieces from the model) {fresh['unloaded step']:.3f}")
    loads = resharded["loads"]
    each = ", ".join(f"{t:.3f}" for t in loads)
    print(f"  pp2 x dp2 engine, in place (resharded): median {statistics.median(loads):.3f} "
          f"({each}); its first step {resharded['first step']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if in_rank():
        rank_main(_args())
    else:
        sys.exit(launch(__file__, sys.argv[1:], world=WORLD))
