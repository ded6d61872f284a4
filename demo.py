"""`make demo`: train a character-level GPT on real text, the Python standard library's own
source files (present on every machine), through the public Engine API, on 4 CPU
processes: data parallel x Megatron tensor parallel (``configs/dp_tp.yaml``) over gloo.
The files are split into documents of variable length at their top-level definitions and
packed several to a row (``PackedDataset``): attention stays inside each document.

``python -m autopar demo`` launches its own ranks through torchrun (``--nproc`` of them,
the strategy's mesh size); under an existing torchrun launch it runs as one of the ranks.
"""
from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import autopar as ap
from autopar.checkpoint import latest_checkpoint
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


def stdlib_documents(max_chars: int) -> list[str]:
    """The standard library's source files, each cut before its top-level definitions
    (``def``, ``class``): documents of a few to thousands of characters."""
    root = Path(os.__file__).parent
    documents, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")[:max_chars - size]
        documents += [d for d in re.split(r"\n(?=(?:async def|def|class) )", text) if d]
        size += len(text)
        if size >= max_chars:
            break
    return documents


def encode(text: str) -> torch.Tensor:
    return torch.tensor([ord(c) if ord(c) < VOCAB else ord("?") for c in text], dtype=torch.long)


def windows(tokens: torch.Tensor, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    count = (len(tokens) - 1) // block
    return [(tokens[i * block:(i + 1) * block], tokens[i * block + 1:(i + 1) * block + 1])
            for i in range(count)]


def draw(logits: torch.Tensor, temperature: float, top_k: int | None,
         generator: torch.Generator) -> int:
    """One token from the last position's logits: the ``top_k`` most likely, softmax at
    ``temperature``. Greedy decoding of a small char model loops on its most frequent
    characters (spaces, ``te te te``); sampling keeps the text it learned."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def generate(engine: ap.Engine, prompt: str, length: int, block: int, temperature: float = 0.8,
             top_k: int | None = 20, seed: int = 0) -> str:
    """Seeded sampling with a fixed window, so every call reuses one planned program. Every
    rank draws the same tokens: the same seed and the same full logits from ``predict``."""
    generator = torch.Generator().manual_seed(seed)
    ids = encode(prompt.rjust(block, "\n")).tolist()   # a fresh line, not an indent
    for _ in range(length):
        logits = engine.predict([torch.tensor(ids[-block:])], batch_size=1)[0]
        ids.append(draw(logits[0, -1], temperature, top_k, generator))
    return prompt + "".join(chr(i) for i in ids[block:])


def loss_rows(train_losses: list[float], valid_losses: list[float],
              valid_steps: list[int]) -> list[tuple]:
    """(step, train loss or None, validation loss or None), one row per step that has
    either; ``valid_losses[i]`` was measured after step ``valid_steps[i]`` (0: before
    training); train step 1 is the first batch."""
    train = dict(enumerate(train_losses, start=1))
    valid = dict(zip(valid_steps, valid_losses, strict=True))
    return [(step, train.get(step), valid.get(step)) for step in sorted(train.keys() | valid)]


def write_loss_curve(rows: list[tuple], out_dir: str | Path) -> tuple[Path, Path]:
    """``loss.csv`` and ``loss.png`` (train and validation curves) in ``out_dir``."""
    from matplotlib.figure import Figure  # the demo extra; Figure draws with Agg, no pyplot
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / "loss.csv", out / "loss.png"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "train_loss", "valid_loss"])
        writer.writerows([s, "" if t is None else f"{t:.6f}", "" if v is None else f"{v:.6f}"]
                         for s, t, v in rows)
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    for column, label, style in ((1, "train (per batch)", "-"), (2, "validation", "o-")):
        points = [(row[0], row[column]) for row in rows if row[column] is not None]
        ax.plot(*zip(*points), style, label=label, linewidth=1)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title="autopar demo: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(png_path)
    return csv_path, png_path


DEFAULT_STRATEGY = Path(__file__).parent / "configs" / "dp_tp.yaml"


def launch(argv: list[str], nproc: int) -> int:
    """Run ``python -m autopar demo argv`` on ``nproc`` local ranks through torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "autopar", "demo", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(command, env=env).returncode


def warmup_linear(warmup: int, total: int, floor: float = 0.1):
    """LR factor: linear warmup over ``warmup`` steps, then linear decay to ``floor``."""
    return lambda step: min(1.0, (step + 1) / warmup) * max(floor, 1.0 - step / total)


def main(steps: int = 400, batch_size: int = 32, dump_dir: str = "dumps/demo",
         strategy_path: str | Path = DEFAULT_STRATEGY, valid_every: int = 50,
         resume: bool = False) -> dict:
    """Train, validating every ``valid_every`` steps and checkpointing at each validation
    into ``<dump_dir>/checkpoints`` (``resume``: continue from the newest there, e.g. with
    a larger ``steps``)."""
    torch.manual_seed(0)
    documents = [encode(d) for d in stdlib_documents(400_000)]
    split = int(len(documents) * 0.95)
    # ~340k parameters: on 2 CPU cores a smaller model sees more characters in the same
    # minute, which is what lowers the loss here (4 layers x 128 stalled near 2.2)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=3, n_head=4, n_embd=96)
    # packed rows, each ({"idx", "position_ids"}, labels): a list, so fit shuffles it
    train = list(ap.PackedDataset(documents[:split], cfg.block_size))
    valid = list(ap.PackedDataset(documents[split:], cfg.block_size))[:4 * batch_size]
    tokens = sum(len(d) for d in documents)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear(30, steps))
    strategy = ap.Strategy.from_yaml(strategy_path).model_copy(update={
        "grad_clip": ap.Strategy(grad_clip={"max_norm": 1.0}).grad_clip,
        "debug": ap.Strategy(debug={"dump_dir": dump_dir}).debug})
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    say = print if engine.is_logging_rank else (lambda *a, **k: None)
    say(f"autopar demo: char-level GPT ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters) on {tokens:,} characters of Python stdlib source in "
        f"{len(documents):,} documents packed into rows of {cfg.block_size}; "
        f"{strategy.describe_mesh()}")
    # validation before training and after every epoch of ``valid_every`` steps
    # (steps round up to whole intervals, so a resumed run with more steps keeps the epochs)
    per_epoch = min(valid_every, steps)
    epochs = math.ceil(steps / per_epoch)
    save_dir = Path(dump_dir) / "checkpoints"
    if resume and latest_checkpoint(save_dir) is not None:
        engine.load(latest_checkpoint(save_dir))
        say(f"resumed from {latest_checkpoint(save_dir)} at step {engine.global_step}")
    first_epoch = engine.epoch
    before = engine.evaluate(valid, batch_size=batch_size)["loss"]
    start = time.perf_counter()
    history = engine.fit(train, batch_size=batch_size, epochs=epochs, steps_per_epoch=per_epoch,
                         log_freq=25, shuffle=True, verbose=2, valid_data=valid,
                         save_dir=save_dir, save_freq="epoch", keep_last=2)
    if not history.get("loss"):
        say(f"nothing to train: the checkpoint is at step {engine.global_step} of {steps}; "
            "pass a larger --steps to continue")
        engine.close()
        return {"history": history}
    elapsed = time.perf_counter() - start
    trained, valid_losses = len(history["loss"]), [before, *history["val_loss"]]
    tokens_per_s = trained * batch_size * cfg.block_size / elapsed
    losses = history["loss"]
    window = max(1, min(25, len(losses) // 4))
    first, last = (sum(part) / len(part) for part in (losses[:window], losses[-window:]))
    say(f"mean loss of the first {window} steps {first:.3f} -> last {window} steps {last:.3f} "
        f"({trained / elapsed:.1f} steps/s incl. validation, {tokens_per_s:,.0f} tokens/s over "
        f"all ranks); validation loss {valid_losses[0]:.3f} -> "
        f"{valid_losses[-1]:.3f}")
    sample = generate(engine, "    def __init__(self", 300, cfg.block_size)
    say("sample (temperature 0.8, top-k 20, seed 0):\n" + sample)
    if engine.is_logging_rank:
        rows = loss_rows(history["loss"], valid_losses,
                         [epoch * per_epoch for epoch in range(epochs + 1 - first_epoch)])
        csv_path, png_path = write_loss_curve(rows, dump_dir)
        say(f"loss curve: {csv_path.resolve()} and {png_path.resolve()}")
    say(f"checkpoint: {latest_checkpoint(save_dir).resolve()} (keeps the last 2); "
        f"continue training with: python -m autopar demo --steps {steps + 200} --resume"
        + ("" if Path(strategy_path) == Path(DEFAULT_STRATEGY) else f" --strategy {strategy_path}"))
    say(f"pass dumps (one file per pass, per rank): {Path(dump_dir).resolve()}/rank<r>/ "
        "(NN_reshard.txt: the collectives and why; NN_partition.txt, or a pipeline's "
        "NN_jobs.txt: the rank's program)")
    engine.close()      # releases the process groups: nothing left pending at exit
    return {"history": history, "valid": valid_losses, "sample": sample}


if __name__ == "__main__":
    main()
