"""Offline planning time: a whole GPT training step (forward, backward, AdamW) planned for
an 8-rank 3-D mesh (2 pipeline stages x dp 2 x tp 2, 4 micro-batches) in one plain process:
capture + every pass (completion, the pipeline's stages and schedule included, IR verified
between passes as by default) + every pipeline rank's jobs and messages.

The torch-native baseline measured in the same run is what torch alone needs to trace the
same step: ``make_fx`` over ``functional_call`` + ``autograd.grad`` on fake tensors. Each
size is planned ``repeats`` times, interleaved, after a warm-up plan (the first trace in a
process also imports torch's tracing machinery); medians are printed, and the 48/24 ratios.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

STRATEGY = """
mesh: {shape: [2, 2, 2], dim_names: [pp, dp, tp]}
data_parallel: {axis: dp}
tensor_parallel:
  axis: tp
  plan: {"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise,
         "blocks.*.fc1": colwise, "blocks.*.fc2": rowwise, "wte": vocab}
pipeline: {axis: pp, schedule: 1F1B, micro_batches: 4}
"""


def _model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=1024, block_size=128, n_layer=layers, n_head=8, n_embd=256))


def _batch() -> torch.Tensor:
    return torch.randint(0, 1024, (16, 128))


def plan_seconds(layers: int) -> tuple[float, int, dict[str, float]]:
    model = _model(layers)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                       strategy=ap.Strategy.from_yaml_str(STRATEGY))
    ids = _batch()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a missing rule would make this plan meaningless
        program = engine.prepare(ids, ids)
    seconds = time.perf_counter() - start
    timings = next(iter(engine.planner.steps.values())).pass_timings
    return seconds, len(program.ops), timings


def trace_seconds(layers: int) -> float:
    """torch alone: trace the same training step with make_fx on fake tensors."""
    model = _model(layers)
    names, params = zip(*model.named_parameters())
    ids = _batch()

    def step(values, x):
        out = torch.func.functional_call(model, dict(zip(names, values)), (x,))
        loss = lm_loss(out, x)
        return [loss, *torch.autograd.grad(loss, values)]

    gc.disable()          # as the engine does while planning: same conditions for both
    try:
        start = time.perf_counter()
        make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(
            [p.detach().requires_grad_() for p in params], ids)
        return time.perf_counter() - start
    finally:
        gc.enable()


def main(repeats: int = 5) -> dict[int, float]:
    cold, _, _ = plan_seconds(1)
    print(f"cold start (first plan in the process, 1 layer): {cold:.2f} s")
    sizes = (24, 48)
    runs: dict[int, list] = {n: [] for n in sizes}
    traces: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):     # interleaved, so machine noise hits every size alike
        for n in sizes:
            runs[n].append(plan_seconds(n))
            traces[n].append(trace_seconds(n))
    medians = {}
    for n in sizes:
        seconds = statistics.median(r[0] for r in runs[n])
        baseline = statistics.median(traces[n])
        timings = runs[n][-1][2]
        medians[n] = seconds
        print(f"{n} layers: plan {seconds:.2f} s ({runs[n][0][1]} ops; passes "
              f"{sum(timings.values()):.2f} s, completion {timings['completion']:.2f} s) | "
              f"torch make_fx trace alone {baseline:.2f} s | ratio plan/trace "
              f"{seconds / baseline:.2f}")
    print(f"48 / 24 layers: plan {medians[48] / medians[24]:.2f}x "
          f"(torch trace alone "
          f"{statistics.median(traces[48]) / statistics.median(traces[24]):.2f}x)")
    return medians


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args().repeats)
