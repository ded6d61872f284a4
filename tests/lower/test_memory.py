"""The plan-time memory estimate (``engine.cost``, ``lower.memory_estimate``) against the runtime's
own account of the live tensors of a step (``runtime.memory_meter``), per rank, on the simulator;
the ``memory_limit_gb`` refusal; the ``plan`` CLI's table."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar import Engine, Strategy
from autopar.lower.memory_estimate import MemoryLimitError, format_estimates
from autopar.models import GPT, GPTConfig
from autopar.runtime.memory_meter import PipelineMeter, measure_step
from autopar.runtime.pipeline_process import PipelineExecutor

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB, SEQ, BATCH = 64, 16, 8


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _engine(config: str | None, extra: str = "", debug: str = "simulate: true"
            ) -> tuple[Engine, GPT]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, block_size=SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    text = (CONFIGS / f"{config}.yaml").read_text() if config else ""
    strategy = Strategy.from_yaml_str(text + f"\ndebug: {{{debug}}}\n" + extra)
    return Engine(model, _loss, opt, strategy=strategy), model


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _measured(engine: Engine, x, y) -> dict[int, int]:
    """Each rank's peak live bytes over a training step, counted by the runtime."""
    engine.train_step(x, y)                    # the optimizer's state exists from here on
    step = engine.planner.plan("train", x, y)
    if step.lowered.pipeline is not None:
        step.executor.meter = meter = PipelineMeter(step.lowered)
        engine.train_step(x, y)
        return meter.peaks()
    return measure_step(step.lowered, engine._feeds(x, y, "train"), dict(engine.state.tensors))


@pytest.mark.parametrize("config,ranks", [(None, 1), ("dp", 2), ("tp", 2), ("dp_tp", 4),
                                          ("pp_1f1b", 2)])
def test_estimate_matches_runtime_within_10_percent(config, ranks):
    engine, model = _engine(config)
    x, y = _batch()
    estimates = engine.cost(x, y)
    assert sorted(estimates) == list(range(ranks))
    measured = _measured(engine, x, y)
    assert sorted(measured) == list(range(ranks))
    for rank, est in estimates.items():
        assert abs(est.peak - measured[rank]) <= 0.1 * measured[rank], (
            f"{config} rank {rank}: predicted {est.peak}, measured {measured[rank]}")
        # every rank holds its state, and the peak holds more than the state
        assert est.peak > est.params + est.optimizer_state + est.buffers


def _exact_state_bytes(model: torch.nn.Module) -> tuple[int, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # AdamW: exp_avg and exp_avg_sq like the parameter, and a float32 scalar step each
    count = len(list(model.parameters()))
    return params, 2 * params + 4 * count


def test_parameter_gradient_and_optimizer_bytes_are_exact():
    engine, model = _engine(None)
    params, optim = _exact_state_bytes(model)
    est = engine.cost(*_batch())[0]
    assert (est.params, est.grads, est.optimizer_state) == (params, params, optim)
    # tensor parallelism splits what it shards; the ranks hold the same amounts
    engine, model = _engine("tp")
    tp = engine.cost(*_batch())
    assert tp[0].params == tp[1].params < params
    assert tp[0].grads == tp[0].params
    assert tp[0].optimizer_state == 2 * tp[0].params + 4 * count_params(model)
    # data parallelism replicates them
    engine, model = _engine("dp")
    dp = engine.cost(*_batch())
    assert all((e.params, e.grads, e.optimizer_state) == (params, params, optim)
               for e in dp.values())
    # a pipeline's ranks split the model's parameters between them (the tied embedding
    # is held by both of its stages)
    engine, model = _engine("pp_1f1b")
    pp = engine.cost(*_batch())
    assert params < pp[0].params + pp[1].params <= params + model.wte.weight.numel() * 4


def count_params(model: torch.nn.Module) -> int:
    return len(list(model.parameters()))


def test_memory_limit_refuses_before_any_step_naming_the_holders():
    engine, model = _engine("dp", extra="memory_limit_gb: 0.0001\n")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batch()
    with pytest.raises(MemoryLimitError) as err:
        engine.train_step(x, y)
    text = str(err.value)
    assert "memory_limit_gb=0.0001" in text and "exceeds" in text
    # the biggest holders at the peak: the MLPs' activations, then the largest weights
    assert "aten.gelu.default (blocks.0) shape [4, 16, 128]: 32.00KiB" in text
    assert "blocks.0.fc1.weight (blocks.0.fc1) shape [128, 32]: 16.00KiB" in text
    assert engine.global_step == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    # a limit the plan fits under plans and trains
    engine, _ = _engine("dp", extra="memory_limit_gb: 1\n")
    engine.train_step(x, y)


def test_strategy_field_is_validated():
    with pytest.raises(ValueError):
        Strategy.from_yaml_str("memory_limit_gb: -1\n")
    assert Strategy.from_yaml_str("memory_limit_gb: 2.5\n").memory_limit_gb == 2.5
    assert Strategy().memory_limit_gb is None


def test_table_and_dump(tmp_path):
    engine, _ = _engine("dp", debug=f"simulate: true, dump_dir: {tmp_path}")
    est = engine.cost(*_batch())
    table = format_estimates(est)
    # the dp replicas hold the same: one row names both
    assert "peak" in table and len(table.splitlines()) == 3
    assert table.splitlines()[2].split()[0] == "0-1"
    est[1].peak += 1 << 20
    assert len(format_estimates(est).splitlines()) == 4     # rows apart when they differ
    dumped = sorted((tmp_path / "rank1").glob("*_memory.txt"))
    assert dumped and "params" in dumped[0].read_text()


def test_plan_cli_prints_the_memory_table(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        from autopar import Engine, Strategy
        from autopar.models import GPT, GPTConfig
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = lambda o, y: F.cross_entropy(o.reshape(-1, o.shape[-1]), y.reshape(-1))
        engine = Engine(model, loss, opt, strategy=Strategy.from_yaml({str(CONFIGS / 'dp.yaml')!r}))
        x = torch.randint(0, 32, (4, 8))
        engine.fit([(a, b) for a, b in zip(x, x)], batch_size=4, verbose=0)
    """))
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", str(script),
                           "--dump-dir", str(tmp_path / "dumps")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "memory per rank (predicted):" in done.stdout
    table = done.stdout.split("memory per rank (predicted):")[1].splitlines()
    assert table[2].split()[0] == "0-1"        # the dp replicas hold the same: one row


def test_allocation_meter_counts_storages_from_allocation_to_last_tensor():
    from autopar.runtime.memory_meter import AllocationMeter
    held = torch.zeros(256)                              # 1 KiB that existed before
    with AllocationMeter([held]) as meter:
        a = torch.ones(1000)                             # 4000 B
        view = a[:10]                                    # the same storage: counted once
        del a
        b = view * 2                                     # 40 B while a's storage lives
        held.add_(1)                                     # in place on a held storage
        del view
        c = torch.ones(500)                              # a's 4000 B are free again
    assert meter.peak_live == 4040
    assert meter.held_bytes == 1024 and meter.peak == 1024 + 4040
    assert meter.live == 40 + 2000                       # b and c still live
    del b, c
    assert meter.live == 0


def _dp2(extra: str, n_embd: int = 64) -> tuple[Engine, tuple[torch.Tensor, torch.Tensor]]:
    """dp2 on a GPT whose weights (and so the optimizer's update) dominate the peak."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=n_embd, n_head=4, vocab_size=256, block_size=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    text = ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n" + extra
            + "debug: {simulate: true}\n")
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 256, (4, 8), generator=g), torch.randint(0, 256, (4, 8), generator=g))
    return Engine(model, _loss, opt, strategy=Strategy.from_yaml_str(text)), batch


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_update_results_share_the_state_they_write(stage):
    """ZeRO-1/2's update reads a sliced parameter piece (not state) of the same shape as its
    optimizer state: each result is the input it writes (the new exp_avg_sq is the state,
    not a copy of the piece held to the end of the step)."""
    engine, (x, y) = _dp2(f"sharding: {{stage: {stage}, axis: dp}}\n")
    estimates = engine.cost(x, y)
    measured = _measured(engine, x, y)
    for rank, est in estimates.items():
        assert abs(est.peak - measured[rank]) <= 0.1 * measured[rank], (
            f"ZeRO-{stage} rank {rank}: predicted {est.peak}, measured {measured[rank]}")


def test_bucketed_all_reduce_counts_its_flat_buffer_until_the_wait():
    """A gradient bucket's start copies its gradients into one buffer (not a tensor in the
    IR: a handle) that lives to its wait, while the gradients may still live: the estimate
    and the runtime's meter both count it, and agree."""
    engine, (x, y) = _dp2("")
    program = engine.planner.plan("train", x, y).lowered.processes[0].program
    buckets = [op for op in program.ops if op.target == "comm.all_reduce_start"]
    assert buckets
    largest = max(sum(v.type.numel * v.type.dtype.itemsize for v in op.inputs)
                  for op in buckets)
    estimates = engine.cost(x, y)
    measured = _measured(engine, x, y)
    for rank, est in estimates.items():
        # at the start, the bucket's gradients (its inputs) and their flat copy both live
        assert est.peak - est.params - est.optimizer_state - est.buffers >= 2 * largest
        assert est.comm_buffers >= largest
        assert abs(est.peak - measured[rank]) <= 0.1 * measured[rank], (
            f"dp2 rank {rank}: predicted {est.peak}, measured {measured[rank]}")


def test_pipeline_step_drops_a_jobs_outputs_once_its_store_has_them():
    """``PipelineExecutor._step``: what a job returns and the store does not keep (a
    micro-batch's gradient term, added into the sum) is freed before the next job runs, not
    held through it. The jobs are stand-ins returning transposed (so never kept) terms."""
    engine, _ = _engine("pp_1f1b")
    x, y = _batch()
    lowered = engine.planner.plan("train", x, y).lowered
    process = lowered.processes[0]
    executor = PipelineExecutor(process, {}, lowered.mesh, None)
    assert executor.micro_batches > 1
    held: list[weakref.ref] = []
    checked = []

    def stand_in(job):
        def run(feeds, state):
            checked.append([str(job) for r in held if r() is not None])
            out = tuple(torch.zeros(2, 3).t() for _ in executor.slots[job])
            held[:] = [weakref.ref(t) for s, t in zip(executor.slots[job], out)
                       if s.kind == "accumulate"]
            return out
        return run
    executor.fns = {job: stand_in(job) for job in executor.fns}
    executor._step(_feeds_of(engine, x, y), None)
    assert any(s.kind == "accumulate" for slots in executor.slots.values() for s in slots)
    assert len(checked) == len(process.order) and not any(checked), checked


def _feeds_of(engine: Engine, x, y) -> dict:
    return engine._feeds(x, y, "train")
