"""Pass ``join_gradients``: under a pipeline a tied weight's gradient has a term from each
of two stages (the embedding's on the first, the output head's on the last). Reshard sums
the joined gradient over micro-batches (``add`` in every micro-batch's backward, then one
all-reduce over ``mb``); this pass sums each stage's term over micro-batches on its own
stage and joins the two sums once, in the optimizer phase. Run through the pass on a tied
2-layer GPT over pp2, that is the program (disabled: the per-micro-batch ``add``); without
micro-batches or a pipeline the pass changes nothing; with it the GPT trains like eager
torch on the simulator (fp32, rtol 1e-5)."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture.step import capture
from autopar.ir import OpKind, Program, Role, format_program
from autopar.ir.attrs import LOCAL_NOTE, NAME
from autopar.ir.dist import MICRO_BATCH_DIM
from autopar.models.gpt import lm_loss
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.pass_infra.manager import PassManager
from autopar.pipeline.phases import STAGE
from autopar.reshard.comm import RESHARD_STEP
from autopar.reshard.steps import AllReduce

from ..parity import (
    assert_same_losses,
    assert_same_params,
    dumped_around,
    eager_train,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
    twin,
)

PASS = "join_gradients"
PP = ("mesh: {shape: [2], dim_names: [pp]}\n"
      "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n")
VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt():
    """The parity GPT: its output head shares the embedding's weight."""
    model = parity_gpt("sgd", vocab=VOCAB, seq=SEQ, layers=2)
    assert model.head.weight is model.wte.weight
    return model


class _Reused(torch.nn.Module):
    """Each layer applied twice, so each weight's gradient is the sum of two terms made on
    one stage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(torch.relu(layer(x))))
        return x


def _plan(yaml: str = PP, disabled: frozenset[str] = frozenset(), model: str = "gpt",
          **inputs) -> Program:
    """The training step (the tied GPT's, or ``_Reused``'s) as the passes up to and
    including this one leave it."""
    if model == "gpt":
        model, loss = _gpt(), lm_loss
        x, y = (torch.stack(t) for t in zip(*lm_data(BATCH, SEQ, VOCAB)))
    else:
        model, loss = _Reused(), torch.nn.functional.mse_loss
        x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 16)
    program = capture(model, loss, x, y, mode="train").program
    ctx = PassContext(PlanInputs.of(
        ap.Strategy.from_yaml_str(yaml), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        param_names={id(p): n for n, p in model.named_parameters()}, **inputs))
    names = [p.name for p in passes.PIPELINE]
    upto = passes.PIPELINE[:names.index(PASS) + 1]
    return PassManager(upto, disabled=disabled).run(program, ctx)


def _sum_over_micro_batches(op) -> bool:
    step = op.attrs.get(RESHARD_STEP)
    return (op.kind is OpKind.COMM and isinstance(step, AllReduce)
            and step.axis == MICRO_BATCH_DIM and step.op == "sum")


def _stage(value) -> int:
    """The stage of the call that made ``value`` (through collectives that moved it)."""
    op = value.producer
    while op.kind is OpKind.COMM:
        op = op.args[0].producer
    return op.attrs[STAGE]


def _wte_gradient(program: Program):
    """The gradient the tied weight's update reads."""
    (update,) = [op for op in program.ops if op.target.startswith("optim.")
                 and op.args[0].producer.kind is OpKind.STATE
                 and op.args[0].producer.attrs[NAME] == "wte.weight"]
    return update.args[1]


def test_join_gradients_sums_each_stage_s_term_then_joins_them_once():
    """pp2, 2 micro-batches, a tied embedding and head: the gradient the tied weight's
    update reads is an ``add`` in the optimizer phase of two sums over ``mb``, one of the
    head's term (last stage) and one of the embedding's (first stage); no ``add`` of the
    two is left in the backward. Disabled: the update reads one sum over ``mb`` of a
    backward ``add`` of the two stages' terms, made every micro-batch."""
    program = _plan(micro_batches=2)
    joined = _wte_gradient(program).producer
    assert joined.target == "aten.add.Tensor" and joined.role is Role.OPTIMIZER
    assert "then joined once" in joined.attrs[LOCAL_NOTE]
    terms = [v.producer for v in joined.args]
    assert all(_sum_over_micro_batches(t) for t in terms)
    assert sorted(_stage(t.args[0]) for t in terms) == [0, 1]
    users = program.users()
    for term in terms:          # each term is summed as its stage's backward made it
        assert term.args[0].producer.role is Role.BACKWARD
        assert users[term.args[0]] == [term]

    off = _plan(disabled=frozenset({PASS}), micro_batches=2)
    total = _wte_gradient(off).producer
    assert _sum_over_micro_batches(total)
    add = total.args[0].producer
    assert add.target == "aten.add.Tensor" and add.role is Role.BACKWARD
    assert sorted(_stage(v) for v in add.args) == [0, 1]


@pytest.mark.parametrize("yaml, inputs, model", [
    (PP, {"micro_batches": 1}, "gpt"),
    ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n", {}, "gpt"),
    (PP, {"micro_batches": 2}, "reused"),
], ids=["one_micro_batch", "no_pipeline", "terms_of_one_stage"])
def test_nothing_to_join_leaves_the_program_alone(yaml, inputs, model):
    """One micro-batch (nothing is summed over micro-batches), no pipeline, or gradients
    whose two terms one stage makes (a layer applied twice: its sum over micro-batches is
    already one message per step): the program is the same as with the pass disabled."""
    program = _plan(yaml, model=model, **inputs)
    if model == "reused":       # each weight and bias: a two-term sum over micro-batches
        sums = [op for op in program.ops if _sum_over_micro_batches(op)
                and op.args[0].producer.target == "aten.add.Tensor"]
        assert len(sums) == 4
        assert all(len({_stage(v) for v in op.args[0].producer.args}) == 1 for op in sums)
    assert format_program(program) == \
        format_program(_plan(yaml, frozenset({PASS}), model=model, **inputs))


def test_join_gradients_trains_like_eager(tmp_path):
    """pp2 1F1B over 2 micro-batches with the tied gradient joined once a step, on the
    simulator: every step's loss and the final parameters equal single-device eager
    torch's (SGD, fp32, rtol 1e-5); the plan that ran is the pass's (its dump joins the
    tied gradient, the dump before it does not)."""
    model, data = _gpt(), lm_data(STEPS * BATCH, SEQ, VOCAB)
    ref = twin(model)
    want = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data, BATCH,
                       STEPS)
    debug = f"debug: {{simulate: true, dump_dir: '{tmp_path}', dump_ranks: [0]}}\n"
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(PP + debug))
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    before, after = dumped_around(tmp_path, PASS)
    assert after.count("then joined once") == 1 and "joined once" not in before
