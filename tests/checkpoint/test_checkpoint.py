"""Checkpoints in one process (serial and simulated ranks): the boxes a piece covers, round
trips between strategies, exact resume, the safety of a save, and the errors of a load.
Real ranks: ``tests/checkpoint/test_checkpoint_ranks.py``."""
from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import autopar as ap
from autopar.checkpoint.boxes import checkpoint_key, piece_boxes, writes_piece
from autopar.checkpoint.store import SafeReader, latest_checkpoint
from autopar.engine.callbacks import ModelCheckpoint
from autopar.ir import StateKey
from autopar.ir.dist import DistAttr, Partial, ProcessMesh, Replicate, Shard, shard_tensor_local
from autopar.lower.executable import StatePiece
from autopar.models.gpt import lm_loss
from autopar.state.checkpointing import CheckpointError, CheckpointMismatch

from ..parity import gpt_optimizer, lm_data, parity_gpt

ROOT = Path(__file__).resolve().parents[2] / "configs"


def strategy(config: str | None, **update) -> ap.Strategy:
    """``configs/<config>.yaml`` on the simulator (None: serial)."""
    if config is None:
        return ap.Strategy(**update)
    data = ap.Strategy.from_yaml(ROOT / f"{config}.yaml").model_dump(exclude_unset=True)
    data.setdefault("debug", {})["simulate"] = True
    data.update(update)
    return ap.Strategy(**data)


def gpt_engine(config: str | None, optim: str = "adamw", dropout: float = 0.1,
               **update) -> ap.Engine:
    model = parity_gpt(optim, dropout=dropout)
    optimizer, scheduler = gpt_optimizer(optim, model)
    return ap.Engine(model, lm_loss, optimizer, strategy=strategy(config, **update),
                     lr_scheduler=scheduler)


DATA = lm_data(24, 16, 64)


# -- the boxes of a piece ------------------------------------------------------------------

PLACEMENTS = [
    ((2,), (Shard(0),)), ((2,), (Replicate(),)), ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Shard(1), Shard(1))), ((2, 2), (Replicate(), Shard(0, groups=3))),
    ((2, 2), (Shard(0, groups=(2, 1, 1)), Shard(1))), ((3,), (Shard(0),)),
]


@pytest.mark.parametrize("mesh_shape,placements", PLACEMENTS, ids=str)
def test_the_written_boxes_tile_the_tensor_once_and_hold_each_piece(mesh_shape, placements):
    mesh = ProcessMesh(torch.arange(int(torch.tensor(mesh_shape).prod())).reshape(mesh_shape))
    shape = (12, 10)
    full = torch.arange(120.0).reshape(shape)
    cover = torch.zeros(shape, dtype=torch.int64)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        piece = StatePiece(StateKey.of_param("w"), shape, torch.float32,
                           DistAttr(mesh, placements), coordinate)
        local = shard_tensor_local(full, mesh, placements, coordinate)
        for box in piece_boxes(piece):
            held = local[tuple(slice(a, a + n) for a, n in zip(box.local, box.sizes))]
            want = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
            assert torch.equal(held, want), (coordinate, box)
            if writes_piece(piece):
                cover[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] += 1
    assert torch.equal(cover, torch.ones_like(cover))


def test_a_grouped_shard_is_several_boxes():
    mesh = ProcessMesh([0, 1])
    piece = StatePiece(StateKey.of_param("qkv"), (96, 32), torch.float32,
                       DistAttr(mesh, (Shard(0, groups=3),)), (1,))
    assert [b.offsets for b in piece_boxes(piece)] == [(16, 0), (48, 0), (80, 0)]


def test_a_partial_state_is_refused_by_name():
    piece = StatePiece(StateKey.accumulator("w"), (4,), torch.float32,
                       DistAttr(ProcessMesh([0, 1]), (Partial(),)), (0,))
    with pytest.raises(ValueError, match="gradient_merge/w.*partial"):
        writes_piece(piece)


def test_keys_follow_torch_get_state_dict():
    """Made from the typed key (nothing parses a state's name); what a checkpoint leaves
    out has none."""
    assert checkpoint_key(StateKey.of_param("fc.weight")) == "model.fc.weight"
    assert checkpoint_key(StateKey.of_buffer("bn.running_mean")) == "model.bn.running_mean"
    assert checkpoint_key(StateKey.optimizer("fc.weight", "exp_avg")) == \
        "optim.state.fc.weight.exp_avg"
    assert checkpoint_key(StateKey.scaler("loss_scale")) == "autopar.amp/loss_scale"
    assert checkpoint_key(StateKey.accumulator("fc.weight")) is None
    assert checkpoint_key(StateKey.constant("const/c@00")) is None


# -- round trips -----------------------------------------------------------------------------

def _saved_boxes(path) -> int:
    metadata = SafeReader(path).read_metadata()
    return max(len(md.chunks) for k, md in metadata.state_dict_metadata.items()
               if k.startswith("model.") and hasattr(md, "chunks"))


@pytest.mark.parametrize("saved_under,loaded_under", [
    ("dp_tp", None), ("dp_pp", "tp"), ("dp_zero3", "pp_1f1b"), (None, "dp_tp"),
    ("tp_sp", "dp_zero3")])
def test_a_checkpoint_loads_under_another_strategy_and_trains_on_like_eager(
        saved_under, loaded_under, tmp_path):
    """The loaded state equals the saved one exactly (parameters, Adam state, scheduler);
    two more steps equal a serial engine's from the same checkpoint."""
    saver = gpt_engine(saved_under)
    saver.fit(DATA, batch_size=8, epochs=1, steps_per_epoch=3, verbose=0)
    saver.save(tmp_path / "ck")
    if saved_under in ("dp_tp", "dp_zero3", "tp_sp"):      # they shard parameters
        assert _saved_boxes(tmp_path / "ck") > 1     # the simulated ranks' boxes
    saved, optim = saver.state_dict(), saver.optimizer.state_dict()
    loader, serial = gpt_engine(loaded_under), gpt_engine(None)
    for engine in (loader, serial):
        engine.load(tmp_path / "ck")
        assert engine.global_step == 3 and engine.lr_scheduler.last_epoch == 3
    loader.sync_model()
    for name, value in loader.state_dict().items():
        assert torch.equal(value, saved[name]), name
    for p, state in loader.optimizer.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(optim["state"][p][k])), (p, k)
    # the saver finished epoch 0: fit's epochs count from the run's start (Keras)
    ours = loader.fit(DATA, batch_size=8, epochs=2, steps_per_epoch=2, verbose=0)["loss"]
    ref = serial.fit(DATA, batch_size=8, epochs=2, steps_per_epoch=2, verbose=0)["loss"]
    assert len(ours) == 2
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=0)


def test_tp_writes_the_fused_qkv_as_one_box_per_head_group(tmp_path):
    engine = gpt_engine("tp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    engine.save(tmp_path / "ck")
    chunks = SafeReader(tmp_path / "ck").read_metadata().state_dict_metadata[
        "model.blocks.0.attn.qkv.weight"].chunks
    assert len(chunks) == 6      # q, k and v of each of 2 ranks


def test_plain_dcp_reads_the_model_back(tmp_path):
    """Keys are get_state_dict's: torch's own dcp.load fills an eager model."""
    engine = gpt_engine("dp_tp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    engine.save(tmp_path / "ck")
    eager = parity_gpt("adamw", dropout=0.1)
    for p in eager.parameters():
        torch.nn.init.zeros_(p)
    state = {"model": eager.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    eager.load_state_dict(state["model"])
    for name, value in engine.state_dict().items():
        assert torch.equal(eager.state_dict()[name], value), name


# -- exact resume ----------------------------------------------------------------------------

@pytest.mark.parametrize("config,optim", [(None, "adamw"), ("dp", "adamw"),
                                          ("pp_1f1b", "sgd"), ("dp_merge", "sgd"),
                                          ("dp_fp16", "adamw")])
def test_resume_from_a_checkpoint_is_bit_for_bit_the_uninterrupted_run(config, optim,
                                                                       tmp_path):
    """Dropout draws, shuffling, the LR schedule, gradient-merge cycles and the loss
    scaler all continue exactly: losses after the checkpoint and final state are equal."""
    batch = 2 if config == "dp_merge" else 4
    freq = 1 if config == "dp_merge" else 4      # dp_merge: one optimizer step per 4 batches
    whole = gpt_engine(config, optim)
    full = whole.fit(DATA, batch_size=batch, epochs=2, shuffle=True, verbose=0,
                     save_dir=tmp_path, save_freq=freq, keep_last=10)
    first = sorted(tmp_path.glob("step_*"))[0]
    resumed = gpt_engine(config, optim)
    resumed.load(first)
    done = resumed.batches_trained
    assert 0 < done < len(full["loss"])
    rest = resumed.fit(DATA, batch_size=batch, epochs=2, shuffle=True, verbose=0)
    assert rest["loss"] == full["loss"][done:]
    if "loss_scale" in full:
        assert rest["loss_scale"] == full["loss_scale"][resumed.global_step - len(
            rest["loss_scale"]):]
    expected = whole.state_dict()
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_fit_resume_continues_from_the_newest_checkpoint(tmp_path):
    whole = gpt_engine("dp")
    full = whole.fit(DATA, batch_size=4, epochs=2, shuffle=True, verbose=0)["loss"]
    first = gpt_engine("dp")
    first.fit(DATA, batch_size=4, epochs=1, shuffle=True, verbose=0, save_dir=tmp_path,
              save_freq=2)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_00000004", "step_00000006"]
    again = gpt_engine("dp")
    rest = again.fit(DATA, batch_size=4, epochs=2, shuffle=True, verbose=0, save_dir=tmp_path,
                     resume=True)["loss"]
    assert rest == full[6:]


def test_epochs_counts_the_run_in_one_process_and_after_a_load(tmp_path):
    """``epochs`` is the run's total: a second ``fit(epochs=1)`` after one epoch trains
    nothing, in one process as after loading that epoch's checkpoint; each says so (the
    epochs done, the checkpoint's position) and returns the history with its usual keys,
    and ``epochs=2`` trains the second epoch in both, equally."""
    first = gpt_engine("dp")
    first.fit(DATA, batch_size=4, epochs=1, verbose=0, save_dir=tmp_path)
    trained = len(first.history["loss"])
    with pytest.warns(UserWarning, match=r"fit\(epochs=1\): nothing to train.*1 are done "
                                         r"\(this engine has trained them\); pass epochs=2"):
        again = first.fit(DATA, batch_size=4, epochs=1, verbose=0)
    assert len(again["loss"]) == trained and first.batches_trained == trained
    loaded = gpt_engine("dp")
    loaded.load(tmp_path / f"step_{first.global_step:08d}")
    with pytest.warns(UserWarning, match=r"1 are done \(the checkpoint it loaded ended at "
                                         r"epoch 1, batch 0\)"):
        history = loaded.fit(DATA, batch_size=4, epochs=1, verbose=0)
    assert history == {"loss": [], "lr": []}
    assert loaded.fit(DATA, batch_size=4, epochs=2, verbose=0)["loss"] == \
        first.fit(DATA, batch_size=4, epochs=2, verbose=0)["loss"][trained:]


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    engine = gpt_engine(None)
    losses = engine.fit(DATA, batch_size=4, epochs=1, verbose=0, save_dir=tmp_path / "none",
                        resume=True)["loss"]
    assert len(losses) == 6


def test_model_checkpoint_keeps_the_best_validation_loss(tmp_path):
    engine = gpt_engine(None, dropout=0.0)
    keeper = ModelCheckpoint(tmp_path, save_freq=None, monitor="val_loss")
    engine.fit(DATA, batch_size=4, epochs=3, valid_data=DATA[:8], verbose=0,
               callbacks=[keeper])
    best = min(engine.history["val_loss"])
    assert keeper.saved and all(p == tmp_path / "best" for p in keeper.saved)
    probe = gpt_engine(None, dropout=0.0)
    probe.load(tmp_path / "best")
    assert probe.evaluate(DATA[:8], batch_size=4)["loss"] == pytest.approx(best, rel=1e-6)


# -- safety ----------------------------------------------------------------------------------

def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = gpt_engine("dp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    engine.save(tmp_path / "step_00000002")
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.fit(DATA, batch_size=4, epochs=2, steps_per_epoch=2, verbose=0)
    assert engine.global_step == 4

    def broken(self, plan, planner):
        raise OSError("disk full")
    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[0\]: OSError: disk full"):
        engine.save(tmp_path / "step_00000004")
    monkeypatch.undo()
    assert not (tmp_path / "step_00000004").exists()
    assert (tmp_path / "step_00000004.partial").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    probe = gpt_engine(None)
    probe.load(latest_checkpoint(tmp_path))
    for name, value in probe.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_keep_last_prunes_older_checkpoints(tmp_path):
    engine = gpt_engine(None)
    engine.fit(DATA, batch_size=4, epochs=2, verbose=0, save_dir=tmp_path, save_freq=2,
               keep_last=2)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_00000010", "step_00000012"]


def test_metadata_that_unpickles_other_objects_is_refused(tmp_path):
    engine = gpt_engine(None)
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    engine.save(tmp_path / "ck")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        gpt_engine(None).load(tmp_path / "ck")


# -- errors ----------------------------------------------------------------------------------

def test_a_checkpoint_of_another_model_is_refused_with_its_keys(tmp_path):
    engine = gpt_engine(None)
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    engine.save(tmp_path / "ck")
    other = parity_gpt("adamw", layers=3)
    with pytest.raises(CheckpointMismatch, match=r"missing \(\d+\): model\.blocks\.2\."):
        ap.Engine(other, lm_loss, gpt_optimizer("adamw", other)[0]).load(tmp_path / "ck")
    wider = parity_gpt("adamw", vocab=80)
    with pytest.raises(CheckpointMismatch, match=r"shape mismatch.*wte.weight: saved "
                                                  r"\[64, 32\], model \[80, 32\]"):
        ap.Engine(wider, lm_loss).load(tmp_path / "ck")
    sgd = parity_gpt("adamw")
    with pytest.raises(CheckpointMismatch, match="optimizer state this SGD does not have"):
        ap.Engine(sgd, lm_loss, torch.optim.SGD(sgd.parameters(), lr=0.1)).load(tmp_path / "ck")


def test_an_engine_without_an_optimizer_reads_only_the_model(tmp_path):
    engine = gpt_engine("dp_tp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    engine.save(tmp_path / "ck")
    model = parity_gpt("adamw", dropout=0.1)
    reader = ap.Engine(model, lm_loss, strategy=strategy("tp"))
    reader.load(tmp_path / "ck")
    assert reader.evaluate(DATA[:8], batch_size=4)["loss"] == pytest.approx(
        engine.evaluate(DATA[:8], batch_size=4)["loss"], rel=1e-5)


def test_saving_mid_gradient_merge_cycle_is_refused(tmp_path):
    engine = gpt_engine("dp_merge", "sgd")
    engine.fit(DATA, batch_size=2, epochs=1, steps_per_epoch=3, verbose=0)
    with pytest.raises(ValueError, match="3 batch\\(es\\) into a gradient_merge cycle"):
        engine.save(tmp_path / "ck")


def test_loading_a_partial_or_missing_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        gpt_engine(None).load(tmp_path / "nothing")


def test_the_dump_lists_each_box_written_and_read(tmp_path):
    engine = gpt_engine("tp", debug={"simulate": True, "dump_dir": str(tmp_path / "dumps")})
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    engine.save(tmp_path / "ck")
    text = (tmp_path / "dumps" / "rank0" / "checkpoint_save_ck.txt").read_text()
    assert "model.blocks.0.attn.qkv.weight  [96, 32]  [16:32, 0:32]" in text
    reader = gpt_engine(None, debug={"dump_dir": str(tmp_path / "dumps")})
    reader.load(tmp_path / "ck")
    text = (tmp_path / "dumps" / "rank0" / "checkpoint_load_ck.txt").read_text()
    assert "model.blocks.0.attn.qkv.weight  [96, 32]  [0:96, 0:32]" in text


def test_a_value_no_process_writes_fails_the_save(tmp_path, monkeypatch):
    """A writer rule that leaves a value to nobody is caught before the commit."""
    from autopar.state import checkpointing
    engine = gpt_engine("dp")
    engine.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    rule = checkpointing.writes_piece
    monkeypatch.setattr(checkpointing, "writes_piece",
                        lambda piece: piece.name != "wte.weight" and rule(piece))
    with pytest.raises(CheckpointError, match="no process wrote model.head.weight, "
                                              "model.wte.weight"):
        engine.save(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_a_pipeline_stage_mesh_micro_batch_dim_is_not_a_replica():
    """Every process sits at coordinate 0 of a stage mesh's ``mb`` dim: exactly one of the
    dp replicas writes each value, whatever its name hashes to."""
    mesh = ProcessMesh(torch.arange(8).reshape(2, 4), dim_names=["dp", "mb"])
    for name in (f"w{i}" for i in range(20)):
        writers = [dp for dp in range(2) if writes_piece(StatePiece(
            StateKey.of_param(name), (4,), torch.float32,
            DistAttr(mesh, (Replicate(), Replicate())), (dp, 0)))]
        assert len(writers) == 1, name
