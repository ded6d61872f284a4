"""Vocab-parallel cross-entropy: with class-sharded logits the loss needs only per-token
scalars (a max and a sum-of-exp all-reduce, a masked target lookup whose sum over ranks is
exact), never the whole [tokens, vocab] logits, and training still equals eager torch.

(a) the nll_loss rules and local forms op by op, on 1-D and 2-D meshes, even, uneven and
empty class shards, ignore_index inside and outside a rank's range, class weights;
(b) the pass: when it rewrites, what the plan communicates, the IR links it leaves;
(c) GPT training on the simulator under tp2 and dp2 x tp2 against single-device eager.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from op_cases import synthetic  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.capture.step import capture  # noqa: E402
from autopar.ir import OpKind, Program  # noqa: E402
from autopar.ir.attrs import DECOMPOSES
from autopar.ir.dist import (  # noqa: E402
    DistAttr,
    Partial,
    ProcessMesh,
    Shard,
    assemble,
    parse_placements,
    shard_tensor_local,
)
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402
from autopar.pass_infra.context import PassContext, PlanInputs  # noqa: E402
from autopar.pass_infra.manager import PassManager  # noqa: E402
from autopar.passes import PIPELINE
from autopar.passes.vocab_parallel_loss import classes_may_shard  # noqa: E402
from autopar.reshard.comm import RESHARD_STEP
from autopar.spmd import lookup  # noqa: E402
from autopar.spmd.local_forms import LocalContext, local_call, run_local  # noqa: E402
from autopar.spmd.rule_registry import tensor_inputs  # noqa: E402

from ..parity import ATOL, RTOL, assert_same_losses, assert_same_params, eager_train, lm_data, twin  # noqa: E402

NLL = "aten.nll_loss_forward.default"
NLL_BACKWARD = "aten.nll_loss_backward.default"
NONE, MEAN, SUM = 0, 1, 2


# ----------------------------------------------------------------------------------------
# (a) op level
# ----------------------------------------------------------------------------------------
def _mesh(shape: tuple[int, ...]) -> ProcessMesh:
    return ProcessMesh(torch.arange(math.prod(shape)).reshape(shape).tolist())


def _log_probs(rows: int | None, classes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (classes,) if rows is None else (rows, classes)
    return torch.randn(shape, generator=g).log_softmax(-1)


def _targets(rows: int | None, classes: int, ignore_index: int) -> torch.Tensor:
    """Every class range hit, some rows ignored."""
    if rows is None:
        return torch.tensor(classes - 1)
    t = torch.arange(rows) * 7 % classes
    t[1::4] = ignore_index
    return t


def _weight(classes: int) -> torch.Tensor:
    return torch.linspace(0.5, 2.0, classes)


def _run_on_ranks(case, mesh: ProcessMesh, needs: tuple[DistAttr, ...],
                  outputs: tuple[DistAttr | None, ...]) -> list[torch.Tensor]:
    """Each rank's local call on its pieces (a Partial(sum) input: the value on the first
    rank, zeros elsewhere), every output reassembled by its placement."""
    op = case.op
    ins = tensor_inputs(op)
    per_rank = {}
    for coord in mesh.coordinates():
        ctx = LocalContext(mesh, coord, needs, outputs)
        pieces = {v: shard_tensor_local(x, mesh, d.placements, coord)
                  for v, x, d in zip(ins, (x for x in case.inputs if torch.is_tensor(x)), needs)}
        result = run_local(op, ctx, pieces)
        per_rank[coord] = list(result) if isinstance(result, (tuple, list)) else [result]
    return [assemble({c: outs[i] for c, outs in per_rank.items()}, v.type.shape, mesh,
                     d.placements)
            for i, (v, d) in enumerate(zip(op.outputs, outputs))]


def _check(case, mesh: ProcessMesh, in_placements: list[str]) -> tuple:
    """The rule's decision from ``in_placements`` run rank by rank equals the global op."""
    dists = [DistAttr(mesh, parse_placements(p)) for p in in_placements]
    decision = lookup(case.op).forward(case.op, dists, mesh)
    got = _run_on_ranks(case, mesh, decision.needs, decision.outputs)
    for i, (ours, want) in enumerate(zip(got, case.outputs)):
        torch.testing.assert_close(ours, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"output {i} on {mesh}: {m}")
    return decision


# (id, mesh shape, rows (None: 1-D input), classes, self placement, target placement)
FORWARD_LAYOUTS = [
    ("tp2-even", (2,), 16, 12, "S(1)", "R"),
    ("tp2-uneven", (2,), 16, 11, "S(1)", "R"),
    ("tp4-empty-shard", (4,), 9, 3, "S(1)", "R"),      # chunks 1,1,1,0
    ("tp3-uneven", (3,), 10, 8, "S(1)", "R"),
    ("nested-2x2", (2, 2), 12, 11, "S(1),S(1)", "R,R"),
    ("dp-x-tp", (2, 2), 11, 10, "S(0),S(1)", "S(0),R"),
    ("tp-x-dp", (2, 3), 12, 9, "S(1),S(0)", "R,S(0)"),
    ("one-sample", (2,), None, 7, "S(0)", "R"),
]


@pytest.mark.parametrize("ignore_index", [-100, 5])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", [SUM, NONE])
@pytest.mark.parametrize("shape,rows,classes,x_at,t_at", [c[1:] for c in FORWARD_LAYOUTS],
                         ids=[c[0] for c in FORWARD_LAYOUTS])
def test_class_sharded_nll_forward_is_a_masked_partial(shape, rows, classes, x_at, t_at,
                                                       reduction, weighted, ignore_index):
    mesh = _mesh(shape)
    x, t = _log_probs(rows, classes), _targets(rows, classes, ignore_index)
    w = _weight(classes) if weighted else None
    case = synthetic(NLL, x, t, w, reduction, ignore_index)
    placements = [x_at, t_at] + ([",".join("R" * len(shape))] if weighted else [])
    decision = _check(case, mesh, placements)
    class_dims = DistAttr(mesh, parse_placements(x_at)).shard_mesh_dims(x.dim() - 1)
    # the class axis stays sharded: no gather of the logits; both results are sums of terms
    assert decision.needs[0].placements == parse_placements(x_at)
    for m in class_dims:
        assert decision.outputs[1].placements[m] == Partial("sum")
        assert decision.outputs[0].placements[m] == Partial("sum")
        if weighted:
            assert decision.needs[2].placements[m] == Shard(0)


def test_mean_reduced_nll_keeps_the_class_axis_whole():
    mesh = _mesh((2,))
    x, t = _log_probs(8, 6), _targets(8, 6, -100)
    decision = _check(synthetic(NLL, x, t, None, MEAN, -100), mesh, ["S(1)", "R"])
    assert decision.needs[0].placements == parse_placements("R")


@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", [MEAN, SUM, NONE])
@pytest.mark.parametrize("shape,rows,classes,x_at,t_at", [c[1:] for c in FORWARD_LAYOUTS],
                         ids=[c[0] for c in FORWARD_LAYOUTS])
def test_class_sharded_nll_backward_writes_only_the_local_classes(
        shape, rows, classes, x_at, t_at, reduction, weighted, ignore_index):
    mesh = _mesh(shape)
    replicated = ",".join("R" * len(shape))
    x, t = _log_probs(rows, classes), _targets(rows, classes, ignore_index)
    w = _weight(classes) if weighted else None
    _, total = torch.ops.aten.nll_loss_forward.default(x, t, w, reduction, ignore_index)
    per_row = reduction == NONE and rows is not None
    g = torch.linspace(-1.0, 2.0, rows) if per_row else torch.tensor(0.7)
    case = synthetic(NLL_BACKWARD, g, x, t, w, reduction, ignore_index, total)
    g_at = t_at if per_row else replicated
    placements = [g_at, x_at, t_at] + ([replicated] if weighted else []) + [replicated]
    decision = _check(case, mesh, placements)
    assert decision.outputs[0].placements == parse_placements(x_at)


def test_partial_incoming_gradient_is_reduced_before_the_class_sharded_backward():
    """A partial scalar gradient is all-reduced (4 bytes) rather than carried into a
    partial [6, 9] result that would need a reduction 54 times larger."""
    mesh = _mesh((2, 2))
    x, t = _log_probs(6, 9), _targets(6, 9, -100)
    _, total = torch.ops.aten.nll_loss_forward.default(x, t, None, SUM, -100)
    case = synthetic(NLL_BACKWARD, torch.tensor(1.5), x, t, None, SUM, -100, total)
    decision = _check(case, mesh, ["P(sum),R", "R,S(1)", "R,R", "R,R"])
    assert decision.needs[0].placements == parse_placements("R,R")
    assert decision.outputs[0].placements == parse_placements("R,S(1)")


def test_local_call_is_unchanged_when_the_class_axis_is_whole():
    mesh = _mesh((2,))
    x, t = _log_probs(8, 6), _targets(8, 6, -100)
    case = synthetic(NLL, x, t, None, SUM, -100)
    dists = [DistAttr(mesh, parse_placements(p)) for p in ("S(0)", "S(0)")]
    decision = lookup(case.op).forward(case.op, dists, mesh)
    ctx = LocalContext(mesh, (1,), decision.needs, decision.outputs)
    assert local_call(case.op, ctx).target == NLL


# ----------------------------------------------------------------------------------------
# (b) the pass and the plan
# ----------------------------------------------------------------------------------------
VOCAB, SEQ, BATCH = 64, 16, 4


def _gpt(vocab: int = VOCAB) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, block_size=SEQ,
                         sdpa=False))


def _plan(strategy: ap.Strategy, loss=lm_loss) -> Program:
    """The GPT training step as reshard leaves it: every move the placements need, before
    later passes regroup the collectives."""
    model = _gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = lm_data(BATCH, SEQ, VOCAB)[0]
    program = capture(model, loss, x.repeat(BATCH, 1), y.repeat(BATCH, 1), mode="train").program
    ctx = PassContext(PlanInputs.of(strategy, optimizer=optimizer, param_names={
        id(p): n for n, p in model.named_parameters()}))
    names = [p.name for p in PIPELINE]
    return PassManager(passes=PIPELINE[:names.index("reshard") + 1]).run(program, ctx)


def _decomposed(program: Program) -> list:
    return [op for op in program.ops if DECOMPOSES in op.attrs]


@pytest.mark.parametrize("config", ["configs/tp.yaml", "configs/dp_tp.yaml"])
def test_plan_moves_only_per_token_scalars_for_the_loss(config):
    program = _plan(ap.Strategy.from_yaml(config))
    tokens = BATCH * SEQ
    assert not any(op.target.startswith("aten._log_softmax") for op in program.ops)
    logits_shapes = {(tokens, VOCAB), (BATCH, SEQ, VOCAB)}
    comms = [op for op in program.ops if op.kind is OpKind.COMM]
    gathered = [op.attrs[RESHARD_STEP] for op in comms for v in op.outputs
                if v.is_tensor and v.type.shape in logits_shapes]
    assert not gathered, f"the logits still move: {gathered}"
    loss_ops = _decomposed(program) + [op for op in program.ops
                                       if op.target in (NLL, NLL_BACKWARD)]
    moved = [v.producer for op in loss_ops for v in op.inputs
             if v.producer is not None and v.producer.kind is OpKind.COMM]
    # forward max and sum-of-exp, backward sum: each per token (the total weight is counted
    # from the labels: one number, and none at all where the labels are whole)
    assert len({op.result for op in moved}) >= 3
    for op in moved:
        assert op.target == "comm.all_reduce", op.attrs[RESHARD_STEP]
        assert op.result.type.numel <= tokens, op.attrs[RESHARD_STEP]
    steps = " ".join(str(op.attrs[RESHARD_STEP]) for op in moved)
    assert "all_reduce(max)" in steps and "all_reduce(sum)" in steps


def test_rewrite_keeps_roles_modules_and_backward_links():
    program = _plan(ap.Strategy.from_yaml("configs/tp.yaml"))
    ops = set(program.ops)
    new = _decomposed(program)
    forward = [op for op in new if op.attrs[DECOMPOSES] == "_log_softmax"]
    backward = [op for op in new if op.attrs[DECOMPOSES] == "_log_softmax_backward_data"]
    assert [op.target for op in forward] == ["aten.amax.default", "aten.sub.Tensor",
                                             "aten.exp.default", "aten.sum.dim_IntList",
                                             "aten.log.default", "aten.sub.Tensor"]
    assert {op.role.value for op in forward} == {"loss"}
    assert {op.role.value for op in backward} == {"bwd"}
    assert {op.module for op in new} == {"<loss>"}
    # backward ops of the log-softmax point at the op that now makes its result
    assert all(op.forward_op is forward[-1] for op in backward)
    assert all(op.forward_op is None or op.forward_op in ops for op in program.ops)
    nll = next(op for op in program.ops if op.target == NLL)
    assert nll.args[0] is forward[-1].result


@pytest.mark.parametrize("config", ["configs/serial.yaml", "configs/dp.yaml"])
def test_serial_and_data_parallel_programs_keep_the_fused_log_softmax(config):
    program = _plan(ap.Strategy.from_yaml(config))
    assert not _decomposed(program)
    targets = [op.target for op in program.ops]
    assert "aten._log_softmax.default" in targets
    assert "aten._log_softmax_backward_data.default" in targets


def test_rewrite_condition():
    program = Program()
    dp = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]}, data_parallel={"axis": "dp"})
    tp1 = ap.Strategy(mesh={"shape": [2, 1], "dim_names": ["dp", "tp"]},
                      tensor_parallel={"axis": "tp"})
    tp2 = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]}, tensor_parallel={"axis": "tp"})
    assert not classes_may_shard(program, PassContext(PlanInputs.of(ap.Strategy())))
    assert not classes_may_shard(program, PassContext(PlanInputs.of(dp)))
    assert not classes_may_shard(program, PassContext(PlanInputs.of(tp1)))
    assert classes_may_shard(program, PassContext(PlanInputs.of(tp2)))
    # shard_tensor alone (no tensor_parallel section) may shard the head's classes
    mesh = ProcessMesh([0, 1], dim_names=["x"])
    annotated = PassContext(PlanInputs.of(ap.Strategy(), param_annotations={
        "head.weight": DistAttr(mesh, (Shard(0),))}))
    assert classes_may_shard(program, annotated)
    one_rank = PassContext(PlanInputs.of(ap.Strategy(), param_annotations={
        "head.weight": DistAttr(ProcessMesh([0], dim_names=["x"]), (Shard(0),))}))
    assert not classes_may_shard(program, one_rank)


# ----------------------------------------------------------------------------------------
# (c) training parity on the simulator
# ----------------------------------------------------------------------------------------
STEPS = 6


def _weighted_loss(vocab: int):
    weight = torch.linspace(0.5, 1.5, vocab)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # class weights, and an ignored class inside the first tp rank's range
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=weight,
                               ignore_index=5)
    return loss


# SGD: Adam divides by the gradient's own size, so the key bias of attention (whose exact
# gradient is 0) would turn rounding noise into full-size steps, with or without this pass.
@pytest.mark.parametrize("config,vocab,weighted", [
    ("configs/tp.yaml", 64, False),
    ("configs/dp_tp.yaml", 64, False),
    ("configs/dp_tp.yaml", 63, True),     # uneven vocab shards [32, 31], weights, ignore
])
def test_gpt_training_on_the_simulator_matches_eager(config, vocab, weighted):
    loss = _weighted_loss(vocab) if weighted else lm_loss
    model = _gpt(vocab)
    ref = twin(model)
    data = lm_data(BATCH * STEPS, SEQ, vocab)
    ref_losses = eager_train(ref, loss, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                             data, batch_size=BATCH, steps=STEPS)
    strategy = ap.Strategy.from_yaml(config).model_copy(update={
        "debug": ap.Strategy(debug={"simulate": True}).debug})
    engine = ap.Engine(model, loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       strategy=strategy)
    x, y = data[0]
    assert _decomposed(engine.prepare(torch.stack([x] * BATCH), torch.stack([y] * BATCH)))
    losses = engine.fit(data, batch_size=BATCH, verbose=0)["loss"]
    assert len(losses) == STEPS
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)
