"""The profile's measured contention lookup, the half-precision curve choice by an op's
dtype, and the refusal of an old-format profile."""
from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from autopar.cost import AlphaBeta, Curve, Profile
from autopar.cost.predict import contention, op_dtype, op_seconds
from autopar.ir import Op, OpKind, TensorType, Value

FP32_MM, FP16_MM, BF16_MM = 1e-9, 5e-8, 2e-9          # s per FLOP, one point per curve
FP32_PW, FP16_PW = 1e-10, 3e-10                        # s per byte


def _profile(**update) -> Profile:
    fields = dict(
        machine="box, 2 cpus", processes=4, threads=1,
        matmul=Curve(points=[(1.0, FP32_MM)]), pointwise=Curve(points=[(1.0, FP32_PW)]),
        matmul_dtypes={"float16": Curve(points=[(1.0, FP16_MM)]),
                       "bfloat16": Curve(points=[(1.0, BF16_MM)])},
        pointwise_dtypes={"float16": Curve(points=[(1.0, FP16_PW)])},
        op_overhead_s=0.0, slowdown={1: 0.6, 2: 0.62, 3: 0.75, 4: 1.0},
        collectives={"all_reduce": {2: AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-9)}})
    fields.update(update)
    return Profile(**fields)


def _op(target: str, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> Op:
    args = tuple(Value(TensorType(s, dtype)) for s in shapes)
    out = Value(TensorType(shapes[0][:-1] + shapes[-1][-1:], dtype))
    return Op(OpKind.CALL, target, args=args, outputs=[out])


def test_contention_is_the_measured_slowdown_interpolated_and_extended():
    profile = _profile(slowdown={1: 0.6, 2: 0.7, 4: 1.0})
    assert [contention(n, profile) for n in (1, 2, 4)] == [0.6, 0.7, 1.0]
    assert contention(3, profile) == pytest.approx(0.85)          # between 2 and 4
    assert contention(8, profile) == pytest.approx(2.0)           # all cores busy: linear
    # not the linear core-sharing rule (that would say 0.5 for 1 process of 4 on 2 cpus)
    assert contention(1, profile) != 0.5
    assert contention(1, _profile(slowdown={})) == 0.5            # no measurement: the rule


@pytest.mark.parametrize("dtype, per_flop", [(torch.float32, FP32_MM),
                                             (torch.float16, FP16_MM),
                                             (torch.bfloat16, BF16_MM)])
def test_a_matmul_is_timed_on_its_dtypes_curve(dtype, per_flop):
    op = _op("aten.mm.default", [(8, 16), (16, 4)], dtype)
    assert op_dtype(op) == str(dtype).removeprefix("torch.")
    assert op_seconds(op, _profile()) == pytest.approx(2 * 8 * 16 * 4 * per_flop, rel=1e-12)


def test_a_pointwise_op_is_timed_on_its_dtypes_curve_or_fp32s_when_unmeasured():
    add16 = _op("aten.add.Tensor", [(64,), (64,)], torch.float16)
    assert op_seconds(add16, _profile()) == pytest.approx(3 * 64 * 2 * FP16_PW, rel=1e-12)
    add_bf16 = _op("aten.add.Tensor", [(64,), (64,)], torch.bfloat16)   # no bf16 curve
    assert op_seconds(add_bf16, _profile()) == pytest.approx(3 * 64 * 2 * FP32_PW, rel=1e-12)


def test_an_old_format_profile_is_refused_with_a_hint_to_recalibrate(tmp_path):
    path = _profile().save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    data["version"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValidationError, match=r"version 1.*python -m autopar calibrate"):
        Profile.load(path)
    assert Profile.load(_profile().save(tmp_path / "q.json")).slowdown[3] == 0.75
