"""Synchronized batch norm: under data parallelism a BatchNorm's per-channel statistics are
all-reduced from each rank's partial sums (passes/sync_batch_norm.py), never its activations
gathered, and training equals single-device eager torch: losses, parameters, running_mean,
running_var and num_batches_tracked, uneven batch shards included.

(a) the pass: when it rewrites, what it leaves (links, update results, serial and eval
    programs untouched), the dumps and ``explain``;
(b) training on the simulator: a BatchNorm1d MLP, a Conv2d+BatchNorm2d CNN, variants
    (3-D input, no affine, no running stats, one module called twice) and Hugging Face's
    ResNetForImageClassification under dp2 and dp4 (batch 6 on dp4: pieces 2, 2, 1, 1),
    the CNN also under dp2 x tp2 and pp2 x dp2; eval under dp2;
(c) the CNN on two real gloo ranks under torchrun (this file is also the rank's script).
"""
from __future__ import annotations

import copy
import os
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import models_zoo as zoo  # noqa: E402
from parity import ATOL, RTOL  # noqa: E402  (by name: this file also runs as a script)

import autopar as ap  # noqa: E402
from autopar.ir import OpKind, Program  # noqa: E402
from autopar.ir.attrs import DECOMPOSES, NAME  # noqa: E402
from autopar.ir.printer import value_names  # noqa: E402
from autopar.reshard.comm import RESHARD_STEP  # noqa: E402

BN = "aten.native_batch_norm.default"
BN_BACKWARD = "aten.native_batch_norm_backward.default"
FUNCTIONAL = "aten._native_batch_norm_legit_functional.default"
STEPS = 3


# ----------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------
class CNN(nn.Module):
    """Conv2d + BatchNorm2d + ReLU + pool, twice, then a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


class BiasFreeCNN(CNN):
    """Convolutions without bias before their batch norms, as ResNets have them: a bias
    there gets an identically zero gradient whose fp32 rounding noise Adam would follow
    (tests/parity.py), so Adam parity is shown without one."""

    def __init__(self):
        super().__init__()
        self.conv1.bias = self.conv2.bias = None


class Variants(nn.Module):
    """BatchNorm1d over (N, C, L) without affine parameters; one without running statistics;
    one module called twice a step (its running statistics are updated twice, in order)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.plain = nn.BatchNorm1d(6, affine=False)
        self.stateless = nn.BatchNorm1d(6, track_running_stats=False)
        self.shared = nn.BatchNorm1d(6, momentum=0.3)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.stateless(torch.relu(self.plain(self.conv(x))))
        x = self.shared(torch.tanh(self.shared(x)))
        return self.head(x.mean(2))


def _resnet() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       num_labels=3)
    return transformers.ResNetForImageClassification(config)


def _samples(shape: tuple[int, ...], classes: int, n: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g), torch.randint(0, classes, (), generator=g))
            for _ in range(n)]


# name -> (build, loss (None: the model's own), samples, whether inputs go as pixel_values)
MODELS = {
    "bn_mlp": (lambda: zoo.BatchNormNet(), F.cross_entropy, lambda n: _samples((8,), 4, n)),
    "cnn": (CNN, F.cross_entropy, lambda n: _samples((3, 8, 8), 5, n)),
    "bias_free_cnn": (BiasFreeCNN, F.cross_entropy, lambda n: _samples((3, 8, 8), 5, n)),
    "variants": (Variants, F.cross_entropy, lambda n: _samples((4, 5), 3, n)),
    "hf_resnet": (_resnet, None,
                  lambda n: [({"pixel_values": x}, y) for x, y in _samples((3, 16, 16), 3, n)]),
}
BN_LAYERS = {"bn_mlp": 1, "cnn": 2, "bias_free_cnn": 2, "variants": 4,
             "hf_resnet": 8}   # calls per step

STRATEGIES = {
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "dp4": "mesh: {shape: [4], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "dp2_tp2": "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
               "tensor_parallel: {axis: tp, plan: {conv1: colwise, conv2: rowwise}}\n",
}


def _strategy(text: str, debug: str = "") -> ap.Strategy:
    return ap.Strategy.from_yaml_str(text + f"debug: {{simulate: true{debug}}}\n")


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _eager(model: nn.Module, loss_fn, data: list, batch: int, steps: int,
           make_opt=_optimizer, max_norm: float | None = None) -> list[float]:
    optimizer = make_opt(model)
    losses = []
    for step in range(steps):
        x, y = torch.utils.data.default_collate(data[step * batch:(step + 1) * batch])
        out = model(**x, labels=y).loss if loss_fn is None else loss_fn(model(x), y)
        optimizer.zero_grad()
        out.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(out.item())
    return losses


def _assert_same_state(ours: nn.Module, ref: nn.Module) -> None:
    """Parameters and buffers (running_mean, running_var, num_batches_tracked)."""
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _train(name: str, strategy: str, batch: int, steps: int = STEPS, make_opt=_optimizer,
           max_norm: float | None = None):
    """(engine, model, eager twin after the same steps, data, our losses, eager losses)."""
    build, loss_fn, samples = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    reference = copy.deepcopy(model)
    data = samples(batch * steps)
    if max_norm is not None:
        strategy += f"grad_clip: {{max_norm: {max_norm}}}\n"
    engine = ap.Engine(model, loss_fn, make_opt(model), strategy=_strategy(strategy))
    got = engine.fit(data, batch_size=batch, steps_per_epoch=steps, verbose=0)["loss"]
    want = _eager(reference, loss_fn, data, batch, steps, make_opt, max_norm)
    return engine, model, reference, data, got, want


def _comms(program: Program) -> Counter:
    return Counter(op.target for op in program.ops if op.kind is OpKind.COMM)


def _statistic_all_reduces(program: Program) -> list:
    """Blocking all-reduces fed by the decomposed batch norms (the gradient buckets are
    ``all_reduce_start``/``wait``)."""
    return [op for op in program.ops if op.kind is OpKind.COMM and op.target == "comm.all_reduce"
            and DECOMPOSES in op.args[0].producer.attrs]


# ----------------------------------------------------------------------------------------
# (b) training equals eager
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,batch", [("dp2", 8), ("dp4", 6)], ids=["dp2", "dp4-uneven"])
@pytest.mark.parametrize("name", [n for n in MODELS if n != "bias_free_cnn"])
def test_trains_like_eager_with_all_reduced_statistics(name, strategy, batch):
    engine, model, reference, _, got, want = _train(name, STRATEGIES[strategy], batch)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)

    # every rank's planned program: all-reduces only (statistics and gradients), no gather
    step = engine.planner.last("train")
    for rank, process in step.lowered.processes.items():
        comms = _comms(process.program)
        assert set(comms) <= {"comm.all_reduce", "comm.all_reduce_start", "comm.wait"}, \
            (rank, comms)
    # per batch-norm call: mean and variance forward, sum(dy) and sum(dy * xhat) backward
    assert len(_statistic_all_reduces(step.program)) == 4 * BN_LAYERS[name]
    assert not [op for op in step.program.ops if op.target in (BN, BN_BACKWARD)]


def test_adamw_and_gradient_clipping_under_uneven_dp4():
    """The clipping norm reads the batch norms' Partial parameter gradients; AdamW."""
    _, model, reference, _, got, want = _train("bias_free_cnn", STRATEGIES["dp4"], 6,
                                               make_opt=_adamw, max_norm=0.5)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)


def test_cnn_channel_sharded_batch_norm_under_dp2_x_tp2():
    """conv1 colwise: bn1's channels are sharded over tp while its batch is over dp, so its
    statistics are all-reduced over dp only. conv2 rowwise: bn2's input is Partial over tp;
    what moves for it besides the rowwise all-reduce are its per-channel statistics (the
    reshard planner may move those as reduce-scatter + all-reduce + all-gather), never
    activations."""
    engine, model, reference, _, got, want = _train("cnn", STRATEGIES["dp2_tp2"], 8)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)
    program = engine.planner.last("train").program
    gathers = [op for op in program.ops if op.target == "comm.all_gather"]
    assert all(op.args[0].type.numel == 8 for op in gathers), gathers   # 8 channels
    bn1 = [op for op in program.ops if op.module == "bn1" and op.target == "aten.mean.dim"]
    assert bn1 and all(str(op.outputs[0].dist.placements[1]) == "S(1)" for op in bn1)
    bn1_reduces = [op for op in _statistic_all_reduces(program) if op.module == "bn1"]
    assert len(bn1_reduces) == 4
    assert all(op.outputs[0].type.numel == 8 and op.attrs[RESHARD_STEP].axis == "dp"
               for op in bn1_reduces)


def test_pipeline_x_dp2_composes_with_one_micro_batch():
    """pp2 x dp2: each stage's batch norms all-reduce over dp inside its jobs. With more
    than one micro-batch a statistic of the whole batch is needed mid-pipeline, which
    micro-batching cannot give: refused at planning, naming BatchNorm."""
    pp = ("mesh: {shape: [2, 2], dim_names: [pp, dp]}\ndata_parallel: {axis: dp}\n"
          "pipeline: {axis: pp, schedule: FThenB, micro_batches: MB, split: [conv2]}\n")
    engine, model, reference, _, got, want = _train("cnn", pp.replace("MB", "1"), 8)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)
    assert len(_statistic_all_reduces(engine.planner.last("train").program)) == 8

    with pytest.raises(Exception, match="BatchNorm.*micro_batches: 1"):
        _train("cnn", pp.replace("MB", "2"), 8, steps=1)


@pytest.mark.parametrize("name", ["cnn", "hf_resnet"])
def test_evaluate_under_dp2_equals_eager_eval(name):
    engine, model, reference, data, _, _ = _train(name, STRATEGIES["dp2"], 8, steps=2)
    reference.eval()
    x, y = torch.utils.data.default_collate(data[:8])
    with torch.no_grad():
        want = (reference(**x, labels=y).loss if MODELS[name][1] is None
                else F.cross_entropy(reference(x), y)).item()
    got = engine.evaluate(data[:8], batch_size=8)["loss"]
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
    program = engine.planner.last("eval").program
    assert [op for op in program.ops if op.target == BN]      # running statistics: fused
    # the one gather is the model's logits, returned whole to the caller
    gathers = [op.outputs[0] for op in program.ops if op.target == "comm.all_gather"]
    assert len(gathers) == 1
    assert gathers[0] in [v for slot, v in program.results() if slot.kind == "output"]
    _assert_same_state(model, reference)                      # eval updates nothing


# ----------------------------------------------------------------------------------------
# (a) the pass
# ----------------------------------------------------------------------------------------
def _prepare(strategy: str | None, mode: str = "train", name: str = "bn_mlp") -> Program:
    build, loss_fn, samples = MODELS[name]
    torch.manual_seed(0)
    model = build()
    s = _strategy(strategy) if strategy else ap.Strategy()
    engine = ap.Engine(model, loss_fn, _optimizer(model), strategy=s)
    x, y = torch.utils.data.default_collate(samples(8))
    return engine.prepare(x, y, mode=mode)


def test_functional_batch_norm_rule_shards_channels_and_keeps_the_batch_whole():
    """The out-of-place fused kernel's rule is the in-place one's plus the two new running
    statistics, which follow the channel."""
    from spmd_util import MESH1, T, forward, make_op
    op = make_op(FUNCTIONAL, T(4, 8, 5, 5), T(8), T(8), T(8), T(8), True, 0.1, 1e-5)
    needs, outs = forward(op, MESH1, "S(1)", "S(0)", "S(0)", "S(0)", "S(0)")
    assert needs == ["S(1)"] + ["S(0)"] * 4 and outs == ["S(1)"] + ["S(0)"] * 4
    needs, outs = forward(op, MESH1, "S(0)", "R", "R", "R", "R")
    assert needs[0] == "R" and outs == ["R"] * 5


def test_serial_and_eval_programs_keep_the_fused_kernels():
    serial = _prepare(None)
    assert [op.target for op in serial.ops if op.target in (BN, BN_BACKWARD)] == [BN, BN_BACKWARD]
    assert not [op for op in serial.ops if DECOMPOSES in op.attrs]
    evaluated = _prepare(STRATEGIES["dp2"], mode="eval")
    assert [op.target for op in evaluated.ops if op.target == BN] == [BN]
    assert not [op for op in evaluated.ops if DECOMPOSES in op.attrs]


def test_rewrite_links_backward_and_makes_buffer_updates_explicit():
    program = _prepare(STRATEGIES["dp2"])
    new = [op for op in program.ops if DECOMPOSES in op.attrs]
    assert {op.attrs[DECOMPOSES] for op in new} == {"native_batch_norm",
                                                    "native_batch_norm_backward"}
    assert all(op.module == "bn" for op in new)
    backward = [op for op in new if op.attrs[DECOMPOSES] == "native_batch_norm_backward"]
    # backward ops point at the op that now makes the batch norm's output
    linked = {op.forward_op for op in backward}
    assert len(linked) == 1
    (forward,) = linked
    assert forward.attrs[DECOMPOSES] == "native_batch_norm" and forward in program.ops
    # no op writes a buffer in place; each buffer's new value is an update result
    updates = {str(slot) for slot, _ in program.results() if slot.kind == "update"}
    assert {"update[bn.running_mean]", "update[bn.running_var]",
            "update[bn.num_batches_tracked]"} <= updates
    in_place = [op.target for op in program.ops if op.kind is OpKind.CALL
                and op.target.startswith("aten.") and op.target.split(".")[1].endswith("_")]
    assert in_place == []


def test_dumps_show_the_all_reduces_and_explain_says_why(tmp_path):
    torch.manual_seed(0)
    model = zoo.BatchNormNet()
    strategy = _strategy(STRATEGIES["dp2"], f", dump_dir: {tmp_path}")
    engine = ap.Engine(model, F.cross_entropy, _optimizer(model), strategy=strategy)
    x, y = torch.utils.data.default_collate(_samples((8,), 4, 8))
    program = engine.prepare(x, y)
    dumps = sorted((tmp_path / "rank0").glob("*_partition.txt"))
    text = dumps[-1].read_text()
    lines = [ln for ln in text.splitlines() if "comm.all_reduce(" in ln and "# bn comm" in ln]
    assert len(lines) == 4 and all("all_reduce(sum) over dp: {P(sum)} -> {R}" in ln
                                   for ln in lines), text
    assert "decomposes='native_batch_norm'" in text
    assert "aten.native_batch_norm" not in text

    names = value_names(program)
    first = _statistic_all_reduces(program)[0]
    why = engine.explain(names[first.outputs[0]])
    # the all-reduce is there because a consumer needs the whole-batch mean, which is a
    # sum of the ranks' partial means since the batch stays sharded over dp
    assert "all_reduce(sum) over dp: {P(sum)} -> {R} for aten.sub.Tensor (bn fwd)" in why
    assert "aten.mean.dim (bn fwd)" in why and "{P(sum)}" in why
    assert "data_parallel.axis dp: batch dim 0" in why


def test_a_batch_sharded_by_shard_tensor_is_synchronized_too():
    """No data_parallel section: a shard_tensor in forward shards the batch over a 2-rank
    mesh, and the pass rewrites as under dp."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])

    class Annotated(zoo.BatchNormNet):
        def forward(self, x):
            return super().forward(ap.shard_tensor(x, mesh, [ap.Shard(0)]))

    torch.manual_seed(0)
    model = Annotated()
    reference = copy.deepcopy(model)
    data = _samples((8,), 4, 16)
    engine = ap.Engine(model, F.cross_entropy, _optimizer(model), strategy=_strategy(""))
    got = engine.fit(data, batch_size=8, steps_per_epoch=2, verbose=0)["loss"]
    want = _eager(reference, F.cross_entropy, data, 8, 2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)
    assert len(_statistic_all_reduces(engine.planner.last("train").program)) == 4


def test_tensor_parallel_alone_keeps_the_fused_kernels_out_of_place():
    """tp shards channels, never the batch: nothing to synchronize, the fused kernel stays,
    in its out-of-place form so that its running statistics are update results too (written
    in place, a replicated buffer was updated once per rank on the simulator)."""
    tp = ("mesh: {shape: [2], dim_names: [tp]}\n"
          "tensor_parallel: {axis: tp, plan: {conv1: colwise, conv2: rowwise}}\n")
    engine, model, reference, _, got, want = _train("bias_free_cnn", tp, 8, make_opt=_adamw)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)
    program = engine.planner.last("train").program
    assert [op.target for op in program.ops if "batch_norm" in op.target
            and "backward" not in op.target] == [FUNCTIONAL, FUNCTIONAL]
    assert not [op for op in program.ops if "batch_norm" in op.attrs.get(DECOMPOSES, "")]
    # bn1 follows conv1's output channels, bn2 reads conv2's reduced output whole
    stats = {slot.name: v.dist.placements for slot, v in program.results()
             if slot.kind == "update" and "running" in slot.name}
    assert str(stats["bn1.running_mean"][0]) == "S(0)"
    assert stats["bn2.running_var"][0].is_replicate()


# ----------------------------------------------------------------------------------------
# (c) real ranks
# ----------------------------------------------------------------------------------------
REAL_BATCH, REAL_STEPS = 5, 3     # 3 + 2 rows per rank


def test_cnn_on_two_real_ranks_matches_eager(tmp_path):
    """The buffers' update results are written back on real ranks too (and gathered)."""
    from multiproc import finish, launch, logs
    proc = launch(2, tmp_path, __file__, env={"AUTOPAR_TEST_RESULT_DIR": str(tmp_path)})
    failure = finish(proc, timeout=240)
    assert not failure, failure + "\n" + logs(tmp_path)
    torch.manual_seed(0)
    reference = CNN().train()
    data = MODELS["cnn"][2](REAL_BATCH * REAL_STEPS)
    want = _eager(reference, F.cross_entropy, data, REAL_BATCH, REAL_STEPS)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(want),
                                   rtol=RTOL, atol=ATOL)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(result["state"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _rank_main() -> None:
    """One rank of the real-rank test: train the CNN under dp2, save losses and state."""
    torch.manual_seed(0)
    model = CNN().train()
    data = MODELS["cnn"][2](REAL_BATCH * REAL_STEPS)
    strategy = ap.Strategy.from_yaml_str(STRATEGIES["dp2"])
    with ap.Engine(model, F.cross_entropy, _optimizer(model), strategy=strategy) as engine:
        losses = engine.fit(data, batch_size=REAL_BATCH, steps_per_epoch=REAL_STEPS,
                            verbose=0)["loss"]
        state = engine.state_dict()
    out = os.environ["AUTOPAR_TEST_RESULT_DIR"]
    torch.save({"loss": losses, "state": state}, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    _rank_main()


def test_tp2_with_sgd_momentum_places_each_buffer_like_its_parameter():
    """The batch norms' parameters are placed by their first consumer (channel shards after
    the colwise conv), not by the plan; their momentum buffers (None before the first step)
    must follow them, not default to replicated (completion once replicated every unplaced
    start before the optimizer could ask, and the first step sliced a None buffer)."""
    tp = ("mesh: {shape: [2], dim_names: [tp]}\n"
          "tensor_parallel: {axis: tp, plan: {conv1: colwise, conv2: rowwise}}\n")
    engine, model, reference, _, got, want = _train("cnn", tp, 4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)
    states = {op.attrs[NAME]: op.result for op in engine.planner.last("train").program.states()}
    assert str(states["bn1.weight/momentum_buffer"].dist) == str(states["bn1.weight"].dist)
