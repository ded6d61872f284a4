"""`make demo`: train a character-level GPT on real text, the Python standard library's own
source files (present on every machine), through the public Engine API, on 4 CPU
processes: data parallel x Megatron tensor parallel (``configs/dp_tp.yaml``) over gloo.

``python -m autopar demo`` launches its own ranks through torchrun (``--nproc`` of them,
the strategy's mesh size); under an existing torchrun launch it runs as one of the ranks.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import autopar as ap
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

VOCAB = 128   # ASCII; other bytes become '?'


def stdlib_text(max_chars: int) -> str:
    root = Path(os.__file__).parent
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    return torch.tensor([ord(c) if ord(c) < VOCAB else ord("?") for c in text], dtype=torch.long)


def windows(tokens: torch.Tensor, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    count = (len(tokens) - 1) // block
    return [(tokens[i * block:(i + 1) * block], tokens[i * block + 1:(i + 1) * block + 1])
            for i in range(count)]


def generate(engine: ap.Engine, prompt: str, length: int, block: int) -> str:
    """Greedy decoding with a fixed window, so every call reuses one planned program."""
    ids = encode(prompt.rjust(block))
    for _ in range(length):
        logits = engine.predict([ids[-block:]], batch_size=1)[0]
        ids = torch.cat([ids, logits[0, -1].argmax().view(1)])
    return "".join(chr(i) for i in ids[block:].tolist())


DEFAULT_STRATEGY = Path(__file__).parent / "configs" / "dp_tp.yaml"


def launch(argv: list[str], nproc: int) -> int:
    """Run ``python -m autopar demo argv`` on ``nproc`` local ranks through torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "autopar", "demo", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(command, env=env).returncode


def main(steps: int = 300, batch_size: int = 16, dump_dir: str = "dumps/demo",
         strategy_path: str | Path = DEFAULT_STRATEGY) -> dict:
    torch.manual_seed(0)
    tokens = encode(stdlib_text(400_000))
    split = int(len(tokens) * 0.95)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=4, n_head=4, n_embd=128)
    train, valid = windows(tokens[:split], cfg.block_size), windows(tokens[split:], cfg.block_size)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=3e-4)
    strategy = ap.Strategy.from_yaml(strategy_path).model_copy(update={
        "grad_clip": ap.Strategy(grad_clip={"max_norm": 1.0}).grad_clip,
        "debug": ap.Strategy(debug={"dump_dir": dump_dir}).debug})
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    say = print if engine.is_logging_rank else (lambda *a, **k: None)
    say(f"autopar demo: char-level GPT ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters) on {len(tokens):,} characters of Python stdlib source; "
        f"{strategy.describe_mesh()}")
    start = time.perf_counter()
    history = engine.fit(train, batch_size=batch_size, epochs=1, steps_per_epoch=steps,
                         log_freq=25, shuffle=True, verbose=2)
    elapsed = time.perf_counter() - start
    scores = engine.evaluate(valid[:64], batch_size=batch_size)
    tokens_per_s = steps * batch_size * cfg.block_size / elapsed
    losses = history["loss"]
    window = max(1, min(25, len(losses) // 4))
    first, last = (sum(part) / len(part) for part in (losses[:window], losses[-window:]))
    say(f"mean loss of the first {window} steps {first:.3f} -> last {window} steps {last:.3f} "
        f"({steps / elapsed:.1f} steps/s, {tokens_per_s:,.0f} tokens/s over all ranks); "
        f"validation loss {scores['loss']:.3f}")
    sample = generate(engine, "def ", 60, cfg.block_size)
    say("sample:", repr(sample))
    say(f"pass dumps (one file per pass, per rank): {Path(dump_dir).resolve()}/rank<r>/ "
        "(NN_reshard.txt: the collectives and why; NN_partition.txt, or a pipeline's "
        "NN_jobs.txt: the rank's program)")
    engine.close()      # releases the process groups: nothing left pending at exit
    return {"history": history, "valid": scores}


if __name__ == "__main__":
    main()
