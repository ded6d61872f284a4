"""What one real rank runs for a multi-process test (launched by ``tests/multiproc.py``):
``python tests/rank_main.py <scenario> [args]``. The rank's result is saved to
``$AUTOPAR_TEST_RESULT`` for the test process to compare."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import autopar as ap  # noqa: E402
from parity import lm_data  # noqa: E402

ROOT = Path(__file__).parent.parent


def gpt_config(dropout: float = 0.0):
    from autopar.models import GPTConfig
    return GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16,
                     dropout=dropout, sdpa=True)


def optimizer_for(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_gpt(config: str, optim: str, steps: str, batch: str, dropout: str = "0") -> dict:
    """The GPT trained through ``Engine.fit`` on the strategy ``configs/<config>.yaml``."""
    from autopar.models import GPT
    from autopar.models.gpt import lm_loss
    torch.manual_seed(0)
    model = GPT(gpt_config(float(dropout)))
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    engine = ap.Engine(model, lm_loss, optimizer_for(optim, model), strategy=strategy)
    data = lm_data(int(steps) * int(batch), 16, 64)
    history = engine.fit(data, batch_size=int(batch), verbose=0)
    valid = engine.evaluate(data[:int(batch)], batch_size=int(batch))
    return {"loss": history["loss"], "state": engine.state_dict(), "valid": valid,
            "optim": {k: v for k, v in engine.optimizer.state_dict()["state"].items()}}


def collectives() -> dict:
    """Every reshard step as a real collective against the reference semantics, on every
    mesh this world size allows (row-major and shuffled ids), even and uneven."""
    from rank_collectives import check_all
    return check_all()


SCENARIOS = {"train_gpt": train_gpt, "collectives": collectives}


def main() -> None:
    scenario, *args = sys.argv[1:]
    result = SCENARIOS[scenario](*args)
    torch.save(result, os.environ["AUTOPAR_TEST_RESULT"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
