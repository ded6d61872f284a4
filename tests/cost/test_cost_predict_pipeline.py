"""The pipeline runtime's costs in the step-time predictor: the timeline on shared cores
(``pipeline.timeline.play`` with ``CoreSharing``: exact times of tiny schedules; the same
times as without sharing when sharing changes nothing) and the measured per-job and
per-send charges growing a planned GPT pipeline's prediction linearly with its
micro-batches. Synthetic profiles: no
timing."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.cost import AlphaBeta, Curve, Profile
from autopar.pipeline.schedules import Job, build_schedule
from autopar.pipeline.timeline import CoreSharing, play

from .test_cost_predict import predict_tiny_gpt

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
JOB_S, SEND_S = 3e-4, 7e-4
PROFILE = Profile(
    machine="synthetic", processes=2, threads=1,
    matmul=Curve(points=[(1.0, 1e-9)]), pointwise=Curve(points=[(1.0, 1e-10)]),
    op_overhead_s=2e-5,
    collectives={k: {2: AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-8)}
                 for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                           "send_recv")})
CHARGED = PROFILE.model_copy(update={"p2p_send": AlphaBeta(alpha_s=SEND_S, beta_s_per_byte=0.0),
                                     "pipeline_job_s": JOB_S})


def _cost(job: Job) -> float:
    return 1.0 + 0.1 * job.stage + (0.5 if job.kind == "B" else 0.0) + 0.01 * job.micro_batch


@pytest.mark.parametrize("schedule, ranks, m", [("1F1B", 4, 8), ("FThenB", 2, 4),
                                                 ("ZBH1", 4, 4)])
def test_sharing_that_changes_nothing_plays_the_same_times(schedule, ranks, m):
    jobs = build_schedule(schedule, ranks, m)
    plain = play(jobs, _cost, latency=0.25)
    shared = play(jobs, _cost, 0.25, CoreSharing((1,) * ranks, lambda n: 1.0))
    assert shared.end == pytest.approx(plain.end, rel=1e-12)
    assert max(shared.finish) == pytest.approx(plain.makespan, rel=1e-12)


def test_a_rank_running_alone_runs_at_the_speed_of_one_process():
    # one micro-batch on 2 ranks: the jobs run one at a time; each cost is at the full
    # plan's contention (2 processes: twice as slow as one), so each takes half its cost
    jobs = build_schedule("FThenB", 2, 1)
    shared = play(jobs, lambda job: 2.0, 0.0, CoreSharing((1, 1), float))
    assert shared.finish == pytest.approx([4.0, 3.0])
    assert shared.bubble() == pytest.approx(0.5)


def test_work_together_is_slower_until_a_rank_finishes():
    # tails only: both run at the full rate until rank 0's 2 s are done at t=2, then rank
    # 1's last 2 s of work at twice the rate (alone): 1 s
    shared = play([[], []], lambda job: 0.0, 0.0, CoreSharing((1, 1), float), [2.0, 4.0])
    assert shared.finish == pytest.approx([2.0, 3.0])
    # a rank standing for 3 processes (dp inside a stage): costs are at 4 processes' rate;
    # alone, rank 1's one process runs 4 times as fast
    shared = play([[], []], lambda job: 0.0, 0.0, CoreSharing((3, 1), float), [2.0, 4.0])
    assert shared.finish == pytest.approx([2.0, 2.0 + 2.0 / 4])


def _predict(micro_batches: int, profile: Profile):
    text = (CONFIGS / "pp_1f1b.yaml").read_text().replace("micro_batches: 4",
                                                          f"micro_batches: {micro_batches}")
    return predict_tiny_gpt(text, profile)


def test_per_job_and_per_send_charges_grow_linearly_with_micro_batches():
    extra = {}
    for m in (2, 4, 8):
        plain, charged = _predict(m, PROFILE), _predict(m, CHARGED)
        assert charged.step_s > plain.step_s
        # the charges are communication; compute is untouched
        for p in plain.processes:
            assert charged[p].compute_s == pytest.approx(plain[p].compute_s, rel=1e-12)
        extra[m] = {p: charged[p].comm_s - plain[p].comm_s for p in plain.processes}
    for p in extra[2]:
        per_mb = (extra[4][p] - extra[2][p]) / 2
        # linear in micro-batches: each one adds the same
        assert extra[8][p] - extra[4][p] == pytest.approx(4 * per_mb, rel=1e-9)
        # each micro-batch is a forward and a backward job (the prefetch after each) and
        # one message this rank sends (rank 0 an activation, rank 1 a gradient), at least
        assert per_mb >= 2 * JOB_S + SEND_S - 1e-12
