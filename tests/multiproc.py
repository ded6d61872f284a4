"""Launch real ranks for a test: N processes with torchrun's environment on a free loopback
port, each running ``tests/rank_main.py <scenario>``; their results come back as Python
objects. A rank that fails stops the others at once, and a run past its time limit is
killed, so a broken collective fails the test with every rank's output instead of hanging.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from autopar.runtime.launch import free_port, rank_env, wait_ranks

RANK_MAIN = Path(__file__).with_name("rank_main.py")


def run_ranks(scenario: str, world: int, *args: str, timeout: float = 240) -> list[Any]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's result, by rank."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        results = [Path(out) / f"rank{r}.pt" for r in range(world)]
        logs = [open(Path(out) / f"rank{r}.log", "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, str(RANK_MAIN), scenario, *args],
                                  env=rank_env(r, world, port,
                                               AUTOPAR_TEST_RESULT=str(results[r]),
                                               PYTHONWARNINGS="ignore"),
                                  stdout=logs[r],
                                  stderr=subprocess.STDOUT)
                 for r in range(world)]
        try:
            failure = wait_ranks(procs, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failure:
            raise AssertionError(f"{scenario} on {world} ranks: {failure}\n" + _tails(logs))
        return [torch.load(path, weights_only=False) for path in results]


def _tails(logs) -> str:
    parts = []
    for r, log in enumerate(logs):
        log.flush()
        log.seek(0)
        text = log.read()
        parts.append(f"--- rank {r} ---\n{text[-3000:]}")
        log.close()
    return "\n".join(parts)
