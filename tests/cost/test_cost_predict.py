"""The step-time predictor (``cost.predict``) on a synthetic profile: exact numbers for tiny
hand-made programs (compute, a synchronous collective, a started one hidden behind compute),
and the shape of its answers on planned GPT steps (data parallel halves each rank's
compute, tensor parallel communicates, pipelines wait on their schedule's timeline). No
timing: the profile is made up, so every figure is known."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar import Engine, Strategy
from autopar.cost import AlphaBeta, Curve, Profile, ProfileNotFound
from autopar.cost.predict import contention, format_step_time, predict_step
from autopar.ir import Op, OpKind, ProcessMesh, Program, Slot, TensorType, Value
from autopar.ir.attrs import SLOTS
from autopar.ir.core import OpaqueType
from autopar.lower.executable import BucketStart, BucketWait, Lowered, RankProgram, StepComm
from autopar.models import GPT, GPTConfig
from autopar.reshard.steps import AllReduce

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# one point per curve: above it time is linear in size, so every cost is a product
MM_S_PER_FLOP, PW_S_PER_BYTE, OVERHEAD = 1e-9, 1e-10, 2e-5
ALPHA, BETA = 1e-4, 1e-8
PROFILE = Profile(
    machine="synthetic", processes=4, threads=1,
    matmul=Curve(points=[(1.0, MM_S_PER_FLOP)]), pointwise=Curve(points=[(1.0, PW_S_PER_BYTE)]),
    op_overhead_s=OVERHEAD,
    collectives={k: {2: AlphaBeta(alpha_s=ALPHA, beta_s_per_byte=BETA)}
                 for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                           "send_recv")})
F32 = torch.float32


def _input(program: Program, name: str, shape: tuple[int, ...]) -> Value:
    op = Op(OpKind.INPUT, name, outputs=[Value(TensorType(shape, F32))])
    return program.add(op).outputs[0]


def _call(program: Program, target: str, args: tuple, shape: tuple[int, ...],
          kind: OpKind = OpKind.CALL, out_type=None) -> Value:
    out = out_type if out_type is not None else TensorType(shape, F32)
    return program.add(Op(kind, target, args=args, outputs=[Value(out)])).outputs[0]


def _lowered(program: Program, result: Value, comms: dict) -> Lowered:
    program.add(Op(OpKind.OUTPUT, "output", args=(result,),
                   attrs={SLOTS: (Slot("output", "0"),)}))
    rank = RankProgram(0, (0,), program, comms, {}, {}, False)
    return Lowered(program, ProcessMesh([0, 1], ["dp"]), {0: rank}, ())


def test_one_mm_one_add_one_all_reduce_is_the_hand_computed_sum():
    program = Program()
    x, w, b = _input(program, "x", (4, 8)), _input(program, "w", (8, 16)), \
        _input(program, "b", (4, 16))
    y = _call(program, "aten.mm.default", (x, w), (4, 16))
    z = _call(program, "aten.add.Tensor", (y, b), (4, 16))
    v = _call(program, "aten.reshape.default", (z, [64]), (64,))            # a view: free
    r = _call(program, "comm.all_reduce", (v,), (64,), kind=OpKind.COMM)
    comm = StepComm(AllReduce(0), ((64,), (64,)))
    step = predict_step(_lowered(program, r, {len(program.ops) - 1: comm}), PROFILE)

    mm = 2 * 4 * 8 * 16 * MM_S_PER_FLOP                    # 1024 FLOPs
    add = (64 * 4 * 2 + 64 * 4) * PW_S_PER_BYTE            # reads two, writes one: 768 B
    # a ring all-reduce of 256 B over 2 ranks: each rank sends 2 x (1/2) x 256 B
    all_reduce = ALPHA + 256 * BETA
    t = step[0]
    assert t.ops == 4
    assert t.compute_s == pytest.approx(mm + add + 4 * OVERHEAD, rel=1e-12)
    assert t.comm_s == pytest.approx(all_reduce, rel=1e-12)
    assert step.step_s == pytest.approx(mm + add + 4 * OVERHEAD + all_reduce, rel=1e-12)
    assert "rank   0" in format_step_time(step)


@pytest.mark.parametrize("rows,k,hidden", [(64, 256, True), (1, 8, False)])
def test_a_started_all_reduce_is_exposed_only_beyond_the_compute_it_overlaps(rows, k, hidden):
    program = Program()
    g, x, w = _input(program, "g", (1024,)), _input(program, "x", (rows, k)), \
        _input(program, "w", (k, 256))
    handle = _call(program, "comm.all_reduce_start", (g,), (), kind=OpKind.COMM,
                   out_type=OpaqueType("handle"))
    start = len(program.ops) - 1
    _call(program, "aten.mm.default", (x, w), (rows, 256))
    done = _call(program, "comm.wait", (handle,), (1024,), kind=OpKind.COMM)
    out = _call(program, "aten.add.Tensor", (done, done), (1024,))
    comms = {start: BucketStart((AllReduce(0),), ((1024,),)), start + 2: BucketWait()}
    step = predict_step(_lowered(program, out, comms), PROFILE)

    mm = 2 * rows * k * 256 * MM_S_PER_FLOP
    add = 3 * 1024 * 4 * PW_S_PER_BYTE
    all_reduce = ALPHA + 4096 * BETA                # 2 x (1/2) x 4096 B
    # the collective starts after its op's overhead, runs while the mm (and the wait's
    # overhead) go on; the wait blocks only for what is left of it
    waited = max(0.0, all_reduce - (mm + 2 * OVERHEAD))
    assert (waited == 0.0) is hidden
    t = step[0]
    assert t.compute_s == pytest.approx(mm + add + 4 * OVERHEAD, rel=1e-12)
    assert t.comm_s == pytest.approx(waited, rel=1e-9, abs=1e-15)


def test_contention_scales_compute_by_the_cores_the_processes_share():
    # measured with 4 single-thread processes on 2 cores: each computed at half speed
    two_cores = PROFILE.model_copy(update={"machine": "box, 2 cpus, torch 2.x, gloo"})
    assert [contention(n, two_cores) for n in (1, 2, 4, 8)] == [0.5, 0.5, 1.0, 2.0]
    assert contention(8, PROFILE) == 1.0          # no core count in the profile: as measured
    program = Program()
    x, w = _input(program, "x", (4, 8)), _input(program, "w", (8, 16))
    y = _call(program, "aten.mm.default", (x, w), (4, 16))
    r = _call(program, "comm.all_reduce", (y,), (4, 16), kind=OpKind.COMM)
    lowered = _lowered(program, r, {len(program.ops) - 1: StepComm(AllReduce(0),
                                                                   ((4, 16), (4, 16)))})
    shared, alone = predict_step(lowered, two_cores), predict_step(lowered, PROFILE)
    assert shared.contention == 0.5 and alone.contention == 1.0
    assert shared[0].compute_s == pytest.approx(0.5 * alone[0].compute_s, rel=1e-12)
    # a collective is latency-bound: its time is the profile's whatever the process count
    for step in (shared, alone):
        assert step[0].comm_s == pytest.approx(ALPHA + 256 * BETA, rel=1e-12)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def predict_tiny_gpt(strategy_text: str, profile: Profile = PROFILE):
    """The predicted training step of a 2-layer GPT (width 32, batch 8 x 16) under the
    strategy YAML ``strategy_text`` on ``profile`` (also used by the pipeline cost tests)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    engine = Engine(model, _loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                    strategy=Strategy.from_yaml_str(strategy_text))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (8, 16), generator=g) for _ in range(2))
    return engine.predict_time(x, y, profile=profile)


def _predict(config: str | None):
    return predict_tiny_gpt((CONFIGS / f"{config}.yaml").read_text() if config else "")


def test_data_parallel_halves_compute_and_tensor_parallel_communicates():
    serial, dp, tp = _predict(None), _predict("dp"), _predict("tp")
    assert sorted(serial.processes) == [0] and sorted(dp.processes) == [0, 1]
    assert serial[0].comm_s == 0.0
    # each dp rank runs the same ops on half the batch: less compute, same op count + comms
    assert dp[0].compute_s < serial[0].compute_s
    assert dp[0].ops > serial[0].ops
    assert all(t.comm_s > 0 for t in tp.processes.values())
    # tp's activations all-reduce every layer: more exposed communication than dp's one
    # gradient bucket, which overlaps the backward
    assert tp[0].comm_s > dp[0].comm_s


def test_pipelines_wait_on_their_schedules_timeline():
    one_f_one_b, zero_bubble = _predict("pp_1f1b"), _predict("pp_zbh1")
    for step in (one_f_one_b, zero_bubble):
        busy = [t.compute_s + t.comm_s for t in step.processes.values()]
        assert step.bubble is not None and step.bubble > 0
        # the stages overlap (the step is shorter than running them one after another)
        # but not perfectly: a rank waits for its peer's first forward or last backward
        assert max(busy) < step.step_s < sum(busy)
        assert any(t.idle_s > 0 for t in step.processes.values())
    # same jobs, same costs: the zero-bubble order fills the wait with weight gradients
    assert zero_bubble.step_s < one_f_one_b.step_s
    assert zero_bubble.bubble < one_f_one_b.bubble


def test_predict_time_without_a_profile_names_calibrate(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PROFILE", str(tmp_path / "none.json"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    engine = Engine(model, _loss, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 32, (2, 8))
    with pytest.raises(ProfileNotFound, match="python -m autopar calibrate"):
        engine.predict_time(x, x)


def test_plan_cli_prints_the_predicted_step_time_next_to_memory(tmp_path):
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    env = {**os.environ, "AUTOPAR_PROFILE": str(profile)}
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", "examples/train_gpt.py",
                           "--strategy", str(CONFIGS / "tp.yaml"), "--dump-dir",
                           str(tmp_path / "dumps"), "--", "--layers", "1"],
                          cwd=CONFIGS.parent, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "memory per rank (predicted):" in out
    assert out.index("memory per rank") < out.index("predicted step time")
    table = out[out.index("predicted step time"):].splitlines()
    rows = [line.split() for line in table if line.strip().startswith("rank ")]
    assert [r[1] for r in rows] == ["0-1"]       # the dp replicas: one row
    assert all(float(r[6]) > 0 for r in rows)        # tp communicates on both ranks
    assert f"(from profile {profile})" in out


def test_collectives_across_machines_are_priced_on_their_own_fits():
    """dp x tp on 2 machines of 2 ranks: tp inside a machine keeps its price, dp's groups
    span the machines and pay the (here 20x slower) inter-node fits; with tp across the
    machines instead, the activations' all-reduces pay them."""
    slow = PROFILE.model_copy(update={"devices_per_node": 2, "inter_node": {
        kind: {n: fit.model_copy(update={"alpha_s": 20 * fit.alpha_s,
                                         "beta_s_per_byte": 20 * fit.beta_s_per_byte})
               for n, fit in by_n.items()} for kind, by_n in PROFILE.collectives.items()}})
    text = (CONFIGS / "dp_tp.yaml").read_text()
    flipped = text.replace("dim_names: [dp, tp]", "dim_names: [tp, dp]")
    assert flipped != text
    one, two = predict_tiny_gpt(text), predict_tiny_gpt(text, slow)
    tp_across = predict_tiny_gpt(flipped, slow)
    assert two.step_s > one.step_s                    # dp's gradient sums cross machines
    assert tp_across.step_s > two.step_s              # every layer's all-reduce crosses them


def test_processes_share_only_their_own_machines_cores():
    """A 1,024-process plan over machines of 8 slows compute as 8 processes on one machine
    do, not as 1,024 time-sharing the profile's cores."""
    from autopar.cost.predict import contention
    measured = PROFILE.model_copy(update={"slowdown": {1: 1.0, 2: 1.1, 4: 2.0}})
    assert contention(1024, measured) == pytest.approx(2.0 * 1024 / 4)
    on_nodes = measured.model_copy(update={"devices_per_node": 4})
    assert contention(1024, on_nodes) == contention(4, measured) == 2.0
    assert contention(2, on_nodes) == 1.1
