"""Checkpoints written in the background (``Engine.save(path, async_save=True)``,
``fit(..., save_async=True)``): exact resume, the state of the call (not of when the
thread writes), waiting at the next save / load / close / fit's end, a failed write
raising there, pruning beside a save in flight; serial, simulated, and on 2 real gloo
ranks (scenario ``ckpt_async`` in ``tests/rank_main.py``).

The writer thread is held where a test needs the write to lag: ``FileSystemWriter.
write_data`` (DCP's, run in that thread) waits for a gate the test opens."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from autopar.checkpoint.store import is_checkpoint, latest_checkpoint
from autopar.engine.callbacks import Callback
from autopar.state.checkpointing import CheckpointError

from ..multiproc import run_ranks
from ..parity import one_thread  # noqa: F401  (a fixture: pytestmark uses it)
from .test_checkpoint import DATA, gpt_engine

pytestmark = pytest.mark.usefixtures("one_thread")

WRITE = FileSystemWriter.write_data


def _gate_writes(monkeypatch) -> threading.Semaphore:
    """Every background (or sync) write waits for one ``release`` of the returned gate."""
    gate = threading.Semaphore(0)

    def gated(self, plan, planner):
        assert gate.acquire(timeout=60), "the test never opened the writer's gate"
        return WRITE(self, plan, planner)
    monkeypatch.setattr(FileSystemWriter, "write_data", gated)
    return gate


def _assert_same_state(path_a, path_b, config=None) -> None:
    """Two checkpoints loaded into fresh engines: parameters, optimizer state and the
    trainer's position equal bit for bit."""
    a, b = gpt_engine(config), gpt_engine(config)
    a.load(path_a)
    b.load(path_b)
    assert (a.global_step, a.batches_trained) == (b.global_step, b.batches_trained)
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
    theirs = b.optimizer.state_dict()["state"]
    for p, state in a.optimizer.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(theirs[p][k])), (p, k)


@pytest.mark.parametrize("config", [None, "dp_tp"])
def test_resume_from_an_async_checkpoint_is_the_uninterrupted_run(config, tmp_path):
    """fit(save_async=True) checkpoints hold what sync ones hold, and a resume from one
    repeats the rest of the run bit for bit."""
    whole = gpt_engine(config)
    full = whole.fit(DATA, batch_size=4, epochs=2, shuffle=True, verbose=0,
                     save_dir=tmp_path / "async", save_freq=4, keep_last=10, save_async=True)
    assert not list((tmp_path / "async").glob("*.partial"))     # fit waited for the last
    synced = gpt_engine(config)
    synced.fit(DATA, batch_size=4, epochs=1, shuffle=True, verbose=0,
               save_dir=tmp_path / "sync", save_freq=4)
    first = tmp_path / "async" / "step_00000004"
    _assert_same_state(first, tmp_path / "sync" / "step_00000004", config)
    resumed = gpt_engine(config)
    resumed.load(first)
    rest = resumed.fit(DATA, batch_size=4, epochs=2, shuffle=True, verbose=0)
    assert rest["loss"] == full["loss"][4:]
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, whole.state_dict()[name]), name


def test_the_checkpoint_holds_the_state_at_the_call(tmp_path, monkeypatch):
    """The write is held until training has gone on and every state tensor was changed in
    place: the checkpoint still equals a sync save taken at the same step."""
    engine = gpt_engine("dp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    engine.save(tmp_path / "sync")
    gate = _gate_writes(monkeypatch)
    assert engine.save(tmp_path / "async", async_save=True) == tmp_path / "async"
    for at in (8, 12):              # fit would wait for the save at its end: steps do not
        engine.train_step(*(torch.stack(t) for t in zip(*DATA[at:at + 4])))
    assert engine.global_step == 4
    with torch.no_grad():
        for value in engine.state.tensors.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.add_(1.0)
    assert not is_checkpoint(tmp_path / "async")      # still being written
    gate.release()
    assert engine.wait_for_checkpoint() == tmp_path / "async"
    _assert_same_state(tmp_path / "async", tmp_path / "sync")


@pytest.mark.parametrize("then", ["save", "load", "close", "export"])
def test_the_next_save_load_or_close_waits_for_the_one_in_flight(then, tmp_path, monkeypatch):
    engine = gpt_engine(None)
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    engine.save(tmp_path / "before")
    gate = _gate_writes(monkeypatch)
    engine.save(tmp_path / "ck", async_save=True)
    opener = threading.Timer(0.3, gate.release)
    start = time.perf_counter()
    opener.start()
    {"save": lambda: engine.save(tmp_path / "next", async_save=True),
     "load": lambda: engine.load(tmp_path / "before"),
     "close": engine.close,
     "export": lambda: engine.save(tmp_path / "full", format="full")}[then]()
    assert time.perf_counter() - start >= 0.25
    assert is_checkpoint(tmp_path / "ck")
    if then == "save":
        gate.release()
        assert engine.wait_for_checkpoint() == tmp_path / "next"
    assert engine.wait_for_checkpoint() is None


@pytest.mark.parametrize("then", ["wait", "save", "close"])
def test_a_failed_background_write_raises_at_the_wait_naming_the_path(then, tmp_path,
                                                                       monkeypatch):
    engine = gpt_engine("dp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    engine.save(tmp_path / "step_00000001")

    def broken(self, plan, planner):
        raise OSError("disk full")
    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    engine.save(tmp_path / "step_00000002", async_save=True)      # the call itself succeeds
    wait = {"wait": engine.wait_for_checkpoint, "close": engine.close,
            "save": lambda: engine.save(tmp_path / "step_00000003")}[then]
    with pytest.raises(CheckpointError, match=r"save to \S*step_00000002 failed on rank\(s\) "
                                              r"\[0\]: OSError: disk full"):
        wait()
    monkeypatch.undo()
    assert (tmp_path / "step_00000002.partial").exists()
    assert not (tmp_path / "step_00000002").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert engine.wait_for_checkpoint() is None       # raised once, then forgotten
    if then == "close":
        assert engine.closed


def test_keep_last_spares_the_save_in_flight_and_counts_only_committed_ones(tmp_path,
                                                                            monkeypatch):
    """Each write is held until the step's callbacks ran: then the newest checkpoint is
    still partial, and pruning kept ``keep_last`` committed ones besides it."""
    gate = _gate_writes(monkeypatch)
    seen: dict[int, list[str]] = {}

    class Look(Callback):                 # runs after fit's ModelCheckpoint
        def on_step_end(self, step: int, logs: dict) -> None:
            if self.engine.global_step % 2 == 0:
                seen[self.engine.global_step] = sorted(p.name for p in tmp_path.iterdir())
                gate.release()
    engine = gpt_engine(None)
    engine.fit(DATA, batch_size=4, epochs=1, verbose=0, save_dir=tmp_path, save_freq=2,
               keep_last=1, save_async=True, callbacks=[Look()])
    assert seen == {2: ["step_00000002.partial"],
                    4: ["step_00000002", "step_00000004.partial"],
                    6: ["step_00000004", "step_00000006.partial"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006"]


def test_async_save_is_a_checkpoint_only():
    with pytest.raises(ValueError, match="async_save=True writes a checkpoint"):
        gpt_engine(None).save("x", format="full", async_save=True)


def test_two_real_ranks_save_in_the_background(tmp_path):
    """dp2 on gloo: fit(save_async=True) checkpoints equal the state the ranks gathered at
    those steps and were pruned to keep_last; a write slow on rank 1 is not committed
    before rank 1 finished it; a write failing on rank 1 raises at the wait on both."""
    ranks = run_ranks("ckpt_async", 2, str(tmp_path), timeout=240)
    first = ranks[0]
    assert first["after_fit"] == ["step_00000006", "step_00000008"]
    for step in (6, 8):
        probe = gpt_engine(None)
        probe.load(tmp_path / f"step_{step:08d}")
        for name, value in probe.state_dict().items():
            assert torch.equal(value, first["captured"][step][name]), (step, name)
    assert first["slow"] == {"committed_early": False, "committed_after_wait": True}
    for rank in ranks:
        assert "failed" in rank["error"] and "disk full (planted" in rank["error"], rank
        assert rank["error"].startswith("CheckpointError: save to ")
    assert not (tmp_path / "failed").exists() and (tmp_path / "failed.partial").exists()
