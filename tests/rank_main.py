"""What one real rank runs for a multi-process test (launched by ``tests/multiproc.py``):
``python tests/rank_main.py <scenario> [args]``. The rank's result is saved to
``$AUTOPAR_TEST_RESULT_DIR/rank<RANK>.pt`` for the test process to compare."""
from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from parity import gpt_optimizer, lm_data, parity_gpt  # noqa: E402

import autopar as ap  # noqa: E402

ROOT = Path(__file__).parent.parent


def train_gpt(config: str, optim: str, steps: str, batch: str, dropout: str = "0",
              trace_dir: str = "", layers: str = "2") -> dict:
    """The GPT of ``parity_gpt`` trained through ``Engine.fit`` on ``configs/<config>.yaml``
    (with ``trace_dir``: dumps and a pipeline trace there), then evaluated and asked to
    predict on the first batch."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt(optim, dropout=float(dropout), layers=int(layers))
    optimizer, scheduler = gpt_optimizer(optim, model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    if trace_dir:
        strategy = strategy.model_copy(update={"debug": ap.Strategy(
            debug={"dump_dir": trace_dir, "trace": True}).debug})
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    data = lm_data(int(steps) * int(batch), 16, 64)
    history = engine.fit(data, batch_size=int(batch), verbose=0)
    valid = engine.evaluate(data[:int(batch)], batch_size=int(batch))
    predicted = engine.predict(data[:int(batch)], batch_size=int(batch))[0]
    return {"loss": history["loss"], "state": engine.state_dict(), "valid": valid,
            "optim": engine.optimizer.state_dict()["state"], "predict": predicted}


def train_nodes(config: str, optim: str, steps: str, batch: str, dropout: str) -> dict:
    """``train_gpt`` on a launch of several torchrun agents (``tests/engine/test_multinode.py``):
    its losses and final state, plus what this rank's agent told it (torchrun's variables,
    the test's own ``AUTOPAR_TEST_NODE`` label of the agent), what the engine read of it
    (``engine.launch``, ``engine.device``) and the ranks of each c10d group it trains in."""
    from autopar.models.gpt import lm_loss
    from autopar.runtime.process_groups import _CACHE
    model = parity_gpt(optim, dropout=float(dropout))
    optimizer, scheduler = gpt_optimizer(optim, model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    history = engine.fit(lm_data(int(steps) * int(batch), 16, 64), batch_size=int(batch),
                         verbose=0)
    groups = {mesh.dim_names[d]: mine.axes[d].ranks
              for mesh, mine in _CACHE.items() for d in range(mesh.ndim)}
    environ = {k: os.environ.get(k) for k in ("AUTOPAR_TEST_NODE", "RANK", "WORLD_SIZE",
                                              "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                              "GROUP_WORLD_SIZE", "ROLE_RANK", "MASTER_ADDR")}
    return {"loss": history["loss"], "state": engine.state_dict(), "environ": environ,
            "agent_pid": os.getppid(), "launch": engine.launch, "device": str(engine.device),
            "groups": groups}


def train_elastic(save_dir: str, marker_dir: str, steps: str, batch: str) -> dict:
    """dp4 with ``elastic: {on_resize: data_parallel}``, a checkpoint every step, resumed
    from the newest (``tests/engine/test_multinode.py``). On the first attempt the workers of the
    agent labelled 1 stop after step 2 (each writes a marker and sleeps: the test then kills
    that agent, a lost machine); the survivors' collectives fail, their agent restarts them
    on the world that is left, and the engine resizes dp and resumes. What the restarted
    run trained: its losses, its mesh, where it resumed, the agent's restart count."""
    import time

    from autopar.engine.callbacks import Callback
    from autopar.models.gpt import lm_loss
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class LoseNodeOne(Callback):
        def on_step_end(self, step: int, logs: dict) -> None:
            if restarts == 0 and self.engine.global_step == 2 \
                    and os.environ["AUTOPAR_TEST_NODE"] == "1":
                (Path(marker_dir) / f"rank{os.environ['RANK']}").write_text("ready")
                time.sleep(600)                  # until the test kills this machine

    model = parity_gpt("adamw", dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [4], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
        "elastic: {on_resize: data_parallel}\ncollective_timeout_s: 60\n")
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    history = engine.fit(lm_data(int(steps) * int(batch), 16, 64), batch_size=int(batch),
                         steps_per_epoch=int(steps), verbose=0, save_dir=save_dir,
                         save_freq=1, keep_last=3, resume=True, callbacks=[LoseNodeOne()])
    return {"loss": history["loss"], "mesh": engine.strategy.mesh.shape,
            "restarts": restarts, "steps": engine.global_step}


def train_auto(steps: str, profile: str) -> dict:
    """``auto: {devices: 2}``: rank 0 plans, every rank trains its choice
    (``tests/auto/test_auto_search.py``)."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("adamw")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(
                           f"auto: {{devices: 2, top: 2, profile: {profile}}}"))
    history = engine.fit(lm_data(int(steps) * 8, 16, 64), batch_size=8, verbose=0)
    return {"loss": history["loss"], "state": engine.state_dict(),
            "strategy": engine.strategy.to_yaml()}


def train_and_close(config: str) -> dict:
    """Train inside ``with Engine(...)``: leaving it releases the process groups."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("sgd")
    optimizer, scheduler = gpt_optimizer("sgd", model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    with ap.Engine(model, lm_loss, optimizer, strategy=strategy,
                   lr_scheduler=scheduler) as engine:
        losses = engine.fit(lm_data(8, 16, 64), batch_size=4, verbose=0)["loss"]
        state = engine.state_dict()
    return {"loss": losses, "state": state, "initialized": torch.distributed.is_initialized()}


def train_until_killed(config: str, marker_dir: str) -> dict:
    """Train the GPT step after step until the test kills a rank: each rank writes
    ``<marker_dir>/rank<R>.pid`` once it has finished two steps, so the kill lands mid-run.
    A collective timeout of 60 s bounds how long a peer of a hung (not dead) rank waits."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("sgd")
    optimizer, _ = gpt_optimizer("sgd", model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml").model_copy(
        update={"collective_timeout_s": 60.0})
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*lm_data(8, 16, 64)))
    for step in range(100_000):
        engine.train_step(x, y)
        if step == 1:
            marker = Path(marker_dir) / f"rank{os.environ['RANK']}.pid"
            marker.write_text(str(os.getpid()))
    raise AssertionError("the test should have killed a rank long before")


def collectives() -> dict:
    """Every reshard step as a real collective against the reference semantics, on every
    mesh this world size allows (row-major and shuffled ids), even and uneven."""
    from rank_collectives import check_all
    return check_all()


def memory_peaks(*strategy_yamls: str) -> list[dict]:
    """For each strategy in turn (a fresh AdamW GPT and engine): this rank's
    predicted peak bytes (``engine.cost``) and the peak the runtime counts (``RankMeter``:
    the rank's program op by op on its real pieces and collectives) over a training step,
    after a first step made the optimizer state; then the peak of every storage a step of
    the compiled program allocates (``AllocationMeter``)."""
    from autopar.models.gpt import lm_loss
    from autopar.runtime.memory_meter import AllocationMeter, RankMeter
    x, y = (torch.stack(t) for t in zip(*lm_data(8, 16, 64)))
    results = []
    for text in strategy_yamls:
        model = parity_gpt("adamw")
        optimizer, _ = gpt_optimizer("adamw", model)
        engine = ap.Engine(model, lm_loss, optimizer, strategy=ap.Strategy.from_yaml_str(text))
        predicted = engine.cost(x, y)[int(os.environ["RANK"])]
        first = engine.train_step(x, y)
        step = engine.planner.plan("train", x, y)
        compiled = step.executor
        step.executor = meter = RankMeter(compiled, step.lowered)
        second = engine.train_step(x, y)
        step.executor = compiled
        with AllocationMeter([*engine.runtime.state.tensors.values(), x, y]) as allocated:
            engine.train_step(x, y)
        results.append({"predicted": predicted.peak, "measured": meter.peak,
                        "loss": [first, second], "held": meter.held(), "estimate": predicted,
                        "allocated": allocated.peak})
    return results


def train_zero(optim: str, steps: str, batch: str, vocab: str, dropout: str) -> dict:
    """The GPT of ``parity_gpt`` (tied embedding and head, ``dropout``) trained through
    ``Engine.fit`` on dp2 under ZeRO stages 1, 2 and 3 in turn (one fresh model and engine
    each, in one launch); per stage: the losses, ``engine.state_dict()`` and torch's
    ``optimizer.state_dict()`` after fit (whole tensors, gathered from the pieces)."""
    from autopar.models.gpt import lm_loss
    results = {}
    for stage in (1, 2, 3):
        model = parity_gpt(optim, vocab=int(vocab), dropout=float(dropout))
        optimizer, scheduler = gpt_optimizer(optim, model)
        strategy = ap.Strategy.from_yaml_str(
            "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
            f"sharding: {{stage: {stage}, axis: dp}}\n")
        engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy,
                           lr_scheduler=scheduler)
        data = lm_data(int(steps) * int(batch), 16, int(vocab))
        history = engine.fit(data, batch_size=int(batch), verbose=0)
        results[stage] = {"loss": history["loss"], "state": engine.state_dict(),
                          "optim": optimizer.state_dict()}
    return results


def train_offload(steps: str, batch: str) -> dict:
    """The AdamW GPT of ``parity_gpt`` (vocabulary 65) on dp2: ZeRO-2 with the optimizer
    offloaded, then ZeRO-3 with the parameters too; per layout the losses, the gathered
    ``engine.state_dict()`` and the state kinds this rank keeps on the host."""
    from autopar.models.gpt import lm_loss
    results = {}
    for layout, text in (("zero2", "stage: 2, axis: dp, offload: {optimizer: true}"),
                         ("zero3", "stage: 3, axis: dp, offload: {optimizer: true, "
                                   "params: true}")):
        model = parity_gpt("adamw", vocab=65)
        optimizer, scheduler = gpt_optimizer("adamw", model)
        strategy = ap.Strategy.from_yaml_str(
            "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
            f"sharding: {{{text}}}\n")
        engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy,
                           lr_scheduler=scheduler)
        history = engine.fit(lm_data(int(steps) * int(batch), 16, 65), batch_size=int(batch),
                             verbose=0)
        pieces = engine.runtime.state.pieces
        results[layout] = {"loss": history["loss"], "state": engine.state_dict(),
                           "on_host": {p.key.kind.value for p in pieces.values() if p.on_host}}
    return results


def train_hsdp(steps: str, batch: str) -> dict:
    """The AdamW GPT of ``parity_gpt`` (vocabulary 65, dropout 0.1) on ``configs/hsdp.yaml``
    (4 ranks: data parallel over [rep, shard], ZeRO-3 over shard): the losses and the
    gathered ``engine.state_dict()``."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("adamw", vocab=65, dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    engine = ap.Engine(model, lm_loss, optimizer, lr_scheduler=scheduler,
                       strategy=ap.Strategy.from_yaml(ROOT / "configs" / "hsdp.yaml"))
    history = engine.fit(lm_data(int(steps) * int(batch), 16, 65), batch_size=int(batch),
                         verbose=0)
    return {"loss": history["loss"], "state": engine.state_dict()}


def train_meta(layout: str, steps: str) -> dict:
    """A GPT built on the meta device trained on 2 ranks (``layout``: ``zero3``, ZeRO-3 over
    dp2; ``pp2``, a 1F1B pipeline): each rank draws only its pieces while its executor is
    made (profiled: the largest allocation), then trains; the model stays on meta."""
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import lm_loss
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=65, block_size=16,
                              dropout=0.1))
    optimizer, _ = gpt_optimizer("sgd", model)
    strategy = ap.Strategy.from_yaml_str({
        "zero3": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
                 "sharding: {stage: 3, axis: dp}\n",
        "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
               "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n"}[layout])
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy)
    data = lm_data(int(steps) * 4, 16, 65)
    x, y = (torch.stack(t) for t in zip(*data[:4]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        engine._ready("train", x, y)          # plans, and makes the executor: the pieces
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    held = {n: t.numel() * t.element_size() for n, t in engine.runtime.state.tensors.items()
            if t is not None and "/" not in n}
    history = engine.fit(data, batch_size=4, verbose=0)
    return {"loss": history["loss"], "state": engine.state_dict(), "largest_alloc": largest,
            "held": held, "still_meta": all(p.is_meta for p in model.parameters())}


def train_merge(steps: str) -> dict:
    """The SGD GPT on ``configs/dp_merge.yaml`` (k = 4), a batch of 2 at a time: each
    batch's loss and how many elements this process all-reduced during it."""
    from autopar.models.gpt import lm_loss
    from autopar.runtime import collectives
    model = parity_gpt("sgd")
    optimizer, _ = gpt_optimizer("sgd", model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / "dp_merge.yaml")
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy)
    counted, functional = [0], collectives.FUNCTIONAL

    class Counting:
        """The functional collectives, all-reduced elements counted."""

        def __getattr__(self, name):
            return getattr(functional, name)

        def all_reduce(self, tensor, *args):
            counted[0] += tensor.numel()
            return functional.all_reduce(tensor, *args)

        def all_reduce_(self, tensor, *args):          # a bucket's, in place
            counted[0] += tensor.numel()
            return functional.all_reduce_(tensor, *args)

        def all_gather_into_tensor(self, tensor, *args):   # a small all-reduce of a pair
            counted[0] += tensor.numel()
            return functional.all_gather_into_tensor(tensor, *args)

    collectives.FUNCTIONAL = Counting()
    losses, reduced = [], []
    data = lm_data(int(steps) * 4 * 2, 16, 64)
    for i in range(0, len(data), 2):
        x, y = (torch.stack(t) for t in zip(*data[i:i + 2]))
        counted[0] = 0
        losses.append(engine.train_step(x, y))
        reduced.append(counted[0])
    collectives.FUNCTIONAL = functional
    return {"loss": losses, "reduced": reduced, "state": engine.state_dict()}


def amp_ranks(steps: str, batch: str, o2_steps: str) -> dict:
    """Mixed precision on 2 real gloo ranks (``tests/passes/test_amp.py``): torch's own DDP under
    O1, the reference autopar's dp2 O1 is measured against, then autopar's O2 with ZeRO-3
    and bf16 gradient reduce-scatters (bf16 collectives on gloo)."""
    from autopar.models.gpt import lm_loss
    torch.set_num_threads(1)
    ddp = _ddp_autocast(int(steps), int(batch))
    model = parity_gpt("adamw")
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / "dp_zero3.yaml").model_copy(update={
        "amp": ap.Strategy(amp={"enable": True, "level": "O2",
                                "reduce_dtype": "bfloat16"}).amp})
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    history = engine.fit(lm_data(int(o2_steps) * int(batch), 16, 64), batch_size=int(batch),
                         verbose=0)
    return {"ddp": ddp, "o2": {"loss": history["loss"], "state": engine.state_dict()}}


def _ddp_autocast(steps: int, batch: int) -> dict:
    """The AdamW GPT of ``parity_gpt`` in ``DistributedDataParallel`` (gloo), each rank on
    its contiguous half of every global batch (as the engine splits it), forward and loss
    under ``torch.autocast("cpu", torch.bfloat16)``."""
    from torch.nn.parallel import DistributedDataParallel

    from autopar.models.gpt import lm_loss
    dist = torch.distributed
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = parity_gpt("adamw")
    optimizer, scheduler = gpt_optimizer("adamw", model)
    ddp = DistributedDataParallel(model)
    data, rows = lm_data(steps * batch, 16, 64), batch // world
    losses = []
    for step in range(steps):
        mine = data[step * batch + rank * rows:step * batch + (rank + 1) * rows]
        x, y = (torch.stack(t) for t in zip(*mine))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {"loss": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train_scaled(steps: str, batch: str, inf_step: str, layout: str = "dp") -> dict:
    """Dynamic loss scaling on dp2 or pp2 (``layout``; ``tests/passes/test_loss_scaling.py``): its
    MLP and Adam, batch ``inf_step`` with an inf in its first sample's input (dp: rank 0's
    half); each step's scale and skip, whether the skipped step left this rank's state as
    it was, the final state."""
    from parity import regression_data

    from autopar.models import MLP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(16, 31, 5, depth=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mesh = {"dp": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
            "pp": "mesh: {shape: [2], dim_names: [pp]}\n"
                  "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n"}[layout]
    strategy = ap.Strategy.from_yaml_str(
        mesh + "amp: {loss_scale: dynamic, init_scale: 4.0, growth_interval: 2}\n")
    # the warmup of tests/passes/test_loss_scaling.py's eager loop (a skipped step steps it too)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    engine = ap.Engine(model, lambda out, y: torch.nn.functional.mse_loss(out, y), optimizer,
                       strategy=strategy, lr_scheduler=warmup)
    n, k = int(batch), int(inf_step)
    data = regression_data(int(steps) * n, 16, 5)
    x, y = data[k * n]
    data[k * n] = (torch.cat([x[:1] * float("inf"), x[1:]]), y)
    after = []
    for i in range(0, len(data), n):
        engine.train_step(*(torch.stack(t) for t in zip(*data[i:i + n])))
        state = {name: t.clone() for name, t in engine.state_dict().items()}
        state.update({f"{i}/{key}": v.clone() for i, s in optimizer.state_dict()["state"].items()
                      for key, v in s.items()})
        after.append(state)
    unchanged = all(torch.equal(after[k][name], v) for name, v in after[k - 1].items())
    return {"loss_scale": engine.history["loss_scale"], "skipped": engine.history["skipped"],
            "unchanged": unchanged, "state": after[-1]}


def train_callbacks(out_dir: str, epochs: str) -> dict:
    """The MLP of ``tests/engine/test_callbacks.py`` on ``configs/dp.yaml`` with EarlyStopping, a
    CSVLogger writing ``out_dir/log_rank<RANK>.csv`` and the progress display: where this
    rank stopped, its validation losses and what it printed."""
    import contextlib
    import io

    from parity import regression_data

    from autopar.engine.callbacks import CSVLogger, EarlyStopping
    from autopar.models import MLP
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    engine = ap.Engine(model, torch.nn.functional.mse_loss,
                       torch.optim.SGD(model.parameters(), lr=0.05),
                       strategy=ap.Strategy.from_yaml(ROOT / "configs" / "dp.yaml"))
    stop = EarlyStopping(patience=2)
    csv_path = Path(out_dir) / f"log_rank{os.environ['RANK']}.csv"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = engine.fit(regression_data(8, 16, 8), batch_size=4, epochs=int(epochs),
                             valid_data=regression_data(8, 16, 8, seed=1), log_freq=1,
                             callbacks=[stop, CSVLogger(csv_path)])
    return {"stopped_epoch": stop.stopped_epoch, "val_loss": history["val_loss"],
            "printed": printed.getvalue()}


# -- checkpoints (tests/checkpoint/test_checkpoint_ranks.py) --------------------------------------

from autopar.engine.callbacks import Callback  # noqa: E402

CKPT_BATCH = 4


def _ckpt_engine(config: str, timeout_s: float | None = None) -> ap.Engine:
    """The checkpoint tests' recipe: the AdamW GPT of ``parity_gpt`` (dropout 0.1, so each
    step's seed matters) with ``gpt_optimizer``'s warmup schedule, on ``configs/<config>``."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("adamw", dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    if timeout_s is not None:
        strategy = strategy.model_copy(update={"collective_timeout_s": timeout_s})
    return ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)


def _ckpt_fit(engine: ap.Engine, save_dir: str, save_freq: int, epochs: int, n_batches: int,
              resume: bool = False, callbacks: list | None = None) -> dict:
    """``fit`` over ``n_batches`` shuffled batches per epoch, checkpointing every
    ``save_freq`` steps into ``save_dir`` (keeping them all); the losses and the final
    parameters."""
    data = lm_data(n_batches * CKPT_BATCH, 16, 64)
    history = engine.fit(data, batch_size=CKPT_BATCH, epochs=epochs, shuffle=True, verbose=0,
                         save_dir=save_dir, save_freq=save_freq, keep_last=1000,
                         resume=resume, callbacks=callbacks)
    return {"loss": history["loss"], "state": _cloned(engine.state_dict())}


def _cloned(state: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def _layout(engine: ap.Engine) -> dict:
    """This rank's pieces of the model's state: pipeline stage owning each, how many boxes
    the piece is, whether this rank writes it to a checkpoint."""
    from autopar.checkpoint.boxes import piece_boxes, writes_piece
    state = engine.runtime.state
    pieces = {n: state.pieces[n] for n in engine.state.module_state_names()}
    return {"pp": state.pipeline.pp if state.pipeline is not None else None,
            "pieces": {n: {"owner": p.owner, "boxes": len(piece_boxes(p)),
                           "writes": writes_piece(p), "held": state.tensors.get(n) is not None}
                       for n, p in pieces.items()}}


class _CaptureAtSaves(Callback):
    """After ``ModelCheckpoint``: the parameters and torch's optimizer state at each
    checkpointed step, as ``state_dict`` gathers them."""

    def __init__(self, save_freq: int):
        self.save_freq, self.captured = save_freq, {}

    def on_step_end(self, step: int, logs: dict) -> None:
        engine = self.engine
        if engine.global_step % self.save_freq == 0:
            state = _cloned(engine.state_dict())
            optim = {i: _cloned(s) for i, s in engine.optimizer.state_dict()["state"].items()}
            self.captured[engine.global_step] = {"state": state, "optim": optim}


def ckpt_train(config: str, save_dir: str, save_freq: str, epochs: str, n_batches: str) -> dict:
    """The uninterrupted run: checkpoints every ``save_freq`` steps, each step's loss, the
    state at each checkpoint and at the end, this rank's layout."""
    engine = _ckpt_engine(config)
    capture = _CaptureAtSaves(int(save_freq))
    out = _ckpt_fit(engine, save_dir, int(save_freq), int(epochs), int(n_batches),
                    callbacks=[capture])
    return {**out, "captured": capture.captured, "layout": _layout(engine)}


def ckpt_resume(config: str, save_dir: str, save_freq: str, epochs: str, n_batches: str
                ) -> dict:
    """A fresh process resuming from the newest checkpoint in ``save_dir`` (``fit(...,
    resume=True)``) and training to the end of the run."""
    engine = _ckpt_engine(config)
    return _ckpt_fit(engine, save_dir, int(save_freq), int(epochs), int(n_batches),
                     resume=True)


def ckpt_until_killed(config: str, save_dir: str, save_freq: str, epochs: str, n_batches: str,
                      marker_dir: str) -> dict:
    """The run of ``ckpt_train`` until the test kills a rank: once a checkpoint exists each
    rank writes ``<marker_dir>/rank<R>.pid`` and from then on rests 0.5 s after each step,
    so the kill lands long before the run ends. A collective timeout of 60 s bounds how
    long a peer of a hung (not dead) rank waits."""
    import time

    from autopar.checkpoint.store import latest_checkpoint

    class MarkAndSlow(Callback):
        def on_step_end(self, step: int, logs: dict) -> None:
            marker = Path(marker_dir) / f"rank{os.environ['RANK']}.pid"
            if marker.exists():
                time.sleep(0.5)
            elif latest_checkpoint(save_dir) is not None:
                marker.write_text(str(os.getpid()))

    engine = _ckpt_engine(config, timeout_s=60.0)
    _ckpt_fit(engine, save_dir, int(save_freq), int(epochs), int(n_batches),
              callbacks=[MarkAndSlow()])
    raise AssertionError("the test should have killed a rank before the run ended")


def ckpt_load(path: str, epochs: str, n_batches: str, *configs: str) -> dict:
    """Per config in turn, a fresh engine loads the checkpoint at ``path`` before any step
    (its pieces are read when a step places them): the parameters an evaluation placed,
    then ``fit`` on from the checkpoint's data position: its losses and final parameters."""
    results = {}
    data = lm_data(int(n_batches) * CKPT_BATCH, 16, 64)
    for config in configs:
        engine = _ckpt_engine(config)
        engine.load(path)
        engine.evaluate(data[:CKPT_BATCH], batch_size=CKPT_BATCH)
        loaded = _cloned(engine.state_dict())
        history = engine.fit(data, batch_size=CKPT_BATCH, epochs=int(epochs), shuffle=True,
                             verbose=0)
        results[config] = {"loaded": loaded, "loss": history["loss"],
                           "state": _cloned(engine.state_dict())}
    return results


def ckpt_crash_save(save_dir: str) -> dict:
    """dp2: a first checkpoint saved after one step, then a second after another step whose
    write raises on rank 1 only (DCP's ``FileSystemWriter.write_data``): what each rank's
    ``save`` raised and whether ``except Exception`` catches it, the parameters at the
    first save."""
    from torch.distributed.checkpoint import FileSystemWriter
    engine = _ckpt_engine("dp", timeout_s=60.0)
    data = lm_data(2 * CKPT_BATCH, 16, 64)
    x, y = (torch.stack(t) for t in zip(*data[:CKPT_BATCH]))
    engine.train_step(x, y)
    engine.save(Path(save_dir) / "step_00000001")
    first = _cloned(engine.state_dict())
    x, y = (torch.stack(t) for t in zip(*data[CKPT_BATCH:]))
    engine.train_step(x, y)
    if os.environ["RANK"] == "1":
        def failing(self, plan, planner):
            raise OSError("disk full (planted by ckpt_crash_save on rank 1)")
        FileSystemWriter.write_data = failing
    try:
        engine.save(Path(save_dir) / "step_00000002")
        error, catchable = None, None
    except BaseException as err:   # the test inspects what each rank got (DCP's own
        # CheckpointException is a BaseException, which ``except Exception`` misses)
        error, catchable = f"{type(err).__name__}: {err}", isinstance(err, Exception)
    return {"first": first, "error": error, "catchable": catchable}


def ckpt_async(save_dir: str) -> dict:
    """dp2, background checkpoints (``tests/checkpoint/test_checkpoint_async.py``): ``fit`` of 8
    batches saving every 2 steps with ``save_async=True``, keeping 2 (the state
    ``state_dict`` gathers at each save, what ``save_dir`` holds after fit); then a save
    whose write on rank 1 sleeps 1.5 s (committed 0.5 s after the call? after the wait?);
    then one whose write raises on rank 1 only (what each rank's wait raised)."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    from autopar.checkpoint.store import is_checkpoint
    engine = _ckpt_engine("dp", timeout_s=60.0)
    capture = _CaptureAtSaves(2)
    engine.fit(lm_data(8 * CKPT_BATCH, 16, 64), batch_size=CKPT_BATCH, shuffle=True,
               verbose=0, save_dir=save_dir, save_freq=2, keep_last=2, save_async=True,
               callbacks=[capture])
    after_fit = sorted(p.name for p in Path(save_dir).iterdir())
    write, on_rank1 = FileSystemWriter.write_data, os.environ["RANK"] == "1"

    def slow(self, plan, planner):
        if on_rank1:
            time.sleep(1.5)
        return write(self, plan, planner)
    FileSystemWriter.write_data = slow
    engine.save(Path(save_dir) / "slow", async_save=True)
    time.sleep(0.5)
    slow_result = {"committed_early": is_checkpoint(Path(save_dir) / "slow")}
    engine.wait_for_checkpoint()
    slow_result["committed_after_wait"] = is_checkpoint(Path(save_dir) / "slow")

    def failing(self, plan, planner):
        if on_rank1:
            raise OSError("disk full (planted by ckpt_async on rank 1)")
        return write(self, plan, planner)
    FileSystemWriter.write_data = failing
    engine.save(Path(save_dir) / "failed", async_save=True)
    try:
        engine.wait_for_checkpoint()
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    FileSystemWriter.write_data = write
    engine.close()
    return {"captured": {s: c["state"] for s, c in capture.captured.items()},
            "after_fit": after_fit, "slow": slow_result, "error": error}


def export_full(config: str, path: str, steps: str, meta: str) -> dict:
    """The GPT of ``parity_gpt`` (tied embedding and head; built on the meta device when
    ``meta`` is "1") trained ``steps`` steps on ``configs/<config>.yaml``, then exported
    with ``engine.save(path, format="full")``: the file it returns, then
    ``engine.state_dict()`` and whether the model stayed on meta."""
    import contextlib

    from autopar.models.gpt import lm_loss
    with torch.device("meta") if meta == "1" else contextlib.nullcontext():
        model = parity_gpt("sgd")
    optimizer, _ = gpt_optimizer("sgd", model)
    engine = ap.Engine(model, lm_loss, optimizer,
                       strategy=ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml"))
    engine.fit(lm_data(int(steps) * 4, 16, 64), batch_size=4, verbose=0)
    written = engine.save(path, format="full")
    return {"file": str(written), "state": engine.state_dict(),
            "still_meta": all(p.is_meta for p in model.parameters())}


def train_compiled(steps: str, batch: str, compiled: str, *runs: str) -> dict:
    """For each ``config:dropout[:amp level]`` of ``runs`` in turn, the one-layer AdamW GPT
    of ``parity_gpt`` trained on ``configs/<config>.yaml``, its programs compiled
    (``compiled == "1"``) or not (``tests/runtime/test_compile.py``)."""
    from autopar.models.gpt import lm_loss
    results = {}
    for run in runs:
        config, dropout, *level = run.split(":")
        model = parity_gpt("adamw", dropout=float(dropout), layers=1)
        optimizer, _ = gpt_optimizer("adamw", model)    # a constant LR: one compile each
        strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
        update = {"compile": ap.Strategy(compile={"enable": compiled == "1"}).compile}
        if level:
            update["amp"] = strategy.amp.model_copy(update={"level": level[0]})
        strategy = strategy.model_copy(update=update)
        engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy)
        history = engine.fit(lm_data(int(steps) * int(batch), 16, 64),
                             batch_size=int(batch), verbose=0)
        results[run] = {"loss": history["loss"], "state": _cloned(engine.state_dict()),
                        "compile_s": history.get("compile_s", [])}
    return results


def compiled_dump(config: str, dump_dir: str) -> dict:
    """A compiled step of the two-layer GPT on ``configs/<config>.yaml``, dumped to
    ``dump_dir`` (Inductor's code of each program next to the passes' dumps)."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("sgd", layers=2)
    optimizer, scheduler = gpt_optimizer("sgd", model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml").model_copy(
        update={"compile": ap.Strategy(compile={"enable": True}).compile,
                "debug": ap.Strategy(debug={"dump_dir": dump_dir}).debug})
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    return {"loss": engine.fit(lm_data(4, 16, 64), batch_size=4, verbose=0)["loss"]}


def train_stream(shardable: str) -> dict:
    """dp2 on a stream of 9 items (``tests/stream_data.py``) read in shards: each rank its
    own, padded to one bucket (``tests/data/test_streams.py``); how many items this rank built."""
    from stream_data import TokenStream

    from autopar.models.gpt import lm_loss
    model = parity_gpt("adamw", seq=64)
    strategy = ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                         "data_parallel: {axis: dp}\n"
                                         "data: {seq_buckets: [64]}\ndevice: cpu\n")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    stream = TokenStream(9, rows=2, count=2, shardable=shardable == "1")
    history = engine.fit(stream, batch_size=4, verbose=0)
    made = sum(p.made for p in stream.parts) if shardable == "1" else stream.made
    return {"loss": history["loss"], "state": engine.state_dict(), "made": made}


SCENARIOS = {"train_scaled": train_scaled, "train_compiled": train_compiled,
             "compiled_dump": compiled_dump,
             "train_gpt": train_gpt, "train_nodes": train_nodes,
             "train_elastic": train_elastic, "train_auto": train_auto,
             "train_and_close": train_and_close,
             "train_until_killed": train_until_killed, "collectives": collectives,
             "memory_peaks": memory_peaks, "train_zero": train_zero, "train_meta": train_meta,
             "train_merge": train_merge, "amp_ranks": amp_ranks,
             "train_callbacks": train_callbacks,
             "ckpt_train": ckpt_train, "ckpt_resume": ckpt_resume,
             "ckpt_until_killed": ckpt_until_killed, "ckpt_load": ckpt_load,
             "ckpt_crash_save": ckpt_crash_save, "ckpt_async": ckpt_async,
             "export_full": export_full, "train_offload": train_offload,
             "train_hsdp": train_hsdp, "train_stream": train_stream}


def main() -> None:
    # a rank that crashes in native code (a rare SIGSEGV of a gloo worker was seen twice in
    # full runs) says where, in its stderr, which the test prints
    faulthandler.enable(all_threads=True)
    scenario, *args = sys.argv[1:]
    result = SCENARIOS[scenario](*args)
    out = Path(os.environ["AUTOPAR_TEST_RESULT_DIR"])
    torch.save(result, out / f"rank{os.environ['RANK']}.pt")
    if torch.distributed.is_initialized():
        # every rank is done: meet, then release the groups (as Engine.close does)
        from autopar.runtime.process_groups import shutdown
        shutdown(barrier=True)


if __name__ == "__main__":
    main()
