"""Pass ``offload_states`` (``sharding.offload``): the optimizer state (with ``params``, the
parameters too) lives in host memory and the update runs there. Run through the pass on a
small MLP: the offloaded state ops are marked ``ON_HOST``; each gradient's host copy starts
right after the op that makes it, one ``host_ready`` right before the run of updates waits
for every copy the updates read, and each new parameter goes back through
``autopar.to_device`` (with ``params``: the host keeps it, and the step's other readers
read a device copy made right after the state). Disabled: no state is on the host and
nothing is copied. With the pass active the MLP trains like eager torch on the simulator
(fp32, rtol 1e-5). tests/passes/test_offload.py covers offloading end to end."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture.step import capture
from autopar.ir import OpKind, Program, Role, StateKind
from autopar.ir.attrs import NAME, ON_HOST, STATE
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

PASS = "offload_states"
OPTIMIZER = "sharding: {stage: 0, offload: {optimizer: true}}\n"
BOTH_STAGE_3 = ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
                "sharding: {stage: 3, axis: dp, offload: {optimizer: true, params: true}}\n")
COPIES = ("autopar.to_host", "autopar.host_ready", "autopar.to_device")
BATCH, STEPS = 6, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 32, 6, depth=2)


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _plan(yaml: str, disabled: frozenset[str] = frozenset()) -> Program:
    """The MLP's AdamW training step as the passes up to and including this one leave it."""
    model = _mlp()
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 6)
    program = capture(model, _mse, x, y, mode="train").program
    ctx = PassContext(PlanInputs.of(
        ap.Strategy.from_yaml_str(yaml), optimizer=torch.optim.AdamW(model.parameters()),
        param_names={id(p): n for n, p in model.named_parameters()}))
    names = [p.name for p in passes.PIPELINE]
    upto = passes.PIPELINE[:names.index(PASS) + 1]
    return PassManager(upto, disabled=disabled).run(program, ctx)


def _updates(program: Program) -> list:
    return [op for op in program.ops if op.target.startswith("optim.")]


def _on_host(program: Program) -> dict[StateKind, set[bool]]:
    found: dict[StateKind, set[bool]] = {}
    for op in program.states():
        found.setdefault(op.attrs[STATE].kind, set()).add(op.attrs.get(ON_HOST, False))
    return found


def _assert_nothing_offloaded(program: Program) -> None:
    assert all(not op.attrs.get(ON_HOST, False) for op in program.states())
    assert not [op for op in program.ops if op.target in COPIES]


def test_offload_states_keeps_optimizer_state_home_and_copies_what_crosses():
    """``offload: {optimizer: true}``: the optimizer states are ``ON_HOST``, the parameters
    are not; a single ``host_ready`` right before the (one) run of updates makes every
    tensor an update reads that is not already home (parameter, gradient), each from a
    ``to_host`` copy: a gradient's right after the backward op that makes it, part of the
    backward; each new parameter is copied back by ``to_device`` after the run and that copy
    is what the step writes back, while the new states stay home. Disabled: nothing."""
    program = _plan(OPTIMIZER)
    ops = program.ops
    assert _on_host(program) == {StateKind.PARAM: {False}, StateKind.OPTIM: {True}}
    updates = _updates(program)
    (wait,) = [op for op in ops if op.target == "autopar.host_ready"]
    assert ops.index(updates[0]) == ops.index(wait) + 1
    assert ops.index(updates[-1]) == ops.index(updates[0]) + len(updates) - 1   # one run
    for update in updates:
        for value in update.inputs:
            if value.is_tensor:
                made = value.producer
                assert made is wait or (made.kind is OpKind.STATE and made.attrs[ON_HOST])
        param, grad = update.args[0], update.args[1]
        assert param.producer is wait and grad.producer is wait
    copies = [v.producer for v in wait.args]
    assert all(copy.target == "autopar.to_host" for copy in copies)
    gradients = [c for c in copies if c.args[0].producer.kind is OpKind.CALL]
    assert len(gradients) == len(updates)
    for copy in gradients:                                   # each as the backward makes it
        made = copy.args[0].producer
        assert made.role is Role.BACKWARD and copy.role is Role.BACKWARD
        assert ops.index(copy) == ops.index(made) + 1
    backs = [op for op in ops if op.target == "autopar.to_device"]
    assert [op.args[0] for op in backs] == [u.outputs[0] for u in updates]
    assert min(ops.index(op) for op in backs) > ops.index(updates[-1])
    for update, back in zip(updates, backs):
        host_param = wait.args[wait.outputs.index(update.args[0])]
        name = host_param.producer.args[0].producer.attrs[NAME]     # to_host(state)
        assert program.result("update", name) is back.result
        assert program.result("update", f"{name}/exp_avg") is update.outputs[1]

    _assert_nothing_offloaded(_plan(OPTIMIZER, frozenset({PASS})))


def test_offloaded_parameters_stay_home_and_are_read_through_a_device_copy():
    """ZeRO-3 with ``params: true`` (FSDP2's CPUOffloadPolicy): every parameter piece is
    ``ON_HOST`` too; its update reads it there, every other reader reads an
    ``autopar.to_device`` copy made right after the state, and the new piece stays home
    (the step writes back the update's own result; no ``to_device`` of it)."""
    program = _plan(BOTH_STAGE_3)
    ops, users = program.ops, program.users()
    assert _on_host(program) == {StateKind.PARAM: {True}, StateKind.OPTIM: {True}}
    updates = {u.args[0].producer.attrs[NAME]: u for u in _updates(program)}
    for state in program.states(StateKind.PARAM):
        name, host = state.attrs[NAME], state.result
        readers = users[host]
        (copy,) = [op for op in readers if op.target == "autopar.to_device"]
        assert ops.index(copy) == ops.index(state) + 1
        assert set(readers) == {copy, updates[name]}
        assert program.result("update", name) is updates[name].outputs[0]
    assert not [op for op in ops if op.target == "autopar.to_device"
                and op.args[0].producer in updates.values()]

    _assert_nothing_offloaded(_plan(BOTH_STAGE_3, frozenset({PASS})))


def test_offloading_parameters_a_rank_updates_a_piece_of_is_refused():
    """Stage 1 keeps each parameter whole and updates a piece cut from it, so the host
    could not keep what the step reads: ``params: true`` is refused, naming the option and
    what would work."""
    yaml = ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
            "sharding: {stage: 1, axis: dp, offload: {optimizer: true, params: true}}\n")
    with pytest.raises(ValueError, match=r"sharding.offload.params: .* stage 3"):
        _plan(yaml)


@pytest.mark.parametrize("yaml", [OPTIMIZER, BOTH_STAGE_3], ids=["optimizer", "dp2_zero3_both"])
def test_offload_states_trains_like_eager(yaml, tmp_path):
    """With the update run on the host copies (on the CPU both homes are one memory), on
    the simulator: every step's loss and the final parameters equal single-device eager
    torch's (AdamW, fp32, rtol 1e-5); the plan that ran is the pass's (its dump keeps the
    states on the host and copies, the dump before it does neither)."""
    model, data = _mlp(), regression_data(STEPS * BATCH, 16, 6)
    ref = twin(model)
    opt, scheduler = gpt_optimizer("adamw", model, warmup=2)
    ref_opt, ref_scheduler = gpt_optimizer("adamw", ref, warmup=2)
    want = eager_train(ref, _mse, ref_opt, data, BATCH, STEPS, scheduler=ref_scheduler)
    debug = f"debug: {{simulate: true, dump_dir: '{tmp_path}', dump_ranks: [0]}}\n"
    engine = ap.Engine(model, _mse, opt, lr_scheduler=scheduler,
                       strategy=ap.Strategy.from_yaml_str(yaml + debug))
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    before, after = dumped_around(tmp_path, PASS)
    assert "{on_host}" in after and "autopar.host_ready" in after
    assert "{on_host}" not in before and "autopar.to_host" not in before
