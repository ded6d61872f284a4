"""autopar tensor parallel vs DTensor ``parallelize_module``: training step time of the same
GPT on 2 gloo ranks (tp2), paired in one run, and each rank's parameter + optimizer bytes.

    .venv/bin/python bench/tp_vs_dtensor.py [--steps 30] [--profile]

The script launches its own ranks (torchrun's environment on a free loopback port, one
thread each). Both sides shard the same layers the Megatron way, ``qkv`` and ``fc1``
column-parallel, ``proj`` and ``fc2`` row-parallel (``configs/tp.yaml`` without the
vocab-parallel embedding, which DTensor's plan here does not have): autopar through its
strategy and ``Engine.train_step``, DTensor through ``ColwiseParallel``/``RowwiseParallel``
on a ``DeviceMesh("cpu", [0, 1])`` with the same AdamW. Every rank gets the same global
batch.

The GPT's attention splits the qkv output and views q/k/v with the *global* head count, so
the DTensor side keeps qkv's output a DTensor (``use_local_output=False``): the split and
views then run on DTensors with DTensor's own sharding rules, and the row-parallel ``proj``
takes that DTensor as it is. DTensor has no sharding rule for CPU flash attention
(``aten._scaled_dot_product_flash_attention_for_cpu``), so both sides run the GPT's explicit
masked-softmax attention (``sdpa=False``; the same ops for both), the DTensor forward and
backward under ``implicit_replication`` because the causal mask is a plain tensor.

Both sides' losses are checked equal to single-device eager torch (fp32, rtol 1e-5) for a
few steps before timing, so the comparison is between two correct implementations of the
same plan. Then the steps alternate (warm-up first) and
rank 0 prints the median step times (each step: the slowest rank), the ratio
autopar/DTensor (< 1 means autopar is faster) and the bytes of state each rank holds.
``--profile`` adds where autopar's step and DTensor's spend their time
(``bench/profile_step.py``).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import (  # noqa: E402
    compiled_strategy,
    finish,
    first_steps,
    gpt_and_batch,
    gpt_arguments,
    held_state,
    init,
    local,
    main,
    paired,
    print_held_state,
    report,
)

import autopar as ap  # noqa: E402
from autopar.models import GPT  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

CHECKED_STEPS = 3
PLANS = {   # plan name -> (colwise, rowwise) layers of each block
    "megatron": (("attn.qkv", "fc1"), ("attn.proj", "fc2")),
    "mlp": (("fc1",), ("fc2",)),
}


def strategy(world: int, plan_name: str = "megatron", sequence_parallel: bool = False
             ) -> ap.Strategy:
    colwise, rowwise = PLANS[plan_name]
    plan = {f"blocks.*.{name}": "colwise" for name in colwise}
    plan.update({f"blocks.*.{name}": "rowwise" for name in rowwise})
    return ap.Strategy(mesh={"shape": [world], "dim_names": ["tp"]},
                       tensor_parallel={"axis": "tp", "plan": plan,
                                        "sequence_parallel": sequence_parallel})


def dtensor_model(model: GPT, mesh: DeviceMesh, plan_name: str = "megatron",
                  sequence_parallel: bool = False) -> GPT:
    """The model with DTensor's plan on the same layers as ``strategy``; with
    ``sequence_parallel``, torchtitan's: ``SequenceParallel`` on the block norms, the
    colwise layers taking sequence shards, the rowwise ones making them, the blocks'
    residual stream sequence-sharded from the first block to the final norm."""
    colwise, rowwise = PLANS[plan_name]
    seq = {"input_layouts": Shard(1)} if sequence_parallel else {}
    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {}
    for i in range(len(model.blocks)):
        for name in colwise:
            # qkv's output stays a DTensor: the attention splits and views it globally;
            # under SP the attention's input is gathered first (below), as torchtitan does
            qkv = name == "attn.qkv"
            plan[f"blocks.{i}.{name}"] = ColwiseParallel(use_local_output=not qkv,
                                                         **({} if qkv else seq))
        for name in rowwise:
            plan[f"blocks.{i}.{name}"] = RowwiseParallel(**out)
        if sequence_parallel:
            # local outputs: the residual stream holds plain sequence shards
            plan[f"blocks.{i}.ln1"] = SequenceParallel(use_local_output=True)
            plan[f"blocks.{i}.ln2"] = SequenceParallel(use_local_output=True)
            plan[f"blocks.{i}.attn"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=False)
    if sequence_parallel:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                              desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
        plan["ln_f"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return parallelize_module(model, mesh, plan)


def _args(argv=None) -> argparse.Namespace:
    parser = gpt_arguments(__doc__)
    parser.add_argument("--plan", choices=sorted(PLANS), default="megatron",
                        help="megatron: qkv + MLP (default); mlp: the MLP only")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron-SP: autopar's sequence_parallel vs DTensor's "
                             "SequenceParallel")
    args = parser.parse_args(argv)
    if args.sequence_parallel and args.plan != "megatron":
        parser.error("--sequence-parallel needs --plan megatron (the attention of a sequence-"
                     "sharded residual stream must be tensor parallel too)")
    return args


def rank_main(args: argparse.Namespace) -> None:
    rank, world = init()
    model, x, y = gpt_and_batch(args, sdpa=False)
    eager, theirs_model = copy.deepcopy(model), copy.deepcopy(model)

    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=compiled_strategy(
                           strategy(world, args.plan, args.sequence_parallel), args.compile))
    mesh = DeviceMesh("cpu", list(range(world)))
    theirs_model = dtensor_model(theirs_model, mesh, args.plan, args.sequence_parallel)
    dt_opt = torch.optim.AdamW(theirs_model.parameters(), lr=1e-3)
    forward = torch.compile(theirs_model) if args.compile else theirs_model
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)

    def torch_step(m, opt) -> float:
        opt.zero_grad()
        with implicit_replication():      # the causal mask is a plain tensor
            loss = lm_loss(m(x), y)
            loss.backward()
        opt.step()
        return float(local(loss.detach()))

    def dtensor_step() -> float:
        return torch_step(forward, dt_opt)

    def autopar_step() -> float:
        return engine.train_step(x, y)

    first = first_steps({"autopar": autopar_step, "DTensor": dtensor_step})
    eager_step = lambda: torch_step(eager, eager_opt)  # noqa: E731
    eager_step()
    _check_losses({"autopar": autopar_step, "DTensor": dtensor_step}, eager_step)
    times = paired({"autopar": autopar_step, "DTensor": dtensor_step}, args.steps, args.warmup)
    memory = held_state(engine, eager, eager_opt, "autopar tp, per rank",
                        {"DTensor tp, per rank": (theirs_model, dt_opt)})
    if rank == 0:
        print(f"GPT {args.layers}x{args.width}, batch {args.batch}x{args.seq} on every rank, "
              f"AdamW, tensor parallel ({args.plan} plan"
              f"{', sequence parallel' if args.sequence_parallel else ''}) on {world} gloo ranks, "
              f"{torch.get_num_threads()} thread(s) each"
              + (f"; compiled both (first step: autopar {first['autopar']:.1f} s, DTensor + "
                 f"torch.compile {first['DTensor']:.1f} s)" if args.compile else ""))
        report(times, "autopar", "DTensor")
        print_held_state(memory, world)
    if args.profile:
        from profile_step import profile_pair
        profile_pair(engine, autopar_step, "DTensor", dtensor_step, rank)
    finish()


def _check_losses(steps: dict, eager_step) -> None:
    """Both parallel runs reproduce single-device eager losses step for step."""
    for step in range(CHECKED_STEPS):
        want = eager_step()
        for name, fn in steps.items():
            got = fn()
            if abs(got - want) > 1e-6 + 1e-5 * abs(want):
                raise AssertionError(f"step {step}: {name} loss {got:.7f} != eager {want:.7f}")


if __name__ == "__main__":
    main(__file__, lambda: rank_main(_args()))
