"""Pass ``clip_grad`` (``grad_clip: {max_norm, norm_type}``): the gradients are clipped by
their global norm as ``torch.nn.utils.clip_grad_norm_`` does, traced from the same ATen ops
(one norm per gradient, the norm of their stack, ``max_norm / (total + 1e-6)`` clamped at 1,
one multiply per gradient) between the backward and the optimizer. Run through the pass, the
update reads the clipped gradients; with the pass disabled, the raw ones. Trained serially
and on the simulator's dp2 with a max_norm that clips every step, an MLP matches eager
torch with ``clip_grad_norm_`` (fp32, rtol 1e-5); planned without the pass it does not."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture.step import capture
from autopar.ir import OpKind, Program, Role
from autopar.models import MLP
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.pass_infra.manager import PassManager
from autopar.planner import step_planner

from ..parity import (
    assert_same_losses,
    assert_same_params,
    dumped_around,
    eager_train,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    regression_data,
    twin,
)

PASS = "clip_grad"
CLIP = "grad_clip: {max_norm: 0.05}\n"     # small enough that every step clips
DP = "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\ndebug: {simulate: true}\n"
BATCH, STEPS = 8, 3
NORM = "aten.linalg_vector_norm.default"

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 32, 6, depth=2)


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _plan(yaml: str, disabled: frozenset[str] = frozenset(), upto: str = PASS) -> Program:
    """The MLP's training step as the passes up to and including ``upto`` leave it."""
    model = _mlp()
    program = capture(model, _mse, torch.randn(BATCH, 16), torch.randn(BATCH, 6),
                      mode="train").program
    ctx = PassContext(PlanInputs.of(
        ap.Strategy.from_yaml_str(yaml), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        param_names={id(p): n for n, p in model.named_parameters()}))
    names = [p.name for p in passes.PIPELINE]
    return PassManager(passes.PIPELINE[:names.index(upto) + 1], disabled=disabled).run(
        program, ctx)


def _norms(program: Program) -> list:
    return [op for op in program.ops if op.kind is OpKind.CALL and op.target == NORM]


def _clipping(program: Program) -> list:
    """The multiplies by the clip coefficient (the one clamp's result)."""
    (clamp,) = [op for op in program.ops if op.kind is OpKind.CALL and "clamp" in op.target]
    return [op for op in program.ops if op.kind is OpKind.CALL
            and op.target == "aten.mul.Tensor" and clamp.outputs[0] in op.inputs]


def test_clip_grad_adds_eager_clip_grad_norm_ops_between_backward_and_update():
    params = len(list(_mlp().parameters()))
    program = _plan(CLIP)
    norms = _norms(program)
    assert len(norms) == params + 1        # one per gradient, one of their stack
    assert all(op.role is Role.OPTIMIZER for op in norms)
    clipped = _clipping(program)
    # each backward gradient is multiplied once, and the step's gradients are the products
    assert len(clipped) == params
    assert all(op.inputs[0].producer.role is Role.BACKWARD for op in clipped)
    grads = [v for slot, v in program.results() if slot.kind == "grad"]
    assert {id(op.outputs[0]) for op in clipped} == {id(g) for g in grads}


def test_the_update_reads_the_clipped_gradients_only():
    program = _plan(CLIP, upto="optimizer_updates")
    clipped = _clipping(program)
    updates = [op for op in program.ops if op.kind is OpKind.CALL
               and op.role is Role.OPTIMIZER and op.target.startswith("optim.")]
    read = {id(v) for op in updates for v in op.inputs}
    assert updates and all(id(op.outputs[0]) in read for op in clipped)
    assert not any(id(op.inputs[0]) in read for op in clipped)      # no raw gradient


@pytest.mark.parametrize("yaml", ["", "grad_clip: {max_norm: null}\n"])
def test_without_max_norm_or_with_the_pass_disabled_nothing_is_clipped(yaml):
    assert not _norms(_plan(yaml))
    assert not _norms(_plan(CLIP, disabled=frozenset({PASS})))


def _train(yaml: str, dump_dir=None) -> tuple[list[float], MLP]:
    model = _mlp()
    if dump_dir is not None:
        yaml += f"debug: {{dump_dir: '{dump_dir}'}}\n"
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       strategy=ap.Strategy.from_yaml_str(yaml))
    history = engine.fit(regression_data(BATCH * STEPS, 16, 6), batch_size=BATCH, verbose=0)
    return history["loss"], model


def _eager() -> tuple[list[float], MLP]:
    model = twin(_mlp())
    losses = eager_train(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         regression_data(BATCH * STEPS, 16, 6), BATCH, STEPS, max_norm=0.05)
    return losses, model


@pytest.mark.parametrize("layout", ["", DP])
def test_training_with_clip_grad_matches_eager_clip_grad_norm(layout):
    want_losses, want = _eager()
    got_losses, got = _train(layout + CLIP)
    assert_same_losses(got_losses, want_losses)
    assert_same_params(got, want)


def test_the_dump_shows_the_clip_after_the_pass(tmp_path):
    _train(CLIP, dump_dir=tmp_path)
    before, after = dumped_around(tmp_path, PASS)
    params = len(list(_mlp().parameters()))
    assert "linalg_vector_norm" not in before
    assert after.count("linalg_vector_norm") == params + 1


def test_planned_without_the_pass_the_run_leaves_eager(monkeypatch):
    """The parity above can fail: the same run planned with the pass disabled trains on
    unclipped gradients, and its parameters leave eager's."""
    monkeypatch.setattr(step_planner, "pass_manager",
                        functools.partial(passes.pass_manager, disabled=frozenset({PASS})))
    _, want = _eager()
    _, got = _train(CLIP)
    with pytest.raises(AssertionError):
        assert_same_params(got, want)
