"""Start local ranks without torchrun: what the multi-process tests and benchmarks share.

torchrun is the launcher for users (multi-node through its rendezvous); tests and benchmarks
start their few local ranks directly, with the environment torchrun would give them, so a
failing rank can be stopped at once and its output shown instead of every peer hanging in
a collective.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time

__all__ = ["free_port", "rank_env", "wait_ranks"]


def free_port() -> int:
    """A loopback port nothing listens on now (the rendezvous of one local launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment plus torchrun's variables for local rank ``rank`` (one
    intra-op thread: the ranks share the machine's cores)."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> str:
    """Wait for every rank: '' when all exited 0, else what went wrong first (a rank's
    exit code, or the time limit). The caller kills what still runs."""
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
