"""Placement ILP time: a GPT (vocab 1024, block 128, 16 heads, E=1024, AdamW, batch 8 x 128)
of L = 2, 8, 24 layers on a 1-D [tp] mesh, tp = 2, 4, 8, as the planner asks it
(``auto.search``: one solve per tensor-parallel degree).

Per (L, tp): capture (``placed_program``), then ``solve_placements`` with the repeated layers
tied (``pass_infra.layers``) and, where ``--untied-up-to`` allows, untied too: build and solve
seconds, variables and rows, ops tied, the objective, whether the untied optimum places
every parameter as the tied one does, and the ``tensor_parallel.plan`` read back (exact:
each module's placements are what its plan style pins; the reason otherwise). Target (issue
16): L=24 under 10 s build + solve for every tp.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import autopar as ap
from autopar.auto import placed_program, solve_placements
from autopar.auto.tp_plan import tensor_parallel_plan_of
from autopar.cost.profile import Profile
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss


def _model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=1024, block_size=128, n_layer=layers, n_head=16,
                         n_embd=1024))


def _program(model: GPT, tp: int):
    ids = torch.randint(0, 1024, (8, 128))
    strategy = ap.Strategy.from_yaml_str(f"mesh: {{shape: [{tp}], dim_names: [tp]}}")
    return placed_program(model, lm_loss, torch.optim.AdamW(model.parameters()), strategy,
                          ids, ids)


def _plan_text(program, choice, mesh) -> str:
    plan, why = tensor_parallel_plan_of(program, choice.params, mesh)
    if plan is None:
        return "no exact plan: " + why
    layer0 = {m: s for m, s in plan.items() if not m.startswith("blocks.")
              or m.startswith("blocks.0.")}
    return ", ".join(f"{m} {s}" for m, s in sorted(layer0.items())) or "{} (replicated)"


def run(layers_list: list[int], degrees: list[int], untied_up_to: int, profile: Profile,
        time_limit_s: float) -> None:
    head = (f"{'L':>3} {'tp':>3} {'ops':>5} {'tied':>5} {'vars':>6} {'rows':>6} "
            f"{'capture':>8} {'build':>7} {'solve':>7} {'objective':>10} | "
            f"{'untied vars':>11} {'build':>7} {'solve':>7} {'objective':>10} same")
    print(head)
    plans = []
    for layers in layers_list:
        model = _model(layers)
        for tp in degrees:
            start = time.perf_counter()
            program, ctx = _program(model, tp)
            capture_s = time.perf_counter() - start
            mesh = ctx.state.mesh
            tied = solve_placements(program, mesh, profile, time_limit_s=time_limit_s)
            line = (f"{layers:>3} {tp:>3} {len(program.ops):>5} {tied.tied_ops:>5} "
                    f"{tied.variables:>6} {tied.constraints:>6} {capture_s:>7.2f}s "
                    f"{tied.build_s:>6.2f}s {tied.solve_s:>6.2f}s "
                    f"{tied.objective_s * 1e3:>8.1f}ms | ")
            if layers <= untied_up_to:
                free = solve_placements(program, mesh, profile, time_limit_s=time_limit_s,
                                        tie_layers=False)
                same = free.params == tied.params
                line += (f"{free.variables:>11} {free.build_s:>6.2f}s {free.solve_s:>6.2f}s "
                         f"{free.objective_s * 1e3:>8.1f}ms {'yes' if same else 'NO'}")
            else:
                line += f"{'-':>11}"
            print(line, flush=True)
            plans.append((layers, tp, _plan_text(program, tied, mesh)))
    print("\ntensor_parallel.plan read back (tied; non-layer modules and blocks.0):")
    for layers, tp, text in plans:
        print(f"  L={layers:<3} tp={tp}: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--untied-up-to", type=int, default=8,
                        help="also solve untied for models of at most this many layers")
    parser.add_argument("--profile", default=None,
                        help="a profile JSON (default: the shipped reference profile)")
    parser.add_argument("--time-limit", type=float, default=120.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    profile = Profile.load(args.profile) if args.profile else Profile.reference()
    run(args.layers, args.tp, args.untied_up_to, profile, args.time_limit)


if __name__ == "__main__":
    main()
