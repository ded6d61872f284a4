"""Pass ``schedule_pipeline``: every pipeline rank's job order, made from the strategy's
schedule and the program's micro-batch count (``PlanInputs.micro_batches``, as
``settle_mesh`` laid the stages out with it), checked and played on a timeline weighed by
the FLOPs of each stage's ops; the program itself is unchanged. Run through the pass, the
schedule fact holds the jobs the schedule's builder makes (1F1B, F-then-B, VPP, ZB-H1's W
jobs), forward jobs only for eval, one job per micro-batch and stage; without a pipeline it
is None; with the pass disabled nothing makes the fact and lowering, which reads it, fails
naming the pass."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import autopar as ap
from autopar import passes
from autopar.capture.step import capture
from autopar.ir import Program, format_program
from autopar.models.gpt import lm_loss
from autopar.pass_infra import FactError
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.pass_infra.manager import PassManager
from autopar.pipeline.schedules import build_schedule

from ..parity import lm_data, one_thread, parity_gpt  # noqa: F401  (one_thread: a fixture)

PASS = "schedule_pipeline"
BATCH, SEQ, VOCAB = 8, 16, 64

pytestmark = pytest.mark.usefixtures("one_thread")


def _pp(schedule: str, micro_batches: int, chunks: int = 1) -> str:
    vpp = f", vpp_chunks: {chunks}" if chunks > 1 else ""
    return ("mesh: {shape: [2], dim_names: [pp]}\n"
            f"pipeline: {{axis: pp, schedule: {schedule}, micro_batches: {micro_batches}{vpp}}}\n")


def _plan(yaml: str, micro_batches: int = 1, mode: str = "train",
          disabled: frozenset[str] = frozenset(), upto: str = PASS
          ) -> tuple[Program, PassContext, str]:
    """A 4-layer GPT's step through the passes up to ``upto``, and its text before the
    last of them."""
    model = parity_gpt("sgd", vocab=VOCAB, seq=SEQ, layers=4)
    x, y = (torch.stack(t) for t in zip(*lm_data(BATCH, SEQ, VOCAB)))
    program = capture(model, lm_loss, x, y if mode != "predict" else None, mode=mode).program
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if mode == "train" else None
    ctx = PassContext(PlanInputs.of(
        ap.Strategy.from_yaml_str(yaml), mode=mode, optimizer=optimizer,
        param_names={id(p): n for n, p in model.named_parameters()},
        micro_batches=micro_batches))
    names = [p.name for p in passes.PIPELINE]
    at = names.index(upto)
    program = PassManager(passes.PIPELINE[:at]).run(program, ctx)
    before = format_program(program)
    program = PassManager(passes.PIPELINE[at:at + 1], disabled=disabled).run(program, ctx)
    return program, ctx, before


@pytest.mark.parametrize("schedule,micro_batches,chunks", [
    ("1F1B", 4, 1), ("FThenB", 2, 1), ("VPP", 4, 2), ("ZBH1", 2, 1)])
def test_the_schedule_is_the_builders_for_the_programs_micro_batches(schedule, micro_batches,
                                                                      chunks):
    program, ctx, before = _plan(_pp(schedule, micro_batches, chunks), micro_batches)
    plan, layout = ctx.state.schedule, ctx.state.pipeline
    assert layout.micro_batches == micro_batches
    assert plan.name == schedule and not plan.forward_only
    assert plan.jobs == build_schedule(schedule, 2, micro_batches, chunks)
    # every stage runs each micro-batch's forward and backward once (ZB-H1: and its W)
    kinds = {"F", "B", "W"} if schedule == "ZBH1" else {"F", "B"}
    count = Counter((job.kind, job.stage, job.micro_batch) for jobs in plan.jobs for job in jobs)
    assert set(count.values()) == {1}
    assert len(count) == len(kinds) * 2 * chunks * micro_batches
    assert plan.timeline.makespan > 0 and all(cost > 0 for cost in plan.costs.values())
    assert format_program(program) == before          # the program itself is unchanged


def test_eval_schedules_forward_jobs_only():
    _, ctx, _ = _plan(_pp("1F1B", 4), micro_batches=2, mode="eval")
    plan = ctx.state.schedule
    assert plan.forward_only
    assert {job.kind for jobs in plan.jobs for job in jobs} == {"F"}
    assert sum(len(jobs) for jobs in plan.jobs) == 2 * 2    # 2 stages x 2 micro-batches


def test_without_a_pipeline_the_schedule_is_none():
    _, ctx, _ = _plan("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n")
    assert ctx.state.schedule is None


def test_disabled_nothing_makes_the_schedule_and_reading_it_names_the_pass():
    _, ctx, _ = _plan(_pp("1F1B", 4), 4, disabled=frozenset({PASS}))
    with pytest.raises(FactError, match="schedule_pipeline"):
        ctx.state.schedule


def test_the_engine_dumps_each_ranks_jobs(tmp_path):
    model = parity_gpt("sgd", vocab=VOCAB, seq=SEQ, layers=4)
    strategy = ap.Strategy.from_yaml_str(_pp("1F1B", 4) + f"debug: {{dump_dir: '{tmp_path}'}}\n")
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*lm_data(BATCH, SEQ, VOCAB)))
    engine.prepare(x, y)
    (jobs,) = (tmp_path / "rank0").glob(f"[0-9][0-9]_{PASS}.jobs.txt")
    text = jobs.read_text()
    assert "rank 0 (stages" in text and "rank 1 (stages" in text
    assert "F0 F1 B0" in text.replace("  ", " ")      # 1F1B's warm-up on rank 0
