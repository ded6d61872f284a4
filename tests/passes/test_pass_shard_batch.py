"""Pass ``shard_batch``: every fed input and label is pinned ``Shard(batch dim)`` over the
data-parallel mesh dim, then over a pipeline's micro-batch dim, and ``Shard(seq dim)`` over
the context-parallel one, the reason naming the axes and the pass. Run through the pass,
that is what the batch holds; with the pass disabled the batch is unplaced. Trained on the
simulator with the pass active (dp2, pp2 x dp2) an MLP matches eager torch (fp32,
rtol 1e-5). tests/data/test_batch_dim.py covers ``batch_dim`` end to end."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture import BatchDimError
from autopar.capture.step import capture
from autopar.ir import OpKind, Program
from autopar.ir.attrs import BATCH_PATH, NAME
from autopar.ir.dist import Shard
from autopar.models import MLP
from autopar.models.gpt import lm_loss
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.pass_infra.manager import PassManager

from ..parity import (
    assert_same_losses,
    assert_same_params,
    dumped_around,
    eager_train,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
    regression_data,
    twin,
)

PASS = "shard_batch"
DP = "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
PP_DP = ("mesh: {shape: [2, 2], dim_names: [pp, dp]}\ndata_parallel: {axis: dp}\n"
         "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n")
BATCH, STEPS = 8, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 32, 6, depth=2)


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _plan(yaml: str, disabled: frozenset[str] = frozenset(), model=None, loss=_mse,
          batch=None, **inputs) -> Program:
    """The training step as the passes up to and including this one leave it (the MLP on
    an [8, 16] batch unless told)."""
    model = model if model is not None else _mlp()
    x, y = batch if batch is not None else (torch.randn(BATCH, 16), torch.randn(BATCH, 6))
    program = capture(model, loss, x, y, mode="train").program
    ctx = PassContext(PlanInputs.of(
        ap.Strategy.from_yaml_str(yaml), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        param_names={id(p): n for n, p in model.named_parameters()}, **inputs))
    names = [p.name for p in passes.PIPELINE]
    upto = passes.PIPELINE[:names.index(PASS) + 1]
    return PassManager(upto, disabled=disabled).run(program, ctx)


def _fed(program: Program) -> dict[str, object]:
    """The fed tensors (inputs, labels) by their path in the batch."""
    return {op.attrs[BATCH_PATH]: op.outputs[0] for op in program.ops_of(OpKind.INPUT)
            if op.attrs[NAME].startswith("batch/")}


def _others(program: Program) -> list:
    return [op.outputs[0] for op in program.ops_of(OpKind.INPUT)
            if not op.attrs[NAME].startswith("batch/")]


def test_shard_batch_cuts_inputs_and_labels_on_the_batch_dim_over_dp():
    """dp2: the inputs and the labels are pinned ``Shard(0)`` on dp for the reason
    ``data_parallel.axis dp: batch dim 0``, recorded by this pass; what else the step is fed
    (the optimizer's hyperparameters) is left alone. Disabled: the batch is unplaced."""
    program = _plan(DP)
    fed = _fed(program)
    assert set(fed) == {"inputs", "labels"}
    for value in fed.values():
        assert value.dist.placements == (Shard(0),)
        assert value.why.kind == "data_parallel" and value.why.made_by == PASS
        assert value.why.text == "data_parallel.axis dp: batch dim 0"
    assert all(v.dist is None for v in _others(program))

    assert all(v.dist is None for v in _fed(_plan(DP, frozenset({PASS}))).values())


@pytest.mark.parametrize("yaml, mesh, placements", [
    (PP_DP, ("dp", "mb"), (Shard(0), Shard(0))),
    ("mesh: {shape: [2], dim_names: [pp]}\n"
     "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n", ("mb",), (Shard(0),)),
], ids=["pp2xdp2", "pp2"])
def test_under_a_pipeline_each_dp_piece_is_cut_into_micro_batches(yaml, mesh, placements):
    """Under a pipeline the program's mesh has a micro-batch dim ``mb``: the batch is cut
    over dp first (the global batch), then each piece over ``mb`` (2 micro-batches), the
    reason naming both. Disabled: unplaced."""
    program = _plan(yaml, micro_batches=2)
    for value in _fed(program).values():
        assert value.dist.mesh.dim_names == mesh
        assert value.dist.placements == placements
        assert value.why.made_by == PASS
        assert "pipeline: 2 micro-batches of each piece: batch dim 0" in value.why.text
        assert ("data_parallel.axis dp" in value.why.text) == ("dp" in mesh)
    off = _plan(yaml, frozenset({PASS}), micro_batches=2)
    assert all(v.dist is None for v in _fed(off).values())


def test_context_parallel_also_cuts_the_sequence_dim():
    """dp2 x cp2 on a GPT: token ids and labels ([batch, seq]) are ``Shard(0)`` on dp and
    ``Shard(1)`` (the strategy's seq dim) on cp."""
    x, y = (torch.stack(t) for t in zip(*lm_data(4, 8, 64)))
    program = _plan("mesh: {shape: [2, 2], dim_names: [dp, cp]}\ndata_parallel: {axis: dp}\n"
                    "context_parallel: {axis: cp}\n",
                    model=parity_gpt("adamw", vocab=64, seq=8, layers=1), loss=lm_loss,
                    batch=(x, y))
    for value in _fed(program).values():
        assert value.dist.placements == (Shard(0), Shard(1))
        assert value.why.text.endswith("context_parallel.axis cp: seq dim 1")
        assert value.why.made_by == PASS


class _SeqFirst(torch.nn.Module):
    """A model fed [seq, batch, features] tensors."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 6)

    def forward(self, x):
        return self.proj(x)


def test_the_strategy_s_batch_dim_is_the_dim_cut():
    """``data_parallel.batch_dim: 1``: [seq, batch, ...] tensors are cut on dim 1; a
    ``batch_dim`` naming a path that is not in the batch is refused, naming it."""
    batch = (torch.randn(5, BATCH, 16), torch.randn(5, BATCH, 6))
    program = _plan("mesh: {shape: [2], dim_names: [dp]}\n"
                    "data_parallel: {axis: dp, batch_dim: 1}\n", model=_SeqFirst(), batch=batch)
    for value in _fed(program).values():
        assert value.dist.placements == (Shard(1),)
        assert value.why.text == "data_parallel.axis dp: batch dim 1"
    with pytest.raises(BatchDimError, match=r"\['inputs.input_ids'\], which are not in the"):
        _plan("mesh: {shape: [2], dim_names: [dp]}\n"
              "data_parallel: {axis: dp, batch_dim: {inputs: 1, inputs.input_ids: 1}}\n",
              model=_SeqFirst(), batch=batch)


@pytest.mark.parametrize("yaml, placed", [(DP, "{S(0)}"), (PP_DP, "{S(0),S(0)}")],
                         ids=["dp2", "pp2xdp2"])
def test_shard_batch_trains_like_eager(yaml, placed, tmp_path):
    """With the batch cut by this pass, each rank computing on its rows (and micro-batches),
    every step's loss and the final parameters equal single-device eager torch's (SGD,
    fp32, rtol 1e-5) on the simulator; the plan that ran is the pass's (its dump places the
    fed tensors, the dump before it does not)."""
    model, data = _mlp(), regression_data(STEPS * BATCH, 16, 6)
    ref = twin(model)
    want = eager_train(ref, _mse, torch.optim.SGD(ref.parameters(), lr=0.1), data, BATCH, STEPS)
    debug = f"debug: {{simulate: true, dump_dir: '{tmp_path}', dump_ranks: [0]}}\n"
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(yaml + debug))
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    before, after = dumped_around(tmp_path, PASS)
    for needle in ("input 'batch/0'", "input 'batch/1'"):
        assert placed in _line(after, needle) and "{" not in _line(before, needle)


def _line(text: str, needle: str) -> str:
    (line,) = [line for line in text.splitlines() if needle in line]
    return line
