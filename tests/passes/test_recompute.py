"""Activation recompute (``recompute: {enable, modules, policy}``, passes/recompute.py): a
plan with recompute trains bit for bit like the same plan without it, and both like eager
torch (rtol 1e-5): the GPT with dropout 0.1 (masks redrawn equal) and Hugging Face Llama,
serial, dp2 x tp2 and pp2 1F1B on the simulator, full and selective; dp2 ZeRO-3 (the
regather sees the recomputed readers); dp2 on two real gloo processes. The activations a
plan holds drop (plan estimate and measured); a pipeline carries only the segments' inputs
from a micro-batch's forward to its backward; the dump and its report say what was
recomputed and kept."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import autopar as ap
from autopar.ir import format_program
from autopar.lower.memory_estimate import value_bytes
from autopar.models.gpt import lm_loss
from autopar.pipeline.phases import Phase
from autopar.runtime.memory_meter import meter_step

from ..multiproc import run_ranks
from ..parity import (
    ATOL,
    RTOL,
    assert_same_losses,
    eager_train,
    gpt_optimizer,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS, BATCH, SEQ, VOCAB, DROPOUT = 4, 4, 16, 64, 0.1
MESHES = {"serial": "", "dp_tp": (CONFIGS / "dp_tp.yaml").read_text(),
          "pp_1f1b": (CONFIGS / "pp_1f1b.yaml").read_text(),
          "dp_zero3": (CONFIGS / "dp_zero3.yaml").read_text()}


def _recompute(policy: str | None, modules: str = "blocks.*") -> str:
    if policy is None:
        return ""
    return f"\nrecompute: {{enable: true, modules: ['{modules}'], policy: {policy}}}\n"


def _strategy(config: str, policy: str | None, debug: str = "simulate: true") -> ap.Strategy:
    return ap.Strategy.from_yaml_str(MESHES[config] + _recompute(policy)
                                     + f"\ndebug: {{{debug}}}\n")


def _batch(n: int = BATCH):
    x, y = zip(*lm_data(n, SEQ, VOCAB))
    return torch.stack(x), torch.stack(y)


def _clones(program) -> tuple[int, int]:
    """(recomputed ops, recomputed random ops whose generator state is set back)."""
    clones = [op for op in program.ops if op.recomputes is not None]
    restores = [op for op in program.ops if op.target == "autopar.set_rng_state"]
    return len(clones), len(restores)


# ----------------------------------------------------------------------------------------
# the GPT: with == without, bit for bit; both == eager
# ----------------------------------------------------------------------------------------
@functools.cache
def _eager_gpt():
    model = parity_gpt("adamw", dropout=DROPOUT)
    opt, scheduler = gpt_optimizer("adamw", model)
    losses = eager_train(model, lm_loss, opt, lm_data(STEPS * BATCH, SEQ, VOCAB),
                         batch_size=BATCH, steps=STEPS, scheduler=scheduler)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def _gpt_run(config: str, policy: str | None):
    """Losses, final parameters and (recomputed ops, restored random ops) of the plan."""
    model = parity_gpt("adamw", dropout=DROPOUT)
    opt, scheduler = gpt_optimizer("adamw", model)
    engine = ap.Engine(model, lm_loss, opt, strategy=_strategy(config, policy),
                       lr_scheduler=scheduler)
    history = engine.fit(lm_data(STEPS * BATCH, SEQ, VOCAB), batch_size=BATCH, verbose=0)
    clones = _clones(engine.prepare(*_batch()))
    return history["loss"], {k: v.detach().clone() for k, v in model.state_dict().items()}, clones


def _assert_bit_for_bit(got, base) -> None:
    assert got[0] == base[0], "losses differ from the plan without recompute"
    for name, value in base[1].items():
        assert torch.equal(got[1][name], value), f"{name} differs from the plan without recompute"


def _assert_like_eager(got, want) -> None:
    assert_same_losses(got[0], want[0])
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("config,policy", [
    ("serial", "full"), ("serial", "selective"), ("dp_tp", "full"), ("dp_tp", "selective"),
    ("pp_1f1b", "full"), ("pp_1f1b", "selective"), ("dp_zero3", "full")])
def test_gpt_with_recompute_trains_bit_for_bit_like_without(config, policy):
    """dp_zero3: the recomputed ops read gathered parameters in the backward, so ZeRO-3's
    regather gathers them again for the clones (the pass runs before it)."""
    got, base = _gpt_run(config, policy), _gpt_run(config, None)
    clones, restores = got[2]
    assert clones > 0 and base[2] == (0, 0)
    # three dropouts a block under full recompute; selective keeps attention's bmm
    # results but still recomputes every dropout mask (cheap ops)
    if config != "pp_1f1b":      # a pipeline restores eager's states per job instead
        assert restores == 3 * 2
    _assert_bit_for_bit(got, base)
    _assert_like_eager(got, _eager_gpt())


def test_selective_recomputes_less_than_full():
    full, selective = _gpt_run("dp_tp", "full")[2][0], _gpt_run("dp_tp", "selective")[2][0]
    assert 0 < selective < full


# ----------------------------------------------------------------------------------------
# Hugging Face Llama
# ----------------------------------------------------------------------------------------
LLAMA_MESHES = {
    "serial": {},
    "dp_tp": {"mesh": {"shape": [2, 2], "dim_names": ["dp", "tp"]},
              "data_parallel": {"axis": "dp"}},
    "pp_1f1b": {"mesh": {"shape": [2], "dim_names": ["pp"]},
                "pipeline": {"axis": "pp", "schedule": "1F1B", "micro_batches": 2}},
}


@functools.cache
def _llama_run(config: str, policy: str | None):
    pytest.importorskip("transformers")
    from ..end_to_end.test_parity_dist import BATCH as HF_BATCH
    from ..end_to_end.test_parity_dist import (
        HF_PLANS,
        HF_STEPS,
        HF_VOCAB,
        _hf,
        _hf_eager,
        _hf_optimizer,
    )
    model = _hf("llama_sdpa")
    ids = torch.randint(0, HF_VOCAB, (HF_STEPS * HF_BATCH, SEQ),
                        generator=torch.Generator().manual_seed(0))
    sections = dict(LLAMA_MESHES[config])
    if config == "dp_tp":
        sections["tensor_parallel"] = {"axis": "tp", "plan": HF_PLANS["llama"]}
    if policy is not None:
        sections["recompute"] = {"enable": True, "modules": ["model.layers.*"],
                                 "policy": policy}
    if config == "serial" and policy is None:        # the eager reference, once
        reference = _hf("llama_sdpa")
        eager = _hf_eager(reference, "llama_sdpa", ids)
    else:
        eager = None
    opt, scheduler = _hf_optimizer("llama_sdpa", model)
    engine = ap.Engine(model, None, opt, strategy=ap.Strategy(**sections,
                                                               debug={"simulate": True}),
                       lr_scheduler=scheduler)
    history = engine.fit([({"input_ids": x}, x.clone()) for x in ids], batch_size=HF_BATCH,
                         verbose=0)
    clones = _clones(engine.prepare({"input_ids": ids[:HF_BATCH]}, ids[:HF_BATCH]))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want = (eager, {k: v.detach().clone() for k, v in reference.state_dict().items()}) \
        if eager is not None else None
    return history["loss"], state, clones, want


@pytest.mark.parametrize("config,policy", [("serial", "full"), ("serial", "selective"),
                                           ("dp_tp", "full"), ("dp_tp", "selective"),
                                           ("pp_1f1b", "full")])
def test_llama_with_recompute_trains_bit_for_bit_like_without(config, policy):
    """Llama's rotary tables are made once at the top and read by every layer: segment
    inputs, kept; RMSNorm, SwiGLU and grouped-query attention are recomputed."""
    got, base = _llama_run(config, policy), _llama_run(config, None)
    assert got[2][0] > 0
    _assert_bit_for_bit(got, base)
    _assert_like_eager(got, _llama_run("serial", None)[3])


# ----------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------
def _activations(config: str, policy: str | None, layers: int) -> tuple[int, int, int, int]:
    """Rank 0's planned peak activations (``engine.cost``), the measured peak bytes of live
    values other than the state (activations and the gradients in flight), and the planned
    and measured peaks."""
    model = parity_gpt("adamw", dropout=DROPOUT, layers=layers)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=_strategy(config, policy))
    x, y = _batch(8)
    planned = engine.cost(x, y)[0]
    engine.train_step(x, y)
    step = engine.planner.plan("train", x, y)
    meter = meter_step(step.lowered, engine._feeds(x, y, "train"), dict(engine.state.tensors))
    held, peak = meter.held()[0], meter.peaks()[0]
    state = held["params"] + held["optimizer_state"] + held["buffers"]
    return planned.activations, peak - state, planned.peak, peak


def test_full_recompute_cuts_peak_activations_of_a_4_layer_gpt():
    """Without recompute every block's attention scores, masks and MLP activations live
    until its backward; with it only each block's input does (plus one block's, again)."""
    off, on = (_activations("serial", policy, layers=4) for policy in (None, "full"))
    assert on[0] <= 0.45 * off[0], (on[0], off[0])     # planned activations
    assert on[1] <= 0.45 * off[1], (on[1], off[1])     # measured
    # the estimate's peak follows the measured one with recompute too
    assert abs(on[2] - on[3]) <= 0.1 * on[3], (on[2], on[3])


def _forward_carries(config: str, policy: str | None) -> dict[int, int]:
    """Bytes each pipeline rank keeps from a micro-batch's forward job for later jobs."""
    model = parity_gpt("adamw", dropout=DROPOUT, layers=4)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=_strategy(config, policy))
    jobs = engine.planner.plan("train", *_batch(8)).lowered.jobs
    return {rank.rank: sum(value_bytes(jobs.keys[key]) for job, keys in rank.kept.items()
                           if job.phase is Phase.F and job.micro_batch == 0 for key in keys)
            for rank in jobs.ranks}


def test_pipeline_forward_jobs_carry_only_segment_inputs():
    off, on = _forward_carries("pp_1f1b", None), _forward_carries("pp_1f1b", "full")
    for rank in off:
        assert on[rank] <= 0.5 * off[rank], (rank, on[rank], off[rank])


# ----------------------------------------------------------------------------------------
# dumps, errors
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,collectives", [
    ("full", "recomputed (full recompute re-runs the forward"),
    ("selective", "kept (its result is saved: no extra communication")])
def test_dump_and_report_say_what_is_recomputed_and_kept(tmp_path, policy, collectives):
    model = parity_gpt("adamw", dropout=DROPOUT)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=_strategy("dp_tp", policy, f"dump_dir: {tmp_path}"))
    engine.prepare(*_batch())
    [report] = (tmp_path / "rank0").glob("[0-9][0-9]_recompute.recompute.txt")
    text = report.read_text()
    assert f"recompute policy {policy}" in text
    for block in ("blocks.0", "blocks.1"):
        assert f"segment {block}:" in text
    assert "kept inputs: " in text and "(param)" in text
    assert "collective %" in text and collectives in text
    dump = report.with_name(report.name.replace(".recompute.txt", ".txt")).read_text()
    assert f"{{recompute='{policy}'}}" in dump and "again of %" in dump
    assert "autopar.get_rng_state()" in dump and "autopar.set_rng_state(" in dump


def test_a_pattern_that_matches_no_module_is_refused():
    model = parity_gpt("adamw")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(_recompute("full", "layers.*")))
    with pytest.raises(ValueError, match=r"'layers\.\*' matches no module.*blocks\.0"):
        engine.prepare(*_batch())


@pytest.mark.parametrize("config", ["dp_tp", "pp_1f1b", "dp_zero3"])
def test_without_modules_every_repeated_layer_is_recomputed(config, tmp_path):
    """``recompute: {enable: true}`` recomputes every repeated layer: the same program, op
    for op, as naming ``blocks.*``, under tp, a pipeline and ZeRO-3 (whose gathers name
    each layer's parameters); the report says where the modules came from."""
    def planned(recompute: str, dump: Path) -> str:
        model = parity_gpt("adamw", dropout=DROPOUT, layers=3)
        strategy = ap.Strategy.from_yaml_str(MESHES[config] + recompute
                                             + f"\ndebug: {{dump_dir: '{dump}'}}\n")
        engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           strategy=strategy)
        return format_program(engine.prepare(*_batch(8)))

    default = planned("\nrecompute: {enable: true}\n", tmp_path / "default")
    assert default == planned(_recompute("full"), tmp_path / "named")
    [report] = (tmp_path / "default" / "rank0").glob("[0-9][0-9]_recompute.recompute.txt")
    assert "modules: every repeated layer (no modules given): blocks.0, blocks.1, blocks.2" \
        in report.read_text()


def test_without_modules_a_model_without_repeated_layers_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    engine = ap.Engine(model, torch.nn.functional.mse_loss,
                       torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy(recompute={"enable": True}))
    with pytest.raises(ValueError, match="every repeated layer.*has none: name the modules"):
        engine.prepare(torch.randn(4, 8), torch.randn(4, 4))


def test_evaluate_and_predict_ignore_recompute():
    """No backward, nothing saved: the eval and predict programs have no clones."""
    model = parity_gpt("adamw", dropout=DROPOUT)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=_strategy("serial", "full"))
    x, y = _batch()
    assert _clones(engine.prepare(x, y, mode="eval")) == (0, 0)
    assert _clones(engine.prepare(x, mode="predict")) == (0, 0)


# ----------------------------------------------------------------------------------------
# real processes
# ----------------------------------------------------------------------------------------
def test_dp2_recompute_on_two_real_ranks_trains_like_eager():
    """configs/dp_recompute.yaml (dp2, full recompute of blocks.*, dropout 0.1) on two gloo
    processes: every step's loss and the final parameters equal eager's on both ranks."""
    steps, batch = 6, 4
    results = run_ranks("train_gpt", 2, "dp_recompute", "adamw", str(steps), str(batch),
                        str(DROPOUT), timeout=300)
    model = parity_gpt("adamw", dropout=DROPOUT)
    opt, scheduler = gpt_optimizer("adamw", model)
    losses = eager_train(model, lm_loss, opt, lm_data(steps * batch, 16, 64),
                         batch_size=batch, steps=steps, scheduler=scheduler)
    want = model.state_dict()
    for rank, got in enumerate(results):
        assert_same_losses(got["loss"], losses)
        for name, value in got["state"].items():
            torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
