"""A plain autopar training script: a small GPT, AdamW, a strategy YAML.

    python examples/train_gpt.py --strategy configs/serial.yaml      # train (serial)
    torchrun --nproc-per-node 4 examples/train_gpt.py --strategy configs/dp_tp.yaml
    python -m autopar plan examples/train_gpt.py --strategy configs/dp_tp.yaml \
        --explain "grad[blocks.0.fc1.weight]" -- --layers 4          # plan any mesh offline
"""
from __future__ import annotations

import argparse

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=args.layers, n_head=4, n_embd=64)
    model = GPT(cfg)
    strategy = ap.Strategy.from_yaml(args.strategy) if args.strategy else ap.Strategy()
    ids = torch.randint(0, cfg.vocab_size, (64, cfg.block_size + 1))
    data = [(row[:-1], row[1:]) for row in ids]
    with ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                   strategy=strategy) as engine:      # leaving it releases the process groups
        history = engine.fit(data, batch_size=8, steps_per_epoch=args.steps, verbose=1)
        if engine.is_logging_rank:
            print(f"final loss {history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
