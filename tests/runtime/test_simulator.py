"""The in-process simulator runs a lowered plan on every rank of its mesh (each rank its
partitioned local program, collectives as the reference semantics) and must reproduce
eager single-device torch, step for step."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.ir import OpKind, Slot
from autopar.ir.attrs import NAME
from autopar.lower.lowering import lower_program
from autopar.lower.partition import partition
from autopar.reshard.comm import RESHARD_STEP
from autopar.runtime.simulator import simulate_step

from ..models_zoo import MegatronMLP, mse
from ..parity import ATOL, RTOL, twin

TP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}


MLP, _mse = MegatronMLP, mse


def _strategy(kind: str) -> ap.Strategy:
    if kind == "dp":
        return ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]}, data_parallel={"axis": "dp"})
    if kind == "tp":
        return ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]},
                           tensor_parallel={"axis": "tp", "plan": TP_PLAN})
    assert kind == "dp_tp"
    return ap.Strategy(mesh={"shape": [2, 2], "dim_names": ["dp", "tp"]},
                       data_parallel={"axis": "dp"},
                       tensor_parallel={"axis": "tp", "plan": TP_PLAN})


def _batches(n: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g))
            for _ in range(n)]


def _make(kind: str, optim: str):
    torch.manual_seed(0)
    model = MLP()
    ref = twin(model)

    def opt(m):
        if optim == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    engine = ap.Engine(model, _mse, opt(model), strategy=_strategy(kind))
    return engine, ref, opt(ref)


def _mesh(engine):
    return engine.planner.last("train").facts.mesh


def _lowered(engine, x, y):
    """Every rank of the planned step, lowered, and the engine's whole starting state."""
    step = engine.planner.plan("train", x, y)
    lowered = lower_program(step.program, step.facts.mesh, None, None)
    state = dict(engine.state.tensors)
    for name, piece in next(iter(lowered.processes.values())).state.items():
        if name not in state and piece.const is None:
            state[name] = engine.state.initial(piece)
    return step.program, lowered, state


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("kind,batch", [("dp", 4), ("dp", 5), ("tp", 4), ("dp_tp", 4),
                                        ("dp_tp", 5)])
def test_simulated_steps_match_eager_single_device(kind, batch, optim):
    engine, ref, ref_opt = _make(kind, optim)
    data = _batches(3, batch)
    program, lowered, state = _lowered(engine, *data[0])
    assert any(op.kind is OpKind.COMM for op in program.ops)
    given = dict(state)
    before = {k: v.clone() for k, v in state.items() if v is not None}
    for step, (x, y) in enumerate(data):
        results, state = simulate_step(lowered, engine._feeds(x, y, "train"), state)
        ref_opt.zero_grad()
        ref_loss = _mse(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(results[Slot("loss")], ref_loss.detach(), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"step {step} loss: {m}")
        for name, p in ref.named_parameters():
            assert state[name].shape == p.shape
            torch.testing.assert_close(state[name], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"step {step} {name}: {m}")
        if step == 0:   # the caller's state is never mutated
            for k, v in before.items():
                assert torch.equal(given[k], v), k
    for name, p in ref.named_parameters():
        for key, value in ref_opt.state[p].items():
            torch.testing.assert_close(state[f"{name}/{key}"], value, rtol=RTOL, atol=ATOL)


def test_partition_gives_each_rank_its_local_shapes_and_local_calls():
    engine, _, _ = _make("tp", "sgd")
    program = engine.prepare(torch.randn(4, 16), torch.randn(4, 16))
    states = {op.attrs[NAME]: op.result for op in program.ops_of(OpKind.STATE)}
    assert states["fc1.weight"].type.shape == (64, 16)
    for coordinate in [(0,), (1,)]:
        local = partition(program, _mesh(engine), coordinate)
        assert len(local.ops) == len(program.ops)
        shapes = {op.attrs[NAME]: op.result.type.shape for op in local.ops_of(OpKind.STATE)}
        assert shapes["fc1.weight"] == (32, 16)
        assert shapes["fc1.bias"] == (32,)
        assert shapes["fc2.weight"] == (16, 32)
        assert shapes["fc2.bias"] == (16,)
        # comm ops stay comm ops; the global program is untouched
        comms = [op for op in local.ops if op.kind is OpKind.COMM]
        assert comms and all(RESHARD_STEP in op.attrs for op in comms)
    assert states["fc1.weight"].type.shape == (64, 16)


def test_partition_rewrites_global_shape_arguments_and_uneven_pieces():
    engine, _, _ = _make("dp_tp", "sgd")
    program = engine.prepare(torch.randn(5, 16), torch.randn(5, 16))
    views = [i for i, op in enumerate(program.ops) if op.target == "aten.view.default"]
    assert views
    batch = {c: partition(program, _mesh(engine), c) for c in [(0, 0), (1, 1)]}
    inputs = {c: [op.result.type.shape for op in p.ops_of(OpKind.INPUT) if op.result.is_tensor]
              for c, p in batch.items()}
    assert inputs[(0, 0)] == [(3, 16), (3, 16)] and inputs[(1, 1)] == [(2, 16), (2, 16)]
    for i in views:   # fc1.bias grad view [64] -> [32] on each tp rank
        op = batch[(1, 1)].ops[i]
        assert list(op.args[1]) == list(op.result.type.shape)


def test_serial_program_is_returned_unchanged_and_simulates_on_one_rank():
    torch.manual_seed(0)
    model = MLP()
    ref = twin(model)
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1, 4)[0]
    program, lowered, state = _lowered(engine, x, y)
    assert partition(program, _mesh(engine), ()) is program
    results, state = simulate_step(lowered, engine._feeds(x, y, "train"), state)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = _mse(ref(x), y)
    loss.backward()
    ref_opt.step()
    torch.testing.assert_close(results[Slot("loss")], loss.detach(), rtol=RTOL, atol=ATOL)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("config,dropout", [("configs/dp.yaml", 0.1), ("configs/tp.yaml", 0.1),
                                            ("configs/dp_tp.yaml", 0.1)])
def test_engine_fit_on_the_simulator_matches_eager_gpt(config, dropout):
    """The public API: a strategy YAML plus debug.simulate trains a GPT (tied vocab-parallel
    embedding, LayerNorm, attention, dropout with batch-sharded masks) on every rank in this
    process; losses
    and parameters equal single-device eager torch seeded the same way."""
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import lm_loss

    from ..parity import assert_same_losses, assert_same_params, eager_train, lm_data
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16,
                          dropout=dropout, sdpa=False))
    ref = twin(model)
    data = lm_data(12, 16, 64)
    ref_losses = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1,
                                                           momentum=0.9),
                             data, batch_size=4, steps=3)
    strategy = ap.Strategy.from_yaml(config).model_copy(update={
        "debug": ap.Strategy(debug={"simulate": True}).debug})
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       strategy=strategy)
    losses = engine.fit(data, batch_size=4, verbose=0)["loss"]
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)
