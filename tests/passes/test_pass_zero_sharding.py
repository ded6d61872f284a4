"""Pass ``zero_sharding``: ZeRO as placements. Run through the pass on a small MLP, it pins
each optimizer state shaped like its parameter ``Shard(0)`` on the sharding axis (stage 3:
the parameters too, with a Replicate annotation before each phase's first read; stage 2
under clipping: the gradient as the backward hands it over; amp O2: the fp32 master and a
single gather of its half copy), each reason naming the pass; with the pass disabled none
of it is there. Trained on the simulator with the pass active, every stage matches eager
torch (fp32, rtol 1e-5). tests/passes/test_zero.py covers ZeRO end to end over many layouts."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture.mixed_precision import Precision
from autopar.capture.step import capture
from autopar.ir import Program, Role, StateKind
from autopar.ir.attrs import DIST, NAME, ORIGIN, PINNED_DIMS, STATE
from autopar.ir.dist import Replicate, Shard
from autopar.models import MLP
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.pass_infra.manager import PassManager

from ..parity import (
    assert_same_losses,
    assert_same_params,
    dumped_around,
    eager_train,
    gpt_optimizer,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    regression_data,
    twin,
)

PASS = "zero_sharding"
DP = "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
BATCH, STEPS = 6, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 32, 6, depth=2)        # first dims 32 and 6: even over 2 ranks


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _plan(yaml: str, disabled: frozenset[str] = frozenset()) -> Program:
    """The MLP's AdamW training step as the passes up to and including this one leave it."""
    model, strategy = _mlp(), ap.Strategy.from_yaml_str(yaml)
    amp = strategy.amp            # capture casts as the engine has it do (amp O2: weights)
    precision = Precision(getattr(torch, amp.dtype), amp.level) if amp.is_enabled else None
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 6)
    program = capture(model, _mse, x, y, mode="train", precision=precision).program
    ctx = PassContext(PlanInputs.of(
        strategy, optimizer=torch.optim.AdamW(model.parameters()),
        param_names={id(p): n for n, p in model.named_parameters()}))
    names = [p.name for p in passes.PIPELINE]
    upto = passes.PIPELINE[:names.index(PASS) + 1]
    return PassManager(upto, disabled=disabled).run(program, ctx)


def _sharded_by_the_pass(value, stage: int, what: str) -> bool:
    """``value`` is cut on dp (dim 0 of a 1-D mesh) for the reason this pass records."""
    why = value.why
    return (value.dist is not None and value.dist.placements == (Shard(0),)
            and why is not None and why.kind == "plan" and why.made_by == PASS
            and why.text.startswith(f"sharding stage {stage}: {what}"))


def _annotations(program: Program, origin: str) -> list:
    return [op for op in program.ops
            if op.target == "autopar.annotate" and op.attrs[ORIGIN].startswith(origin)]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_sharding_cuts_each_optimizer_state_on_the_sharding_axis(stage):
    """Stages 1 and 2: every optimizer state shaped like its parameter is pinned
    ``Shard(0)`` over dp, the reason naming the stage, the state and the pass; Adam's
    scalar ``step`` and the parameters stay unplaced (completion's to decide). Disabled:
    no state is placed."""
    program = _plan(DP + f"sharding: {{stage: {stage}, axis: dp}}\n")
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    states = program.states(StateKind.OPTIM)
    assert len(states) == 3 * len(params)                 # exp_avg, exp_avg_sq, step
    for op in states:
        name, value = op.attrs[NAME], op.result
        if value.type.shape == params[op.attrs[STATE].param].type.shape:
            assert _sharded_by_the_pass(value, stage, f"optimizer state {name!r}"), name
        else:
            assert value.type.shape == () and value.dist is None, name
    assert all(p.dist is None for p in params.values())

    off = _plan(DP + f"sharding: {{stage: {stage}, axis: dp}}\n", frozenset({PASS}))
    assert all(op.result.dist is None for op in off.states())


def test_stage_3_cuts_the_parameters_and_gathers_them_before_each_phase_reads_them():
    """Stage 3: each parameter is pinned ``Shard(0)`` too, and an annotation pinning
    Replicate on dp goes right before the forward's first read of it (and the backward's,
    for the weights the backward reads), every reader of that phase reading the annotation:
    so reshard all-gathers the weight there instead of moving activations. Disabled: no
    parameter is cut, no gather is asked for."""
    program = _plan(DP + "sharding: {stage: 3, axis: dp}\n")
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    users = program.users()
    for name, param in params.items():
        assert _sharded_by_the_pass(param, 3, f"parameter {name!r}"), name
        found = _annotations(program, f"zero-3 gather {name}")
        notes = {op.role: op for op in found}
        assert Role.FORWARD in notes and len(notes) == len(found), name     # one a phase
        for role, note in notes.items():
            assert note.attrs[DIST].placements == (Replicate(),)
            assert note.attrs[PINNED_DIMS] == (0,)
            assert note.args == (param,)
            readers = users[note.result]
            assert readers and all(op.role is role for op in readers)
            assert program.ops.index(note) < min(program.ops.index(op) for op in readers)
        # the phases read the gathered copies only; the update reads the piece
        direct = {op.role for op in users[param] if op.target != "autopar.annotate"}
        assert direct == {Role.OPTIMIZER}, (name, direct)
    # the backward reads the weights of the layers after the first (input gradients)
    assert {n for n in params if Role.BACKWARD in
            {op.role for op in _annotations(program, f"zero-3 gather {n}")}} == \
        {"layers.1.weight", "head.weight"}

    off = _plan(DP + "sharding: {stage: 3, axis: dp}\n", frozenset({PASS}))
    assert not _annotations(off, "zero-3 gather")
    assert all(op.result.dist is None for op in off.states(StateKind.PARAM))


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_2_holds_a_clipped_gradient_sharded_where_its_update_runs(stage):
    """With clipping between the backward and the update, stage 2 pins each raw gradient
    ``Shard(0)`` right before the first optimizer op that reads it (clipping then works on
    the pieces); stage 1 does not (the gradient may be held whole). Disabled: never."""
    yaml = DP + f"sharding: {{stage: {stage}, axis: dp}}\ngrad_clip: {{max_norm: 0.5}}\n"
    program = _plan(yaml)
    notes = _annotations(program, "zero-2 gradient")
    if stage == 1:
        assert not notes
    else:
        updates = [op for op in program.ops if op.target.startswith("optim.")]
        assert len(notes) == len(updates) == 6
        users = program.users()
        for note in notes:
            assert note.role is Role.OPTIMIZER
            assert note.attrs[DIST].placements == (Shard(0),)
            assert note.args[0].producer.role is not Role.OPTIMIZER   # as the backward made it
            readers = users[note.result]
            assert readers and all(op.role is Role.OPTIMIZER for op in readers)
            assert not [op for op in users[note.args[0]]
                        if op.role is Role.OPTIMIZER and op is not note]
    assert not _annotations(_plan(yaml, frozenset({PASS})), "zero-2 gradient")


def test_a_colwise_weight_is_cut_on_a_dim_tensor_parallel_leaves_whole():
    """dp2 x tp2: a colwise weight is already cut on dim 0 over tp, so its optimizer states
    are cut on dim 1 over dp (each ZeRO piece a slice of the tensor-parallel piece); a
    rowwise weight (cut on dim 1 over tp) keeps ZeRO's dim 0."""
    program = _plan("mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
                    "tensor_parallel: {axis: tp, plan: {layers.0: colwise, layers.1: rowwise}}\n"
                    "sharding: {stage: 1, axis: dp}\n")
    placed = {op.attrs[NAME]: op.result for op in program.states(StateKind.OPTIM)}
    assert placed["layers.0.weight/exp_avg"].dist.placements == (Shard(1), Shard(0))
    assert placed["layers.1.weight/exp_avg"].dist.placements == (Shard(0), Shard(1))
    assert placed["layers.0.weight/exp_avg"].why.made_by == PASS


def test_amp_o2_keeps_the_fp32_master_cut_and_gathers_its_half_copy_once():
    """Stages 1-2 under amp O2 (Megatron's distributed optimizer): each fp32 parameter read
    only through its half-dtype cast is pinned ``Shard(0)``, the cast is hoisted right after
    it and one annotation right after the cast gathers the half copy for every forward and
    backward read."""
    program = _plan(DP + "sharding: {stage: 1, axis: dp}\n"
                    "amp: {enable: true, dtype: bfloat16, level: O2}\n")
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    users = program.users()
    for name, param in params.items():
        assert _sharded_by_the_pass(param, 1, f"fp32 master parameter {name!r}"), name
        (note,) = _annotations(program, f"zero gather {name}")
        cast = note.args[0].producer
        assert cast.target == "aten._to_copy.default" and cast.args == (param,)
        assert note.args[0].type.dtype == torch.bfloat16
        ops = program.ops
        assert ops.index(cast) == ops.index(param.producer) + 1
        assert ops.index(note) == ops.index(cast) + 1
        assert note.attrs[DIST].placements == (Replicate(),)
        assert [op for op in users[cast.result] if op is not note] == []
        assert {op.role for op in users[note.result]} <= {Role.FORWARD, Role.BACKWARD}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_sharding_trains_like_eager(stage, tmp_path):
    """dp2 with the pass active, AdamW, on the simulator: every step's loss and the final
    parameters equal single-device eager torch's (fp32, rtol 1e-5); the plan that ran is
    the pass's (its dump cuts the optimizer state, the dump before it does not)."""
    model, data = _mlp(), regression_data(STEPS * BATCH, 16, 6)
    ref = twin(model)
    opt, scheduler = gpt_optimizer("adamw", model, warmup=2)
    ref_opt, ref_scheduler = gpt_optimizer("adamw", ref, warmup=2)
    want = eager_train(ref, _mse, ref_opt, data, BATCH, STEPS, scheduler=ref_scheduler)
    strategy = ap.Strategy.from_yaml_str(
        DP + f"sharding: {{stage: {stage}, axis: dp}}\n"
        f"debug: {{simulate: true, dump_dir: '{tmp_path}', dump_ranks: [0]}}\n")
    engine = ap.Engine(model, _mse, opt, strategy=strategy, lr_scheduler=scheduler)
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    before, after = dumped_around(tmp_path, PASS)
    needle = "state optim 'layers.0.weight/exp_avg'"
    assert "{S(0)}" in _line(after, needle) and "{S(0)}" not in _line(before, needle)


def _line(text: str, needle: str) -> str:
    (line,) = [line for line in text.splitlines() if needle in line]
    return line
