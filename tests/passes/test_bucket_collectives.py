"""Gradient all-reduces fused into asynchronous buckets: where they start and end, how big
they are, and that a bucketed plan still trains exactly like eager (simulator)."""
from __future__ import annotations

import torch

import autopar as ap
from autopar.ir import OpKind, Role
from autopar.ir.attrs import COMM_TEXT
from autopar.ir.dist import micro_batch_dim
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.reshard.comm import FOR_ROLE, RESHARD_STEP

from ..parity import assert_same_losses, assert_same_params, eager_train, lm_data, twin


def _plan(bucket_mb: float, simulate: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]},
                           data_parallel={"axis": "dp", "bucket_mb": bucket_mb},
                           debug={"simulate": simulate})
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    x = torch.randint(0, 64, (4, 16))
    return model, engine, engine.prepare(x, x)


def _gradient_buckets(program, target="comm.all_reduce_start"):
    return [op for op in program.ops if op.target == target
            and op.attrs[FOR_ROLE] == Role.OPTIMIZER.value]


def _grad_all_reduces(program):
    return [op for op in program.ops if op.target == "comm.all_reduce"
            and op.attrs[FOR_ROLE] == Role.OPTIMIZER.value]


def test_one_bucket_holds_every_gradient_and_starts_right_after_the_last_one():
    model, _, program = _plan(25)
    starts, waits = _gradient_buckets(program), _gradient_buckets(program, "comm.wait")
    assert len(starts) == len(waits) == 1
    assert len(starts[0].args) == len(list(model.parameters()))   # head tied to wte
    assert _grad_all_reduces(program) == []
    i, j = program.ops.index(starts[0]), program.ops.index(waits[0])
    assert program.ops[i - 1] is starts[0].args[-1].producer or any(
        v.producer is program.ops[i - 1] for v in starts[0].args)
    updates = [k for k, op in enumerate(program.ops)
               if op.kind is OpKind.CALL and op.role is Role.OPTIMIZER]
    assert i < j < updates[0]          # waited for just before the first update reads it


def test_small_buckets_start_while_the_backward_still_runs():
    _, _, program = _plan(0.01)      # about 10 KB per bucket
    starts = _gradient_buckets(program)
    assert len(starts) >= 3
    last_backward = max(i for i, op in enumerate(program.ops) if op.role is Role.BACKWARD)
    assert program.ops.index(starts[0]) < last_backward
    for op in starts:
        total = sum(v.type.numel * 4 for v in op.args)
        biggest = max(v.type.numel * 4 for v in op.args)
        assert total - biggest < 0.01 * 2**20          # filled up to the cap, then closed
        assert "gradients" in op.attrs[COMM_TEXT] and "over dp" in op.attrs[COMM_TEXT]


def test_bucket_mb_zero_keeps_one_all_reduce_per_gradient():
    model, _, program = _plan(0)
    assert not _gradient_buckets(program)
    assert len(_grad_all_reduces(program)) == len(list(model.parameters()))


def _trains_like_eager(model, engine) -> None:
    """3 steps of 4 sequences: the engine's losses and parameters equal eager SGD's."""
    ref = twin(model)
    data = lm_data(12, 16, 64)
    ref_losses = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data,
                             batch_size=4, steps=3)
    assert_same_losses(engine.fit(data, batch_size=4, verbose=0)["loss"], ref_losses)
    assert_same_params(model, ref)


def test_bucketed_plan_trains_like_eager_on_the_simulator():
    model, engine, _ = _plan(0.01, simulate=True)
    _trains_like_eager(model, engine)


def test_the_reported_loss_is_reduced_while_the_backward_runs():
    _, _, program = _plan(25)
    loss = program.result("loss")
    wait = loss.producer
    assert wait.target == "comm.wait" and program.ops.index(wait) == len(program.ops) - 2
    start = wait.args[0].producer
    assert "1 values" in start.attrs[COMM_TEXT]
    made = program.ops.index(start.args[0].producer)
    assert program.ops.index(start) == made + 1
    assert any(op.role is Role.BACKWARD for op in program.ops[made:program.ops.index(wait)])


def _tp_mlp(simulate: bool):
    """GPT with the MLP-only tensor-parallel plan (fc1 colwise, fc2 rowwise) over tp2."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]},
                           tensor_parallel={"axis": "tp", "plan": {"blocks.*.fc1": "colwise",
                                                                   "blocks.*.fc2": "rowwise"}},
                           debug={"simulate": simulate})
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    return model, engine


def test_a_tp_backward_input_gradient_is_all_reduced_while_the_weight_gradient_computes():
    """The colwise fc1's input gradient (Partial over tp) starts its all-reduce where its mm
    makes it (its view moved up there), and the weight gradient's mm runs before the wait:
    Megatron's asynchronous all-reduce. Trains like eager (simulator)."""
    model, engine = _tp_mlp(simulate=True)
    x = torch.randint(0, 64, (4, 16))
    program = engine.prepare(x, x)
    starts = [op for op in program.ops if op.target == "comm.all_reduce_start"
              and op.attrs[FOR_ROLE] == Role.BACKWARD.value]
    assert len(starts) == 2                      # one per block's fc1
    for start in starts:
        wait = next(op for op in program.ops if op.target == "comm.wait"
                    and op.args[0] is start.result)
        between = program.ops[program.ops.index(start) + 1:program.ops.index(wait)]
        assert any(op.target == "aten.mm.default" and op.module == start.args[0].producer.module
                   for op in between), [op.target for op in between]
    _trains_like_eager(model, engine)


def _pp_dp(simulate: bool):
    """GPT under pp2 x dp2 (1F1B, 2 micro-batches)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    strategy = ap.Strategy(mesh={"shape": [2, 2], "dim_names": ["pp", "dp"]},
                           data_parallel={"axis": "dp"},
                           pipeline={"axis": "pp", "schedule": "1F1B", "micro_batches": 2},
                           debug={"simulate": simulate})
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    return model, engine


def test_a_pipeline_stage_all_reduces_its_accumulated_gradients_in_buckets():
    """A pipeline's gradients are summed over micro-batches first; before, each sum sat
    between the previous gradient's update and its own all-reduce, so every gradient went
    alone (26 synchronous all-reduces per stage of GPT 4x128)."""
    model, engine = _pp_dp(simulate=True)
    x = torch.randint(0, 64, (4, 16))
    program = engine.prepare(x, x)
    starts = _gradient_buckets(program)
    alone = [op for op in _grad_all_reduces(program)
             if op.attrs[RESHARD_STEP].mesh_dim != micro_batch_dim(op.args[0].dist.mesh)]
    bucketed = sum(len(op.args) for op in starts)
    assert len(starts) >= 2                      # a bucket per stage at least
    assert bucketed >= len(list(model.parameters())) - 2
    assert len(alone) <= 2                       # the tied embedding's, on both stages
    _trains_like_eager(model, engine)
