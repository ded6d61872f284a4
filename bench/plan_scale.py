"""Planning a cluster on a laptop: ``engine.cost()`` (memory and predicted time of every
rank) for meshes up to 1,024 ranks, in one process, with its seconds and peak memory.

    .venv/bin/python bench/plan_scale.py            # GPT cases, then the 70B Llama
    .venv/bin/python bench/plan_scale.py --no-llama

Baseline, same run: the reports lowered for every rank (what ``engine.cost`` did before
``lower_representatives``), on the 16-rank case, both checked to give the same tables.
Targets (issue 32): a 24-layer GPT on dp32 x pp8 x tp4 = 1,024 ranks in <= 60 s and
<= 4 GB; a 70B-shaped Llama on 1,024 ranks in <= 5 minutes. Each case runs in its own
process, so its peak memory is its own (``ru_maxrss``).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT_CASES = {  # name: (layers, (pp, dp, tp))
    "gpt 24L dp2 x pp4 x tp2 (16 ranks)": (24, (4, 2, 2)),
    "gpt 24L dp32 x pp8 x tp4 (1,024 ranks)": (24, (8, 32, 4)),
}


def _gpt_engine(layers: int, pp: int, dp: int, tp: int):
    import torch

    import autopar as ap
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import lm_loss
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=layers, n_head=4,
                              n_embd=128))
    strategy = ap.Strategy(
        mesh={"shape": [pp, dp, tp], "dim_names": ["pp", "dp", "tp"]},
        data_parallel={"axis": "dp"},
        tensor_parallel={"axis": "tp", "plan": {
            "blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
            "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise", "wte": "vocab"}},
        pipeline={"axis": "pp", "schedule": "1F1B", "micro_batches": 8})
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    x = torch.randint(0, 512, (8 * dp, 128))
    return engine, x


def _llama_engine():
    import torch
    sys.path.insert(0, str(ROOT / "examples"))
    from llama_70b import LLAMA_70B, causal_lm_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    import autopar as ap
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_70B, attn_implementation="sdpa"))
    engine = ap.Engine(model, causal_lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-4),
                       strategy=ap.Strategy.from_yaml(str(ROOT / "examples/llama_70b_1024.yaml")))
    return engine, torch.randint(0, LLAMA_70B["vocab_size"], (256, 4096))


def _one(case: str, every: bool) -> dict:
    """Plan and cost one case in this process: seconds, peak RSS, the tables' text."""
    from autopar.cost import Profile, format_step_time
    from autopar.lower import estimate_memory, format_estimates, lower_program
    begin = time.perf_counter()
    engine, x = _llama_engine() if case == "llama" else _gpt_engine(GPT_CASES[case][0],
                                                                    *GPT_CASES[case][1])
    engine.prepare(x, x)
    planned = time.perf_counter()
    profile = Profile.reference()
    if every:      # the baseline: every rank lowered for the reports
        step = engine.planner.plan("train", x, x)
        facts = step.facts
        step.every_process = lower_program(step.program, facts.mesh, facts.pipeline,
                                           facts.schedule, check=False)
        memory = estimate_memory(step.every_process)
        timed = engine.predict_time(x, x, profile=profile)
    else:
        cost = engine.cost(x, x, profile=profile)
        memory, timed = dict(cost), cost.time
    done = time.perf_counter()
    return {"plan_s": planned - begin, "cost_s": done - planned, "total_s": done - begin,
            "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "tables": format_estimates(memory) + "\n" + format_step_time(timed)}


def _run(case: str, every: bool = False) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", case] + (["--every"] if every
                                                                       else []),
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{case}: failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--every", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-llama", action="store_true")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.every)))
        return
    small = next(iter(GPT_CASES))
    base, ours = _run(small, every=True), _run(small)
    same = "same tables" if base["tables"] == ours["tables"] else "TABLES DIFFER"
    print(f"{small}: engine.cost {ours['cost_s']:.1f} s, every rank lowered "
          f"{base['cost_s']:.1f} s: {ours['cost_s'] / base['cost_s']:.2f}x ({same})")
    cases = list(GPT_CASES)[1:] + ([] if args.no_llama else ["llama"])
    print(f"\n{'case':<44} {'plan s':>7} {'cost s':>7} {'total s':>8} {'peak GB':>8}  target")
    for case in cases:
        r = _run(case)
        name = "llama 70B-shaped, pp8 x dp16 x tp8 (1,024)" if case == "llama" else case
        target = "<= 300 s" if case == "llama" else "<= 60 s, <= 4 GB"
        print(f"{name:<44} {r['plan_s']:7.1f} {r['cost_s']:7.1f} {r['total_s']:8.1f} "
              f"{r['rss_gb']:8.2f}  {target}")
        print("\n".join("    " + line for line in r["tables"].splitlines()[:12]))


if __name__ == "__main__":
    main()
