"""Launch real ranks for a test: N processes with torchrun's environment on a free loopback
port, each running ``tests/rank_main.py <scenario>``; their results come back as Python
objects. A rank that fails stops the others at once, and a run past its time limit is
killed, so a broken collective fails the test with every rank's output instead of hanging.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RANK_MAIN = Path(__file__).with_name("rank_main.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int, result: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", AUTOPAR_TEST_RESULT=str(result),
               PYTHONWARNINGS="ignore")
    return env


def run_ranks(scenario: str, world: int, *args: str, timeout: float = 240) -> list[Any]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's result, by rank."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        results = [Path(out) / f"rank{r}.pt" for r in range(world)]
        logs = [open(Path(out) / f"rank{r}.log", "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, str(RANK_MAIN), scenario, *args],
                                  env=_env(r, world, port, results[r]), stdout=logs[r],
                                  stderr=subprocess.STDOUT)
                 for r in range(world)]
        try:
            failure = _wait(procs, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failure:
            raise AssertionError(f"{scenario} on {world} ranks: {failure}\n" + _tails(logs))
        return [torch.load(path, weights_only=False) for path in results]


def _wait(procs: list[subprocess.Popen], timeout: float) -> str:
    """'' when every rank exited 0; else what went wrong first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return f"rank {failed[0]} exited with {codes[failed[0]]}"
        if all(c == 0 for c in codes):
            return ""
        time.sleep(0.05)
    return f"timed out after {timeout:.0f} s"


def _tails(logs) -> str:
    parts = []
    for r, log in enumerate(logs):
        log.flush()
        log.seek(0)
        text = log.read()
        parts.append(f"--- rank {r} ---\n{text[-3000:]}")
        log.close()
    return "\n".join(parts)
