"""Launch real ranks for a test with the real ``torchrun`` (``python -m
torch.distributed.run``), as a user would: N workers on a free loopback port, each running
``tests/rank_main.py <scenario>``; their results come back as Python objects.

torchrun's agent stops every worker when one fails and exits non-zero, and a launch past
its time limit is killed, so a broken collective fails the test with every rank's output
instead of hanging. Every launch must exit 0: a rank that trains correctly and then dies at
interpreter exit (a teardown race) fails the test too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from autopar.runtime.spawn import free_port

RANK_MAIN = Path(__file__).with_name("rank_main.py")


def torchrun_command(world: int, port: int, log_dir: Path, *script: str) -> list[str]:
    """The torchrun command line of one local launch: no restarts, each worker's output in
    its own file under ``log_dir``."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
            "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}",
            "--max-restarts=0", "--monitor-interval=0.1", f"--log-dir={log_dir}",
            "--redirects=3", *script]


def launch(world: int, out: Path, *script: str, env: dict[str, str] | None = None,
           ) -> subprocess.Popen:
    """Start torchrun for ``script`` (its own output goes to ``out/torchrun.log``)."""
    with open(out / "torchrun.log", "w") as log:     # torchrun keeps its own copy
        return subprocess.Popen(
            torchrun_command(world, free_port(), out / "logs", *script),
            env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for torchrun; '' when it exited 0, else what went wrong. A launch past its time
    limit is stopped with all its workers (``stop``)."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return f"timed out after {timeout:.0f} s"
    return "" if code == 0 else f"torchrun exited with {code}"


def stop(agent: subprocess.Popen) -> None:
    """Stop a torchrun agent and its workers. torchrun starts each worker in a session of
    its own, so killing the agent's process group would leave them running: SIGTERM lets
    the agent stop them itself; whatever still runs after that is killed, workers by their
    sessions."""
    workers = _children(agent.pid)
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(15)
    except subprocess.TimeoutExpired:
        pass
    for pid in (agent.pid, *workers):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    agent.wait()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def run_ranks(scenario: str, world: int, *args: str, timeout: float = 240) -> list[Any]:
    """Run ``scenario`` on ``world`` ranks under torchrun; returns each rank's result, by
    rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        proc = launch(world, out, str(RANK_MAIN), scenario, *args,
                      env={"AUTOPAR_TEST_RESULT_DIR": str(out)})
        failure = finish(proc, timeout)
        if failure:
            raise AssertionError(f"{scenario} on {world} ranks: {failure}\n" + logs(out))
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def logs(out: Path) -> str:
    """torchrun's own output and the tail of every worker's; a long worker log keeps its
    head too (a native crash writes its cause first, then a long fatal-error report)."""
    parts = [f"--- torchrun ---\n{(out / 'torchrun.log').read_text()[-3000:]}"]
    for path in sorted((out / "logs").rglob("std*.log")):
        parts.append(f"--- worker {path.parent.name} {path.stem} ---\n"
                     f"{_head_and_tail(path.read_text())}")
    return "\n".join(parts)


def _head_and_tail(text: str, head: int = 2000, tail: int = 3000) -> str:
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n[... {len(text) - head - tail} characters ...]\n{text[-tail:]}"
