"""Checkpoints on real gloo ranks (torchrun, ``tests/multiproc.py``; scenarios ``ckpt_*`` in
``tests/rank_main.py``), with the AdamW GPT (dropout 0.1, warmup schedule) trained by
``fit(shuffle=True)``:

* round trips: saved under tp2 (the fused qkv's grouped shards: several boxes a piece),
  dp2 x tp2 (4 ranks), ZeRO-3 dp2 and a 1F1B pp2 (the tied embedding owned by stage 0),
  loaded in this process (serial), and the tp2 one under dp2 and pp2 on real ranks: the
  loaded parameters equal the saving ranks' ``state_dict()`` at the save bit for bit, and
  training on from the checkpoint's data position gives the losses (and parameters) of
  single-device eager torch started from the saved state;
* exact resume: a fresh launch with ``fit(resume=True)`` continues the uninterrupted run
  bit for bit (every later loss, the final parameters), under pp2, and under dp2 after a
  rank of the run was SIGKILLed (torchrun fails the job within the collective timeout);
* a write that fails on one rank mid-save: every rank's ``save`` raises, only the
  ``.partial`` directory is left, and the previous checkpoint is the newest and loads.
"""
from __future__ import annotations

import copy
import os
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils.data import DataLoader

import autopar as ap
from autopar.checkpoint.store import SafeReader, latest_checkpoint
from autopar.models.gpt import lm_loss

from ..engine.test_launch import KILL_DEADLINE_S, _alive, _wait_for_markers
from ..multiproc import RANK_MAIN, finish, launch, logs, run_ranks
from ..parity import (
    ATOL,
    RTOL,
    assert_same_losses,
    gpt_optimizer,
    lm_data,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    parity_gpt,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEQ, VOCAB, DROPOUT = 4, 16, 64, 0.1     # tests/rank_main.py's ckpt recipe
# the long runs: 2 epochs of 10 batches, a checkpoint every 7 steps (7 and 14: both in
# mid-epoch, so a resume skips part of a shuffled epoch)
EPOCHS, N_BATCHES, SAVE_FREQ = 2, 10, 7
# the short runs saved for round trips: 1 epoch of 5 batches, saved after step 2
SHORT = SHORT_STEP, SHORT_EPOCHS, SHORT_BATCHES = 2, 1, 5


def _step_dir(save_dir: Path, step: int) -> Path:
    return save_dir / f"step_{step:08d}"


def _train(config: str, save_dir: Path, save_freq: int, epochs: int, n_batches: int,
           world: int = 2) -> list[dict]:
    """An uninterrupted run (``ckpt_train``) checkpointing into ``save_dir``."""
    return run_ranks("ckpt_train", world, config, str(save_dir), str(save_freq), str(epochs),
                     str(n_batches), timeout=300)


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory) -> Callable[[str], tuple[Path, list[dict]]]:
    """The uninterrupted long runs (dp2, pp2), each launched once, when first asked for."""
    made: dict[str, tuple[Path, list[dict]]] = {}

    def get(config: str) -> tuple[Path, list[dict]]:
        if config not in made:
            save_dir = tmp_path_factory.mktemp(f"{config}_run")
            made[config] = save_dir, _train(config, save_dir, SAVE_FREQ, EPOCHS, N_BATCHES)
        return made[config]
    return get


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    save_dir = tmp_path_factory.mktemp("tp_run")
    return save_dir, _train("tp", save_dir, *SHORT)


# -- the reference: single-device eager torch from the loaded state -------------------------

def _serial_engine() -> ap.Engine:
    model = parity_gpt("adamw", dropout=DROPOUT)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    return ap.Engine(model, lm_loss, optimizer, strategy=ap.Strategy(), lr_scheduler=scheduler)


def _eager_twin(saved: dict, step: int):
    """Plain torch at optimizer step ``step`` of the run: the model with the saving ranks'
    parameters, AdamW with their optimizer state, the schedule stepped ``step`` times."""
    model = parity_gpt("adamw", dropout=DROPOUT)
    # the tied embedding and head are one tensor, under one of their names
    canonical = {id(t): n for n, t in model.named_parameters()}
    model.load_state_dict({k: saved["state"][canonical.get(id(t), k)]
                           for k, t in model.state_dict(keep_vars=True).items()})
    optimizer, scheduler = gpt_optimizer("adamw", model)
    with warnings.catch_warnings():      # stepped without optimizer.step(): on purpose
        warnings.simplefilter("ignore")
        for _ in range(step):
            scheduler.step()
    optimizer.load_state_dict({"state": copy.deepcopy(saved["optim"]),
                               "param_groups": optimizer.state_dict()["param_groups"]})
    return model, optimizer, scheduler


def _eager_continuation(saved: dict, step: int, epochs: int, n_batches: int,
                        seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """What eager torch trains from the state saved at ``step`` to the end of ``epochs``
    epochs of ``n_batches`` batches: each epoch's batches shuffled by a generator seeded
    ``seed + epoch``, batch ``i`` of the run drawing its random numbers from
    ``manual_seed(seed + i)``. Its losses and final parameters."""
    model, optimizer, scheduler = _eager_twin(saved, step)
    data = lm_data(n_batches * BATCH, SEQ, VOCAB)
    losses = []
    model.train()
    for epoch in range(step // n_batches, epochs):
        loader = DataLoader(data, batch_size=BATCH, shuffle=True,
                            generator=torch.Generator().manual_seed(seed + epoch))
        for i, (x, y) in enumerate(loader):
            index = epoch * n_batches + i
            if index < step:
                continue
            torch.manual_seed(seed + index)
            optimizer.zero_grad()
            loss = lm_loss(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    return losses, model.state_dict()


def _assert_close_state(got: dict, want: dict, what: str) -> None:
    """``got`` (an engine's ``state_dict``) against eager's ``model.state_dict()`` (which
    also lists a tied weight's other names)."""
    assert got.keys() <= want.keys(), f"{what}: keys {sorted(got.keys() - want.keys())}"
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {name}: {m}")


def _assert_equal_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs"


def _serial_round_trip(path: Path, saved: dict, step: int, epochs: int, n_batches: int
                       ) -> None:
    """Load ``path`` (saved at ``step``) in this process: parameters and torch's optimizer
    state equal the saving ranks' at the save exactly; fit on from the checkpoint's data
    position equals eager torch from the saved state."""
    engine = _serial_engine()
    engine.load(path)
    _assert_equal_state(engine.state_dict(), saved["state"], f"serial load of {path.name}")
    optim = engine.optimizer.state_dict()["state"]
    assert optim.keys() == saved["optim"].keys()
    for index, state in saved["optim"].items():
        _assert_equal_state(optim[index], state, f"serial load of {path.name}, "
                                                  f"optimizer state {index}")
    assert (engine.global_step, engine.batches_trained) == (step, step)
    want, final = _eager_continuation(saved, step, epochs, n_batches)
    assert want, "nothing left to train after the checkpoint"
    got = engine.fit(lm_data(n_batches * BATCH, SEQ, VOCAB), batch_size=BATCH, epochs=epochs,
                     shuffle=True, verbose=0)["loss"]
    assert_same_losses(got, want)
    _assert_close_state(engine.state_dict(), final, f"serial fit on from {path.name}")


def _chunks(path: Path) -> dict[str, int]:
    """Checkpoint key -> how many boxes (DCP chunks) the ranks wrote of it."""
    metadata = SafeReader(path).read_metadata()
    return {k: len(v.chunks) for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


# -- round trips ----------------------------------------------------------------------------

def _assert_grouped_qkv(path: Path, ranks: list[dict], writers: int) -> None:
    """The fused qkv weight's pieces are grouped shards (several boxes each); ``writers``
    ranks write theirs (one per data-parallel replica group), and the checkpoint holds
    exactly their boxes."""
    qkv = "blocks.0.attn.qkv.weight"
    pieces = [r["layout"]["pieces"][qkv] for r in ranks]
    assert all(p["boxes"] > 1 for p in pieces), f"{qkv}: {pieces}, not grouped shards"
    assert sum(p["writes"] for p in pieces) == writers
    assert _chunks(path)[f"model.{qkv}"] == sum(p["boxes"] for p in pieces if p["writes"])


def test_tp2_checkpoint_of_grouped_shards_loads_serially(tp_run):
    save_dir, ranks = tp_run
    path = _step_dir(save_dir, SHORT_STEP)
    _assert_grouped_qkv(path, ranks, writers=2)
    _serial_round_trip(path, ranks[0]["captured"][SHORT_STEP], *SHORT)


@pytest.mark.slow
def test_dp2_tp2_checkpoint_on_four_ranks_loads_serially(tmp_path):
    ranks = _train("dp_tp", tmp_path, *SHORT, world=4)
    path = _step_dir(tmp_path, SHORT_STEP)
    _assert_grouped_qkv(path, ranks, writers=2)        # the dp replicas write once
    _serial_round_trip(path, ranks[0]["captured"][SHORT_STEP], *SHORT)


def test_zero3_checkpoint_loads_serially(tmp_path):
    ranks = _train("dp_zero3", tmp_path, *SHORT)
    path = _step_dir(tmp_path, SHORT_STEP)
    # ZeRO-3 shards parameters and AdamW state: each rank writes its half
    chunks = _chunks(path)
    assert chunks["model.blocks.0.fc1.weight"] == 2
    assert chunks["optim.state.blocks.0.fc1.weight.exp_avg"] == 2
    saved = ranks[0]["captured"][SHORT_STEP]
    for rank in ranks[1:]:
        _assert_equal_state(rank["captured"][SHORT_STEP]["state"], saved["state"],
                            "the ranks' state_dict at the save")
    _serial_round_trip(path, saved, *SHORT)


def test_pp2_checkpoint_loads_serially(long_runs):
    save_dir, ranks = long_runs("pp_1f1b")
    wte = [r["layout"]["pieces"]["wte.weight"] for r in ranks]
    # the tied embedding and head: both stages hold it, stage 0 owns (writes) it
    assert [p["held"] for p in wte] == [True, True] and {p["owner"] for p in wte} == {0}
    path = _step_dir(save_dir, SAVE_FREQ)
    assert _chunks(path)["model.wte.weight"] == 1
    # step 7: mid-epoch and mid-warmup; fit on crosses into the second epoch
    _serial_round_trip(path, ranks[0]["captured"][SAVE_FREQ], SAVE_FREQ, EPOCHS, N_BATCHES)


def test_tp2_checkpoint_loads_under_dp2_and_pp2_on_ranks(tp_run):
    save_dir, saving = tp_run
    path = _step_dir(save_dir, SHORT_STEP)
    results = run_ranks("ckpt_load", 2, str(path), str(SHORT_EPOCHS), str(SHORT_BATCHES),
                        "dp", "pp_1f1b", timeout=300)
    want, final = _eager_continuation(saving[0]["captured"][SHORT_STEP], *SHORT)
    saved = saving[0]["captured"][SHORT_STEP]["state"]
    for rank, by_config in enumerate(results):
        assert sorted(by_config) == ["dp", "pp_1f1b"]
        for config, got in by_config.items():
            where = f"rank {rank} under {config}"
            _assert_equal_state(got["loaded"], saved, f"{where}, loaded")
            assert_same_losses(got["loss"], want)
            _assert_close_state(got["state"], final, f"{where}, after fit")


# -- exact resume ---------------------------------------------------------------------------

def _resume(config: str, save_dir: Path) -> list[dict]:
    """A fresh launch of the long run under ``config``: ``fit(resume=True)`` from the newest
    checkpoint in ``save_dir``."""
    return run_ranks("ckpt_resume", 2, config, str(save_dir), str(SAVE_FREQ), str(EPOCHS),
                     str(N_BATCHES), timeout=300)


def _assert_resumed_exactly(resumed: list[dict], run: list[dict], step: int) -> None:
    """Every rank of the resumed launch trained steps ``step + 1`` on with the
    uninterrupted run's losses and ended with its parameters, bit for bit."""
    for rank, (got, want) in enumerate(zip(resumed, run)):
        assert got["loss"] == want["loss"][step:], f"rank {rank}: resumed losses differ"
        _assert_equal_state(got["state"], want["state"], f"rank {rank}, after the resumed run")


def test_pp2_resumes_exactly_in_a_fresh_launch(long_runs, tmp_path):
    save_dir, run = long_runs("pp_1f1b")
    resume_dir = tmp_path / "resume"
    # step 14: 4 batches into the second (shuffled) epoch, past the warmup (a schedule not
    # restored would start it again)
    step = 2 * SAVE_FREQ
    shutil.copytree(_step_dir(save_dir, step), _step_dir(resume_dir, step))
    _assert_resumed_exactly(_resume("pp_1f1b", resume_dir), run, step)


@pytest.mark.slow
def test_killed_dp2_run_fails_and_resumes_exactly(long_runs, tmp_path):
    """SIGKILL one rank after the first checkpoint (step 7) is written: torchrun ends the job
    non-zero within the collective timeout, leaving no worker; a fresh launch resumes from
    the newest complete checkpoint and continues the uninterrupted run bit for bit."""
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    markers = tmp_path / "markers"
    markers.mkdir()
    proc = launch(2, tmp_path, str(RANK_MAIN), "ckpt_until_killed", "dp", str(save_dir),
                  str(SAVE_FREQ), str(EPOCHS), str(N_BATCHES), str(markers),
                  env={"AUTOPAR_TEST_RESULT_DIR": str(tmp_path)})
    try:
        pids = _wait_for_markers(markers, 2, lambda: proc.poll() is None)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        failure = finish(proc, timeout=KILL_DEADLINE_S + 30)
        waited = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert failure.startswith("torchrun exited with"), \
        (failure or "torchrun exited 0") + "\n" + logs(tmp_path)
    assert waited < KILL_DEADLINE_S, f"the job took {waited:.0f} s to fail"
    time.sleep(0.5)
    assert not _alive(pids[0]), "torchrun left rank 0 running"
    found = latest_checkpoint(save_dir)
    assert found is not None
    step = int(found.name.split("_")[1])
    assert step % SAVE_FREQ == 0 and step < EPOCHS * N_BATCHES, found
    _, run = long_runs("dp")
    _assert_resumed_exactly(_resume("dp", save_dir), run, step)


# -- a failed save --------------------------------------------------------------------------

def test_a_write_failing_on_one_rank_leaves_the_previous_checkpoint(tmp_path):
    ranks = run_ranks("ckpt_crash_save", 2, str(tmp_path), timeout=300)
    for rank, result in enumerate(ranks):
        assert result["error"] is not None, f"rank {rank}: the failed save did not raise"
        assert result["catchable"], f"rank {rank}: save raised {result['error']!r}, which " \
            "is no Exception: a caller's `except Exception` does not catch it"
    assert "planted by ckpt_crash_save" in ranks[1]["error"]
    first, second = _step_dir(tmp_path, 1), _step_dir(tmp_path, 2)
    assert not second.exists()
    assert second.with_name(second.name + ".partial").is_dir()
    assert latest_checkpoint(tmp_path) == first
    engine = _serial_engine()
    engine.load(first)
    _assert_equal_state(engine.state_dict(), ranks[0]["first"], "serial load of step 1")
    assert engine.global_step == 1
