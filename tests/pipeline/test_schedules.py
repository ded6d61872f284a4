"""Pipeline schedules: every job list obeys the dependency rules, plays without deadlock,
pairs every send with a receive, and has the bubble and activation memory the papers give."""
from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.pipeline.schedules import (
    SCHEDULES,
    Job,
    build_schedule,
    check_schedule_args,
    splits_backward,
)
from autopar.pipeline.timeline import (
    DeadlockError,
    Timeline,
    check_jobs,
    chrome_trace,
    peak_in_flight,
    play,
    render,
    timeline_events,
    transfers,
)

PROPERTY = settings(max_examples=60, deadline=None)


def labels(jobs: list[list[Job]], chunks: int = 1) -> list[str]:
    ranks = len(jobs)
    return [" ".join(job.label(ranks, chunks) for job in rank_jobs) for rank_jobs in jobs]


def valid(name: str, ranks: int, micro_batches: int, chunks: int) -> bool:
    try:
        check_schedule_args(name, ranks, micro_batches, chunks)
    except ValueError:
        return False
    return True


def costs(forward: float, backward: float, weight: float = 0.0):
    return lambda job: {"F": forward, "B": backward, "W": weight}[job.kind]


@st.composite
def schedule_cases(draw):
    """(name, ranks, micro_batches, chunks, forward_only), valid for the schedule. Half the
    micro-batch counts are multiples of ranks so VPP cases are common enough."""
    name = draw(st.sampled_from(SCHEDULES))
    ranks = draw(st.integers(1, 8))
    micro_batches = draw(st.one_of(st.integers(1, 16),
                                   st.integers(1, 16 // ranks).map(lambda k: k * ranks)))
    chunks = draw(st.integers(2, 4)) if name == "VPP" else 1
    assume(valid(name, ranks, micro_batches, chunks))
    return name, ranks, micro_batches, chunks, draw(st.booleans())


# --------------------------------------------------------------------------------------
# jobs and argument checks
# --------------------------------------------------------------------------------------
def test_job_names_show_micro_batch_and_stage_or_chunk():
    job = Job("F", 5, 3)
    assert str(job) == "F3@s5"
    assert job.rank(4) == 1 and job.chunk(4) == 1
    assert job.label(4, chunks=2) == "F3.1"
    assert Job("B", 2, 7).label(4) == "B7"


def test_job_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="'X'"):
        Job("X", 0, 0)


@pytest.mark.parametrize("args, message", [
    (("GPipe", 2, 4, 1), "unknown pipeline schedule 'GPipe'; known: FThenB, 1F1B, VPP, ZBH1"),
    (("1F1B", 0, 4, 1), "ranks must be >= 1, got 0"),
    (("1F1B", 2, 0, 1), "micro_batches must be >= 1, got 0"),
    (("VPP", 2, 4, 0), "chunks must be >= 1, got 0"),
    (("1F1B", 4, 3, 1), "1F1B needs micro_batches >= pipeline ranks, got micro_batches=3 < "
                        "ranks=4"),
    (("ZBH1", 8, 5, 1), "ZBH1 needs micro_batches >= pipeline ranks, got micro_batches=5 < "
                        "ranks=8"),
    (("VPP", 4, 6, 2), "micro_batches=6, ranks=4, remainder 2"),
    (("VPP", 4, 8, 1), "VPP needs chunks >= 2 per rank, got chunks=1"),
    (("FThenB", 2, 4, 2), "FThenB runs one chunk per rank, got chunks=2"),
])
def test_bad_sizes_are_refused_naming_the_numbers(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_schedule_args(*args)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_schedule(*args)


def test_only_zbh1_splits_the_backward():
    assert [splits_backward(name) for name in SCHEDULES] == [False, False, False, True]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        splits_backward("ZBH2")


# --------------------------------------------------------------------------------------
# golden job lists
# --------------------------------------------------------------------------------------
def test_f_then_b_runs_every_forward_first():
    assert labels(build_schedule("FThenB", 2, 3)) == ["F0 F1 F2 B0 B1 B2"] * 2


def test_1f1b_warms_up_p_minus_r_minus_1_forwards():
    assert labels(build_schedule("1F1B", 3, 4)) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_vpp_follows_megatrons_interleaved_order():
    assert labels(build_schedule("VPP", 2, 4, 2), chunks=2) == [
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
    ]


@pytest.mark.parametrize("ranks, micro_batches, chunks", [(4, 8, 2), (4, 4, 3), (2, 8, 4)])
def test_vpp_warm_up_is_megatrons(ranks, micro_batches, chunks):
    total = micro_batches * chunks
    for rank, rank_jobs in enumerate(build_schedule("VPP", ranks, micro_batches, chunks)):
        warmup = next(i for i, job in enumerate(rank_jobs) if job.kind == "B")
        if micro_batches == ranks:
            assert warmup == total
        else:
            assert warmup == min(total, 2 * (ranks - rank - 1) + (chunks - 1) * ranks) + 1
        assert [job.stage for job in rank_jobs[:ranks]] == [rank] * ranks


def test_zbh1_defers_the_first_weight_grads_of_each_rank_to_the_end():
    assert labels(build_schedule("ZBH1", 3, 4)) == [
        "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "F0 F1 B0 F2 B1 W1 F3 B2 W2 B3 W3 W0",
        "F0 B0 F1 B1 F2 B2 W2 F3 B3 W3 W0 W1",
    ]


@pytest.mark.parametrize("name, chunks", [("FThenB", 1), ("1F1B", 1), ("VPP", 3), ("ZBH1", 1)])
def test_one_rank_is_plain_gradient_accumulation(name, chunks):
    jobs = build_schedule(name, 1, 4, chunks)
    check_jobs(jobs, 1, 4, chunks, splits_backward(name))
    timeline = play(jobs)
    assert timeline.bubble() == 0.0
    assert transfers(jobs) == []
    if name == "1F1B":
        assert labels(jobs) == ["F0 B0 F1 B1 F2 B2 F3 B3"]


@pytest.mark.parametrize("name, chunks", [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("ZBH1", 1)])
def test_forward_only_has_every_forward_and_nothing_else(name, chunks):
    jobs = build_schedule(name, 4, 8, chunks, forward_only=True)
    check_jobs(jobs, 4, 8, chunks, splits_backward(name), forward_only=True)
    assert {job.kind for rank_jobs in jobs for job in rank_jobs} == {"F"}
    assert play(jobs).makespan == 8 * chunks + 3


# --------------------------------------------------------------------------------------
# check_jobs and play on broken lists
# --------------------------------------------------------------------------------------
def test_check_jobs_names_the_offending_job():
    good = build_schedule("1F1B", 2, 2)
    with pytest.raises(ValueError, match="runs twice"):
        check_jobs([good[0], good[1] + [good[1][0]]], 2, 2, 1, False)
    with pytest.raises(ValueError, match=r"2 jobs never run: B0@s1, B1@s1"):
        check_jobs([good[0], [j for j in good[1] if j.kind == "F"]], 2, 2, 1, False)
    with pytest.raises(ValueError, match="job F0@s1 is on rank 0 but stage 1 belongs to rank 1"):
        check_jobs([good[0] + [Job("F", 1, 0)], good[1][1:]], 2, 2, 1, False)
    with pytest.raises(ValueError, match="job B0@s1 on rank 1 .position 0. comes before its "
                                         "same-rank dependency F0@s1"):
        check_jobs([good[0], good[1][1::-1] + good[1][2:]], 2, 2, 1, False)
    with pytest.raises(ValueError, match="unexpected job W0@s0"):
        check_jobs([good[0] + [Job("W", 0, 0)], good[1]], 2, 2, 1, False)


def test_a_cyclic_wait_is_a_deadlock_naming_each_ranks_job():
    jobs = [[Job("F", 0, 0), Job("B", 0, 0), Job("F", 0, 1), Job("B", 0, 1)],
            [Job("F", 1, 1), Job("F", 1, 0), Job("B", 1, 0), Job("B", 1, 1)]]
    check_jobs(jobs, 2, 2, 1, False)  # each rank's own order is fine
    with pytest.raises(DeadlockError) as caught:
        play(jobs)
    assert isinstance(caught.value, RuntimeError)
    assert caught.value.stuck == {0: Job("B", 0, 0), 1: Job("F", 1, 1)}
    message = str(caught.value)
    assert "rank 0 stuck at B0@s0 (position 1) waiting for B0@s1 (rank 1, position 2)" in message
    assert "rank 1 stuck at F1@s1 (position 0) waiting for F1@s0 (rank 0, position 2)" in message


def test_latency_delays_only_cross_rank_dependencies():
    timeline = play(build_schedule("1F1B", 2, 2), latency=0.5)
    start = {str(job): timeline.start[job] for job in timeline.start}
    assert start == {"F0@s0": 0, "F1@s0": 1, "F0@s1": 1.5, "B0@s1": 2.5, "F1@s1": 3.5,
                     "B1@s1": 4.5, "B0@s0": 4, "B1@s0": 6}
    assert timeline.makespan == 7
    assert timeline.idle(0) == 3 and timeline.idle(1) == 3


# --------------------------------------------------------------------------------------
# properties over every schedule
# --------------------------------------------------------------------------------------
@PROPERTY
@given(schedule_cases(), st.sampled_from([0.0, 0.5]))
def test_every_schedule_is_valid_and_plays_without_deadlock(case, latency):
    name, ranks, micro_batches, chunks, forward_only = case
    jobs = build_schedule(name, ranks, micro_batches, chunks, forward_only)
    check_jobs(jobs, ranks, micro_batches, chunks, splits_backward(name), forward_only)
    timeline = play(jobs, costs(1, 2, 1), latency=latency)
    assert 0.0 <= timeline.bubble() < 1.0
    assert all(timeline.idle(rank) >= 0 for rank in range(ranks))


@pytest.mark.parametrize("name, chunks", [("FThenB", 1), ("1F1B", 1), ("VPP", 4), ("ZBH1", 1)])
def test_the_largest_sizes_are_valid_too(name, chunks):
    """Hypothesis favours small cases; the biggest ones the properties range over, once."""
    for forward_only in (False, True):
        jobs = build_schedule(name, 8, 16, chunks, forward_only)
        check_jobs(jobs, 8, 16, chunks, splits_backward(name), forward_only)
        play(jobs, costs(1, 2, 1), latency=0.5)


@PROPERTY
@given(st.sampled_from(SCHEDULES), st.integers(1, 8), st.integers(0, 16), st.integers(0, 4))
def test_build_refuses_exactly_what_check_refuses(name, ranks, micro_batches, chunks):
    if valid(name, ranks, micro_batches, chunks):
        build_schedule(name, ranks, micro_batches, chunks)
    else:
        with pytest.raises(ValueError):
            build_schedule(name, ranks, micro_batches, chunks)


def sends(jobs: list[list[Job]]) -> list[tuple]:
    """Producer side: a forward hands its activation to the next stage, a backward its input
    gradient to the previous one."""
    ranks, out = len(jobs), []
    stages = 1 + max(job.stage for rank_jobs in jobs for job in rank_jobs)
    stages = -(-stages // ranks) * ranks
    for rank, rank_jobs in enumerate(jobs):
        for job in rank_jobs:
            to = {"F": job.stage + 1, "B": job.stage - 1}.get(job.kind)
            if to is not None and 0 <= to < stages and to % ranks != rank:
                out.append((rank, to % ranks, job.kind, job.stage, to, job.micro_batch))
    return out


def receives(jobs: list[list[Job]]) -> list[tuple]:
    """Consumer side, from the transfers the timeline derives from the dependency rules."""
    return [(t.src, t.dst, t.producer.kind, t.producer.stage, t.consumer.stage,
             t.producer.micro_batch) for t in transfers(jobs)]


@PROPERTY
@given(schedule_cases())
def test_sends_match_receives(case):
    name, ranks, micro_batches, chunks, forward_only = case
    jobs = build_schedule(name, ranks, micro_batches, chunks, forward_only)
    sent, received = sends(jobs), receives(jobs)
    assert sorted(sent) == sorted(received)
    assert len(set(sent)) == len(sent)  # one producer and one consumer per tensor
    directions = 1 if forward_only else 2
    assert len(sent) == (directions * (ranks * chunks - 1) * micro_batches if ranks > 1 else 0)


@PROPERTY
@given(st.integers(1, 8), st.integers(1, 16), st.sampled_from(["FThenB", "1F1B"]))
def test_1f1b_and_f_then_b_bubble_is_p_minus_1_over_m_plus_p_minus_1(ranks, micro_batches,
                                                                      name):
    assume(valid(name, ranks, micro_batches, 1))
    timeline = play(build_schedule(name, ranks, micro_batches))
    assert timeline.makespan == 2 * (micro_batches + ranks - 1)
    assert timeline.bubble() == pytest.approx((ranks - 1) / (micro_batches + ranks - 1),
                                              rel=1e-12, abs=1e-15)


@PROPERTY
@given(st.integers(1, 8), st.integers(1, 16))
def test_in_flight_is_p_minus_r_for_1f1b_and_m_for_f_then_b(ranks, micro_batches):
    f_then_b = build_schedule("FThenB", ranks, micro_batches)
    assert [peak_in_flight(jobs) for jobs in f_then_b] == [micro_batches] * ranks
    if micro_batches >= ranks:
        one_f_one_b = build_schedule("1F1B", ranks, micro_batches)
        assert [peak_in_flight(jobs) for jobs in one_f_one_b] == [ranks - r for r in range(ranks)]


@PROPERTY
@given(st.integers(1, 8), st.integers(1, 4), st.integers(2, 4))
def test_vpp_bubble_is_p_minus_1_over_vm_plus_p_minus_1(ranks, groups, chunks):
    """Each chunk holds 1/v of a rank's layers. Costs are scaled by v to stay integral:
    a VPP chunk's F or B costs 1, a 1F1B stage's costs v."""
    micro_batches = groups * ranks
    vpp = play(build_schedule("VPP", ranks, micro_batches, chunks))
    one_f_one_b = play(build_schedule("1F1B", ranks, micro_batches), costs(chunks, chunks))
    assert vpp.makespan == 2 * (chunks * micro_batches + ranks - 1)  # exact, Megatron's order
    assert vpp.makespan <= one_f_one_b.makespan
    assert vpp.bubble() == pytest.approx((ranks - 1) / (chunks * micro_batches + ranks - 1),
                                         rel=1e-12, abs=1e-15)


def deferred_weights(rank_jobs: list[Job]) -> int:
    """B jobs whose W does not follow at once: their micro-batch stays alive longer."""
    return sum(1 for job, after in zip(rank_jobs, rank_jobs[1:] + [None])
               if job.kind == "B" and after != Job("W", job.stage, job.micro_batch))


@PROPERTY
@given(st.integers(1, 8), st.integers(1, 16))
def test_zbh1_beats_1f1b_at_1f1b_memory_plus_its_deferred_weights(ranks, micro_batches):
    assume(micro_batches >= ranks)
    zbh1 = build_schedule("ZBH1", ranks, micro_batches)
    one_f_one_b = build_schedule("1F1B", ranks, micro_batches)
    zb, base = play(zbh1), play(one_f_one_b, costs(1, 2))
    assert zb.makespan == 3 * micro_batches + ranks - 1  # (p-1)(T_F + T_B - T_W) of bubble
    if ranks > 1:
        assert zb.bubble() < base.bubble()
    assert [deferred_weights(jobs) for jobs in zbh1] == list(range(ranks))
    for rank in range(ranks):
        assert (peak_in_flight(zbh1[rank])
                <= peak_in_flight(one_f_one_b[rank]) + deferred_weights(zbh1[rank]))


def test_observed_numbers_for_4_ranks_8_micro_batches():
    """The numbers quoted in the design notes (F = B = W = 1; 1F1B's B = 2 to compare)."""
    one_f_one_b = build_schedule("1F1B", 4, 8)
    zbh1 = build_schedule("ZBH1", 4, 8)
    vpp = build_schedule("VPP", 4, 8, 2)
    assert play(one_f_one_b, costs(1, 2)).bubble() == pytest.approx(3 / 11)
    assert play(zbh1).bubble() == pytest.approx(3 / 27)
    assert play(vpp).bubble() == pytest.approx(3 / 19)
    assert [peak_in_flight(jobs) for jobs in one_f_one_b] == [4, 3, 2, 1]
    assert [peak_in_flight(jobs) for jobs in zbh1] == [4, 4, 4, 4]
    assert [peak_in_flight(jobs) for jobs in vpp] == [11, 9, 7, 5]  # in chunks (1/2 stage)


# --------------------------------------------------------------------------------------
# pictures
# --------------------------------------------------------------------------------------
def test_render_draws_one_row_per_rank_under_a_header():
    text = render(play(build_schedule("1F1B", 2, 3)), title="1F1B")
    assert text == (
        "1F1B: ranks=2 stages=2 micro_batches=3 makespan=8 bubble=25.0%\n"
        "rank 0 |F0|F1|..|B0|F2|B1|..|B2|\n"
        "rank 1 ...|F0|B0|F1|B1|F2|B2|...")


@pytest.mark.parametrize("name, chunks", [("1F1B", 1), ("VPP", 2), ("ZBH1", 1)])
def test_render_shape_for_8_ranks_16_micro_batches(name, chunks):
    lines = render(play(build_schedule(name, 8, 16, chunks))).splitlines()
    assert len(lines) == 9 and "makespan=" in lines[0] and "bubble=" in lines[0]
    assert [line[:7] for line in lines[1:]] == [f"rank {r} " for r in range(8)]
    assert len({len(line) for line in lines[1:]}) == 1
    assert "F15" in lines[1] and "B15" in lines[8]


def test_chrome_trace_has_a_named_track_per_rank_and_events_in_microseconds():
    timeline = play(build_schedule("1F1B", 2, 3))
    trace = chrome_trace(timeline_events(timeline))
    json.dumps(trace)
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [
        "autopar pipeline"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 12
    first_on_rank_1 = min((e for e in spans if e["tid"] == 1), key=lambda e: e["ts"])
    assert first_on_rank_1["name"] == "F0"
    assert first_on_rank_1["ts"] == pytest.approx(1000.0)  # 1 unit = 1 ms
    assert first_on_rank_1["dur"] == pytest.approx(1000.0)


def test_chrome_trace_refuses_an_event_that_ends_before_it_starts():
    with pytest.raises(ValueError, match="'F0' on rank 1 ends before it starts"):
        chrome_trace([(1, "F0", 2.0, 1.0)])


def test_an_empty_timeline_is_harmless():
    timeline = Timeline(jobs=[[]], start={}, end={}, makespan=0.0, stages=1)
    assert timeline.bubble() == 0.0
    assert render(timeline).splitlines()[1] == "rank 0 ."
