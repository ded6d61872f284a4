"""How a pipeline is planned: stage splits, each op's stage and phase, the jobs and messages
of every rank, the dumps, and the errors that come before anything runs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar as ap
from autopar.ir import Role, verify
from autopar.lower.executable import Recv, Send
from autopar.lower.lowering import lower_program
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.passes.assign_phases import PipelineError
from autopar.passes.split_stages import StageSplitError
from autopar.pipeline.jobs import JobId
from autopar.pipeline.phases import STAGE, Phase, homes_of
from autopar.pipeline.schedules import build_schedule

from ..parity import ATOL, RTOL, assert_same_losses, eager_train, lm_data


def gpt(layers: int = 4, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, block_size=16, **kw))


def everyone(plan):
    """Every process of a planned pipelined step, lowered (the engine lowers only what it
    runs)."""
    facts = plan.facts
    return lower_program(plan.program, facts.mesh, facts.pipeline, facts.schedule)


def pipeline(pp: int = 2, schedule: str = "1F1B", micro_batches: int = 4, extra: str = "",
             **section) -> ap.Strategy:
    fields = ", ".join(f"{k}: {v}" for k, v in section.items())
    return ap.Strategy.from_yaml_str(
        f"mesh: {{shape: [{pp}], dim_names: [pp]}}\n"
        f"pipeline: {{axis: pp, schedule: {schedule}, micro_batches: {micro_batches}"
        f"{', ' + fields if fields else ''}}}\ndebug: {{simulate: true}}\n" + extra)


def planned(model: nn.Module, s: ap.Strategy, batch: int = 8):
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), strategy=s)
    x = torch.randint(0, 64, (batch, 16))
    program = engine.prepare(x, x)
    return engine, program, list(engine.planner.steps.values())[-1]


def stage_of_module(program, module: str) -> set[int]:
    return {op.attrs[STAGE] for op in program.ops
            if op.role is Role.FORWARD and STAGE in op.attrs
            and (op.module == module or op.module.startswith(module + "."))}


# -- stage splits -------------------------------------------------------------------------------

def test_explicit_split_puts_each_module_on_its_stage():
    _, program, _ = planned(gpt(4), pipeline(split="[blocks.1]"))
    assert stage_of_module(program, "wte") == {0}
    assert stage_of_module(program, "blocks.0") == {0}
    for module in ("blocks.1", "blocks.3", "ln_f", "head"):
        assert stage_of_module(program, module) == {1}
    # the loss on the last stage; a backward op on its forward op's stage
    assert {op.attrs[STAGE] for op in program.ops if op.role is Role.LOSS} == {1}
    for op in program.ops:
        if op.role is Role.BACKWARD and op.forward_op is not None and STAGE in op.attrs:
            assert op.attrs[STAGE] == op.forward_op.attrs[STAGE]


@pytest.mark.parametrize("layers,pp,starts", [(4, 2, ["blocks.2"]),
                                              (8, 4, ["blocks.2", "blocks.4", "blocks.6"])])
def test_auto_split_balances_equal_layers(layers, pp, starts):
    _, program, _ = planned(gpt(layers), pipeline(pp))
    for stage, module in enumerate(starts, start=1):
        assert stage_of_module(program, module) == {stage}


def test_stages_from_annotated_meshes_train_like_eager():
    """Semi-auto: parameters annotated on two meshes are two stages (no mesh, no split)."""
    def annotated():
        model = gpt(2)
        first, second = ap.ProcessMesh([0], ["x"]), ap.ProcessMesh([1], ["x"])
        for name, p in model.named_parameters():
            late = name.startswith(("blocks.1", "ln_f"))
            ap.shard_tensor(p, second if late else first, [ap.Replicate()])
        return model
    s = ap.Strategy.from_yaml_str("pipeline: {schedule: 1F1B, micro_batches: 2}\n"
                                  "debug: {simulate: true}")
    model = annotated()
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), strategy=s)
    data = lm_data(40, 16, 64)
    history = engine.fit(data, batch_size=8, verbose=0)
    ref = gpt(2)
    want = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data, 8, 5)
    assert_same_losses(history["loss"], want)
    program = engine.programs()["train0"]
    assert stage_of_module(program, "blocks.0") == {0}
    assert stage_of_module(program, "blocks.1") == {1}


# -- errors before anything runs ----------------------------------------------------------------

def test_more_stages_than_layers_cut_at_the_top_level_modules_too():
    """Two layers for four stages: the embedding, the final norm and the head are cut
    points too (the model's top-level children), so every stage gets work."""
    _, program, _ = planned(gpt(2), pipeline(4, micro_batches=4))
    stages = [stage_of_module(program, m) for m in ("wte", "blocks.0", "blocks.1", "head")]
    assert set().union(*stages) == {0, 1, 2, 3}
    assert all(len(s) == 1 for s in stages) and stages == sorted(stages, key=min)


def test_more_stages_than_cut_points_is_refused():
    with pytest.raises(StageSplitError,
                       match=r"8 stages but the model has \d+ layers and top-level modules"):
        planned(gpt(2), pipeline(8, micro_batches=8), batch=8)


def test_a_split_module_that_does_not_exist_is_refused():
    with pytest.raises(StageSplitError, match="'blocks.9' runs no op in the forward"):
        planned(gpt(4), pipeline(split="[blocks.9]"))


def test_split_modules_out_of_forward_order_are_refused():
    with pytest.raises(StageSplitError, match="must follow the forward's order"):
        planned(gpt(4), pipeline(3, micro_batches=3, split="[blocks.3, blocks.1]"), batch=9)


def test_a_batch_that_does_not_divide_into_micro_batches_is_refused():
    model = gpt(2)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=pipeline(2, micro_batches=4))
    with pytest.raises(ValueError, match="batch of 6 rows does not split into data_parallel=1 "
                                         "x pipeline.micro_batches=4"):
        engine.fit(lm_data(12, 16, 64), batch_size=6, verbose=0)


@pytest.mark.parametrize("text,message", [
    ("pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}",
     "1F1B needs micro_batches >= pipeline ranks, got micro_batches=2 < ranks=4"),
    ("pipeline: {axis: pp, schedule: VPP, vpp_chunks: 2, micro_batches: 6}",
     "VPP needs micro_batches divisible by pipeline ranks"),
    ("pipeline: {axis: pp, schedule: ZBH1, micro_batches: 3}", "ZBH1 needs micro_batches"),
])
def test_schedules_check_their_micro_batches_when_the_engine_takes_the_strategy(text, message):
    strategy = ap.Strategy.from_yaml_str("mesh: {shape: [4], dim_names: [pp]}\n" + text)
    model = gpt(4)
    with pytest.raises(ValueError, match=message):
        ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)


def test_the_micro_batch_dim_name_is_reserved():
    strategy = ap.Strategy.from_yaml_str("mesh: {shape: [2, 2], dim_names: [pp, mb]}")
    model = gpt(2)
    with pytest.raises(ValueError, match="'mb' is reserved"):
        ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)


class BatchStatistics(nn.Module):
    """Subtracts the batch mean in the middle of the forward (as BatchNorm does)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, x):
        h = self.fc(self.emb(x))
        return self.head(h - h.mean(0, keepdim=True))


def test_a_statistic_of_the_whole_batch_mid_forward_is_refused_by_name():
    s = pipeline(1, micro_batches=2)
    with pytest.raises(PipelineError, match=r"needs the whole batch, all_reduce\(sum\) over mb"
                       r".* of a value .*\(fc fwd\) computes while the pipeline runs"):
        planned(BatchStatistics(), s)


# -- phases, jobs and messages ------------------------------------------------------------------

def test_phases_of_a_gpt_step():
    _, program, _ = planned(gpt(4), pipeline())
    by_target = {}
    for op in program.ops:
        by_target.setdefault(op.target, set()).update(p for _, p in homes_of(op))
    assert by_target["aten.ne.Scalar"] == {Phase.PRE_MB}          # the loss's token count
    assert Phase.PRE in by_target["aten.t.default"]                # weights transposed once
    assert by_target["aten.mm.default"] >= {Phase.F, Phase.B}
    assert by_target["optim.sgd"] == {Phase.POST}
    tied = next(op for op in program.ops if op.target == "optim.sgd"
                and op.module == "wte")
    assert {s for s, _ in homes_of(tied)} == {0, 1}                # both copies updated


def test_zbh1_splits_the_backward_into_input_and_weight_gradients():
    _, program, _ = planned(gpt(4), pipeline(schedule="ZBH1"))
    phases = {}
    for op in program.ops:
        for stage, phase in homes_of(op):
            phases.setdefault(stage, set()).add(phase)
    assert {Phase.B, Phase.W} <= phases[1]     # stage 1 sends input gradients to stage 0
    assert Phase.B not in phases[0]            # stage 0 sends none: all its backward is W
    weight_grads = [op for op in program.ops if op.target == "aten.mm.default"
                    and op.role is Role.BACKWARD and (1, Phase.W) in homes_of(op)]
    assert weight_grads


@pytest.mark.parametrize("schedule,pp,chunks,layers", [
    ("1F1B", 2, 1, 2), ("VPP", 2, 2, 4), ("ZBH1", 4, 1, 4), ("FThenB", 2, 1, 2)])
def test_every_message_is_sent_and_received_once_and_every_job_verifies(
        schedule, pp, chunks, layers):
    _, program, plan = planned(gpt(layers), pipeline(pp, schedule, vpp_chunks=chunks))
    pipeline_plan = plan.lowered.jobs
    sent = [m for r in pipeline_plan.ranks for ms in r.sent.values() for m in ms]
    received = [m for r in pipeline_plan.ranks for ms in r.received.values() for m in ms]
    assert sorted(sent, key=str) == sorted(received, key=str) == \
        sorted(pipeline_plan.messages, key=str)
    layout = pipeline_plan.layout
    schedule = build_schedule(layout.schedule, layout.ranks, layout.micro_batches, layout.chunks)
    for rank in pipeline_plan.ranks:     # a rank runs its schedule's jobs, in its order
        assert [j for j in rank.order if j.phase in (Phase.F, Phase.B, Phase.W)] == [
            JobId(Phase(job.kind), job.stage, job.micro_batch) for job in schedule[rank.rank]]
    for process in everyone(plan).processes.values():    # lowering made and verified them
        assert process.order == pipeline_plan.ranks[process.pp].order
        for job in process.programs.values():
            verify(job.program)
    # both ends of a pair post its messages in one order, the schedule's
    orders = [m.order for m in pipeline_plan.messages]
    assert orders == sorted(orders)


def test_dumps_show_the_schedule_and_every_rank_s_jobs(tmp_path):
    s = pipeline().model_copy(update={"debug": ap.Strategy(
        debug={"dump_dir": str(tmp_path), "simulate": True}).debug})
    planned(gpt(4), s)
    jobs = next((tmp_path / "rank0").glob("[0-9][0-9]_schedule_pipeline.jobs.txt")).read_text()
    assert "rank 0 (stages [0], peak in-flight micro-batches 2): F0 F1 B0 F2 B1 F3 B2 B3" in jobs
    assert "bubble=" in jobs and "rank 1 " in jobs
    rank1 = next((tmp_path / "rank1").glob("[0-9][0-9]_jobs.txt")).read_text()
    assert "# job F0@s1" in rank1 and "comm.recv()" in rank1 and "comm.send(" in rank1
    assert "accumulate[" in rank1 and "# job post" in rank1
    stages = next((tmp_path / "rank0").glob("[0-9][0-9]_assign_phases.txt")).read_text()
    assert "@s0:F" in stages and "@s1:B" in stages and "@s0,1:post" in stages


# -- eval, predict, clipping, memory -------------------------------------------------------------

def test_evaluate_and_predict_run_pipelined_like_eager():
    model = gpt(4)
    ref = gpt(4).eval()
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=pipeline())
    data = lm_data(10, 16, 64)
    x = torch.stack([d[0] for d in data[:5]])
    y = torch.stack([d[1] for d in data[:5]])
    with torch.no_grad():
        want = ref(x)
    got = engine.predict(data[:5], batch_size=5)[0]          # 5 rows: fewer micro-batches
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    scores = engine.evaluate(data[:5], batch_size=5)
    assert scores["loss"] == pytest.approx(lm_loss(want, y).item(), rel=1e-5)


def test_gradient_clipping_across_stages_matches_eager():
    s = pipeline(extra="grad_clip: {max_norm: 0.05}")
    model, ref = gpt(4), gpt(4)
    data = lm_data(40, 16, 64)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), strategy=s)
    history = engine.fit(data, batch_size=8, verbose=0)
    want = eager_train(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data, 8, 5,
                       max_norm=0.05)
    assert_same_losses(history["loss"], want)
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_1f1b_holds_fewer_activations_than_f_then_b():
    peaks = {}
    for schedule in ("FThenB", "1F1B"):
        model = gpt(4)
        engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                           strategy=pipeline(2, schedule, micro_batches=4))
        engine.fit(lm_data(8, 16, 64), batch_size=8, verbose=0)
        peaks[schedule] = engine.peak_activation_bytes()
    # stage 0 holds p=2 micro-batches under 1F1B, all m=4 under F-then-B
    assert peaks["1F1B"][0] / peaks["FThenB"][0] == pytest.approx(0.5, abs=0.05)


def test_reshard_plans_go_straight_over_micro_batches():
    """A sum over micro-batches exists only once every micro-batch made its term: a value
    partial over mb keeps that placement while other dims change, never reduced and made
    partial again on the way (which the cost of per-micro-batch steps would otherwise buy)."""
    from autopar.ir.dist import DistAttr, Partial, Replicate, Shard
    from autopar.reshard import plan_reshard
    mesh = ap.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["dp", "tp", "mb"])
    src = DistAttr(mesh, (Partial(), Replicate(), Partial()))
    dst = DistAttr(mesh, (Partial(), Shard(0), Partial()))
    steps = plan_reshard((64, 32), src, dst)
    assert [(s.kind, s.axis or mesh.dim_names[s.mesh_dim]) for s in steps] == [("slice", "tp")]
    # a gradient: accumulated over micro-batches before its all-reduce over dp
    grad = plan_reshard((64, 32), DistAttr(mesh, (Partial(), Replicate(), Partial())),
                        DistAttr.replicated(mesh))
    assert [mesh.dim_names[s.mesh_dim] for s in grad] == ["mb", "dp"]


@pytest.mark.parametrize("schedule,pp,chunks,layers,tied", [
    ("1F1B", 2, 1, 2, True), ("VPP", 2, 2, 4, True), ("ZBH1", 4, 1, 4, False),
    ("FThenB", 2, 1, 2, True)])
def test_both_ends_of_every_pair_post_its_messages_in_one_order(schedule, pp, chunks, layers,
                                                                tied):
    """What NCCL needs to never hang: each rank runs its jobs' receives and sends through its
    transport, alone (the posting order is decided locally); for every pair, the messages
    one end posts to the other come out in the same order as the other end posts them."""
    from autopar.runtime.p2p import P2PTransport

    class Recording(P2PTransport):
        def _post(self, m, other, tensor):
            self.log.setdefault(other, []).append(m)
            return type("Done", (), {"wait": lambda self: None})()

    _, program, plan = planned(gpt(layers, tie_weights=tied),
                               pipeline(pp, schedule, vpp_chunks=chunks))
    logs = {}
    for process in everyone(plan).processes.values():
        jobs = [process.programs[job] for job in process.order]
        shapes = {c.message: (c.shape, c.dtype) for job in jobs for c in job.comms.values()
                  if isinstance(c, Recv)}
        transport = Recording(process.messages, process.pp, process.peers, shapes, "cpu")
        transport.log = {}
        for job in jobs:
            transport.prefetch()      # as the runtime does between jobs
            for i, comm in sorted(job.comms.items()):
                if isinstance(comm, Recv):
                    transport.recv(comm.message)
                elif isinstance(comm, Send):
                    transport.send(comm.message, torch.zeros(()))
        transport.finish()
        logs[process.pp] = transport.log
    pairs = {(a, b) for a in logs for b in logs[a]}
    assert pairs
    for a, b in pairs:
        assert logs[a][b] == logs[b][a], f"ranks {a} and {b} post their messages differently"


def test_a_tied_weight_s_gradient_crosses_stages_once_per_step():
    """wte on stage 0 and the head on stage 1 share a weight: each stage sums its term over
    the micro-batches and the two terms are exchanged once (not once per micro-batch)."""
    _, program, plan = planned(gpt(4), pipeline(micro_batches=4))
    messages = plan.lowered.jobs.messages
    per_micro_batch = [m for m in messages if m.micro_batch >= 0]
    once = [m for m in messages if m.micro_batch < 0]
    assert len(per_micro_batch) == 2 * 4           # an activation forward, its gradient back
    assert sorted((m.src, m.dst) for m in once) == [(0, 1), (1, 0), (1, 0)]  # 2 terms, loss
    joined = [op for op in program.ops if op.target == "aten.add.Tensor"
              and op.role is Role.OPTIMIZER]
    assert len(joined) == 1 and {s for s, _ in homes_of(joined[0])} == {0, 1}


class _WholeBatchFirst(nn.Module):
    """Reads the whole batch through an op with no SPMD rule (cumprod) before its layers:
    that value exists only once every micro-batch's piece is in, before any runs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        scale = torch.cumprod(x, 0)[-1]
        return self.layers[1](self.layers[0](x) * scale)


def test_a_whole_batch_value_needed_before_the_micro_batches_is_refused_naming_its_reader():
    from autopar.pipeline.jobs import PipelinePlanError
    model = _WholeBatchFirst()
    engine = ap.Engine(model, lambda out, y: (out - y).pow(2).mean(),
                       torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=pipeline(2, micro_batches=2, split="[layers.1]"))
    with pytest.warns(UserWarning, match="cumprod"), \
            pytest.raises(PipelinePlanError, match=r"cumprod \(top level\) reads .* whole "
                                                   r"batch.*micro-batches \[\] of 2"):
        engine.prepare(torch.randn(4, 8), torch.randn(4, 8))
