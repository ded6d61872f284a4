"""Gradient merge (``gradient_merge: {k_steps: 4, avg: true}``): k = 4 batches of B = 2 train
exactly like one batch of 8 (each optimizer step's loss is the mean of its 4 batch losses;
the final parameters, ``state_dict`` and torch's optimizer state equal eager's), serial, dp2,
pp2 1F1B and dp2 with ZeRO stage 2 on the simulator, with SGD + momentum and with AdamW
under a warmup LR scheduler that steps once per optimizer step. The accumulate program has
no gradient communication and no update; the apply program all-reduces the merged
gradients once. With clipping it composes with dp2 x tp2 (sequence parallel), ZeRO-3 and
recompute, and with a pp2 x dp2 pipeline. Dropout draws per batch (seed + batch index), as
an eager accumulation loop does; a cycle runs on across epochs. On 2 real gloo ranks the
gradient all-reduce runs in every k-th batch only (counted in each process)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import autopar as ap
from autopar.ir import NAME, STATE, OpKind, Role, StateKind
from autopar.models.gpt import lm_loss
from autopar.passes.merge_gradients import MERGE
from autopar.pipeline.jobs import MESSAGE
from autopar.reshard.comm import FOR_ROLE

from ..multiproc import run_ranks
from ..parity import (
    ATOL,
    RTOL,
    assert_same_losses,
    assert_same_params,
    eager_train,
    gpt_optimizer,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
    twin,
)

pytestmark = pytest.mark.usefixtures("one_thread")

K, B, STEPS = 4, 2, 2          # 2 optimizer steps of 4 batches of 2 rows
# at seq 8, one blocks.1.fc1.weight gradient element is ~1e-9: its fp32 rounding differs by
# 3% between one batch of 8 and 4 batches of 2 in eager torch itself, and AdamW, dividing
# by the element's own magnitude, follows it past rtol 1e-5; at seq 16 no element is so small
SEQ, VOCAB = 16, 64

STRATEGIES = {
    "serial": "",
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
           "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n",
    "dp2_zero2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
                 "sharding: {stage: 2, axis: dp}\n",
}


def _strategy(name: str, extra: str = "") -> ap.Strategy:
    return ap.Strategy.from_yaml_str(
        STRATEGIES[name] + f"gradient_merge: {{k_steps: {K}, avg: true}}\n"
        "debug: {simulate: true}\n" + extra)


def _data(steps: int = STEPS):
    return lm_data(steps * K * B, SEQ, VOCAB)


def _engine(optim: str, strategy: ap.Strategy, dropout: float = 0.0):
    model = parity_gpt(optim, vocab=VOCAB, seq=SEQ, dropout=dropout)
    ref = twin(model)
    opt, scheduler = gpt_optimizer(optim, model, warmup=3)
    engine = ap.Engine(model, lm_loss, opt, strategy=strategy, lr_scheduler=scheduler)
    return engine, model, ref


COMBINED = {
    # Megatron pairs with sequence parallelism, ZeRO-3 over dp, recomputed blocks
    "dp2_tp2_zero3_recompute": (
        "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
        "tensor_parallel: {axis: tp, sequence_parallel: true, plan: {"
        '"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
        '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}}\n'
        "sharding: {stage: 3, axis: dp}\nrecompute: {enable: true, modules: [blocks.*]}\n", B),
    "pp2_dp2": ("mesh: {shape: [2, 2], dim_names: [pp, dp]}\ndata_parallel: {axis: dp}\n"
                "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n", 2 * B),
}


@pytest.mark.parametrize("combined", list(COMBINED))
def test_merge_composes_with_other_strategies_and_clipping(combined):
    """Clipping reads the merged gradient (its norm over all k batches, as eager's batch of
    k*B clips), under ZeRO-3 + tp + sequence parallelism + recompute, and a pp2 x dp2
    pipeline (a batch of 4: 2 micro-batches of 2 rows over dp2)."""
    text, batch = COMBINED[combined]
    strategy = ap.Strategy.from_yaml_str(
        text + f"gradient_merge: {{k_steps: {K}}}\ngrad_clip: {{max_norm: 0.5}}\n"
        "debug: {simulate: true}\n")
    engine, model, ref = _engine("adamw", strategy)
    data = lm_data(STEPS * K * batch, SEQ, VOCAB)
    ref_opt, ref_sched = gpt_optimizer("adamw", ref, warmup=3)
    want = eager_train(ref, lm_loss, ref_opt, data, K * batch, STEPS, max_norm=0.5,
                       scheduler=ref_sched)
    got = engine.fit(data, batch_size=batch, verbose=0)["loss"]
    assert_same_losses(torch.tensor(got).view(STEPS, K).mean(dim=1).tolist(), want)
    assert_same_params(model, ref)


def _eager_merged(model, optimizer, data, batches: int, seed: int = 0,
                  scheduler=None) -> list[float]:
    """Eager accumulation: each batch's mean loss / k backpropagated, one step per k."""
    losses = []
    for i, (x, y) in enumerate(DataLoader(data, batch_size=B)):
        if i >= batches:
            break
        torch.manual_seed(seed + i)
        loss = lm_loss(model(x), y)
        (loss / K).backward()
        losses.append(loss.item())
        if (i + 1) % K == 0:
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return losses


def _same_optimizer_state(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    ours, theirs = ours.state_dict(), theirs.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]     # the scheduler's lr too
    assert ours["state"].keys() == theirs["state"].keys()
    for key, state in theirs["state"].items():
        assert ours["state"][key].keys() == state.keys()     # no accumulator leaks in
        for name, value in state.items():
            torch.testing.assert_close(ours["state"][key][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"optimizer state {key} {name}: {m}")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_k_batches_train_like_one_batch_k_times_larger(strategy, optim):
    """Every optimizer step's loss (the mean of its k batch losses), the parameters and
    torch's optimizer state equal eager's batch of k*B; AdamW's warmup scheduler steps
    once per optimizer step, so every batch of a cycle sees one lr."""
    engine, model, ref = _engine(optim, _strategy(strategy))
    ref_opt, ref_sched = gpt_optimizer(optim, ref, warmup=3)
    want = eager_train(ref, lm_loss, ref_opt, _data(), K * B, STEPS, scheduler=ref_sched)
    history = engine.fit(_data(), batch_size=B, verbose=0)
    assert len(history["loss"]) == K * STEPS                  # one entry per batch
    per_step = torch.tensor(history["loss"]).view(STEPS, K).mean(dim=1)
    assert_same_losses(per_step.tolist(), want)
    assert_same_params(model, ref)
    _same_optimizer_state(engine.optimizer, ref_opt)
    assert engine.global_step == STEPS and engine.batches_trained == K * STEPS
    assert engine.state_dict().keys() <= ref.state_dict().keys()
    if ref_sched is not None:
        lrs = torch.tensor(history["lr"]).view(STEPS, K)
        assert (lrs == lrs[:, :1]).all() and not (lrs[0] == lrs[1]).all()
        assert engine.lr_scheduler.last_epoch == ref_sched.last_epoch == STEPS


@pytest.mark.parametrize("strategy", ["serial", "dp2"])
def test_dropout_draws_per_batch_like_eager_accumulation(strategy):
    """Batch i draws seed + i: dropout masks differ per batch and match eager's."""
    engine, model, ref = _engine("sgd", _strategy(strategy), dropout=0.1)
    ref_opt, _ = gpt_optimizer("sgd", ref)
    want = _eager_merged(ref, ref_opt, _data(), K * STEPS)
    engine.lr_scheduler = None
    got = engine.fit(_data(), batch_size=B, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)


def test_a_cycle_continues_across_epochs():
    """6 batches per epoch, k = 4: the second optimizer step sums the last 2 batches of
    epoch 1 and the first 2 of epoch 2 (the engine counts batches, not epochs). A fit that
    ends mid-cycle warns: those batches are in no parameter yet."""
    engine, model, ref = _engine("sgd", _strategy("serial"))
    ref_opt, _ = gpt_optimizer("sgd", ref)
    data = _data()[:6 * B]
    engine.lr_scheduler = None
    got = list(engine.fit(data, batch_size=B, epochs=2, verbose=0)["loss"])
    want = _eager_merged(ref, ref_opt, data + data, 12)
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    assert engine.global_step == 3
    with pytest.warns(UserWarning, match="fit ended 2 batch"):     # the run's third epoch
        engine.fit(data[:2 * B], batch_size=B, epochs=3, verbose=0)


def test_a_cycle_continues_across_batch_shapes():
    """7 rows in batches of 2: each epoch ends with a batch of 1, which has a plan of its own
    (its own pair of programs); the runtime steps every plan through one cycle by the
    batch's index in the run, so k = 4 still merges batches 1-4 and 5-8 as eager's
    accumulation loop does."""
    engine, model, ref = _engine("sgd", _strategy("serial"))
    engine.lr_scheduler = None
    data = _data()[:7]
    got = engine.fit(data, batch_size=B, epochs=2, verbose=0)["loss"]
    ref_opt, _ = gpt_optimizer("sgd", ref)
    want = []
    for x, y in [batch for _ in range(2) for batch in DataLoader(data, batch_size=B)]:
        torch.manual_seed(len(want))
        loss = lm_loss(ref(x), y)
        (loss / K).backward()
        want.append(loss.item())
        if len(want) % K == 0:
            ref_opt.step()
            ref_opt.zero_grad()
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    assert engine.global_step == 2 and len(engine.planner.steps) == 2


def _grad_comms(program) -> list:
    return [op for op in program.ops
            if op.kind is OpKind.COMM and op.attrs.get(FOR_ROLE) is Role.OPTIMIZER]


def test_accumulate_program_has_no_gradient_communication():
    engine, _, _ = _engine("adamw", _strategy("dp2", "grad_clip: {max_norm: 1.0}\n"))
    x, y = (torch.stack(t) for t in zip(*_data()[:B]))
    accumulate = engine.prepare(x, y, accumulate_only=True)
    apply = engine.prepare(x, y)
    assert not _grad_comms(accumulate)
    assert not [op for op in accumulate.ops if op.target.startswith("optim.")]
    assert _grad_comms(apply) and [op for op in apply.ops if op.target.startswith("optim.")]
    merges = {op.attrs[MERGE].split()[0] for op in apply.ops if MERGE in op.attrs}
    assert merges == {"accumulate", "average", "reset"}
    states = {op.attrs[NAME]: op.attrs[STATE] for op in accumulate.states()}
    updated = [states[s.name] for s, _ in accumulate.results() if s.kind == "update"]
    assert updated and all(key.kind is StateKind.GRAD_MERGE for key in updated)


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_amp_o2_accumulates_in_the_reduce_dtype_without_communication(reduce_dtype):
    """O2 makes half gradients; the accumulator holds them as they are reduced (FSDP2
    accumulates in its reduce dtype too): fp32 after the cast, or the half partial terms
    before a half reduction, and either way an accumulating step communicates no gradient."""
    engine, _, _ = _engine("adamw", _strategy(
        "dp2", f"amp: {{enable: true, dtype: bfloat16, level: O2, "
               f"reduce_dtype: {reduce_dtype}}}\n"))
    x, y = (torch.stack(t) for t in zip(*_data()[:B]))
    accumulate, apply = engine.prepare(x, y, accumulate_only=True), engine.prepare(x, y)
    def reductions(program) -> list:     # a half reduction feeds the backward's cast
        return [op for op in program.ops if op.kind is OpKind.COMM
                and op.attrs.get(FOR_ROLE) in (Role.BACKWARD, Role.OPTIMIZER)]

    assert not reductions(accumulate) and reductions(apply)
    accumulators = accumulate.states(StateKind.GRAD_MERGE)
    assert accumulators and {op.result.type.dtype for op in accumulators} == {
        getattr(torch, reduce_dtype)}


def test_loss_scaling_checks_and_updates_once_per_optimizer_step():
    """fp16 with dynamic loss scaling equals eager's GradScaler accumulation loop written as
    the engine computes it, bit for bit: every batch's scaled loss is backpropagated and
    summed into ``.grad``, the sum is multiplied by 1/k (``passes/merge_gradients.py``,
    avg), then GradScaler unscales it, checks it (inf/nan) and updates the scale, once per
    optimizer step. Not ``scaler.scale(loss / k)``: that halves values inside the float16
    backward, whose rounding (subnormals, a CPU's native fp16 kernels) then differs from
    dividing the fp32 sum; the same ops in the same order round the same on any CPU."""
    amp = ("amp: {enable: true, dtype: float16, level: O1, loss_scale: dynamic, "
           "init_scale: 1024.0, growth_interval: 1}\n")
    engine, model, ref = _engine("sgd", _strategy("serial", amp))
    history = engine.fit(_data(), batch_size=B, verbose=0)
    ref_opt, _ = gpt_optimizer("sgd", ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    want, scales = [], []
    for i, (x, y) in enumerate(DataLoader(_data(), batch_size=B)):
        torch.manual_seed(i)
        with torch.autocast("cpu", torch.float16):
            loss = lm_loss(ref(x), y)
        scaler.scale(loss).backward()
        want.append(loss.item())
        if (i + 1) % K == 0:
            for p in ref.parameters():
                p.grad *= 1.0 / K
            scales.append(scaler.get_scale())
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
    assert history["loss"] == want
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert history["loss_scale"] == scales == [1024.0, 2048.0]   # grown once per step
    assert history["skipped"] == [False, False]


def test_pipeline_jobs_send_in_the_order_messages_are_posted():
    """Real ranks post a pair's messages in one order (``Message.order``), a send after every
    earlier message of its pair. Accumulating, stage 1's post job sends two sums from its
    store to stage 0 (the tied embedding's term, the loss): it must send them in that order
    (on 2 gloo ranks it sent the loss first, before the term it had not read yet)."""
    engine, _, _ = _engine("sgd", _strategy("pp2"))
    x, y = (torch.stack(t) for t in zip(*_data()[:B]))
    apply = engine.planner.plan("train", x, y)
    for step in (apply.accumulating, apply):
        for made in step.lowered.processes.values():
            for job in made.programs.values():
                orders = [op.attrs[MESSAGE].order for op in job.program.ops
                          if op.target == "comm.send"]
                assert orders == sorted(orders), f"process {made.process} {job.job}"


def test_cost_counts_the_accumulators_as_gradient_memory():
    """``engine.cost``: an accumulator per parameter, held across steps like eager's
    ``.grad``, is gradient memory (not a buffer) and adds its bytes to the peak."""
    x, y = (torch.stack(t) for t in zip(*_data()[:B]))

    def cost(strategy: ap.Strategy) -> dict:
        return _engine("sgd", strategy)[0].cost(x, y)

    plain = cost(ap.Strategy.from_yaml_str(STRATEGIES["dp2"] + "debug: {simulate: true}\n"))
    merged = cost(_strategy("dp2"))
    for rank in (0, 1):
        without, with_merge = plain[rank], merged[rank]
        assert with_merge.grads == without.grads + without.params > without.grads
        assert with_merge.buffers == without.buffers
        # and nothing else: the reset is made from the accumulator at the step's end, so
        # no merged gradient outlives its reduction
        assert with_merge.peak == without.peak + without.params


def test_gradient_merge_needs_an_optimizer():
    model = parity_gpt("sgd", vocab=VOCAB, seq=SEQ)
    with pytest.raises(ValueError, match="gradient_merge.*no optimizer"):
        ap.Engine(model, lm_loss, strategy=_strategy("serial"))


def test_accumulate_only_needs_gradient_merge():
    model = parity_gpt("sgd", vocab=VOCAB, seq=SEQ)
    opt, _ = gpt_optimizer("sgd", model)
    engine = ap.Engine(model, lm_loss, opt)
    x, y = (torch.stack(t) for t in zip(*_data()[:B]))
    with pytest.raises(ValueError, match="k_steps > 1"):
        engine.prepare(x, y, accumulate_only=True)


def test_dp2_real_ranks_reduce_once_per_k():
    """2 gloo processes (configs/dp_merge.yaml): losses and parameters equal eager's one
    batch of 8, and the gradients are all-reduced only in every k-th batch (the collective
    calls counted in each process: the accumulate batches reduce only the loss)."""
    results = run_ranks("train_merge", 2, str(STEPS), timeout=300)
    model = parity_gpt("sgd")
    optimizer, scheduler = gpt_optimizer("sgd", model)
    want = eager_train(model, lm_loss, optimizer, lm_data(STEPS * K * B, 16, 64), K * B,
                       STEPS, scheduler=scheduler)
    numel = sum(p.numel() for p in model.parameters())
    for rank, got in enumerate(results):
        per_step = torch.tensor(got["loss"]).view(STEPS, K).mean(dim=1)
        assert_same_losses(per_step.tolist(), want)
        want_state = model.state_dict()     # a tied weight is under one of its names
        assert {"wte.weight", "blocks.0.fc1.weight"} <= got["state"].keys() <= want_state.keys()
        for name, value in got["state"].items():
            torch.testing.assert_close(value, want_state[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        reduced = got["reduced"]                       # elements all-reduced, per batch
        assert len(reduced) == K * STEPS
        for i, count in enumerate(reduced):
            if (i + 1) % K:
                assert count < 16, f"rank {rank} batch {i}: accumulating reduced {count}"
            else:
                assert count >= numel, f"rank {rank} batch {i}: applying reduced {count}"
