"""``sharding: {offload: {optimizer, params}}``: optimizer state (and parameters) kept in
host memory, the update run there (ZeRO-Offload, FSDP2's CPUOffloadPolicy).

On the CPU both homes are one memory, so what is checked here is everything but the bytes
moving: every strategy the offload touches trains like eager torch (fp32, rtol 1e-5), the
program moves what it must where it must (gradients copied as the backward makes them,
one wait before a run of updates, new parameters copied back), the runtime keeps each
piece where its plan says (a ``meta`` compute device stands in for a GPU), the memory
estimate moves the offloaded bytes from the device's peak to the host's, and what cannot
be offloaded is refused by name before anything runs. tests/engine/test_devices.py's CUDA tests
and bench/gpu_check.py run it on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.ir import OpKind, StateKind
from autopar.ir.attrs import ON_HOST, STATE
from autopar.ir.kernels.generator_state import compute_device, use_device
from autopar.ir.kernels.offload import host_ready, to_device, to_host
from autopar.lower.executable import StatePiece
from autopar.runtime.rank_state import at_home

from ..multiproc import run_ranks
from ..parity import ATOL, RTOL, eager_train, gpt_optimizer, lm_data, one_thread, parity_gpt  # noqa: F401
from . import test_zero as zero

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIMIZER, BOTH = "{optimizer: true}", "{optimizer: true, params: true}"
STEPS = 6


def _strategy(stage: int, dp: int = 1, tp: int = 1, pp: int = 1, offload: str = OPTIMIZER,
              extra: str = "") -> ap.Strategy:
    dims = [(n, k) for n, k in (("pp", pp), ("dp", dp), ("tp", tp)) if k > 1]
    text = ""
    if dims:
        text = (f"mesh: {{shape: {[k for _, k in dims]}, "
                f"dim_names: [{', '.join(n for n, _ in dims)}]}}\n"
                "data_parallel: {axis: dp}\ndebug: {simulate: true}\n")
    text += f"sharding: {{stage: {stage}, axis: dp, offload: {offload}}}\n"
    if tp > 1:
        text += f"tensor_parallel: {{axis: tp, plan: {zero.TP_PLAN}}}\n"
    if pp > 1:
        text += "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 3}\n"
    return ap.Strategy.from_yaml_str(text + extra)


@pytest.mark.parametrize("model, optim, layout", [
    ("gpt", "adamw", dict(stage=0)),
    ("gpt", "sgd", dict(stage=0, offload=BOTH)),           # momentum made by the first step
    ("gpt", "adamw", dict(stage=1, dp=2)),
    ("mlp", "adamw", dict(stage=2, dp=4)),                 # uneven pieces, an empty one
    ("gpt", "adamw", dict(stage=3, dp=2, offload=BOTH)),
    ("gpt", "sgd", dict(stage=0, dp=2, tp=2)),
    ("gpt", "adamw", dict(stage=2, dp=2, pp=2)),
    ("gpt", "adamw", dict(stage=3, dp=2, pp=2, offload=BOTH)),
])
def test_offloaded_runs_train_like_eager(model, optim, layout):
    """Losses, parameters, ``engine.state_dict()`` and the optimizer's state equal eager's."""
    zero._fit_both(model, optim, _strategy(**layout), steps=STEPS)


def test_clipping_gradient_merge_and_loss_scaling_with_offload():
    """What else reads the gradients before the update: clipping, merging over batches."""
    zero._fit_both("gpt", "adamw", _strategy(2, dp=2, extra="grad_clip: {max_norm: 0.5}\n"),
                   max_norm=0.5, steps=STEPS)
    amp = ("amp: {enable: true, dtype: float16, level: O1, loss_scale: dynamic, "
           "init_scale: 65536.0}\ngradient_merge: {k_steps: 2}\n")
    offloaded = _fp16_run(_strategy(2, dp=2, extra=amp))
    kept = _fp16_run(zero._strategy(2, 2, extra=amp))
    assert offloaded[0] == kept[0]           # the same program, its copies aside: bit for bit
    for a, b in zip(offloaded[1], kept[1]):
        assert torch.equal(a, b)


def _fp16_run(strategy: ap.Strategy):
    model = parity_gpt("adamw", vocab=64, seq=8)
    engine = ap.Engine(model, zero.lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    history = engine.fit(lm_data(8 * 6, 8, 64), batch_size=6, verbose=0)
    return history["loss"], [p.detach().clone() for p in model.parameters()]


def _program(strategy: ap.Strategy, model_name: str = "mlp"):
    model, loss_fn, data = zero.MODELS[model_name]("adamw", 1)
    engine = ap.Engine(model, loss_fn, torch.optim.AdamW(model.parameters()), strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*data[:zero.BATCH]))
    engine.train_step(x, y)
    return engine, engine.planner.plan("train", x, y).program, x, y


def test_the_program_copies_each_gradient_as_it_is_made_and_waits_once_per_run():
    _, program, _, _ = _program(_strategy(0, extra="amp: {enable: true, dtype: float16, "
                                          "level: O1, loss_scale: dynamic}\n"))
    ops = program.ops
    updates = [op for op in ops if op.target.startswith("optim.")]
    assert len(updates) == 6
    for op in program.states():
        assert op.attrs.get(ON_HOST, False) == (op.attrs[STATE].kind is StateKind.OPTIM)
    waits = [op for op in ops if op.target == "autopar.host_ready"]
    assert len(waits) == 1 and ops.index(waits[0]) == ops.index(updates[0]) - 1
    for update in updates:                  # param, gradient, found_inf: host copies, waited
        assert all(v.producer is waits[0] for v in (update.args[0], update.args[1],
                                                    update.kwargs["found_inf"]))
    copies = {v: v.producer for v in waits[0].args}
    assert all(op.target == "autopar.to_host" for op in copies.values())
    # found_inf is copied once for every update; each gradient right after its producer
    assert sum(1 for op in copies.values() if op.args[0].type.shape == ()) == 1
    for copy in copies.values():
        made = copy.args[0].producer
        if made.kind in (OpKind.CALL, OpKind.COMM):
            assert ops.index(copy) == ops.index(made) + 1
    # every new parameter goes back to the device: the update slot reads the copy
    back = [op for op in ops if op.target == "autopar.to_device"]
    assert [op.args[0] for op in back] == [u.outputs[0] for u in updates]
    # each parameter's new value written back is its device copy; its states stay home
    written = {slot.name: v for slot, v in program.results() if slot.kind == "update"}
    params = {n: v for n, v in written.items() if "/" not in n}
    assert len(params) == len(updates)
    assert {v.producer.target for v in params.values()} == {"autopar.to_device"}
    assert all(v.producer.target.startswith("optim.") for n, v in written.items()
               if "/" in n and not n.startswith("amp/"))        # (the loss scaler's own)


def test_offloaded_parameters_are_read_through_their_device_copy():
    _, program, _, _ = _program(_strategy(3, dp=2, offload=BOTH))
    for state in program.states(StateKind.PARAM):
        assert state.attrs[ON_HOST]
        readers = [op for op in program.ops if state.result in op.inputs]
        assert {op.target for op in readers} <= {"autopar.to_device", "optim.adam"}
        assert any(op.target == "autopar.to_device" for op in readers)
    assert not any(op.target == "autopar.to_device" and op.args[0].producer.target
                   .startswith("optim.") for op in program.ops)    # new values stay home


def test_the_estimate_moves_offloaded_bytes_from_the_device_to_the_host():
    def estimate(offload: str | None):
        text = f"sharding: {{stage: 0, offload: {offload}}}\n" if offload else ""
        model, loss_fn, data = zero.MODELS["gpt"]("adamw", 1)
        engine = ap.Engine(model, loss_fn, torch.optim.AdamW(model.parameters()),
                           strategy=ap.Strategy.from_yaml_str(text))
        x, y = (torch.stack(t) for t in zip(*data[:zero.BATCH]))
        engine.train_step(x, y)
        return engine.cost(x, y)[0], sum(p.numel() * 4 for p in model.parameters())
    kept, params = estimate(None)
    optim, _ = estimate(OPTIMIZER)
    both, _ = estimate(BOTH)
    assert kept.host == 0 and kept.optimizer_state > 2 * params
    assert optim.optimizer_state == 0 and optim.params == kept.params
    # the state, and the step's host copies of each parameter and gradient
    assert optim.host >= kept.optimizer_state + 2 * params
    assert optim.peak <= kept.peak - kept.optimizer_state
    assert both.params == 0 and both.host >= optim.host and both.peak < optim.peak


def test_the_memory_table_shows_the_host_column_only_with_offload(tmp_path):
    engine, _, x, y = _program(_strategy(1, dp=2))
    table = ap.lower.memory_estimate.format_estimates(engine.cost(x, y))
    assert "host" in table and "device's" in table
    engine, _, x, y = _program(zero._strategy(1, 2))
    assert "host" not in ap.lower.memory_estimate.format_estimates(engine.cost(x, y))


def test_pieces_live_where_their_plan_says():
    """A ``meta`` compute device stands in for a GPU: a piece the plan keeps on the host
    stays a CPU tensor, the others go to the device; a value already home is itself."""
    key = ap.ir.StateKey.of_param("w")
    device, host = (StatePiece(key, (2,), torch.float32, None, (), on_host=h)
                    for h in (False, True))
    value = torch.ones(2)
    assert at_home(value, device, torch.device("meta")).is_meta
    assert at_home(value, host, torch.device("meta")) is value
    assert at_home(value, device, torch.device("cpu")) is value
    assert at_home(None, host, torch.device("meta")) is None


def test_copy_kernels_on_one_memory_are_the_value_itself():
    before = compute_device()
    try:
        x = torch.arange(3.0)
        assert to_host(x) is x and host_ready(x, x) == (x, x) and to_device(x) is x
        use_device(torch.device("meta"))             # a device that is not the host's
        moved = to_device(x)
        assert moved.is_meta and moved.shape == x.shape
    finally:
        use_device(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_kernels_on_cuda_round_trip_through_pinned_memory():
    before = compute_device()
    try:
        use_device(torch.device("cuda", 0))
        x = torch.randn(1 << 16, device="cuda")
        host = to_host(x)
        assert host.device.type == "cpu" and host.is_pinned()
        (ready,) = host_ready(host)
        assert torch.equal(ready, x.cpu())
        assert torch.equal(to_device(ready * 2), x * 2)
    finally:
        use_device(before)


def test_what_cannot_be_offloaded_is_refused_by_name():
    with pytest.raises(ValueError, match="set optimizer: true as well"):
        ap.Strategy.from_yaml_str("sharding: {offload: {params: true}}")
    with pytest.raises(ValueError, match="unknown key 'optimiser'.*sharding.offload"):
        ap.Strategy.from_yaml_str("sharding: {offload: {optimiser: true}}")
    with pytest.raises(ValueError, match="ZeRO stage 1 or 2 keeps the parameter whole"):
        _program(_strategy(1, dp=2, offload=BOTH))


def test_offload_on_two_real_ranks_trains_like_eager():
    """ZeRO-2 with the optimizer offloaded and ZeRO-3 with the parameters too, on 2 gloo
    processes: losses and the gathered state equal eager's; each rank's runtime keeps the
    offloaded pieces as its plan says."""
    results = run_ranks("train_offload", 2, "4", "6", timeout=300)
    model = parity_gpt("adamw", vocab=65)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    losses = eager_train(model, zero.lm_loss, optimizer, lm_data(24, 16, 65), 6, 4,
                         scheduler=scheduler)
    want = model.state_dict()
    for rank, by_layout in enumerate(results):
        for layout, got in by_layout.items():
            torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(losses),
                                       rtol=RTOL, atol=ATOL)
            for name, value in got["state"].items():
                torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"rank {rank} {layout} {name}: {m}")
            assert got["on_host"] == ({"optim"} if layout == "zero2" else {"optim", "param"})


def test_a_compiled_step_offloads_too():
    """Under ``torch.compile`` the copies are plain ``Tensor.to`` and the waits vanish."""
    zero._fit_both("mlp", "adamw", _strategy(0, offload=BOTH, extra="compile: {enable: true}\n"),
                   steps=3)
