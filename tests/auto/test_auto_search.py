"""The planner (``auto:`` in a strategy, ``autopar.auto.search``): on cases whose optimum is
known it picks it, it keeps what the user fixed (annotations, a partial strategy), a memory
limit that rules out data parallel gives a sharded plan whose measured peak fits, the chosen
strategy trains like eager torch on the simulator and on real ranks (which all run the same
choice), and ``python -m autopar plan --auto`` prints the candidates and writes the YAML.

Known optima are judged on a fixed test machine (``MACHINE``), not on the calibrated or
reference profile, so a remeasured profile does not move them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar as ap
from autopar.auto.report import compact_yaml
from autopar.auto.search import NoPlanFits
from autopar.auto.space import Constraints, Layout, base_layouts, degree_triples
from autopar.cost.profile import AlphaBeta, Curve, Profile
from autopar.ir.attrs import NAME
from autopar.ir.dist import Shard
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.runtime.memory_meter import measure_step
from autopar.strategy.sections import AutoConfig

from ..models_zoo import MegatronMLP as MLP
from ..models_zoo import mse
from ..multiproc import run_ranks
from ..parity import RTOL, assert_same_params, eager_train, lm_data, one_thread, parity_gpt, twin

pytestmark = pytest.mark.usefixtures("one_thread")
_ = one_thread
ROOT = Path(__file__).resolve().parents[2]


def _machine() -> Profile:
    """10 GFLOP/s matrix products, 5 GB/s memory-bound ops, collectives of 20 us latency and
    1 GB/s per byte a rank sends, on 2 and 4 ranks."""
    def line(per_second: float) -> Curve:
        return Curve(points=[(1.0, 1.0 / per_second), (1e12, 1e12 / per_second)])
    fit = {n: AlphaBeta(alpha_s=20e-6, beta_s_per_byte=1e-9) for n in (2, 4)}
    return Profile(machine="test", processes=4, threads=1, matmul=line(1e10),
                   pointwise=line(5e9), op_overhead_s=0.0,
                   collectives={k: dict(fit) for k in ("all_reduce", "all_gather",
                                                       "reduce_scatter", "all_to_all",
                                                       "broadcast", "send_recv")})


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> str:
    return str(_machine().save(tmp_path_factory.mktemp("profile") / "machine.json"))


def _auto(machine: str, devices: int, extra: str = "", **auto) -> ap.Strategy:
    fields = ", ".join(f"{k}: {v}" for k, v in {"devices": devices, "profile": machine,
                                                 "time_budget_s": 120, **auto}.items())
    return ap.Strategy.from_yaml_str(f"auto: {{{fields}}}\ndebug: {{simulate: true}}\n"
                                     + extra)


def _mlp_engine(model, strategy, lr=0.01):
    return ap.Engine(model, mse, torch.optim.SGD(model.parameters(), lr=lr), strategy=strategy)


def _rows(rows: int, d: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)


def test_big_weights_small_batch_choose_megatron_tensor_parallel(machine):
    engine = _mlp_engine(MLP(512, 2048), _auto(machine, 2))
    engine.prepare(*_rows(4, 512))
    plan = engine.auto_plan
    assert plan.chosen.layout == Layout(dp=1, tp=2, pp=1)
    assert engine.strategy.tensor_parallel.plan == {"fc1": "colwise", "fc2": "rowwise"}
    assert engine.strategy.auto is None                 # what runs is a plain strategy
    # every candidate was judged, and data parallel's 16 MiB of gradients cost it the race
    dp = next(e for e in plan.candidates if e.layout.name() == "dp2")
    assert dp.predicted.step_s > 2 * plan.chosen.predicted.step_s


def test_big_batch_small_weights_choose_data_parallel(machine):
    engine = _mlp_engine(MLP(32, 32), _auto(machine, 2))
    engine.prepare(*_rows(4096, 32))
    assert engine.auto_plan.chosen.layout == Layout(dp=2, tp=1, pp=1)
    assert engine.strategy.data_parallel is not None and engine.strategy.mesh.shape == (2,)


def test_an_annotation_is_kept_and_fixes_the_mesh(machine):
    model = MLP(512, 2048)
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    ap.shard_tensor(model.fc1.weight, mesh, [Shard(1)])       # rowwise: not the optimum
    engine = _mlp_engine(model, _auto(machine, 2))
    program = engine.prepare(*_rows(4, 512))
    assert [e.layout for e in engine.auto_plan.candidates if e.predicted] == [Layout(1, 2, 1)]
    assert engine.strategy.mesh.dim_names == ("x",)
    weight = next(op.result for op in program.states() if op.attrs[NAME] == "fc1.weight")
    assert tuple(weight.dist.placements) == (Shard(1),)


def test_a_partial_strategy_is_a_constraint(machine):
    # a fixed mesh and data parallel over all of it: the planner may only add ZeRO
    strategy = _auto(machine, 2, "mesh: {shape: [2], dim_names: [d]}\n"
                                 "data_parallel: {axis: d}\n")
    engine = _mlp_engine(MLP(512, 2048), strategy)
    engine.prepare(*_rows(4, 512))
    assert {e.layout.tp for e in engine.auto_plan.candidates} == {1}
    assert engine.strategy.data_parallel.axis == "d"


def test_a_memory_limit_that_rules_out_dp_gives_a_sharded_plan_that_fits(machine):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=128))
    x, y = (torch.stack(t) for t in zip(*lm_data(8, 16, 64)))
    copy = twin(model)
    free = ap.Engine(copy, lm_loss, torch.optim.AdamW(copy.parameters()),
                     strategy=_auto(machine, 2, axes="[dp]"))
    free.prepare(x, y)
    dp = free.auto_plan.chosen.predicted.max_peak
    limit_gb = 0.8 * dp / 2**30
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                       strategy=_auto(machine, 2, memory_limit_gb=limit_gb))
    engine.prepare(x, y)
    plan = engine.auto_plan
    plain_dp = next(e for e in plan.candidates if e.layout == Layout(2, 1, 1))
    assert not plain_dp.fits
    assert plan.chosen.layout != Layout(2, 1, 1) and plan.chosen.predicted.max_peak <= \
        limit_gb * 2**30
    # what the runtime holds in the chosen plan's step fits too
    engine.train_step(x, y)
    step = engine.planner.plan("train", x, y)
    if step.lowered.pipeline is None:
        peaks = measure_step(step.lowered, engine._feeds(x, y, "train"),
                             dict(engine.state.tensors))
        assert max(peaks.values()) <= limit_gb * 2**30


def test_no_plan_fits_names_the_candidates(machine):
    with pytest.raises(NoPlanFits, match="no candidate fits memory_limit_gb") as err:
        _mlp_engine(MLP(64, 64), _auto(machine, 2, memory_limit_gb=1e-6)).prepare(
            *_rows(8, 64))
    assert "dp2" in str(err.value)


def test_gpt_with_auto_trains_like_eager_on_the_simulator(machine):
    model = parity_gpt("adamw")
    ref = twin(model)
    data = lm_data(32, 16, 64)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=_auto(machine, 4, top=3))
    history = engine.fit(data, batch_size=8, verbose=0)
    want = eager_train(ref, lm_loss, torch.optim.AdamW(ref.parameters(), lr=1e-3), data, 8, 4)
    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(want), rtol=RTOL,
                               atol=1e-6)
    assert_same_params(model, ref)
    assert engine.auto_plan.chosen.strategy == engine.strategy.model_copy(
        update={"debug": engine.auto_plan.chosen.strategy.debug})


def test_extending_two_cuts_predicts_the_whole_model(machine):
    """The planner plans a deep stack at pp and 2 pp layers and extends linearly: on a
    4-layer GPT the extension predicts what planning all 4 layers does."""
    from autopar.auto.evaluate import evaluate, plan_and_predict
    from autopar.auto.truncate import find_repeated_stack
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=64))
    opt = torch.optim.AdamW(model.parameters())
    x, y = (torch.stack(t) for t in zip(*lm_data(8, 16, 64)))
    plan = plan_and_predict(lm_loss, x, y, Profile.load(machine))
    strategy = ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                         "data_parallel: {axis: dp}")
    stack = find_repeated_stack(model)
    assert (stack.path, stack.layers) == ("blocks", 4)
    extended = evaluate(Layout(2, 1, 1), strategy, model, opt, plan, stack, None)
    assert extended.layers_planned == (1, 2)
    whole = plan(model, opt, strategy)
    assert extended.predicted.step_s == pytest.approx(whole.step_s, rel=0.05)
    assert extended.predicted.max_peak == pytest.approx(whole.max_peak, rel=0.05)


def test_the_winner_is_planned_whole_and_fits_the_limit_the_engine_checks(machine):
    """dp4 ZeRO-1 on GPT 4x128 extends from 1 and 2 layers to a peak under the limit while the
    whole model's is over it (its second gradient bucket holds every layer past the first
    MiB); the engine then refused the plan the search chose. Now the first is planned whole
    before it wins."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128))
    x = torch.randint(0, 128, (8, 64))
    copy = twin(model)
    dp4 = ap.Engine(copy, lm_loss, torch.optim.AdamW(copy.parameters()),
                    strategy=ap.Strategy.from_yaml_str(
                        "mesh: {shape: [4], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
                        "debug: {simulate: true}\n"))
    limit_gb = 0.75 * max(m.peak for m in dp4.cost(x, x).values()) / 2**30
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                       strategy=_auto(machine, 4, memory_limit_gb=limit_gb))
    engine.prepare(x, x)                     # the engine's own limit check passes
    plan = engine.auto_plan
    assert plan.chosen.fits and plan.chosen.layers_planned == ()
    whole = [e for e in plan.candidates if any("planned whole" in n for n in e.notes)]
    assert any(not e.fits and e.layout.zero for e in whole)   # the ZeRO plan over the limit
    assert max(m.peak for m in engine.cost(x, x).values()) <= limit_gb * 2**30


def test_the_search_space():
    assert sorted(degree_triples(4, ("dp", "tp", "pp"))) == [
        (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert list(degree_triples(4, ("dp",))) == [(4, 1, 1)]
    auto = AutoConfig(devices=4)
    layouts, skipped = base_layouts(auto, Constraints(), rows=6)
    assert Layout(4, 1, 1) not in layouts and any("dp4" in s for s in skipped)
    assert {lay.micro_batches for lay in layouts if lay.pp == 2} == {2}   # 6 rows: 2, not 4


def test_tensor_parallelism_stays_inside_a_node():
    """``auto: {devices: 16, nodes: 2}``: tp over at most a node's 8 devices (the mesh puts tp
    last, on consecutive ranks: the ranks of one node)."""
    layouts, skipped = base_layouts(AutoConfig(devices=16, nodes=2), Constraints(), rows=16)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    assert any("tp16: would cross a node (16 devices on 2 nodes: 8 per node)" in s
               for s in skipped)
    one_node, _ = base_layouts(AutoConfig(devices=16), Constraints(), rows=16)
    assert 16 in {lay.tp for lay in one_node}
    with pytest.raises(ValueError, match="do not spread evenly over 3 nodes"):
        AutoConfig(devices=16, nodes=3)


def test_auto_yaml_round_trips_and_is_validated():
    text = "auto: {devices: 8, memory_limit_gb: 16, axes: [dp, tp], zero_stages: [0, 1]}\n"
    strategy = ap.Strategy.from_yaml_str(text)
    assert ap.Strategy.from_yaml_str(strategy.to_yaml()) == strategy
    assert strategy.auto.devices == 8 and strategy.auto.axes == ("dp", "tp")
    for bad, why in [("auto: {devices: 0}", "devices"), ("auto: {devices: 4, axes: [dp, dp]}",
                                                          "repeats"),
                     ("auto: {devices: 4, axes: [ep]}", "axes"),
                     ("auto: {devices: 4, fastest: true}", "fastest")]:
        with pytest.raises(ValueError, match=why):
            ap.Strategy.from_yaml_str(bad)


def test_compact_yaml_reads_back_equal():
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2, 2], dim_names: [pp, dp]}\ndata_parallel: {axis: dp}\n"
        "pipeline: {axis: pp, micro_batches: 4}\nsharding: {axis: dp, stage: 1}")
    text = compact_yaml(strategy)
    assert ap.Strategy.from_yaml_str(text) == strategy
    assert "seed" not in text                 # defaults left out


def test_auto_devices_must_match_the_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="auto: {devices: 2} but the launch started 4"):
        ap.Engine(MLP(), mse, torch.optim.SGD(MLP().parameters(), lr=0.1),
                  strategy=ap.Strategy.from_yaml_str("auto: {devices: 2}"))


def test_real_ranks_run_the_one_choice_of_rank_0_like_eager(machine):
    results = run_ranks("train_auto", 2, "6", machine)
    assert results[0]["strategy"] == results[1]["strategy"]
    assert "mesh" in results[0]["strategy"]
    ref = parity_gpt("adamw")
    data = lm_data(48, 16, 64)
    want = eager_train(ref, lm_loss, torch.optim.AdamW(ref.parameters(), lr=1e-3), data, 8, 6)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(want),
                                   rtol=RTOL, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(results[0]["state"][name], p.detach(), rtol=RTOL, atol=1e-6)


def test_plan_cli_auto_prints_the_candidates_and_writes_the_strategy(tmp_path, machine):
    out = tmp_path / "chosen.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "autopar", "plan", "examples/train_gpt.py", "--auto",
         "--devices", "2", "--write-strategy", str(out), "--dump-dir", str(tmp_path / "d"),
         "--strategy", str(_profile_only(tmp_path, machine)), "--", "--layers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout
    assert "auto plan: 2 devices" in report and "chosen: " in report
    assert "step ms" in report and "peak/rank" in report
    chosen = ap.Strategy.from_yaml(out)
    assert chosen.world_size == 2 and chosen.auto is None
    assert "memory per rank (predicted):" in report       # the chosen plan, as plan prints it


def test_plan_cli_auto_needs_devices(tmp_path):
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", "examples/train_gpt.py",
                           "--auto"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--devices" in done.stderr
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", "examples/train_gpt.py",
                           "--devices", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "only with --auto" in done.stderr


def _profile_only(tmp_path: Path, machine: str) -> Path:
    path = tmp_path / "constraints.yaml"
    path.write_text(f"auto: {{devices: 2, profile: {machine}}}\n")
    return path


def test_a_choice_no_plan_style_reproduces_reads_back_as_the_nearest_plan():
    from autopar.auto import placed_program
    from autopar.auto.tp_plan import nearest_tensor_parallel_plan
    from autopar.ir.dist import DistAttr, Replicate
    model = MLP(16, 64)
    strategy = ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [tp]}\n"
                                         "tensor_parallel: {axis: tp}")
    program, ctx = placed_program(model, mse, torch.optim.SGD(model.parameters(), lr=0.1),
                                  strategy, *_rows(4, 16), {})
    mesh = ctx.state.mesh
    def d(p):
        return DistAttr(mesh, (p,))
    # fc2's bias sharded (as a reduce-scatter would leave it): no style does that; its weight
    # is rowwise's. fc1's bias alone sharded: no style cuts the weight so: left replicated.
    params = {"fc1.weight": d(Replicate()), "fc1.bias": d(Shard(0)),
              "fc2.weight": d(Shard(1)), "fc2.bias": d(Shard(0))}
    plan, notes = nearest_tensor_parallel_plan(program, params, mesh)
    assert plan == {"fc2": "rowwise"}
    assert any(n.startswith("fc2: the ILP's weight S(1), bias S(0) taken as rowwise")
               for n in notes)
    assert any(n.startswith("fc1: no plan style") and "left replicated" in n for n in notes)
