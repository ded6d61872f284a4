"""Real launches, as a user makes them: ``torchrun`` runs ``examples/train_gpt.py`` under
data, tensor and pipeline parallelism and exits 0 (no teardown race at interpreter exit),
and a rank killed mid-step makes every rank of the job exit non-zero within the collective
timeout, with or without torchrun's agent to stop them.

Every real-rank test of the suite launches through the real torchrun (tests/multiproc.py),
so its exit code is checked too: more than twenty launches per run of the suite.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from autopar.runtime.spawn import free_port, rank_env

from ..multiproc import RANK_MAIN, finish, launch, logs

ROOT = Path(__file__).resolve().parents[2]
KILL_DEADLINE_S = 60      # the collective timeout train_until_killed sets


@pytest.mark.parametrize("config,world", [("dp", 2), ("tp", 2), ("pp_1f1b", 2), ("tp_sp", 2),
                                          ("pp_zbh1", 2), ("dp_tp", 4)])
@pytest.mark.slow
def test_the_example_script_exits_cleanly_under_torchrun(config, world, tmp_path):
    proc = launch(world, tmp_path, str(ROOT / "examples" / "train_gpt.py"),
                  "--strategy", str(ROOT / "configs" / f"{config}.yaml"), "--steps", "3")
    failure = finish(proc, timeout=180)
    assert not failure, failure + "\n" + logs(tmp_path)
    outputs = [p.read_text() for p in sorted((tmp_path / "logs").rglob("stdout.log"))]
    assert len(outputs) == world
    # the logging rank prints the progress and the final loss; the others print nothing
    assert "final loss" in outputs[0]
    assert all("final loss" not in text for text in outputs[1:])


def _wait_for_markers(marker_dir: Path, world: int, procs_alive, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        markers = {int(p.stem[4:]): int(p.read_text()) for p in marker_dir.glob("rank*.pid")
                   if p.read_text()}
        if len(markers) == world:
            return markers
        assert procs_alive(), "a rank ended before the kill"
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not finish two steps within {timeout} s")


@pytest.mark.parametrize("config", ["dp", "pp_1f1b"])
def test_a_killed_rank_makes_every_other_rank_exit_non_zero(config):
    """No agent here (the ranks are started directly, as on separate nodes): the surviving
    rank notices the dead peer in its next collective or message and exits non-zero by
    itself, well within the collective timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        port = free_port()
        logs_ = [open(out / f"rank{r}.log", "w+") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, str(RANK_MAIN), "train_until_killed",
                                   config, str(out)],
                                  env=rank_env(r, 2, port, PYTHONWARNINGS="ignore"),
                                  stdout=logs_[r], stderr=subprocess.STDOUT)
                 for r in range(2)]
        try:
            _wait_for_markers(out, 2, lambda: all(p.poll() is None for p in procs))
            procs[1].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            code = procs[0].wait(timeout=KILL_DEADLINE_S + 30)
            waited = time.monotonic() - killed
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        logs_[0].seek(0)
        output = logs_[0].read()
        for log in logs_:
            log.close()
    assert code != 0, f"rank 0 exited 0 after its peer was killed:\n{output[-2000:]}"
    assert waited < KILL_DEADLINE_S, f"rank 0 took {waited:.0f} s to fail"


def test_torchrun_fails_the_job_when_a_worker_is_killed(tmp_path):
    """Under torchrun the agent sees the dead worker, stops the rest and exits non-zero;
    no worker is left running."""
    proc = launch(2, tmp_path, str(RANK_MAIN), "train_until_killed", "dp", str(tmp_path),
                  env={"AUTOPAR_TEST_RESULT_DIR": str(tmp_path)})
    try:
        pids = _wait_for_markers(tmp_path, 2, lambda: proc.poll() is None)
        os.kill(pids[1], signal.SIGKILL)
        failure = finish(proc, timeout=KILL_DEADLINE_S + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert failure.startswith("torchrun exited with"), failure or "torchrun exited 0"
    time.sleep(0.5)
    assert not _alive(pids[0]), "torchrun left rank 0 running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead: its parent (torchrun, gone) has not reaped it
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
