"""Predicted vs measured step time: the cost model (``Engine.predict_time``, ``cost/predict.py``)
against real gloo ranks, for every strategy in ``configs/`` at its own world size, on two
GPT sizes.

    .venv/bin/python bench/cost_model.py [--profile PATH] [--sizes 2x64 4x128] [--steps 12]
                                         [--rounds 3]

Every config runs on as many ranks as its mesh has (``configs/dp_tp.yaml`` and
``configs/dp_pp.yaml`` on 4, the 2-rank configs on 2, ``serial.yaml`` on 1; ``3d.yaml``
needs 8 and is left out): the script launches its own ranks (torchrun's environment on a
free loopback port, one thread each), once per world size. For each config and size,
rank 0 asks ``engine.predict_time(x, y, profile=...)`` before anything runs. Then every
rank trains, in ``--rounds`` rounds over all the world's configs (so that a burst of other
load on the machine spoils part of each config's steps, not all steps of one): warm-up
steps (3 in the first round, 1 later) and the round's share of the measured steps, each
step started behind a barrier and timed as the slowest rank's (``Engine.train_step``).
The measured figure is the median step over all rounds;
under gradient merge (``dp_merge``, k steps) the steps alternate between k - 1 that only
accumulate and one that applies, so both sides are the mean over whole cycles.

The profile is the reference one shipped with autopar (``cost/reference_profile.json``,
measured on the development machine: 2 cores, 4 gloo processes) unless ``--profile`` names
another (``python -m autopar calibrate --out PATH`` measures this machine). Printed: each
pair, the error, the Spearman rank correlation over all pairs (``scipy.stats.spearmanr``)
and the median absolute relative error, against the issue's targets (>= 0.9, <= 25%).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import ROOT, finish, in_rank, init, launch  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.cost import Profile  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

TARGET_SPEARMAN, TARGET_ERROR = 0.9, 0.25


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=None,
                        help="a profile JSON (default: the shipped reference profile)")
    parser.add_argument("--sizes", nargs="+", default=["2x64", "4x128"],
                        help="GPT sizes, layers x width")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12, help="measured steps")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all configs the measured steps are spread over")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=None, help="names in configs/")
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def config_worlds(names: list[str] | None) -> dict[str, int]:
    """Every config in configs/ (or the named ones) with its world size: its mesh's size.
    ``auto`` configs (no mesh: the planner picks one) are left out: their plan is whatever
    the search finds, on the profile given, and the search takes a while."""
    out = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if names and path.stem not in names:
            continue
        text = yaml.safe_load(path.read_text()) or {}
        if text.get("auto") and not text.get("mesh"):
            continue
        out[path.stem] = math.prod((text.get("mesh") or {}).get("shape", [1]))
    return out


def half_precision(name: str) -> bool:
    """Whether a config trains in fp16/bf16 (``amp.enable``)."""
    text = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text()) or {}
    return bool((text.get("amp") or {}).get("enable"))


def load_profile(path: str | None) -> Profile:
    return Profile.load(path) if path else Profile.reference()


def _merge_steps(strategy: ap.Strategy) -> int:
    return strategy.gradient_merge.k_steps


def sized_gpt(args: argparse.Namespace, size: str) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """The GPT of ``size`` ("layers x width", 4 heads) and its batch (``--batch`` x
    ``--seq`` tokens of ``--vocab``), seeded: every rank and every run build the same."""
    layers, width = (int(v) for v in size.split("x"))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=4,
                    n_embd=width)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    return model, x, y


def build_config(args: argparse.Namespace, name: str, size: str, profile: Profile) -> dict:
    """Build one config's engine at one GPT size and predict its step (rank 0)."""
    model, x, y = sized_gpt(args, size)
    strategy = ap.Strategy.from_yaml_str((ROOT / "configs" / f"{name}.yaml").read_text())
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    k = _merge_steps(strategy)
    predicted = predict_s = None
    if dist.get_rank() == 0:
        start = time.perf_counter()
        apply = engine.predict_time(x, y, profile=profile)
        predicted = apply.step_s
        if k > 1:
            only = engine.planner.time(engine.planner.plan("train", x, y).accumulating,
                                       profile)
            predicted = ((k - 1) * only.step_s + apply.step_s) / k
        predict_s = time.perf_counter() - start
    return {"config": name, "size": size, "engine": engine, "x": x, "y": y, "k": k,
            "predicted_s": predicted, "predict_s": predict_s, "times": []}


def measure_round(args: argparse.Namespace, run: dict, first: bool) -> None:
    """Warm-up steps (all of them in the first round, one cycle later) and this round's
    share of the measured steps, each from a barrier; the slowest rank's times."""
    k = run["k"]
    per_round = max(1, math.ceil(args.steps / args.rounds))
    steps = per_round if k == 1 else max(1, per_round // k) * k
    warmup = (args.warmup if first else 1) if k == 1 else max(1, math.ceil(
        (args.warmup if first else 1) / k)) * k
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        begin = time.perf_counter()
        run["engine"].train_step(run["x"], run["y"])
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    run["times"] += worst.tolist()


def row(run: dict) -> dict:
    """Rank 0's result of one config: the median step (gradient merge: the mean over whole
    cycles) over every round."""
    times = run["times"]
    measured = statistics.median(times) if run["k"] == 1 else statistics.fmean(times)
    return {"config": run["config"], "size": run["size"], "world": dist.get_world_size(),
            "predicted_s": run["predicted_s"], "measured_s": measured,
            "predict_s": run["predict_s"], "steps": [round(t, 6) for t in times]}


def rank_main(args: argparse.Namespace) -> None:
    init()
    profile = load_profile(args.profile)
    runs = [build_config(args, name, size, profile)
            for name, world in config_worlds(args.configs).items() if world == args.world
            for size in args.sizes]
    # rounds over every config: a burst of other load on the machine spoils a part of each
    # config's steps rather than all steps of one config
    for i in range(args.rounds):
        for run in runs:
            measure_round(args, run, i == 0)
    rows = []
    for run in runs:
        run["engine"].close()
        if dist.get_rank() == 0:
            rows.append(row(run))
            r = rows[-1]
            print(f"  {r['config']:<14} {r['size']:>6} on {r['world']}: predicted "
                  f"{r['predicted_s'] * 1e3:8.2f} ms, measured "
                  f"{r['measured_s'] * 1e3:8.2f} ms", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    finish()


def summarize(rows: list[dict], profile: Profile, label: str) -> None:
    from scipy.stats import spearmanr

    print(f"\ncost model vs real gloo ranks ({label}: {profile.machine}; measured with "
          f"{profile.processes} processes x {profile.threads} thread(s))")
    print(f"{'config':<14} {'GPT':>6} {'ranks':>5} {'predicted':>11} {'measured':>11} "
          f"{'error':>7}")
    errors = []
    for r in sorted(rows, key=lambda r: (r["size"], r["world"], r["config"])):
        error = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        errors.append(abs(error))
        print(f"{r['config']:<14} {r['size']:>6} {r['world']:>5} "
              f"{r['predicted_s'] * 1e3:8.2f} ms {r['measured_s'] * 1e3:8.2f} ms "
              f"{error:>+7.1%}")
    rho = spearmanr([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])[0]
    median = statistics.median(errors)
    print(f"pairs: {len(rows)}; Spearman rank correlation {rho:.3f} (target >= "
          f"{TARGET_SPEARMAN}: {'met' if rho >= TARGET_SPEARMAN else 'NOT met'}); median "
          f"|error| {median:.1%} (target <= {TARGET_ERROR:.0%}: "
          f"{'met' if median <= TARGET_ERROR else 'NOT met'})")
    fp32 = [r for r in rows if not half_precision(r["config"])]
    parts = [(f"GPT {size}", [r for r in rows if r["size"] == size])
             for size in sorted({r["size"] for r in rows})]
    parts.append(("fp32 configs only", fp32))
    for what, part in parts:
        if len(part) < 2:
            continue
        rho = spearmanr([r["predicted_s"] for r in part], [r["measured_s"] for r in part])[0]
        print(f"  {what}: {len(part)} pairs, Spearman {rho:.3f}, median |error| "
              f"{statistics.median(abs(r['predicted_s'] / r['measured_s'] - 1) for r in part):.1%}")
    slowest = max(r["predict_s"] for r in rows)
    print(f"slowest prediction (planning every rank + the predictor): {slowest:.2f} s")


def main() -> None:
    args = _args()
    if in_rank():
        rank_main(args)
        return
    profile = load_profile(args.profile)      # fails here, before any launch, when missing
    label = args.profile or "REFERENCE profile, cost/reference_profile.json"
    worlds = sorted({w for w in config_worlds(args.configs).values() if w in (1, 2, 4)})
    skipped = [n for n, w in config_worlds(args.configs).items() if w not in (1, 2, 4)]
    if skipped:
        print(f"left out (need more than 4 ranks): {', '.join(skipped)}")
    code = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        out.touch()
        for world in worlds:
            print(f"{world} rank(s):", flush=True)
            code |= launch(__file__, [*sys.argv[1:], "--world", str(world), "--out", str(out)],
                           world=world)
        rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    if rows:
        summarize(rows, profile, label)
    sys.exit(code)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
