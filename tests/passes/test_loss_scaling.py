"""Loss scaling (``amp.loss_scale``: ``passes/scale_loss.py``, ``passes/skip_nonfinite_steps.py``)
against eager ``torch.amp.GradScaler`` on the same data.

On an fp32 model the scaled step is GradScaler's to the bit: the backward seeded with the
scale, the gradients unscaled by the float of the double reciprocal, a step with an inf or
nan gradient skipped (parameters and optimizer state, Adam's step count too, unchanged) and
the scale backed off, ``growth_interval`` clean steps growing it, the LR scheduler stepped
after every step, skipped or not (as eager code steps it). Serial runs equal eager
exactly; data parallel runs (simulator, two real gloo ranks) sum gradients in another order,
so their losses and parameters are within the parity tolerance while the scale history and
the skipped steps are eager's exactly. The found-inf flag costs at most one scalar
all-reduce: none under plain data parallelism (the gradient all-reduce already hands every
rank the same sums), one under dp x tp and ZeRO-2 (sharded gradients check their pieces).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import autopar as ap
from autopar.ir import OpKind
from autopar.ir.attrs import COMM_TEXT
from autopar.models import MLP
from autopar.models.gpt import lm_loss
from autopar.passes.scale_loss import LOSS_SCALING

from ..multiproc import run_ranks
from ..parity import (
    ATOL,
    RTOL,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
    regression_data,
    rounding_bound,
    twin,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BATCH, STEPS, INF_STEP = 6, 8, 3
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 31, 5, depth=2)


def _data(inf_step: int | None = INF_STEP, targets: float = 1.0) -> list:
    """Regression batches (targets times ``targets``); batch ``inf_step`` holds an inf in
    its first sample's input (on data-parallel rank 0 only), so its loss and every
    gradient are inf or nan."""
    data = [(x, y * targets) for x, y in regression_data(STEPS * BATCH, 16, 5)]
    if inf_step is not None:
        x, y = data[inf_step * BATCH]
        data[inf_step * BATCH] = (torch.cat([x[:1] * math.inf, x[1:]]), y)
    return data


def _strategy(scaling: str, mesh: str = "") -> ap.Strategy:
    return ap.Strategy.from_yaml_str(f"amp: {{{scaling}}}\n{mesh}")


DP2 = "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\ndebug: {simulate: true}\n"
MESHES = {"serial": "", "dp2": DP2, "dp2_zero2": DP2 + "sharding: {stage: 2, axis: dp}\n",
          "dp2_zero3": DP2 + "sharding: {stage: 3, axis: dp}\n"}


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = {n: t.clone() for n, t in model.state_dict().items()}
    state = {f"{i}/{k}": v.clone() for i, s in optimizer.state_dict()["state"].items()
             for k, v in s.items()}
    return {**params, **state}


def _fp32(model, x, y):
    return _mse(model(x), y)


def _o1(model, x, y):
    """Eager O1 float16: the forward and the loss under autocast."""
    with torch.autocast("cpu", dtype=torch.float16):
        return _mse(model(x), y)


def _o2(model, x, y):
    """Eager O2 float16 by hand: the model reads float16 copies of its fp32 parameters and
    the float16 batch, its output goes back to fp32 for the loss."""
    half = {name: p.to(torch.float16) for name, p in model.named_parameters()}
    out = torch.func.functional_call(model, half, (x.to(torch.float16),)).float()
    return _mse(out, y.to(torch.float16))


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """An LR that moves every step: a skipped step steps it too (eager code calls
    ``scheduler.step()`` after ``scaler.step``, whether or not that stepped the optimizer)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))


def _eager(model, optimizer, data, scaler: torch.amp.GradScaler, fixed: float | None = None,
           forward=_fp32) -> dict:
    """The GradScaler loop: each step's loss, scale, whether it skipped, and a snapshot of
    the parameters and optimizer state after it. ``fixed``: the scale kept constant;
    ``forward``: how the loss is computed (fp32, or eager O1 / O2)."""
    out = {"loss": [], "loss_scale": [], "skipped": [], "after": []}
    scheduler = _warmup(optimizer)
    for x, y in DataLoader(data, batch_size=BATCH):
        optimizer.zero_grad()
        loss = forward(model, x, y)
        out["loss_scale"].append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        found = scaler._found_inf_per_device(optimizer).values()
        out["skipped"].append(bool(sum(v.item() for v in found)))
        scaler.update(fixed)
        with warnings.catch_warnings():   # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
        out["loss"].append(loss.item())
        out["after"].append(_snapshot(model, optimizer))
    return out


def _ours(model, optimizer, data, strategy: ap.Strategy, scheduled: bool = True) -> dict:
    engine = ap.Engine(model, _mse, optimizer, strategy=strategy,
                       lr_scheduler=_warmup(optimizer) if scheduled else None)
    losses, after = [], []
    for x, y in DataLoader(data, batch_size=BATCH):
        losses.append(engine.train_step(x, y))
        engine.sync_model()
        after.append(_snapshot(model, optimizer))
    return {**engine.history, "loss": losses, "after": after}


def _run_both(scaling: str, scaler: dict, mesh: str = "", fixed: float | None = None,
              data: list | None = None, optim=torch.optim.AdamW, forward=_fp32):
    data = _data() if data is None else data
    model = _mlp()
    ref = twin(model)
    got = _ours(model, optim(model.parameters(), lr=1e-2), data, _strategy(scaling, mesh))
    want = _eager(ref, optim(ref.parameters(), lr=1e-2), data,
                  torch.amp.GradScaler("cpu", **scaler), fixed, forward)
    return got, want


def _assert_history(got: dict, want: dict, exact: bool) -> None:
    assert got["skipped"] == want["skipped"]
    assert got["loss_scale"] == want["loss_scale"]
    if exact:
        assert [str(v) for v in got["loss"]] == [str(v) for v in want["loss"]]
    else:
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]),
                                   rtol=RTOL, atol=ATOL, equal_nan=True)
    for step, (ours, eager) in enumerate(zip(got["after"], want["after"], strict=True)):
        # torch makes Adam's state at its first step; the plan holds it, zero, from the start
        assert eager.keys() <= ours.keys()
        assert all(not ours[name].any() for name in ours.keys() - eager.keys())
        for name, value in eager.items():
            if exact:
                assert torch.equal(ours[name], value), f"step {step} {name}"
            else:
                torch.testing.assert_close(ours[name], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} {name}: {m}")


def _assert_skipped_unchanged(got: dict, step: int) -> None:
    """The skipped step changed no parameter and no optimizer state (Adam's step too)."""
    before, after = got["after"][step - 1], got["after"][step]
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} changed in the skipped step {step}"


def test_dynamic_scale_from_overflow_equals_grad_scaler_bit_for_bit():
    """A scale so large the scaled gradients overflow: the first steps skip and back off
    (by 0.3: a factor whose product rounds, taken in double as GradScaler does), 2 clean
    steps grow it by 3 until it overflows again; losses, scales, parameters and Adam's
    state equal eager's."""
    scaler = dict(init_scale=2.0 ** 126, growth_factor=3.0, backoff_factor=0.3,
                  growth_interval=2)
    text = ", ".join(f"{k}: {v}" for k, v in scaler.items())
    got, want = _run_both(f"loss_scale: dynamic, {text}", scaler, data=_data(None, 100.0))
    assert want["skipped"][:4] == [True, True, False, False] and any(want["skipped"][4:])
    assert len(set(want["loss_scale"])) >= 4           # backed off and grown
    _assert_history(got, want, exact=True)
    _assert_skipped_unchanged(got, 1)


@pytest.mark.parametrize("where", list(MESHES))
def test_an_inf_skips_the_step_on_every_rank_and_halves_the_scale(where):
    """Batch 3 holds an inf (on dp rank 0 only): the step is skipped, the parameters and
    the optimizer state stay (ZeRO: every rank's pieces), the scale halves; the next steps
    train on and the scale, grown every 2 clean steps, follows GradScaler's."""
    scaler = dict(init_scale=4.0, growth_interval=2)
    got, want = _run_both("loss_scale: dynamic, init_scale: 4.0, growth_interval: 2", scaler,
                          mesh=MESHES[where], optim=torch.optim.Adam)
    assert got["skipped"] == [s == INF_STEP for s in range(STEPS)]
    scales = got["loss_scale"]
    assert scales[INF_STEP + 1] == scales[INF_STEP] / 2
    assert scales[-1] > scales[INF_STEP + 1]
    assert math.isnan(got["loss"][INF_STEP]) or math.isinf(got["loss"][INF_STEP])
    _assert_history(got, want, exact=where == "serial")
    _assert_skipped_unchanged(got, INF_STEP)


def test_a_compiled_step_skips_the_inf_step_as_grad_scaler_does():
    """compile: {enable: true}: inside one compiled graph the optimizer cannot read the flag
    on the host (a data-dependent branch, refused; it failed to compile before), so the
    update runs and keeps the old values where the flag is set. The same steps skip, the
    same scales follow, and what the skipped step left is bit for bit what it found."""
    scaler = dict(init_scale=4.0, growth_interval=2)
    got, want = _run_both("loss_scale: dynamic, init_scale: 4.0, growth_interval: 2", scaler,
                          mesh="compile: {enable: true}\n", optim=torch.optim.Adam)
    assert got["skipped"] == [s == INF_STEP for s in range(STEPS)]
    _assert_history(got, want, exact=False)
    _assert_skipped_unchanged(got, INF_STEP)


# The float16 O2 MLP's longest chains of float16 roundings, read off its program: 4 in the
# forward (the batch's cast, three contractions; relu rounds nothing) and 8 to the first
# layer's weight gradient (the loss gradient's cast, two input-gradient contractions and a
# weight-gradient one); its fp32 roundings (2^-24 each) are below the count's slack
FP16_FORWARD_CHAIN, FP16_CHAIN = 4, 8


def test_compiled_float16_sgd_momentum_skips_before_its_buffers_exist():
    """compile + float16 O2 + dynamic scaling + SGD with momentum, a scale that overflows at
    first (backed off by 16 each time, never grown: no step sits near float16's largest
    value, where a rounding could tip it): the first two steps skip before any momentum
    buffer exists. torch makes the buffers from a step's gradients and a skipped step must
    leave them absent, which a graph that cannot read the flag on the host has no tensor
    to say, so such a step runs uncompiled (``runtime/compiled.py``) and the program
    compiles once, with the buffers. The steps skip and the scales follow as GradScaler's,
    the skipped steps leave the parameters as they were and no buffer; compiled, Inductor
    rounds elsewhere than eager, so losses and parameters are within float16's rounding
    bound of eager GradScaler over both runs' chains (``rounding_bound``: losses 3.9e-3,
    relative; the parameters' movement 7.9e-3 of what training moved, SGD's update being
    linear in its gradients): a run at half the learning rate is 0.5 off, one that does
    not update 1."""
    scaler = dict(init_scale=2.0 ** 24, backoff_factor=2.0 ** -4, growth_interval=1000)
    text = ", ".join(f"{k}: {v}" for k, v in scaler.items())
    data = _data(None)
    model = _mlp()
    ref, init = twin(model), twin(model).state_dict()
    want = _eager(ref, torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9), data,
                  torch.amp.GradScaler("cpu", **scaler), forward=_o2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    engine = ap.Engine(model, _mse, optimizer, lr_scheduler=_warmup(optimizer),
                       strategy=_strategy(f"enable: true, dtype: float16, level: O2, "
                                          f"loss_scale: dynamic, {text}",
                                          "compile: {enable: true}\n"))
    losses, buffers = [], []
    for x, y in DataLoader(data, batch_size=BATCH):
        losses.append(engine.train_step(x, y))
        engine.sync_model()
        buffers.append(any(optimizer.state.get(p, {}).get("momentum_buffer") is not None
                           for p in model.parameters()))
        if len(losses) == 2:          # after the skipped steps
            assert all(torch.equal(v, init[k]) for k, v in model.state_dict().items())
    history = engine.history
    assert history["skipped"] == want["skipped"] == [True, True] + [False] * (STEPS - 2)
    assert history["loss_scale"] == want["loss_scale"]
    assert buffers == [False, False] + [True] * (STEPS - 2)
    assert len(history["compile_s"]) == 1
    loss_bound = rounding_bound(2 * FP16_FORWARD_CHAIN, torch.float16)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want["loss"])) <= loss_bound
    for name, value in ref.state_dict().items():
        moved = (value - init[name]).norm()
        assert (model.state_dict()[name] - value).norm() <= rounding_bound(
            2 * FP16_CHAIN, torch.float16) * moved, name


def test_a_fixed_scale_never_changes_and_still_skips():
    """``loss_scale: 1024``: Megatron's constant scaler; eager is GradScaler put back to
    1024 after every step."""
    got, want = _run_both("loss_scale: 1024.0", dict(init_scale=1024.0), fixed=1024.0,
                          optim=torch.optim.SGD)
    assert got["loss_scale"] == [1024.0] * STEPS
    assert got["skipped"] == [s == INF_STEP for s in range(STEPS)]
    _assert_history(got, want, exact=True)


@pytest.mark.parametrize("level, forward", [("O1", _o1), ("O2", _o2)])
def test_float16_equals_eager_with_grad_scaler_bit_for_bit(level, forward):
    """``amp: {enable: true, dtype: float16, level: O1 | O2, loss_scale: dynamic}`` against
    eager float16 (O1: ``torch.autocast("cpu", torch.float16)``; O2: float16 copies of the
    fp32 master weights) + GradScaler: the scale grows every 2 clean steps until the float16
    gradients overflow, and that step is skipped, as in eager."""
    scaler = dict(init_scale=65536.0, growth_interval=2)
    got, want = _run_both(f"enable: true, dtype: float16, level: {level}, loss_scale: dynamic, "
                          "init_scale: 65536.0, growth_interval: 2", scaler,
                          data=_data(None), forward=forward)
    assert any(want["skipped"]) and not want["skipped"][0]     # a real float16 overflow
    _assert_history(got, want, exact=True)


def test_gradient_merge_sums_scaled_gradients_and_checks_the_sum():
    """gradient_merge k=2: both batches' gradients are scaled by the cycle's scale and
    summed; the sum is unscaled and checked once, at the update (GradScaler with
    accumulation: ``scaler.scale(loss).backward()`` k times, then ``step`` and ``update``).
    The inf of batch 3 skips the second cycle's update."""
    data = _data()
    model = _mlp()
    ref = twin(model)
    strategy = _strategy("loss_scale: dynamic, init_scale: 4.0, growth_interval: 2",
                         "gradient_merge: {k_steps: 2, avg: false}\n")
    got = _ours(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), data,
                strategy, scheduled=False)
    optimizer = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    scales, skipped = [], []
    for i, (x, y) in enumerate(DataLoader(data, batch_size=BATCH)):
        if i % 2 == 0:
            scales.append(scaler.get_scale())
        scaler.scale(_mse(ref(x), y)).backward()
        if i % 2 == 1:
            scaler.step(optimizer)
            skipped.append(bool(sum(v.item() for v in
                                    scaler._found_inf_per_device(optimizer).values())))
            scaler.update()
            optimizer.zero_grad()
    assert got["skipped"] == skipped == [False, True, False, False]
    assert got["loss_scale"] == scales
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _trained_gpt(strategy: ap.Strategy) -> tuple[dict, torch.nn.Module, torch.nn.Module, list]:
    """The GPT trained by the engine under ``strategy`` with SGD + momentum: its history,
    the model, its untrained twin and the data."""
    model = parity_gpt("sgd")
    ref = twin(model)
    data = lm_data(STEPS * 4, 16, 64)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9), strategy=strategy)
    return engine.fit(data, batch_size=4, verbose=0), model, ref, data


def _gpt_against_grad_scaler(strategy: ap.Strategy, scaler: torch.amp.GradScaler
                             ) -> tuple[dict, dict, torch.nn.Module, torch.nn.Module]:
    """The GPT trained by the engine under ``strategy`` (an fp32 step, scaled) next to its
    eager twin under ``scaler``: both histories (loss, loss_scale, skipped), the model and
    the twin."""
    history, model, ref, data = _trained_gpt(strategy)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    eager = {"loss": [], "loss_scale": [], "skipped": []}
    for x, y in DataLoader(data, batch_size=4):
        optimizer.zero_grad()
        loss = lm_loss(ref(x), y)
        eager["loss_scale"].append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        eager["skipped"].append(bool(sum(v.item() for v in
                                         scaler._found_inf_per_device(optimizer).values())))
        scaler.update()
        eager["loss"].append(loss.item())
    return history, eager, model, ref


def _dp2_eager_fp16(model: torch.nn.Module, data, scaler: torch.amp.GradScaler,
                    max_norm: float) -> dict:
    """Two data-parallel ranks written out eagerly under ``torch.autocast`` float16: each
    rank's half batch, its loss the sum over its tokens / the global count (a mean's share),
    backpropagated from ``scaler.scale(loss)``; the ranks' fp32 gradients summed (DDP's
    all-reduce), then ``unscale_``, ``clip_grad_norm_``, ``step`` and ``update``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    out = {"loss": [], "loss_scale": [], "skipped": []}
    for x, y in DataLoader(data, batch_size=4):
        total, grads = torch.zeros(()), None
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(
                    model(xs).flatten(0, 1), ys.flatten(), reduction="sum") / y.numel()
            total = total + loss.detach()          # the loss's all-reduce
            g = torch.autograd.grad(scaler.scale(loss), params)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g
        out["loss_scale"].append(scaler.get_scale())
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(optimizer)
        out["skipped"].append(bool(sum(v.item() for v in
                                       scaler._found_inf_per_device(optimizer).values())))
        scaler.update()
        optimizer.zero_grad()
        out["loss"].append(total.item())
    return out


def test_config_dp_fp16_equals_two_eager_ranks_with_grad_scaler():
    """``configs/dp_fp16.yaml`` (dp2 float16 O1, dynamic scaling, clipping) on the simulator,
    the scale from 2**14 growing every 2 steps, against two eager ranks under autocast +
    GradScaler (``unscale_`` before ``clip_grad_norm_``): the same scales and skips, and the
    losses and parameters bit for bit. Not one-device eager: each rank's float16 gradient of
    its half batch rounds differently from one device's of the whole (its losses moved by
    30-45% of fp32's parity tolerance here, with the kernels a CPU's features select); the
    ranks written out run the same ops on the same halves, which round the same on any CPU."""
    strategy = ap.Strategy.from_yaml(CONFIGS / "dp_fp16.yaml")
    strategy = strategy.model_copy(update={
        "debug": ap.Strategy(debug={"simulate": True}).debug,
        "amp": strategy.amp.model_copy(update={"init_scale": 2.0 ** 14, "growth_interval": 2})})
    history, model, ref, data = _trained_gpt(strategy)
    eager = _dp2_eager_fp16(ref, data, torch.amp.GradScaler("cpu", init_scale=2.0 ** 14,
                                                            growth_interval=2), max_norm=1.0)
    scales = eager["loss_scale"]
    assert history["loss_scale"] == scales and len(set(scales)) == STEPS // 2
    assert history["skipped"] == eager["skipped"] == [False] * STEPS
    assert history["loss"] == eager["loss"]
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _flag_collectives(mesh: str) -> list[str]:
    """The collectives that carry the found-inf check (a loss-scaling op's scalar)."""
    strategy = ap.Strategy.from_yaml_str(mesh + "amp: {loss_scale: dynamic}\n")
    model = parity_gpt("adamw", vocab=64, seq=8)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()), strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*lm_data(4, 8, 64)))
    program = engine.prepare(x, y)
    return [op.attrs.get(COMM_TEXT, op.target) for op in program.ops
            if op.kind is OpKind.COMM and "all_reduce" in op.target
            and any(v.producer.attrs.get(LOSS_SCALING, "").startswith("unscale")
                    for v in op.inputs)]


@pytest.mark.parametrize("mesh, count", [
    ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n", 0),
    ("mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
     f"tensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\n", 1),
    ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
     "sharding: {stage: 2, axis: dp}\n", 1),
], ids=["dp2", "dp2xtp2", "zero2"])
def test_found_inf_takes_at_most_one_scalar_all_reduce(mesh, count):
    found = _flag_collectives(mesh)
    assert len(found) == count, found


def test_pipeline_stages_skip_together():
    """pp2 1F1B (simulator) on the GPT: each stage unscales and checks its own gradients,
    their sums meet in one flag every stage's updates read; a scale that overflows at first
    skips the first steps on both stages (a stage that updated from inf gradients would end
    in nan), then the scale grows as GradScaler's."""
    init = 3.0e38
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2], dim_names: [pp]}\n"
        "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n"
        f"amp: {{loss_scale: dynamic, init_scale: {init:.6e}, growth_factor: 3.0, "
        "backoff_factor: 0.3, growth_interval: 2}\ndebug: {simulate: true}\n")
    history, eager, model, ref = _gpt_against_grad_scaler(
        strategy, torch.amp.GradScaler("cpu", init_scale=init, growth_factor=3.0,
                                       backoff_factor=0.3, growth_interval=2))
    assert history["skipped"] == eager["skipped"] and eager["skipped"][:2] == [True, True]
    # GradScaler's first get_scale() is the Python float it was given, not its fp32 state
    assert history["loss_scale"] == [torch.tensor(init).item()] + eager["loss_scale"][1:]
    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(eager["loss"]),
                               rtol=RTOL, atol=ATOL)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["dp", "pp"])
def test_two_real_ranks_skip_the_same_step(layout):
    """dp2 or pp2 1F1B on two gloo processes: the inf of batch 3 reaches only rank 0's half
    of the batch (dp) or the first stage's input (pp); both ranks skip the step, keep their
    state, halve the scale, and end where eager does."""
    results = run_ranks("train_scaled", 2, str(STEPS), str(BATCH), str(INF_STEP), layout)
    model = _mlp()
    want = _eager(model, torch.optim.Adam(model.parameters(), lr=1e-2), _data(),
                  torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2))
    for rank, got in enumerate(results):
        assert got["skipped"] == want["skipped"] == [s == INF_STEP for s in range(STEPS)]
        assert got["loss_scale"] == want["loss_scale"], f"rank {rank}"
        assert got["unchanged"], f"rank {rank}: the skipped step changed its state"
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["state"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def test_the_check_reads_each_gradient_once():
    """Unscale and inf/nan check are one op per gradient (GradScaler's own kernel on a copy);
    before, every gradient went through abs, * 0 and sum besides the unscale."""
    strategy = ap.Strategy.from_yaml_str("amp: {loss_scale: dynamic}\n")
    model = parity_gpt("adamw", vocab=64, seq=8)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()), strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*lm_data(4, 8, 64)))
    program = engine.prepare(x, y)
    checks = [op for op in program.ops if op.target == "autopar.unscale_checked"]
    assert len(checks) == len(list(model.parameters()))
    for check in checks:
        readers = [op for op in program.ops if check.args[0] in op.inputs
                   and LOSS_SCALING in op.attrs]
        assert readers == [check]
    unscaled = {c.outputs[0] for c in checks}
    assert all(op.args[1] in unscaled for op in program.ops if op.target == "optim.adam")
