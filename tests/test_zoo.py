"""Third-party architectures as they come (Hugging Face models built from tiny configs, no
download; the model computes its own loss from dict inputs and labels), trained under data
and pipeline parallelism on the simulator: the losses of every step equal eager torch's.

The zoo grows with issue 12 (tensor-parallel plans per architecture, timm, torchtitan,
mixture-of-experts); each entry is one builder.
"""
from __future__ import annotations

import pytest
import torch

import autopar as ap

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 64, 12, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, vocab_size=VOCAB)


def _gqa(config_class, model_class):
    """A Llama-like decoder with grouped-query attention (2 key/value heads for 4)."""
    return lambda: model_class(config_class(num_key_value_heads=2, **DECODER))


ZOO = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB)),
    "llama": _gqa(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": _gqa(transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": _gqa(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "phi": lambda: transformers.PhiForCausalLM(transformers.PhiConfig(**DECODER)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**DECODER)),
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, vocab_size=VOCAB)),
    "bert_mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**DECODER)),
}

STRATEGIES = {
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
           "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2, split: auto}\n",
}


def _data() -> tuple[torch.Tensor, list]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    return ids, [({"input_ids": x}, x.clone()) for x in ids]


def _eager(build, ids: torch.Tensor) -> list[float]:
    torch.manual_seed(0)
    model = build().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x = ids[step * BATCH:(step + 1) * BATCH]
        torch.manual_seed(step)           # the engine's random stream (dropout)
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_architecture_trains_like_eager(arch, strategy):
    build = ZOO[arch]
    ids, data = _data()
    torch.manual_seed(0)
    model = build().train()
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(STRATEGIES[strategy]
                                                          + "debug: {simulate: true}\n"))
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_eager(build, ids)), **TOL)
