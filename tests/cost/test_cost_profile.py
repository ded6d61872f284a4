"""The cost profile: curve interpolation and extrapolation, alpha-beta fits, save/load,
the missing-profile error, the shipped reference profile, and one quick calibration on 2
real gloo ranks."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from autopar.calibrate import fit_alpha_beta, group_sizes, monotone_curve
from autopar.cost import AlphaBeta, Curve, Profile, ProfileNotFound, default_profile
from autopar.cost.profile import COLLECTIVE_KINDS


def _profile(**update) -> Profile:
    fields = dict(
        machine="test", processes=2, threads=1,
        matmul=Curve(points=[(1e3, 1e-6), (1e6, 1e-4), (1e9, 1e-1)]),
        pointwise=Curve(points=[(64.0, 2e-6), (6.4e7, 1e-2)]),
        op_overhead_s=5e-6,
        collectives={"all_reduce": {2: AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-9),
                                    4: AlphaBeta(alpha_s=3e-4, beta_s_per_byte=2e-9)},
                     "send_recv": {2: AlphaBeta(alpha_s=5e-5, beta_s_per_byte=5e-10)}})
    fields.update(update)
    return Profile(**fields)


def test_curve_hits_its_points_and_interpolates_in_log_log():
    curve = Curve(points=[(1e3, 1e-6), (1e6, 1e-4), (1e9, 1e-1)])
    for size, seconds in curve.points:
        assert curve.seconds(size) == pytest.approx(seconds, rel=1e-12)
    # halfway in log size between 1e3 and 1e6 is halfway in log time: sqrt(1e-6 * 1e-4)
    assert curve.seconds(math.sqrt(1e3 * 1e6)) == pytest.approx(1e-5, rel=1e-12)
    # a power law between two points: t = 1e-4 * (s / 1e6)^(log(1e3)/log(1e3)) = linear
    assert curve.seconds(1e7) == pytest.approx(1e-3, rel=1e-12)


def test_curve_extrapolates_at_constant_throughput_above_and_flat_below():
    curve = Curve(points=[(1e3, 1e-6), (1e6, 1e-4)])
    assert curve.seconds(4e6) == pytest.approx(4e-4, rel=1e-12)    # last point's throughput
    assert curve.throughput(1e8) == pytest.approx(1e10, rel=1e-12)
    assert curve.seconds(10.0) == 1e-6                              # latency-bound floor
    assert curve.seconds(0.0) == 1e-6
    single = Curve(points=[(100.0, 2e-6)])
    assert single.seconds(50.0) == 2e-6 and single.seconds(400.0) == pytest.approx(8e-6)


def test_curve_is_monotone_when_its_points_are():
    curve = Curve(points=[(1e3, 1e-6), (1e5, 3e-6), (1e7, 2e-4), (1e9, 2e-2)])
    sizes = [10 ** (k / 10) for k in range(10, 110)]
    times = [curve.seconds(s) for s in sizes]
    assert all(b >= a for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("points, words", [
    ([], "at least one"),
    ([(1e3, 1e-6), (1e2, 1e-5)], "increasing"),
    ([(1e3, 1e-6), (1e3, 1e-5)], "increasing"),
    ([(1e3, 0.0)], "positive"),
    ([(-1.0, 1e-6)], "positive"),
    ([(1e3, float("nan"))], "positive"),
])
def test_curve_refuses_bad_points(points, words):
    with pytest.raises(ValidationError, match=words):
        Curve(points=points)


def test_alpha_beta_is_latency_plus_bytes_and_no_bytes_is_no_call():
    fit = AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-9)
    assert fit.seconds(1e6) == pytest.approx(1e-4 + 1e-3)
    assert fit.seconds(0) == 0.0


def test_profile_looks_up_measured_groups_and_estimates_others():
    profile = _profile()
    assert profile.alpha_beta("all_reduce", 4).alpha_s == 3e-4
    assert profile.collective_seconds("all_reduce", 2, 1e6) == pytest.approx(1e-4 + 1e-3)
    # 8 ranks from the nearest measured (4): ring steps 7/3, same per-byte cost
    eight = profile.alpha_beta("all_reduce", 8)
    assert eight.alpha_s == pytest.approx(3e-4 * 7 / 3) and eight.beta_s_per_byte == 2e-9
    three = profile.alpha_beta("all_reduce", 3)     # a tie goes to the larger group
    assert three.alpha_s == pytest.approx(3e-4 * 2 / 3)
    assert profile.collective_seconds("all_reduce", 1, 1e6) == 0.0
    with pytest.raises(KeyError, match="'all_gather'.*calibrate"):
        profile.alpha_beta("all_gather", 2)


def test_profile_refuses_unknown_kinds_and_single_rank_groups():
    with pytest.raises(ValidationError, match="unknown collective kinds"):
        _profile(collectives={"allreduce": {2: AlphaBeta(alpha_s=1e-4, beta_s_per_byte=0)}})
    with pytest.raises(ValidationError, match="group sizes"):
        _profile(collectives={"all_reduce": {1: AlphaBeta(alpha_s=1e-4, beta_s_per_byte=0)}})


def test_profile_save_load_round_trip(tmp_path, monkeypatch):
    profile = _profile()
    path = profile.save(tmp_path / "sub" / "p.json")
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.collectives["all_reduce"][4].alpha_s == 3e-4     # int keys back from JSON
    assert loaded.matmul.seconds(3e7) == profile.matmul.seconds(3e7)
    monkeypatch.setenv("AUTOPAR_PROFILE", str(path))
    assert default_profile() == profile
    assert _profile(machine="other").save() == path                  # default path too
    assert default_profile().machine == "other"


def test_a_profile_without_the_pipeline_fields_loads_and_charges_nothing(tmp_path):
    path = tmp_path / "p.json"
    data = json.loads(Profile.reference().model_dump_json())
    del data["p2p_send"], data["pipeline_job_s"]
    path.write_text(json.dumps(data))
    old = Profile.load(path)
    assert old.p2p_send is None and old.pipeline_job_s == 0.0


def test_missing_profile_tells_the_user_to_calibrate(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PROFILE", str(tmp_path / "none.json"))
    with pytest.raises(ProfileNotFound, match=r"none\.json.*python -m autopar calibrate"):
        default_profile()
    monkeypatch.delenv("AUTOPAR_PROFILE")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"\.cache/autopar/profile\.json"):
        default_profile()


def test_fit_recovers_a_line_and_never_goes_below_zero():
    line = [(b, 2e-4 + 1e-9 * b) for b in (1e3, 1e4, 1e5, 1e6, 1e7)]
    fit = fit_alpha_beta(line)
    assert fit.alpha_s == pytest.approx(2e-4, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(1e-9, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    # convex points pull a free line's intercept below zero: refit through the origin
    convex = [(1e3, 1e-7), (1e6, 1e-4), (1e7, 1e-2)]
    assert fit_alpha_beta(convex).alpha_s == 0.0 and fit_alpha_beta(convex).beta_s_per_byte > 0
    noisy = [(1e3, 3e-4), (1e4, 1e-4), (1e5, 2e-4)]
    assert fit_alpha_beta(noisy).r2 < 0.9


def test_monotone_curve_never_predicts_a_bigger_op_faster():
    curve = monotone_curve((1e3, 1e4, 1e5, 1e6), [3e-6, 2e-6, 4e-6, 3e-5])
    assert curve.points == [(1e3, 3e-6), (1e4, 3e-6), (1e5, 4e-6), (1e6, 3e-5)]


def test_group_sizes_are_the_mesh_dims_a_launch_allows():
    assert group_sizes(4) == [2, 4]
    assert group_sizes(6) == [2, 3, 6]
    assert group_sizes(1) == []


def test_quick_calibration_on_two_gloo_ranks(tmp_path):
    """The CLI launches 2 processes through torchrun and rank 0 writes a valid profile."""
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--processes", "2",
                           "--quick", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "GFLOP/s" in done.stdout and "R^2" in done.stdout and str(out) in done.stdout
    profile = Profile.load(out)
    assert (profile.processes, profile.threads) == (2, 1)
    assert "gloo" in profile.machine
    assert set(profile.collectives) == set(COLLECTIVE_KINDS)
    for kind, by_size in profile.collectives.items():
        assert list(by_size) == [2], kind                  # the one mesh dim 2 ranks allow
        fit = by_size[2]
        assert 0 <= fit.alpha_s < 1 and 0 <= fit.beta_s_per_byte < 1e-6, (kind, fit)
        assert fit.seconds(1e6) > 0 and math.isfinite(fit.r2)
    assert 0 <= profile.op_overhead_s < 1e-3
    # sanity, not speed: a big matmul or add runs at a far higher rate than a tiny one
    mm, pw = profile.matmul, profile.pointwise
    assert mm.throughput(mm.points[-1][0]) > 3 * mm.throughput(mm.points[0][0])
    assert pw.throughput(pw.points[-1][0]) > 3 * pw.throughput(pw.points[0][0])
    assert all(t < 1.0 for _, t in mm.points + pw.points)
    # measured half-precision curves and the slowdown of 1 and 2 processes computing
    assert set(profile.matmul_dtypes) == set(profile.pointwise_dtypes) == {"float16",
                                                                         "bfloat16"}
    assert sorted(profile.slowdown) == [1, 2] and profile.slowdown[1] == pytest.approx(1.0)
    assert all(0 < s < 3 for s in profile.slowdown.values())
    # the probed ops: a curve per target and dtype, over growing sizes; the view cost
    assert {"aten.gelu.default", "optim.adam",
            "aten._scaled_dot_product_flash_attention_for_cpu.default"} <= set(
                profile.op_curves)
    assert set(profile.op_curves["aten.gelu.default"]) == {"float32", "float16", "bfloat16"}
    assert set(profile.op_curves["optim.adam"]) == {"float32"}
    assert len(profile.op_curves["aten.gelu.default"]["float32"].points) == 2
    assert 0 < profile.view_s < 1e-3
    # the pipeline exchange: a send call's line over the bytes, the prefetch after a job
    assert profile.p2p_send is not None and 0 < profile.p2p_send.seconds(65536) < 0.1
    assert 0 < profile.pipeline_job_s < 0.1
    assert "pipeline runtime" in done.stdout


def test_the_shipped_reference_profile_is_a_full_four_process_gloo_profile():
    reference = Profile.reference()
    assert (reference.processes, reference.threads) == (4, 1) and "gloo" in reference.machine
    assert set(reference.collectives) == set(COLLECTIVE_KINDS)
    for kind, by_size in reference.collectives.items():
        assert sorted(by_size) == ([2] if kind == "send_recv" else [2, 4]), kind
    assert reference.matmul.points[-1][0] >= 1e9 and reference.pointwise.points[-1][0] >= 6e7
    assert sorted(reference.slowdown) == [1, 2, 3, 4]
    assert reference.p2p_send is not None and reference.pipeline_job_s > 0
    assert set(reference.matmul_dtypes) == {"float16", "bfloat16"}


def test_fits_of_groups_across_machines_are_kept_apart():
    from autopar.calibrate.fits import collective_fits as _collective_fits
    points = [(1e3, 1e-4), (1e5, 2e-4), (1e6, 1.1e-3)]
    slow = [(b, 10 * t) for b, t in points]
    measured = {"collectives": {"all_reduce": {2: points, 4: slow}},
                "links": {2: "intra-node", 4: "inter-node"}, "local_world": 2}
    fits = _collective_fits(measured)
    assert list(fits["collectives"]["all_reduce"]) == [2]
    assert list(fits["inter_node"]["all_reduce"]) == [4] and fits["devices_per_node"] == 2
    one_machine = _collective_fits({**measured, "links": {2: "intra-node", 4: "intra-node"}})
    assert list(one_machine) == ["collectives"]
    assert sorted(one_machine["collectives"]["all_reduce"]) == [2, 4]


def test_a_mesh_dim_across_machines_is_priced_on_the_inter_node_fits():
    profile = Profile.reference()
    assert not profile.crosses_node([[0, 1], [2, 3]], 0)          # one machine
    on_two = profile.model_copy(update={"devices_per_node": 2, "inter_node": {
        kind: {n: fit.model_copy(update={"beta_s_per_byte": 10 * fit.beta_s_per_byte})
               for n, fit in by_n.items()} for kind, by_n in profile.collectives.items()}})
    assert on_two.crosses_node([[0, 1], [2, 3]], 0)               # [0, 2], [1, 3]
    assert not on_two.crosses_node([[0, 1], [2, 3]], 1)           # [0, 1], [2, 3]
    inside = on_two.collective_seconds("all_reduce", 2, 1e6)
    across = on_two.collective_seconds("all_reduce", 2, 1e6, across_nodes=True)
    assert across > 5 * inside
    assert profile.collective_seconds("all_reduce", 2, 1e6, across_nodes=True) == \
        profile.collective_seconds("all_reduce", 2, 1e6)           # none measured: as within
