"""General mechanisms third-party models needed (issue 31), each on a small model of its own
trained through ``Engine.fit`` against eager torch (fp32, rtol 1e-5) serial, under data
parallelism and in a two-stage pipeline on the simulator, with ``debug.strict_rules`` (an op
without an SPMD rule is an error, not a replicated fallback):

* a learned position embedding indexed by position ids (its backward is ``index_put``);
* an ``as_strided`` pooling head (its backward writes through ``as_strided`` with ``copy_``)
  after a softplus (``softplus_backward``);
* BatchNorm in a pipeline of several micro-batches, by each micro-batch's own statistics
  (``pipeline.batch_norm: per_micro_batch``) against eager running the micro-batches one
  after another;
* a contrastive loss over the whole batch, which micro-batches cannot compute: refused by
  name in a pipeline of several micro-batches, exact elsewhere.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import autopar as ap
from autopar.ir import Op, OpKind, Program, TensorType, Value
from autopar.ir.attrs import INPUT_LAYOUT
from autopar.ir.dist import DistAttr, ProcessMesh, Shard, format_placements
from autopar.ir.ops import resolve
from autopar.ir.printer import format_program
from autopar.passes.assign_phases import PipelineError
from autopar.passes.completion import MissingRuleWarning
from autopar.passes.strided_views import plain_views
from autopar.reshard import plan_reshard
from autopar.reshard.steps import AllGather, Slice
from autopar.spmd.rule_registry import RULES

from ..parity import assert_same_losses, assert_same_params, eager_train, one_thread, twin

pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["one_thread"]

STRICT = "debug: {simulate: true, strict_rules: true}\n"
PLANS = {
    "serial": STRICT,
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n" + STRICT,
    "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
           "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n" + STRICT,
}
BATCH, STEPS = 8, 3


def _pipeline(schedule: str, micro_batches: int, extra: str = "") -> str:
    return ("mesh: {shape: [2], dim_names: [pp]}\n"
            f"pipeline: {{axis: pp, schedule: {schedule}, micro_batches: {micro_batches}"
            f"{extra}}}\n" + STRICT)


def _fit(model: nn.Module, loss, data, plan: str) -> list[float]:
    engine = ap.Engine(model, loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(plan))
    return engine.fit(data, batch_size=BATCH, verbose=0)["loss"]


def _assert_like_eager(build, loss, data, plan: str) -> None:
    torch.manual_seed(0)
    model = build()
    reference = twin(model)
    losses = _fit(model, loss, data, plan)
    want = eager_train(reference, loss, torch.optim.SGD(reference.parameters(), lr=0.1), data,
                       BATCH, STEPS)
    assert_same_losses(losses, want)
    assert_same_params(model, reference)


def _vectors(d_in: int, d_out: int, shape: tuple[int, ...] = ()) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, d_in, generator=g), torch.randn(d_out, generator=g))
            for _ in range(BATCH * STEPS)]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


# ----------------------------------------------------------------------------------------
# (a) a learned position embedding: a Parameter indexed by position ids (backward index_put)
# ----------------------------------------------------------------------------------------
class PositionTable(nn.Module):
    """Token embedding plus ``pos[position_ids]`` on a plain Parameter, not nn.Embedding."""

    def __init__(self, vocab: int = 16, seq: int = 6, d: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        h = self.tok(ids) + self.pos[position_ids]
        return self.fc2(torch.relu(self.fc1(h)))


def lm_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _tokens(vocab: int = 16, seq: int = 6) -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (BATCH * STEPS, seq + 1), generator=g)
    return [(t[:-1], t[1:]) for t in ids]


@pytest.mark.parametrize("plan", list(PLANS))
def test_indexed_position_table_trains_like_eager(plan):
    _assert_like_eager(PositionTable, lm_ce, _tokens(), PLANS[plan])


def test_a_pipeline_refusal_names_the_op_without_a_rule(monkeypatch):
    """Without its rule the op runs replicated, on the whole batch: refused by name."""
    monkeypatch.delitem(RULES, "aten.index_put.default")
    lenient = PLANS["pp2"].replace("strict_rules: true", "strict_rules: false")
    with pytest.warns(MissingRuleWarning, match="index_put"), \
            pytest.raises(PipelineError, match=r"aten.index_put.default has no SPMD rule"):
        _fit(PositionTable(), lm_ce, _tokens(), lenient)


# ----------------------------------------------------------------------------------------
# (b) an as_strided pooling head after a softplus
# ----------------------------------------------------------------------------------------
class StridedPooling(nn.Module):
    """First and last token pooled through ``as_strided`` (a head written against memory)."""

    def __init__(self, seq: int = 4, d: int = 8):
        super().__init__()
        self.seq, self.d = seq, d
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.softplus(self.fc1(x))                                  # [B, S, d]
        n, row = h.shape[0], self.seq * self.d
        first = h.as_strided((n, self.d), (row, 1))
        last = h.as_strided((n, self.d), (row, 1), (self.seq - 1) * self.d)
        return self.fc2(first + last)


@pytest.mark.parametrize("plan", list(PLANS))
def test_as_strided_pooling_head_trains_like_eager(plan):
    _assert_like_eager(StridedPooling, mse, _vectors(8, 3, (4,)), PLANS[plan])


# (input shape, size, stride, offset): reads that are a block of the input's elements
BLOCKS = [
    ((4, 4, 8), (4, 8), (32, 1), 0),          # first token
    ((4, 4, 8), (4, 8), (32, 1), 24),         # last token
    ((4, 4, 8), (8, 4), (1, 32), 8),          # transposed
    ((6, 5), (3, 5), (10, 1), 5),             # every other row from row 1
    ((2, 3, 4), (2, 3, 4), (12, 4, 1), 0),    # the input itself
    ((2, 3, 4), (2, 1, 3, 4), (12, 7, 4, 1), 0),   # a size-1 dim
    ((4, 8), (4, 3, 8), (8, 0, 1), 0),        # a broadcast dim
    ((24,), (2, 3), (12, 4), 1),              # an inner stride above 1
    ((128,), (4, 4, 8), (32, 8, 1), 0),       # a flat buffer viewed whole
]
# reads that are not: overlapping windows, strides that do not divide, past the end
NOT_BLOCKS = [((10,), (3, 4), (2, 1), 0), ((12,), (2, 5), (5, 2), 0), ((4, 4), (4, 4), (4, 1), 1)]


def _strided(shape, size, stride, offset) -> tuple[Program, Value, Op]:
    x = Value(TensorType(shape, torch.float32))
    op = Op(OpKind.CALL, "aten.as_strided.default", (x, list(size), list(stride), offset), {},
            [Value(TensorType(size, torch.float32))],
            attrs={INPUT_LAYOUT: (torch.empty(shape).stride(), 0)})
    op.outputs[0].producer = op
    return Program([op]), x, op


@pytest.mark.parametrize("shape,size,stride,offset", BLOCKS)
def test_as_strided_becomes_plain_views_that_read_the_same_elements(shape, size, stride,
                                                                    offset):
    program, x, op = _strided(shape, size, stride, offset)
    out = op.outputs[0]
    plain_views(program)
    assert all(o.target != "aten.as_strided.default" for o in program.ops)
    values = {x: torch.arange(float(torch.Size(shape).numel())).reshape(shape)}
    for o in program.ops:
        args = [values[a] if isinstance(a, Value) else a for a in o.args]
        values[o.outputs[0]] = resolve(o.target)(*args)
    want = values[x].as_strided(size, stride, offset)
    torch.testing.assert_close(values[out], want, rtol=0, atol=0)


@pytest.mark.parametrize("shape,size,stride,offset", NOT_BLOCKS)
def test_as_strided_that_is_no_block_stays(shape, size, stride, offset):
    program, _, op = _strided(shape, size, stride, offset)
    assert plain_views(program).ops == [op]


# ----------------------------------------------------------------------------------------
# (d) BatchNorm in a pipeline: each micro-batch normalized by its own statistics
# ----------------------------------------------------------------------------------------
class Normed(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc1, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d, momentum=0.3)
        self.fc2, self.fc3 = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


class ConvNormed(nn.Module):
    """BatchNorm2d: statistics over the batch and both spatial dims, per channel."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc1, self.fc2 = nn.Linear(4 * 5 * 5, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))


def eager_micro_batches(model: nn.Module, data, micro_batches: int) -> list[float]:
    """torch.distributed.pipelining's math on one device: the micro-batches one after
    another through the model (each its own statistics, running statistics updated in
    order), gradients accumulated, one step; the loss is the global batch's mean."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in DataLoader(data, batch_size=BATCH):
        optimizer.zero_grad()
        total = 0.0
        for xk, yk in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = mse(model(xk), yk) * (len(xk) / len(x))
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("build,schedule,micro_batches", [
    (Normed, "1F1B", 2), (Normed, "FThenB", 4), (Normed, "FThenB", 1), (ConvNormed, "1F1B", 2),
], ids=["1d-1F1B-mb2", "1d-FThenB-mb4", "1d-FThenB-mb1", "2d-1F1B-mb2"])
def test_batch_norm_per_micro_batch_trains_like_eager_micro_batches(build, schedule,
                                                                    micro_batches):
    data = _vectors(8, 3) if build is Normed else _vectors(5, 3, (2, 5))
    torch.manual_seed(0)
    model = build()
    reference = twin(model)
    plan = _pipeline(schedule, micro_batches, ", batch_norm: per_micro_batch")
    losses = _fit(model, mse, data, plan)
    assert_same_losses(losses, eager_micro_batches(reference, data, micro_batches))
    assert_same_params(model, reference)     # running statistics and the batch count too


def test_batch_norm_per_micro_batch_is_named_in_the_program():
    torch.manual_seed(0)
    model = Normed()
    engine = ap.Engine(model, mse, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           _pipeline("1F1B", 2, ", batch_norm: per_micro_batch")))
    program = engine.prepare(torch.randn(BATCH, 8), torch.randn(BATCH, 3))
    text = format_program(program)
    assert "autopar.micro_batch_norm(" in text and "autopar.micro_batch_norm_backward(" in text
    assert "batch_norm: per_micro_batch" in engine.strategy.to_yaml()
    # on the micro-batch dim: its rows, its own statistics, its terms of the running ones
    norm = next(op for op in program.ops if op.target == "autopar.micro_batch_norm")
    assert [format_placements(v.dist.placements) for v in norm.outputs] == \
        ["{S(0)}", "{R}", "{R}", "{P(sum)}", "{P(sum)}"]


def test_batch_norm_of_the_whole_batch_in_a_pipeline_is_refused_with_the_option():
    torch.manual_seed(0)
    with pytest.raises(PipelineError, match=r"batch_norm.*\(bn\).*pipeline.batch_norm: "
                                            r"per_micro_batch"):
        _fit(Normed(), mse, _vectors(8, 3), PLANS["pp2"])


@pytest.mark.parametrize("plan", ["serial", "dp2"])
def test_batch_norm_without_micro_batches_keeps_whole_batch_statistics(plan):
    _assert_like_eager(Normed, mse, _vectors(8, 3), PLANS[plan])


# ----------------------------------------------------------------------------------------
# (c) a contrastive loss over the whole batch
# ----------------------------------------------------------------------------------------
class TwoTowers(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.a(x), self.b(x)])


def contrastive(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = out[0], out[1]
    return F.cross_entropy(a @ b.T, torch.arange(a.shape[0]))


@pytest.mark.parametrize("plan", ["serial", "dp2", "pp2_one_micro_batch"])
def test_contrastive_loss_over_the_batch_trains_like_eager(plan):
    text = _pipeline("FThenB", 1) if plan == "pp2_one_micro_batch" else PLANS[plan]
    _assert_like_eager(TwoTowers, contrastive, _vectors(8, 1), text)


def test_contrastive_loss_over_micro_batches_is_refused_naming_the_op():
    torch.manual_seed(0)
    with pytest.raises(PipelineError, match=r"aten.mm.default \(<loss>\) needs the whole "
                                            r"batch.*the loss couples micro-batches"):
        _fit(TwoTowers(), contrastive, _vectors(8, 1), PLANS["pp2"])


def test_a_shard_change_over_micro_batches_is_planned_through_the_whole_value():
    mesh = ProcessMesh([0, 1], dim_names=["mb"])
    steps = plan_reshard([8, 8], DistAttr(mesh, (Shard(0),)), DistAttr(mesh, (Shard(1),)))
    assert [type(s) for s in steps] == [AllGather, Slice]
