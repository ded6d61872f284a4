"""Format 3 of the cost profile: per-op measured curves (``calibrate/op_probes.py``), the view
cost, the slowdown relative to one process alone, the fixed-window probe, and the refusal
of a format-2 profile."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
from pydantic import ValidationError

from autopar import Engine, Strategy
from autopar.calibrate import op_probes
from autopar.calibrate.fits import op_curves as _op_curves
from autopar.calibrate.slowdown import relative_slowdown as _slowdown
from autopar.calibrate.timing import batch_probe as _batch_probe
from autopar.calibrate.timing import sweep
from autopar.cost import AlphaBeta, Curve, Profile
from autopar.cost.predict import op_seconds, op_size
from autopar.ir import Op, OpKind, TensorType, Value
from autopar.models import GPT, GPTConfig

PW = 1e-10                    # the pointwise class curve: s per byte
GELU32, GELU16 = 1e-8, 4e-8   # gelu's own curves
ADAM = 1e-7                   # per parameter byte


def _profile(**update) -> Profile:
    fields = dict(
        machine="box, 2 cpus", processes=4, threads=1,
        matmul=Curve(points=[(1.0, 1e-9)]), pointwise=Curve(points=[(1.0, PW)]),
        op_overhead_s=0.0, slowdown={1: 1.0, 2: 1.5},
        collectives={"all_reduce": {2: AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-9)}},
        op_curves={"aten.gelu.default": {"float32": Curve(points=[(1.0, GELU32)]),
                                         "float16": Curve(points=[(1.0, GELU16)])},
                   "optim.adam": {"float32": Curve(points=[(1.0, ADAM)])}},
        view_s=2e-6)
    fields.update(update)
    return Profile(**fields)


def _op(target: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, args=None) -> Op:
    values = tuple(Value(TensorType(s, dtype)) for s in shapes)
    return Op(OpKind.CALL, target, args=args or values,
              outputs=[Value(TensorType(shapes[0], dtype))])


def test_op_curve_by_target_and_dtype_falls_back_to_fp32_and_to_none():
    profile = _profile()
    gelu = profile.op_curves["aten.gelu.default"]
    assert profile.op_curve("aten.gelu.default", "float16") is gelu["float16"]
    assert profile.op_curve("aten.gelu.default", "bfloat16") is gelu["float32"]
    assert profile.op_curve("aten.add.Tensor", "float32") is None


def test_a_probed_op_is_timed_on_its_own_curve_others_on_their_class():
    profile = _profile()
    gelu = _op("aten.gelu.default", [(64,)], torch.float32)
    assert op_size(gelu) == 2 * 64 * 4                             # read + written
    assert op_seconds(gelu, profile) == pytest.approx(2 * 64 * 4 * GELU32, rel=1e-12)
    gelu16 = _op("aten.gelu.default", [(64,)], torch.float16)
    assert op_seconds(gelu16, profile) == pytest.approx(2 * 64 * 2 * GELU16, rel=1e-12)
    add = _op("aten.add.Tensor", [(64,), (64,)], torch.float32)
    assert op_seconds(add, profile) == pytest.approx(3 * 64 * 4 * PW, rel=1e-12)
    # without the op's curve, gelu is a plain pointwise op again
    assert op_seconds(gelu, _profile(op_curves={})) == pytest.approx(2 * 64 * 4 * PW,
                                                                     rel=1e-12)


def test_an_optimizer_update_is_sized_by_its_parameter_and_a_view_costs_view_s():
    profile = _profile()
    p, g, m, v = (Value(TensorType((32, 8), torch.float32)) for _ in range(4))
    step = Value(TensorType((), torch.float32))
    adam = Op(OpKind.CALL, "optim.adam", args=(p, g, {"lr": 1e-3}, m, v, step),
              outputs=[Value(TensorType((32, 8), torch.float32))])
    assert op_size(adam) == 32 * 8 * 4
    assert op_seconds(adam, profile) == pytest.approx(32 * 8 * 4 * ADAM, rel=1e-12)
    view = _op("aten.view.default", [(4, 16)], torch.float32)
    assert op_seconds(view, profile) == 2e-6
    assert op_seconds(view, _profile(view_s=0.0)) == 0.0


def test_probe_cases_grow_and_are_sized_as_the_predictor_sizes_their_ops():
    for target, _, (fn, op) in op_probes.cases(torch.float32, 2):
        assert op.target == target and op_size(op) > 0
        fn()                                                        # the call runs
    sizes: dict[str, list[float]] = {}
    for target, _, (_, op) in op_probes.cases(torch.float32, 4):
        sizes.setdefault(target, []).append(op_size(op))
    assert set(sizes) == set(op_probes.PROBED)
    for target, row in sizes.items():
        assert row == sorted(row) and len(set(row)) == 4, (target, row)
    # attention by FLOPs: QK^T and PV over every query-key pair, 4 x b x h x s^2 x d
    (_, _, (_, sdpa)), = [c for c in op_probes.cases(torch.float32, 1)
                          if c[0] == op_probes.SDPA]
    assert op_size(sdpa) == 4.0 * 8 * 32 * 32 * 16
    # half precision: only the ops marked for it, AdamW's state stays fp32
    half = {target for target, _, _ in op_probes.cases(torch.bfloat16, 1)}
    assert "optim.adam" not in half and op_probes.SDPA in half


def test_the_probed_targets_are_the_ones_a_captured_gpt_step_runs():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    engine = Engine(model, lambda logits, y: torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten()), torch.optim.AdamW(model.parameters()),
        strategy=Strategy())
    x = torch.randint(0, 32, (2, 16))
    engine.predict_time(x, x, profile=_profile())
    targets = {op.target for op in engine.planner.last("train").program.ops}
    expected = {"aten.gelu.default", "aten.gelu_backward.default",
                "aten.native_layer_norm.default", "aten.native_layer_norm_backward.default",
                op_probes.SDPA, op_probes.SDPA_BACKWARD, "optim.adam"}
    assert expected <= targets, expected - targets
    assert expected <= set(op_probes.PROBED)


def test_op_curves_are_made_from_the_points_and_never_fall():
    compute = {"op:aten.gelu.default:float32": [2e-6, 1e-6, 8e-6],
               "opsize:aten.gelu.default:float32": [1e3, 1e4, 1e5],
               "op:optim.adam:float32": [5e-5], "opsize:optim.adam:float32": [1024.0],
               "view": [2e-6]}
    curves = _op_curves(compute)
    assert curves["aten.gelu.default"]["float32"].points == [(1e3, 2e-6), (1e4, 2e-6),
                                                           (1e5, 8e-6)]
    assert curves["optim.adam"]["float32"].points == [(1024.0, 5e-5)]


def test_slowdown_is_relative_to_one_process_alone():
    # 3 processes, 2 probes: P=1 only rank 0 timed, P=2 ranks 0-1, P=3 all
    everyone = [{"slowdown": [[1.0, 2.0], [1.5, 3.0], [2.0, 4.0]]},
                {"slowdown": [None, [1.5, 3.2], [2.0, 4.4]]},
                {"slowdown": [None, None, [2.0, 4.0]]}]
    slowdown = _slowdown(everyone)
    assert slowdown[1] == 1.0
    assert slowdown[2] == pytest.approx(math.sqrt(1.5 * 3.1 / 2.0))
    assert slowdown[3] == pytest.approx(2.0)


def test_a_probe_times_calls_over_a_fixed_window():
    calls = []

    def sleep() -> None:
        calls.append(None)
        time.sleep(0.002)
    probe = _batch_probe(sleep, 0.02)
    calls.clear()
    per_call = probe()
    assert 5 <= len(calls) <= 11 and 0.002 <= per_call < 0.004
    one = _batch_probe(sleep, 0.0)                 # no window: exactly one call
    calls.clear()
    assert one() >= 0.002 and len(calls) == 1
    assert sweep([one, one], 3, together=False) == [pytest.approx(0.002, abs=2e-3)] * 2


def test_a_format_2_profile_is_refused_with_a_hint_to_recalibrate(tmp_path):
    path = _profile().save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    data["version"] = 2
    del data["op_curves"], data["view_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValidationError, match=r"version 2.*version 3.*autopar calibrate"):
        Profile.load(path)
