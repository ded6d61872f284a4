"""Unmodified third-party transformers (Hugging Face GPT-2 and Llama, tiny configs built
locally, no download) train through the Engine with eager torch's exact losses and
parameters. The models compute their own loss (loss=None) from dict inputs + labels."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar as ap

transformers = pytest.importorskip("transformers")

VOCAB = 97
STEPS, BATCH, SEQ = 3, 2, 16
TOL = dict(rtol=1e-5, atol=1e-6)
SEED = 0   # Strategy().seed


def gpt2(attn: str) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=32, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(cfg)


def llama(attn: str) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=VOCAB, max_position_embeddings=64,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def lm_data(n: int = STEPS * BATCH) -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [({"input_ids": x}, x.clone()) for x in ids]   # HF shifts the labels itself


def eager(model: torch.nn.Module, data: list) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        batch = data[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([inputs["input_ids"] for inputs, _ in batch])
        y = torch.stack([labels for _, labels in batch])
        torch.manual_seed(SEED + step)   # the engine's dropout stream (GPT-2 drops 0.1)
        out = model(input_ids=x, labels=y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("build,attn", [(gpt2, "eager"), (gpt2, "sdpa"),
                                        (llama, "eager"), (llama, "sdpa")],
                         ids=["gpt2-eager", "gpt2-sdpa", "llama-eager", "llama-sdpa"])
def test_hf_causal_lm_parity(build, attn):
    torch.manual_seed(0)
    model = build(attn).train()
    reference = copy.deepcopy(model)
    data = lm_data()

    engine = ap.Engine(model, None, torch.optim.AdamW(model.parameters(), lr=1e-3))
    history = engine.fit(data, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, verbose=0)

    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(eager(reference, data)),
                               **TOL)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"parameter {name}: {m}")
