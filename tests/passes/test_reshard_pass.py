"""The reshard pass writes the communication completion implies as comm ops: every
consumer then reads exactly the placement it needs, each move happens once, and the dump
says which step, over which mesh dim, from which placements to which."""
from __future__ import annotations

import torch

import autopar as ap
from autopar.ir import OpKind, Role, format_program
from autopar.ir.attrs import COMM_TEXT
from autopar.ir.dist import Partial, Replicate
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.passes.reshard import check_resharded
from autopar.reshard.comm import BUCKET_STEPS, RESHARD_STEP


def _gpt_program(config: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                       strategy=ap.Strategy.from_yaml(config))
    ids = torch.randint(0, 64, (4, 16))
    return engine.prepare(ids, ids)


def test_data_parallel_reduces_each_gradient_once_before_its_update():
    program = _gpt_program("configs/dp.yaml")
    check_resharded(program)
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role is Role.OPTIMIZER:
            wait = op.args[1].producer      # gradients travel in one bucket (bucket_mb 25)
            assert wait.kind is OpKind.COMM and wait.target == "comm.wait"
            start = wait.args[0].producer
            grad = start.args[op.args[1].index]
            assert start.attrs[BUCKET_STEPS][op.args[1].index].kind == "all_reduce"
            assert grad.dist.placements == (Partial("sum"),)
            assert op.args[1].dist.placements == (Replicate(),)
    reductions = [s for op in program.ops if op.kind is OpKind.COMM
                  for s in op.attrs.get(BUCKET_STEPS) or [op.attrs.get(RESHARD_STEP)]
                  if s is not None]
    grads = [op for op in program.ops if op.kind is OpKind.CALL and op.role is Role.OPTIMIZER]
    # one all-reduce per gradient, plus the loss's two scalars (sum and count)
    assert len(reductions) == len(grads) + 2
    assert all(s.axis == "dp" for s in reductions)


def test_a_value_several_consumers_need_alike_moves_once_and_the_dump_says_how():
    program = _gpt_program("configs/dp_tp.yaml")
    check_resharded(program)
    seen = {}
    for op in program.ops:
        if op.kind is OpKind.COMM:
            key = (op.args[0], op.target, op.attrs[COMM_TEXT])
            assert key not in seen, f"{op.attrs[COMM_TEXT]} inserted twice"
            seen[key] = op
    text = format_program(program)
    assert "comm.all_reduce" in text and "over tp: {S(0),P(sum)} -> {S(0),R}" in text
    # the layer norm reads the reduced residual in forward and again in backward
    ln = [op for op in program.ops if op.target == "aten.native_layer_norm.default"][0]
    ln_bwd = [op for op in program.ops if op.target == "aten.native_layer_norm_backward.default"
              and op.forward_op is ln][0]
    assert ln.args[0] is ln_bwd.args[1]


def test_serial_programs_get_no_communication():
    program = _gpt_program("configs/serial.yaml")
    assert not [op for op in program.ops if op.kind is OpKind.COMM]
