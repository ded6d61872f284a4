"""A 70B-shaped Llama (80 layers, hidden 8192, grouped-query attention: 64 heads, 8 of keys
and values) built on the meta device: no memory, so a laptop can plan it for a cluster.

    python -m autopar plan examples/llama_70b.py --strategy examples/llama_70b_1024.yaml

plans the 1,024-rank job of ``llama_70b_1024.yaml`` (pp8 x dp16 x tp8, ZeRO-1, bf16 O2,
1F1B with 16 micro-batches of one 4,096-token row) in one process and prints each rank's
memory and predicted step time; ``--ranks 0,517`` also dumps those ranks' programs. Under
torchrun on the real cluster the same script trains (``--steps``), each rank drawing only
its own pieces of the weights. Needs ``transformers``.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import autopar as ap

LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False)


def causal_lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256, help="global batch, in rows")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    config = LlamaConfig(**{**LLAMA_70B, "num_hidden_layers": args.layers},
                         attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    strategy = ap.Strategy.from_yaml(args.strategy) if args.strategy else ap.Strategy()
    engine = ap.Engine(model, causal_lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-4),
                       strategy=strategy)
    ids = torch.randint(0, config.vocab_size, (args.batch * args.steps, args.seq + 1))
    engine.fit([(row[:-1], row[1:]) for row in ids], batch_size=args.batch, verbose=1)


if __name__ == "__main__":
    main()
