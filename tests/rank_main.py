"""What one real rank runs for a multi-process test (launched by ``tests/multiproc.py``):
``python tests/rank_main.py <scenario> [args]``. The rank's result is saved to
``$AUTOPAR_TEST_RESULT`` for the test process to compare."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from parity import gpt_optimizer, lm_data, parity_gpt  # noqa: E402

import autopar as ap  # noqa: E402

ROOT = Path(__file__).parent.parent


def train_gpt(config: str, optim: str, steps: str, batch: str, dropout: str = "0",
              trace_dir: str = "") -> dict:
    """The GPT of ``parity_gpt`` trained through ``Engine.fit`` on ``configs/<config>.yaml``
    (with ``trace_dir``: dumps and a pipeline trace there)."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt(optim, dropout=float(dropout))
    optimizer, scheduler = gpt_optimizer(optim, model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    if trace_dir:
        strategy = strategy.model_copy(update={"debug": ap.Strategy(
            debug={"dump_dir": trace_dir, "trace": True}).debug})
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    data = lm_data(int(steps) * int(batch), 16, 64)
    history = engine.fit(data, batch_size=int(batch), verbose=0)
    valid = engine.evaluate(data[:int(batch)], batch_size=int(batch))
    predicted = engine.predict(data[:int(batch)], batch_size=int(batch))[0]
    return {"loss": history["loss"], "state": engine.state_dict(), "valid": valid,
            "optim": engine.optimizer.state_dict()["state"], "predict": predicted}


def train_and_close(config: str) -> dict:
    """Train inside ``with Engine(...)``: leaving it releases the process groups."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("sgd")
    optimizer, scheduler = gpt_optimizer("sgd", model)
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    with ap.Engine(model, lm_loss, optimizer, strategy=strategy,
                   lr_scheduler=scheduler) as engine:
        losses = engine.fit(lm_data(8, 16, 64), batch_size=4, verbose=0)["loss"]
        state = engine.state_dict()
    return {"loss": losses, "state": state, "initialized": torch.distributed.is_initialized()}


def collectives() -> dict:
    """Every reshard step as a real collective against the reference semantics, on every
    mesh this world size allows (row-major and shuffled ids), even and uneven."""
    from rank_collectives import check_all
    return check_all()


SCENARIOS = {"train_gpt": train_gpt, "train_and_close": train_and_close,
             "collectives": collectives}


def main() -> None:
    scenario, *args = sys.argv[1:]
    result = SCENARIOS[scenario](*args)
    torch.save(result, os.environ["AUTOPAR_TEST_RESULT"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
