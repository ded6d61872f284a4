"""Runtime: generated code frees values early, batches optimizer updates, names missing ops."""
import pytest
import torch

import autopar as ap
from autopar.ir import Op, OpKind, Program, Slot, StateKey, TensorType, Value
from autopar.ir.attrs import NAME, SLOTS, STATE
from autopar.models import MLP
from autopar.runtime.codegen import generate


def _engine_source() -> str:
    torch.manual_seed(0)
    model = MLP(4, 8, 2)
    engine = ap.Engine(model, lambda o, y: (o - y).pow(2).mean(),
                       torch.optim.Adam(model.parameters()))
    engine.train_step(torch.randn(3, 4), torch.randn(3, 2))
    (plan,) = engine.planner.steps.values()
    return plan.executor.source


def test_values_are_deleted_after_their_last_use():
    source = _engine_source()
    assert source.count("del ") > 5
    lines = source.splitlines()
    first_mm = next(i for i, line in enumerate(lines) if "aten_addmm" in line)
    # the input batch is dead once the backward no longer needs it, long before the return
    assert any(line.strip().startswith("del ") for line in lines[first_mm:first_mm + 3])


def test_one_param_group_is_one_optimizer_call():
    source = _engine_source()
    assert source.count("k_optim_adam_batched_(") == 1
    assert "k_optim_adam(" not in source


def test_unknown_op_is_named():
    w = Op(OpKind.STATE, "state", outputs=[Value(TensorType((2,), torch.float32))],
           attrs={STATE: StateKey.of_param("w"), NAME: "w"})
    bad = Op(OpKind.CALL, "mylib.frobnicate.default", args=(w.outputs[0],),
             outputs=[Value(TensorType((2,), torch.float32))])
    program = Program()
    for op in (w, bad, Op(OpKind.OUTPUT, "output", args=(bad.outputs[0],),
                          attrs={SLOTS: (Slot("output", "0"),)})):
        program.add(op)
    with pytest.raises(KeyError, match="mylib.frobnicate.default"):
        generate(program)
