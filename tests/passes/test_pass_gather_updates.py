"""Pass ``gather_updates``: under ZeRO stages 1 and 2 each rank updates its piece of every
parameter and the new pieces are all-gathered back to the whole parameter. Reshard leaves
one synchronous gather per parameter after the last update; this pass makes them
asynchronous collectives, a layer at a time merged up to ``data_parallel.bucket_mb``, each
started right after its unit's last update and waited for where the first of its gathers
was. Run through the pass that is the program (disabled: the synchronous gathers stay);
stage 3 and pipelines are left alone; with the pass active an MLP trains like eager torch
on the simulator (fp32, rtol 1e-5)."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture.step import capture
from autopar.ir import Program, format_program
from autopar.ir.attrs import COMM_TEXT
from autopar.ir.dist import Replicate
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

PASS = "gather_updates"
BATCH, STEPS = 6, 3
LAYERS = [["layers.0.weight", "layers.0.bias"], ["layers.1.weight", "layers.1.bias"],
          ["head.weight", "head.bias"]]

pytestmark = pytest.mark.usefixtures("one_thread")


def _yaml(stage: int, bucket_mb: float = 0, extra: str = "") -> str:
    """dp2 ZeRO; ``bucket_mb: 0``: no two layers' gathers merged."""
    return ("mesh: {shape: [2], dim_names: [dp]}\n"
            f"data_parallel: {{axis: dp, bucket_mb: {bucket_mb}}}\n"
            f"sharding: {{stage: {stage}, axis: dp}}\n" + extra)


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 32, 6, depth=2)


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _plan(yaml: str, disabled: frozenset[str] = frozenset(), **inputs) -> Program:
    """The MLP's SGD-with-momentum training step as the passes up to and including this one
    leave it."""
    model = _mlp()
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 6)
    program = capture(model, _mse, x, y, mode="train").program
    ctx = PassContext(PlanInputs.of(
        ap.Strategy.from_yaml_str(yaml),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        param_names={id(p): n for n, p in model.named_parameters()}, **inputs))
    names = [p.name for p in passes.PIPELINE]
    upto = passes.PIPELINE[:names.index(PASS) + 1]
    return PassManager(upto, disabled=disabled).run(program, ctx)


def _starts(program: Program) -> list:
    return [op for op in program.ops if op.target == "comm.all_gather_start"]


def _sync_gathers_of_updates(program: Program) -> list:
    return [op for op in program.ops if op.target == "comm.all_gather"
            and op.args[0].producer.target.startswith("optim.")]


@pytest.mark.parametrize("stage", [1, 2])
def test_gather_updates_starts_each_layer_s_gather_right_after_its_updates(stage):
    """``bucket_mb: 0``: one asynchronous all-gather per layer, over that layer's new
    pieces, started right after the layer's last update (so it travels while the next
    layers update) and waited for after the last update; the waits make the values the
    step writes back (``update[...]``, replicated), so nothing reading them changed. No
    synchronous gather of an updated piece is left. Disabled: six synchronous gathers after
    the last update and no asynchronous one."""
    program = _plan(_yaml(stage))
    ops = program.ops
    updates = [op for op in ops if op.target.startswith("optim.")]
    starts = _starts(program)
    assert not _sync_gathers_of_updates(program)
    assert len(starts) == len(LAYERS)
    by_piece = {u.outputs[0]: u for u in updates}
    for k, start in enumerate(starts):
        mine = [by_piece[v] for v in start.args]
        assert start.attrs[COMM_TEXT].startswith(
            f"update gather {k}: zero gather of updated {', '.join(LAYERS[k])},")
        assert ops.index(start) == max(ops.index(u) for u in mine) + 1
        later = [u for u in updates if u not in mine and ops.index(u) > ops.index(start)]
        assert len(later) == 2 * (len(LAYERS) - 1 - k)        # the next layers' updates
        (wait,) = [op for op in ops if op.target == "comm.wait" and op.args == (start.result,)]
        assert ops.index(wait) > ops.index(updates[-1])
        for name, value in zip(LAYERS[k], wait.outputs):
            assert program.result("update", name) is value
            assert value.dist.placements == (Replicate(),)

    off = _plan(_yaml(stage), frozenset({PASS}))
    assert not _starts(off)
    gathers = _sync_gathers_of_updates(off)
    assert len(gathers) == 6
    last = max(off.ops.index(op) for op in off.ops if op.target.startswith("optim."))
    assert min(off.ops.index(g) for g in gathers) > last


def test_small_layers_are_merged_into_one_bucket():
    """Under the default 25 MiB bucket the tiny MLP's six gathers are one collective,
    started right after the last update."""
    program = _plan(_yaml(1, bucket_mb=25))
    (start,) = _starts(program)
    assert len(start.args) == 6 and not _sync_gathers_of_updates(program)
    last = max(program.ops.index(op) for op in program.ops if op.target.startswith("optim."))
    assert program.ops.index(start) == last + 1


@pytest.mark.parametrize("yaml, inputs, synchronous", [
    (_yaml(3), {}, 0),
    ("mesh: {shape: [2, 2], dim_names: [pp, dp]}\ndata_parallel: {axis: dp, bucket_mb: 0}\n"
     "sharding: {stage: 1, axis: dp}\npipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n",
     {"micro_batches": 2}, 6),
], ids=["stage3", "pp2xdp2_stage1"])
def test_stage_3_and_pipelines_are_left_alone(yaml, inputs, synchronous):
    """Stage 3 keeps its parameters sharded (nothing gathers a new piece: its asynchronous
    gathers are ``prefetch_gathers``'), and a pipeline's six gathers of new pieces run
    once a step outside the micro-batches and stay synchronous: the program is the same as
    with the pass disabled."""
    program = _plan(yaml, **inputs)
    assert len(_sync_gathers_of_updates(program)) == synchronous
    assert not [op for op in _starts(program) if "update gather" in op.attrs[COMM_TEXT]]
    assert format_program(program) == format_program(_plan(yaml, frozenset({PASS}), **inputs))


@pytest.mark.parametrize("stage", [1, 2])
def test_gather_updates_trains_like_eager(stage, tmp_path):
    """dp2 ZeRO with the gathers made asynchronous, a layer at a time, on the simulator:
    every step's loss and the final parameters equal single-device eager torch's (SGD with
    momentum, fp32, rtol 1e-5); the plan that ran is the pass's (its dump starts the
    update gathers, the dump before it has none)."""
    model, data = _mlp(), regression_data(STEPS * BATCH, 16, 6)
    ref = twin(model)
    opt, _ = gpt_optimizer("sgd", model)
    ref_opt, _ = gpt_optimizer("sgd", ref)
    want = eager_train(ref, _mse, ref_opt, data, BATCH, STEPS)
    debug = f"debug: {{simulate: true, dump_dir: '{tmp_path}', dump_ranks: [0]}}\n"
    engine = ap.Engine(model, _mse, opt, strategy=ap.Strategy.from_yaml_str(
        _yaml(stage, extra=debug)))
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    assert_same_losses(got, want)
    assert_same_params(model, ref)
    before, after = dumped_around(tmp_path, PASS)
    assert after.count("comm.all_gather_start") == len(LAYERS)
    assert "update gather 0:" in after and "update gather" not in before
