"""Pipeline parity through the public API: ``Engine.fit`` on a pipelined strategy trains
the GPT exactly like single-device eager torch (every step's loss and the final parameters,
fp32, rtol 1e-5), for every schedule, on the in-process simulator (every process of the
pipeline in this one) and on real gloo processes.

The GPT keeps its tied embedding (``wte`` on the first stage, ``head`` on the last: both
hold and update the weight) and trains with dropout: a micro-batch draws its rows of what
eager draws for the whole batch. AdamW runs as in ``tests/end_to_end/test_parity_dist.py`` (no qkv
bias, warm-up), SGD with momentum keeps the bias.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

from ..multiproc import run_ranks
from ..parity import ATOL, RTOL, assert_same_losses, eager_train, gpt_optimizer, lm_data

STEPS, BATCH, SEQ, VOCAB = 20, 8, 16, 64
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gpt(layers: int, optim: str, dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB,
                          block_size=SEQ, dropout=dropout, sdpa=optim == "adamw"))
    if optim == "adamw":
        for block in model.blocks:
            block.attn.qkv.register_parameter("bias", None)
    return model


@functools.cache
def eager(layers: int, optim: str) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Losses, final parameters and final optimizer state of the single-device run."""
    model = gpt(layers, optim)
    optimizer, scheduler = gpt_optimizer(optim, model)
    losses = eager_train(model, lm_loss, optimizer, lm_data(STEPS * BATCH, SEQ, VOCAB),
                         batch_size=BATCH, steps=STEPS, scheduler=scheduler)
    return (losses, {k: v.detach().clone() for k, v in model.state_dict().items()},
            optimizer.state_dict()["state"])


def strategy(pp: int, schedule: str, micro_batches: int = 4, chunks: int = 1,
             dp: int = 1, tp: int = 1, simulate: bool = True, extra: str = "",
             vocab: bool = False) -> ap.Strategy:
    dims = [("pp", pp)] + [(n, k) for n, k in (("dp", dp), ("tp", tp)) if k > 1]
    text = (f"mesh: {{shape: {[k for _, k in dims]}, dim_names: {[n for n, _ in dims]}}}\n"
            f"pipeline: {{axis: pp, schedule: {schedule}, micro_batches: {micro_batches}, "
            f"vpp_chunks: {chunks}}}\n"
            f"debug: {{simulate: {str(simulate).lower()}}}\n")
    if dp > 1:
        text += "data_parallel: {axis: dp}\n"
    if tp > 1:
        plan = TP_PLAN[:-1] + ', "wte": vocab}' if vocab else TP_PLAN
        text += f"tensor_parallel: {{axis: tp, plan: {plan}}}\n"
    return ap.Strategy.from_yaml_str(text.replace("'", "") + extra)


def train(layers: int, optim: str, s: ap.Strategy) -> tuple[list[float], GPT, ap.Engine]:
    model = gpt(layers, optim)
    optimizer, scheduler = gpt_optimizer(optim, model)
    engine = ap.Engine(model, lm_loss, optimizer, strategy=s, lr_scheduler=scheduler)
    history = engine.fit(lm_data(STEPS * BATCH, SEQ, VOCAB), batch_size=BATCH, verbose=0)
    return history["loss"], model, engine


def assert_like_eager(losses: list[float], state: dict[str, torch.Tensor], layers: int,
                      optim: str) -> None:
    want_losses, want_state, _ = eager(layers, optim)
    assert_same_losses(losses, want_losses)
    for name, value in want_state.items():
        if name in state:
            torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("schedule,pp,chunks,layers", [
    ("FThenB", 2, 1, 2), ("1F1B", 2, 1, 2), ("VPP", 2, 2, 4), ("ZBH1", 2, 1, 2),
    ("FThenB", 4, 1, 4), ("1F1B", 4, 1, 4), ("VPP", 4, 2, 8), ("ZBH1", 4, 1, 4),
])
def test_every_schedule_trains_like_eager_on_the_simulator(schedule, pp, chunks, layers):
    losses, model, _ = train(layers, "sgd", strategy(pp, schedule, chunks=chunks))
    assert_like_eager(losses, model.state_dict(), layers, "sgd")


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_adamw_trains_like_eager_on_the_simulator(schedule):
    losses, model, _ = train(2, "adamw", strategy(2, schedule))
    assert_like_eager(losses, model.state_dict(), 2, "adamw")


def test_pp2_dp2_tp2_trains_like_eager_on_the_simulator():
    """3-D, with a vocab-parallel embedding tied to the head on the last stage."""
    losses, model, engine = train(2, "sgd", strategy(2, "1F1B", dp=2, tp=2, vocab=True))
    assert_like_eager(losses, model.state_dict(), 2, "sgd")
    peaks = engine.peak_activation_bytes()
    assert len(peaks) == 2 and peaks[0] > peaks[1] > 0   # rank 0 holds 2 micro-batches


def test_sequence_parallel_inside_a_pipeline_trains_like_eager():
    """pp2 x tp2 with Megatron-SP: the stages hand each other sequence-sharded activations."""
    text = strategy(2, "1F1B", tp=2, vocab=True).to_yaml().replace(
        "sequence_parallel: false", "sequence_parallel: true")
    losses, model, _ = train(2, "sgd", ap.Strategy.from_yaml_str(text))
    assert_like_eager(losses, model.state_dict(), 2, "sgd")


def test_one_stage_accumulates_gradients_like_the_full_batch():
    """A pipeline of one stage is gradient accumulation: 4 micro-batches, one process."""
    s = ap.Strategy.from_yaml_str("mesh: {shape: [1], dim_names: [pp]}\n"
                                  "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 4}")
    losses, model, _ = train(2, "sgd", s)
    assert_like_eager(losses, model.state_dict(), 2, "sgd")


# -- real processes ---------------------------------------------------------------------------

@pytest.mark.parametrize("config,world,optim,layers,stages", [
    ("pp_1f1b", 2, "adamw", 2, 2), ("pp_zbh1", 2, "sgd", 2, 2), ("pp_fthenb", 2, "sgd", 2, 2),
    ("pp_vpp", 2, "adamw", 4, 4), ("dp_pp", 4, "sgd", 2, 2),
])
@pytest.mark.slow
def test_real_gloo_ranks_train_like_eager(config, world, optim, layers, stages, tmp_path):
    results = run_ranks("train_gpt", world, config, optim, str(STEPS), str(BATCH), "0.1",
                        str(tmp_path), str(layers))
    model = gpt(layers, optim)
    model.load_state_dict(eager(layers, optim)[1])
    x, y = (torch.stack(t) for t in zip(*lm_data(BATCH, SEQ, VOCAB)))
    with torch.no_grad():
        want = model.eval()(x)
    for result in results:       # every rank reports the global loss and the full model
        assert_like_eager(result["loss"], result["state"], layers, optim)
        assert result["valid"]["loss"] == pytest.approx(lm_loss(want, y).item(), rel=RTOL)
        torch.testing.assert_close(result["predict"], want, rtol=RTOL, atol=ATOL)
        # the optimizer's state_dict is torch's full state, gathered across the stages
        for index, state in eager(layers, optim)[2].items():
            for key, value in state.items():
                torch.testing.assert_close(result["optim"][index][key], value, rtol=RTOL,
                                           atol=ATOL, msg=lambda m: f"state {index} {key}: {m}")
    # the trace: every process's jobs of every step, on one timeline
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == set(range(world))
    # 4 micro-batches through every stage of every pipeline (pp is 2: dp_pp has two)
    assert sum(e["name"].startswith("F") for e in spans) == STEPS * 4 * stages * (world // 2)
    assert list((tmp_path / "rank1").glob("[0-9][0-9]_jobs.txt"))     # the lowered jobs


def test_simulated_trace_is_the_schedule_timeline(tmp_path):
    s = strategy(2, "1F1B")
    s = s.model_copy(update={"debug": ap.Strategy(
        debug={"simulate": True, "trace": True, "dump_dir": str(tmp_path)}).debug})
    train(2, "sgd", s)
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert names == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


@pytest.mark.parametrize("name", ["gpt2", "llama_sdpa"])
def test_hugging_face_model_trains_like_eager_under_pp2_tp2(name):
    """Unmodified third-party models: GPT-2 (fused c_attn, Conv1D, tied head) and Llama
    (rotary embedding computed at the top and read by every layer, GQA), 2 stages x tp2."""
    pytest.importorskip("transformers")
    from ..end_to_end.test_parity_dist import hf_trains_like_eager
    hf_trains_like_eager(name, mesh={"shape": [2, 2], "dim_names": ["pp", "tp"]},
                         pipeline={"axis": "pp", "schedule": "1F1B", "micro_batches": 2})
