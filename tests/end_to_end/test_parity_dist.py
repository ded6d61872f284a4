"""Distributed parity through the public API: ``Engine.fit`` with ``debug: {simulate: true}``
runs the planned program on every rank in this process, and every step's loss and the final
parameters must equal single-device eager torch (fp32, rtol 1e-5, atol of tests/parity.py).

Two facts about AdamW shape the settings below (measured, see the notes in the test report):

* Every plan's gradients are as close to an fp64 reference as eager's fp32 gradients, but
  summed in another order, so they differ from eager's in the last bits. Adam's first step
  moves a parameter by ``lr * g / (|g| + eps)``: for an element whose gradient is within a
  few ``eps`` of zero that is ``lr / eps = 1e5`` times its rounding difference, ~1e-6, the
  whole atol. The usual GPT learning-rate warmup makes that first step small, so the AdamW
  runs warm up (linearly over 10 steps) as GPT training does.
* The key part of a fused qkv bias has an identically zero gradient (softmax ignores a
  shift of a row of scores); fp32 leaves +-1e-11 of noise there, whose sign Adam follows, so
  that slice is rounding noise of whichever summation order ran. The AdamW GPT has no qkv
  bias (as nanoGPT's ``bias=False`` and Llama); the SGD runs keep it (SGD moves it by
  ``lr * 1e-11``). Hugging Face GPT-2 keeps its bias and trains with SGD + momentum; Llama
  has no biases and trains with AdamW.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch

import autopar as ap
from autopar.models import GPT
from autopar.models.gpt import lm_loss

from .. import models_zoo as zoo
from ..parity import ATOL, RTOL, assert_same_losses, eager_train, gpt_optimizer, lm_data, parity_gpt

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS, BATCH, SEQ, VOCAB = 20, 4, 16, 64
WARMUP = 10


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine: one intra-op thread is several times faster.
    Eager and simulated runs share it, so it changes no comparison."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _simulated(config: str) -> ap.Strategy:
    strategy = ap.Strategy.from_yaml(CONFIGS / config)
    return strategy.model_copy(update={"debug": ap.Strategy(debug={"simulate": True}).debug})


def _optimizer(name: str, model: torch.nn.Module):
    return gpt_optimizer(name, model, WARMUP)


def _gpt(optim: str) -> GPT:
    return parity_gpt(optim, vocab=VOCAB, seq=SEQ, dropout=0.1)


@functools.cache
def _eager_gpt(optim: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device run every strategy is compared with (one per optimizer)."""
    model = _gpt(optim)
    opt, scheduler = _optimizer(optim, model)
    losses = eager_train(model, lm_loss, opt, lm_data(STEPS * BATCH, SEQ, VOCAB),
                         batch_size=BATCH, steps=STEPS, scheduler=scheduler)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_params(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("config", ["dp.yaml", "tp.yaml", "dp_tp.yaml"])
def test_gpt_trains_like_eager_for_20_steps(config, optim):
    """GPT (tied vocab-parallel embedding, LayerNorm, attention, dropout 0.1 everywhere)
    trained 20 steps from a strategy YAML on the simulator: dp all-reduces gradients, tp
    runs Megatron pairs, dp x tp both; AdamW with warmup, or SGD with momentum."""
    want_losses, want_params = _eager_gpt(optim)
    model = _gpt(optim)
    opt, scheduler = _optimizer(optim, model)
    engine = ap.Engine(model, lm_loss, opt, strategy=_simulated(config), lr_scheduler=scheduler)
    history = engine.fit(lm_data(STEPS * BATCH, SEQ, VOCAB), batch_size=BATCH, verbose=0)
    assert_same_losses(history["loss"], want_losses)
    _assert_same_params(model, want_params)


# ----------------------------------------------------------------------------------------
# unmodified Hugging Face models under dp2 x tp2
# ----------------------------------------------------------------------------------------
HF_STEPS, HF_VOCAB = 3, 97
HF_PLANS = {
    "gpt2": {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
             "transformer.wte": "vocab"},
    "llama": {"model.layers.*.self_attn.q_proj": "colwise",
              "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise",
              "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise", "model.embed_tokens": "vocab",
              "lm_head": "colwise"},
}


def _hf(name: str) -> torch.nn.Module:
    """GPT-2 (dropout 0.1, SDPA) trains with SGD + momentum (its fused qkv bias, see the
    module docstring), Llama (eager or SDPA attention) with AdamW."""
    torch.manual_seed(0)
    if name == "gpt2":
        return zoo.hf_gpt2("sdpa", HF_VOCAB).train()
    return zoo.hf_llama(name.removeprefix("llama_"), HF_VOCAB).train()


def _hf_optimizer(name: str, model: torch.nn.Module):
    return _optimizer("sgd" if name == "gpt2" else "adamw", model)


def _hf_eager(model: torch.nn.Module, name: str, ids: torch.Tensor) -> list[float]:
    opt, scheduler = _hf_optimizer(name, model)
    losses = []
    for step, x in enumerate(ids.split(BATCH)):
        torch.manual_seed(step)      # the engine's random stream: strategy seed 0 + step
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(out.loss.item())
    return losses


def hf_trains_like_eager(name: str, **strategy) -> None:
    """``name`` (``_hf``) trained through ``Engine.fit`` on a simulated strategy (sections as
    keyword arguments; its tensor_parallel plan is ``HF_PLANS``) equals eager, step by step."""
    model = _hf(name)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, HF_VOCAB, (HF_STEPS * BATCH, SEQ),
                        generator=torch.Generator().manual_seed(0))
    want = _hf_eager(reference, name, ids)
    strategy = ap.Strategy(**strategy, debug={"simulate": True},
                           tensor_parallel={"axis": "tp", "plan": HF_PLANS[name[:5]]})
    opt, scheduler = _hf_optimizer(name, model)
    engine = ap.Engine(model, None, opt, strategy=strategy, lr_scheduler=scheduler)
    history = engine.fit([({"input_ids": x}, x.clone()) for x in ids], batch_size=BATCH,
                         verbose=0)
    assert_same_losses(history["loss"], want)
    _assert_same_params(model, {k: v.detach() for k, v in reference.state_dict().items()})


@pytest.mark.parametrize("name", ["gpt2", "llama_eager", "llama_sdpa"])
def test_hugging_face_model_trains_like_eager_under_dp2_tp2(name):
    pytest.importorskip("transformers")
    hf_trains_like_eager(name, mesh={"shape": [2, 2], "dim_names": ["dp", "tp"]},
                         data_parallel={"axis": "dp"})
