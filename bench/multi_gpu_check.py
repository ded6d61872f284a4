"""The prepared check of autopar on two or more CUDA GPUs (issue 28): NCCL parity and step
time of data, tensor, ZeRO-3 and pipeline parallelism against their torch-native peers,
one call, at most about 8 minutes, printing one table for bench/README.md.

    python bench/multi_gpu_check.py [--gpus 2] [--budget-s 480] [--steps 30]
                                    [--layers 4 --width 128 --seq 64 --batch 8]

Not under torchrun, it relaunches itself through ``torch.distributed.run`` on ``--gpus``
local ranks (NCCL, ``cuda:LOCAL_RANK``, autopar with ``device: cuda``). Rows, each in its
own try (a failing row says why and the next one runs; a row that would start past the
budget is reported as not run):

* dp vs DDP (``bench/dp_vs_ddp.py``'s strategy: ``configs/dp.yaml``);
* tp, the Megatron plan (qkv, fc1 column-, proj, fc2 row-parallel), vs DTensor's
  ``parallelize_module`` (``bench/tp_vs_dtensor.py``'s strategy and plan; the GPT's explicit
  attention on both sides, as there);
* ZeRO-3 vs FSDP2 (``bench/zero_vs_fsdp2.py``'s strategy and wrapping);
* pp 1F1B vs ``torch.distributed.pipelining.Schedule1F1B`` (``bench/pp_vs_pipelining.py``'s
  strategy and hand-built stages; two ranks only, ``tie_weights=False``).

Every row trains the benchmarks' small GPT (``bench/ranks.py``, no qkv bias: ``gpu_check``'s
reason) with AdamW (a 10-step linear warmup, as the parity tests train) for 3 steps on
autopar, on the peer and on single-device eager (each rank's own GPU, the global batch):
both parallel sides' losses must equal eager's at fp32 rtol 1e-5, atol 1e-6 (TF32 off), and
autopar's gathered parameters too, or be no farther from eager's than twice the peer's are
(AdamW magnifies the last bits a sum over ranks changes: DDP itself misses atol here on
gloo). Then the two sides' steps alternate (warm-up first, each step from a barrier and
synchronized, its time the slowest rank's) and the row gives their medians and the ratio
autopar/peer (< 1: autopar faster), which must be at most ``gpu_check.SPEED_LIMIT`` (1.10)
for the row to pass. A row for another world size (HSDP: 4 ranks; pp: 2) is skipped. Rank 0
prints the table; the exit status is 1 when a row failed, raised or was not run for want of
budget (``gpu_check.exit_status``), 0 when all passed or were skipped. A rank stuck in a collective
(a row failing on some ranks only) ends the run after ``--timeout-s``, the rows printed so
far standing. Each side's helpers come from those benchmarks and ``bench/ranks.py``; the
parity and timing here are their CPU ones made device-aware (synchronized, NCCL tensors).

Without CUDA or with fewer than 2 GPUs it says so in one line and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dp_vs_ddp  # noqa: E402
import pp_vs_pipelining  # noqa: E402
import tp_vs_dtensor  # noqa: E402
import zero_vs_fsdp2  # noqa: E402
from gpu_check import ATOL, RTOL, SKIPPED, STEPS, exit_status, speed_ratio  # noqa: E402
from ranks import gpt_and_batch, gpt_arguments, in_rank, local  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402

Row = Callable[[argparse.Namespace, torch.device], tuple[bool, str]]
Step = Callable[[], float]


# ------------------------------------------------------------------------ the pieces


def _model(args: argparse.Namespace, device: torch.device, **config) -> tuple:
    """The benchmarks' GPT (same seed on every rank) without the qkv bias (Adam follows the
    rounding noise of its zero gradients, not a difference of ours), and the global batch,
    on ``device``."""
    model, x, y = gpt_and_batch(args, **config)
    for block in model.blocks:
        block.attn.qkv.register_parameter("bias", None)
    return model.to(device), x.to(device), y.to(device)


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    """AdamW with a GPT run's linear warmup (over 10 steps), as the parity tests train
    (tests/parity.py): Adam's first full step moves an element whose gradient is near zero
    by ``lr`` whatever its last bits, and a sum over ranks has other last bits than eager's."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


def _engine(model: torch.nn.Module, strategy: ap.Strategy, device: torch.device) -> ap.Engine:
    """autopar on ``strategy`` (a mesh of one dim: the launch's width), on ``device``'s type
    (the engine takes ``cuda:LOCAL_RANK`` itself)."""
    config = strategy.model_dump(exclude_unset=True)
    if len(config["mesh"]["shape"]) == 1:
        config["mesh"]["shape"] = [dist.get_world_size()]
    config["device"] = device.type
    opt, schedule = _optimizer(model)
    return ap.Engine(model, lm_loss, opt, strategy=ap.Strategy(**config), lr_scheduler=schedule)


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
           wrap: Callable[[], object] | None = None) -> Callable[[], torch.Tensor]:
    """A plain torch training step of ``model`` (eager, or a torch peer's wrapped model) on
    ``x``, ``y`` (``_optimizer``); returns the loss tensor. ``wrap``: a context for forward
    and backward (DTensor's ``implicit_replication``)."""
    opt, schedule = _optimizer(model)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with (wrap or contextlib.nullcontext)():
            loss = lm_loss(model(x), y)
            loss.backward()
        opt.step()
        schedule.step()
        return loss.detach()
    return step


def _mean_over_ranks(step: Callable[[], torch.Tensor]) -> Step:
    """A data-parallel peer's global-batch loss: the mean of the ranks' equal halves."""
    def loss() -> float:
        value = step().clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return value.item()
    return loss


def _parity(sides: dict[str, Step], eager: Step, src: int, device: torch.device
            ) -> tuple[bool, str]:
    """Each side's loss against eager's, step for step. Every rank runs every step; the
    figures of rank ``src`` are judged (a pipeline's loss is its last stage's), broadcast so
    that every rank reaches the same verdict and goes on alike."""
    worst, ok = dict.fromkeys(sides, 0.0), True
    for _ in range(STEPS):
        want = eager()
        got = [step() for step in sides.values()]
        figures = torch.tensor([want, *got], dtype=torch.float64, device=device)
        dist.broadcast(figures, src)
        want, *got = figures.tolist()
        for name, value in zip(sides, got):
            ok = ok and abs(value - want) <= ATOL + RTOL * abs(want)
            worst[name] = max(worst[name], abs(value - want) / max(abs(want), 1e-12))
    return ok, ", ".join(f"{name} loss max rel {w:.1e}" for name, w in worst.items())


def _distance(params: dict[str, torch.Tensor], eager: torch.nn.Module) -> tuple[float, bool]:
    """(the largest difference of ``params``, by name, from eager's, whether all are within
    rtol, atol)."""
    worst, close = 0.0, True
    for name, want in eager.named_parameters():
        got, want = params[name].detach().float().cpu(), want.detach().float().cpu()
        worst = max(worst, (got - want).abs().max().item())
        close = close and torch.allclose(got, want, rtol=RTOL, atol=ATOL)
    return worst, close


def _whole(model: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    """A torch peer's parameters, whole (a DTensor's gathered: a collective)."""
    from torch.distributed.tensor import DTensor
    return lambda: {n: p.full_tensor() if isinstance(p, DTensor) else p
                    for n, p in model.named_parameters()}


def _params(engine: ap.Engine, eager: torch.nn.Module, peer: str,
            peer_params: Callable[[], dict[str, torch.Tensor]] | None) -> tuple[bool, str]:
    """autopar's gathered parameters against eager's: within rtol, atol, or no farther than
    twice the torch peer's (a sum over ranks has other last bits than eager's, and AdamW
    magnifies them where a gradient is near zero: DDP itself misses atol on this GPT)."""
    ours, close = _distance(engine.state_dict(), eager)     # a collective: gathered
    text = f"params vs eager max abs: autopar {ours:.1e}"
    if peer_params is None:
        return close, text
    theirs, _ = _distance(peer_params(), eager)
    return close or ours <= 2 * theirs, f"{text}, {peer} {theirs:.1e}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], object], device: torch.device) -> float:
    """One step's seconds on this rank: from a barrier, the GPU idle, to the GPU done (a
    step returns at launch)."""
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _paired(steps: dict[str, Callable[[], object]], measured: int, warmup: int,
            device: torch.device) -> dict[str, float]:
    """Each side's median step, the sides interleaved (``bench/ranks.py``'s ``paired``),
    each step's time the slowest rank's."""
    times = {name: [] for name in steps}
    for i in range(warmup + measured):
        for name, step in steps.items():
            t = _timed(step, device)
            if i >= warmup:
                times[name].append(t)
    out = {}
    for name, ts in times.items():
        worst = torch.tensor(ts, dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = statistics.median(worst.tolist())
    return out


def _judge(args: argparse.Namespace, engine: ap.Engine, eager: torch.nn.Module,
           x: torch.Tensor, y: torch.Tensor, peer: str, peer_loss: Step,
           peer_step: Callable[[], object], peer_params=None, src: int = 0
           ) -> tuple[bool, str]:
    """A row's verdict: parity of both sides with eager (``_parity``; autopar's parameters
    gathered too), then their step times: autopar/peer at most ``SPEED_LIMIT``."""
    ours = lambda: engine.train_step(x, y)  # noqa: E731
    ok, losses = _parity({"autopar": ours, peer: peer_loss}, _as_float(_train(eager, x, y)),
                         src, x.device)
    same, params = _params(engine, eager, peer, peer_params)
    ok = ok and same
    times = _paired({"autopar": ours, peer: peer_step}, args.steps, args.warmup, x.device)
    engine.close()
    fast, speed = speed_ratio(times["autopar"], times[peer], peer)
    return ok and fast, (f"{losses}; {params}; step autopar {times['autopar'] * 1e3:.2f} ms, "
                         f"{peer} {times[peer] * 1e3:.2f} ms, {speed}")


def _as_float(step: Callable[[], torch.Tensor]) -> Step:
    return lambda: step().item()


# ------------------------------------------------------------------------------ rows


def row_dp(args: argparse.Namespace, device: torch.device) -> tuple[bool, str]:
    from torch.nn.parallel import DistributedDataParallel
    world, rank = dist.get_world_size(), dist.get_rank()
    model, x, y = _model(args, device)
    theirs, eager = copy.deepcopy(model), copy.deepcopy(model)
    engine = _engine(model, dp_vs_ddp.strategy(None), device)
    mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    ids = [device.index] if device.type == "cuda" else None
    ddp = _train(DistributedDataParallel(theirs, device_ids=ids), x[mine], y[mine])
    return _judge(args, engine, eager, x, y, "DDP", _mean_over_ranks(ddp), ddp,
                  _whole(theirs))


def row_tp(args: argparse.Namespace, device: torch.device) -> tuple[bool, str]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import implicit_replication
    world = dist.get_world_size()
    model, x, y = _model(args, device, sdpa=False)   # DTensor: no rule for a masked SDPA
    theirs, eager = copy.deepcopy(model), copy.deepcopy(model)
    engine = _engine(model, tp_vs_dtensor.strategy(world), device)
    theirs = tp_vs_dtensor.dtensor_model(theirs, DeviceMesh(device.type, list(range(world))))
    # the causal mask is a plain tensor among DTensors
    step = _train(theirs, x, y, implicit_replication)
    return _judge(args, engine, eager, x, y, "DTensor", lambda: float(local(step())),
                  step, _whole(theirs))


def row_zero3(args: argparse.Namespace, device: torch.device, offload: bool = False,
              hsdp: bool = False) -> tuple[bool, str]:
    """ZeRO-3 against FSDP2; ``offload``: both keep parameters and optimizer state in host
    memory (``sharding.offload`` / ``CPUOffloadPolicy``); ``hsdp``: on a [rep, shard] mesh
    of 2 x 2 (``configs/hsdp.yaml`` / ``fully_shard(mesh=2-D)``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    world, rank = dist.get_world_size(), dist.get_rank()
    if hsdp and world != 4:
        raise ValueError(f"HSDP's mesh is [2, 2]; launched on {world} ranks")
    model, x, y = _model(args, device)
    theirs, eager = copy.deepcopy(model), copy.deepcopy(model)
    strategy = zero_vs_fsdp2.strategy(hsdp)
    if offload:
        data = strategy.model_dump(exclude_defaults=True)
        data["sharding"]["offload"] = {"optimizer": True, "params": True}
        strategy = ap.Strategy.model_validate(data)
    engine = _engine(model, strategy, device)
    mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    if offload:
        for block in theirs.blocks:
            fully_shard(block, offload_policy=CPUOffloadPolicy())
        theirs = fully_shard(theirs, offload_policy=CPUOffloadPolicy())
    else:
        theirs = zero_vs_fsdp2.fsdp_model(theirs, hsdp=hsdp)
    fsdp = _train(theirs, x[mine], y[mine])
    return _judge(args, engine, eager, x, y, "FSDP2", _mean_over_ranks(fsdp), fsdp,
                  _whole(theirs))


def row_pp(args: argparse.Namespace, device: torch.device) -> tuple[bool, str]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != 2:
        raise ValueError(f"the hand-built torch stages are two; launched on {world} ranks")
    cut, micro = args.layers // 2, args.micro_batches
    # untied: tied, the head would be a weight of both hand-built stages (pp_vs_pipelining)
    model, x, y = _model(args, device, tie_weights=False)
    theirs, eager = copy.deepcopy(model), copy.deepcopy(model)
    engine = _engine(model, pp_vs_pipelining.strategy(world, cut, micro), device)
    stage_module = pp_vs_pipelining.Stage(theirs, rank, cut)
    schedule = Schedule1F1B(PipelineStage(stage_module, rank, num_stages=world, device=device),
                            n_microbatches=micro, loss_fn=lm_loss)
    opt, warmup = _optimizer(stage_module)

    def torch_step() -> float:
        """This rank's stage; the micro-batches' mean loss on the last stage, else nan."""
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
        opt.step()
        warmup.step()
        return torch.stack(losses).mean().item() if losses else float("nan")
    return _judge(args, engine, eager, x, y, "pipelining", torch_step, torch_step,
                  src=world - 1)


def rows(world: int) -> list[tuple[str, Row, str | None]]:
    """The check's rows on a launch of ``world`` ranks: (name, row, why it is skipped on
    this launch or None)."""
    def needs(ranks: int) -> str | None:
        return None if world == ranks else f"needs {ranks} ranks, launched on {world}"
    return [(f"dp{world} vs DDP", row_dp, None),
            (f"tp{world} Megatron vs DTensor", row_tp, None),
            (f"ZeRO-3 dp{world} vs FSDP2", row_zero3, None),
            (f"ZeRO-3 dp{world} + offload vs FSDP2 CPUOffloadPolicy",
             functools.partial(row_zero3, offload=True), None),
            ("HSDP [2, 2] vs FSDP2 2-D mesh", functools.partial(row_zero3, hsdp=True),
             needs(4)),
            ("pp2 1F1B vs pipelining", row_pp, needs(2))]


# ------------------------------------------------------------------------ the launch


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = gpt_arguments(__doc__)
    parser.add_argument("--gpus", type=int, default=2, help="ranks, one GPU each (default 2)")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="NCCL collective timeout: how long a stuck rank can hold the run")
    args = parser.parse_args(argv)
    if args.profile or args.compile:
        parser.error("--profile and --compile are the single benchmarks' options, not this "
                     "check's")
    if args.gpus < 2:
        parser.error(f"--gpus {args.gpus}: the check needs 2 or more")
    return args


def _why(err: BaseException) -> str:
    """An error in a table cell: its type, first line and where it was raised."""
    where = traceback.extract_tb(err.__traceback__)[-1]
    first = (str(err).splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first} ({Path(where.filename).name}:{where.lineno})"


def _agreed(flag: bool, device: torch.device) -> bool:
    """Rank 0's ``flag``, on every rank: they take the same branch around collectives."""
    value = torch.tensor([int(flag)], device=device)
    dist.broadcast(value, 0)
    return bool(value.item())


def _run_row(row: Row, args: argparse.Namespace, device: torch.device) -> tuple[str, str]:
    """(result, detail) of one row, the worst over the ranks (a rank's error reported even
    where rank 0 passed)."""
    try:
        ok, detail = row(args, device)
        mine = ("pass" if ok else "FAIL", detail)
    except Exception as err:               # a failing row is a result, the next one runs
        mine = ("ERROR", _why(err))
    _sync(device)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, (result, detail) in enumerate(everyone):
        if result != "pass":
            return result, f"rank {rank}: {detail}"
    return everyone[0]


def rank_main(args: argparse.Namespace) -> int:
    """One rank of the check (under torchrun)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s),
                            device_id=device)
    torch.backends.cuda.matmul.allow_tf32 = False    # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        _header(world, args)
    start = time.perf_counter()
    results = []
    for name, row, skip in rows(world):
        began = time.perf_counter()
        if skip is not None:
            result, detail = SKIPPED, skip
        elif not _agreed(began - start <= args.budget_s, device):
            result, detail = "not run", f"budget of {args.budget_s:.0f} s spent"
        else:
            result, detail = _run_row(row, args, device)
        torch.cuda.empty_cache()
        results.append(result)      # the same on every rank (_run_row gathers them)
        if rank == 0:
            print(f"| {name} | {result} | {detail.replace('|', '/')} | "
                  f"{time.perf_counter() - began:.0f} |", flush=True)
    status = exit_status(results)
    if rank == 0:
        print(f"\nmulti_gpu_check: {len(results)} rows, {results.count('pass')} passed, "
              f"{results.count(SKIPPED)} skipped: exit {status}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return status


def _header(world: int, args: argparse.Namespace) -> None:
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"multi_gpu_check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {world} x "
          f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, NCCL {nccl}; GPT {args.layers}x{args.width}, seq "
          f"{args.seq}, global batch {args.batch}, AdamW fp32, {STEPS} parity steps "
          f"(rtol {RTOL:g}), median of {args.steps} timed steps\n")
    print("| check | result | detail | s |\n|---|---|---|---|", flush=True)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """This script on ``--gpus`` local ranks through torchrun; its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.gpus}", str(Path(__file__).resolve()), *argv]
    # c10d's deprecation notices would bury the table
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS="ignore::FutureWarning")
    try:
        return subprocess.run(command, env=env, timeout=args.budget_s + 300).returncode
    except subprocess.TimeoutExpired:
        print(f"multi_gpu_check: still running {args.budget_s + 300:.0f} s after launch; "
              "stopped", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        print(f"multi_gpu_check: needs 2 or more CUDA devices, this machine has {count} "
              f"(torch.cuda.is_available() is {torch.cuda.is_available()}); nothing to check")
        return 0
    if in_rank():
        return rank_main(args)
    if args.gpus > count:
        print(f"multi_gpu_check: --gpus {args.gpus}, this machine has {count} CUDA devices",
              file=sys.stderr)
        return 2
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
