"""Where the data stands is part of a checkpoint (``data/data_position.py``): a run resumed
from a checkpoint reads the batches the uninterrupted run read, for a DataLoader that
shuffles with torch's global generator, one with its own seeded generator (resumed in a
later epoch, where a fresh generator would replay the first epoch's order), and torchdata's
``StatefulDataLoader``, which continues from its own state without re-reading the batches
trained before the checkpoint. A checkpoint without a data position (written before autopar
kept one) still warns about an unseeded loader."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import autopar as ap
from autopar.data.data_position import DataPosition, EpochReader, loader_generators
from autopar.models.gpt import lm_loss
from autopar.state.checkpointing import DATA_KEY

from ..parity import gpt_optimizer, lm_data, one_thread, parity_gpt  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]
DATA = lm_data(24, 16, 64)


class Counted(Dataset):
    """DATA, counting the samples read (a replay reads the trained batches again)."""

    def __init__(self):
        self.reads = 0

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, i: int):
        self.reads += 1
        return DATA[i]


def engine(config: str | None = None) -> ap.Engine:
    model = parity_gpt("adamw", dropout=0.1)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    text = {None: "", "dp": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
            "debug: {simulate: true}\n"}[config]
    return ap.Engine(model, lm_loss, optimizer, lr_scheduler=scheduler,
                     strategy=ap.Strategy.from_yaml_str(text or "{}"))


def unseeded(data=DATA) -> DataLoader:
    return DataLoader(data, batch_size=4, shuffle=True)


def seeded(data=DATA) -> DataLoader:
    return DataLoader(data, batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(7))


def stateful(data=DATA):
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful_dataloader.StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))


def _resumed_equals_uninterrupted(tmp_path, make_loader, config=None, save_at=8,
                                  epochs=3) -> ap.Engine:
    """The run interrupted after ``save_at`` batches and resumed in a fresh engine (with
    torch's global generator moved, as a new process would have it) trains the rest of the
    uninterrupted run's batches, to the same parameters."""
    torch.manual_seed(1234)
    whole = engine(config)
    full = whole.fit(make_loader(), epochs=epochs, verbose=0)["loss"]
    torch.manual_seed(1234)
    first = engine(config)
    first.fit(make_loader(), epochs=epochs, verbose=0, save_dir=tmp_path, save_freq=save_at,
              keep_last=1, steps_per_epoch=None, callbacks=[_StopAt(save_at)])
    torch.manual_seed(99)       # a new process draws other numbers before it resumes
    again = engine(config)
    rest = again.fit(make_loader(), epochs=epochs, verbose=0, save_dir=tmp_path,
                     resume=True)["loss"]
    assert rest == full[save_at:]
    expected = whole.state_dict()
    for name, value in again.state_dict().items():
        assert torch.equal(value, expected[name]), name
    return again


class _StopAt(ap.engine.callbacks.Callback):
    def __init__(self, batches: int):
        self.batches = batches

    def on_step_end(self, step, logs):
        if self.engine.batches_trained >= self.batches:
            self.engine.stop_training = True


def test_an_unseeded_shuffling_loader_resumes_with_the_interrupted_order(tmp_path):
    """Mid-epoch (batch 2 of epoch 2): the epoch's order is drawn again from the global
    generator as it was when that epoch started; no warning."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _resumed_equals_uninterrupted(tmp_path, unseeded)


def test_a_seeded_loader_resumed_in_a_later_epoch_draws_that_epochs_order(tmp_path):
    """The loader's generator is where epoch 2 left it, not where a fresh one starts."""
    _resumed_equals_uninterrupted(tmp_path, seeded, config="dp")


def test_a_checkpoint_between_epochs_resumes_the_next_epochs_order(tmp_path):
    _resumed_equals_uninterrupted(tmp_path, unseeded, save_at=6)


def test_a_stateful_loader_continues_from_its_own_state_without_a_replay(tmp_path):
    made: list[Counted] = []

    def loader():
        made.append(Counted())
        return stateful(made[-1])
    _resumed_equals_uninterrupted(tmp_path, loader)
    # the resumed run read its 10 batches of 4 (18 - 8), none of the 8 trained before
    assert made[-1].reads == 40


def test_every_process_writes_its_own_data_position(tmp_path):
    trained = engine("dp")
    trained.fit(seeded(), epochs=1, verbose=0, steps_per_epoch=2)
    trained.save(tmp_path / "ck")
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata
    assert f"{DATA_KEY}/rank0" in keys


def test_an_epoch_reader_keeps_the_states_its_consumer_may_not_have_trained():
    loader = stateful()
    reader = EpochReader(loader, loader_generators(loader))
    it = reader.batches()
    for _ in range(4):
        next(it)
    assert reader.position(3).loader is not None
    with pytest.raises(RuntimeError, match="after batch 1 of the epoch was not kept"):
        reader.position(1)


def test_a_position_from_another_loader_is_refused():
    position = DataPosition([torch.get_rng_state()], None)
    with pytest.raises(ValueError, match="holds 0 loader generator state\\(s\\), the loader "
                                         "given draws from 1"):
        EpochReader(seeded(), loader_generators(seeded()), position)


def test_a_checkpoint_without_a_data_position_still_warns(tmp_path, monkeypatch):
    first = engine()
    first.fit(DATA, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    monkeypatch.setattr(ap.Engine, "_note_data_position", lambda self: None)
    first.state.progress.data = None
    first.save(tmp_path / "ck")
    again = engine()
    again.load(tmp_path / "ck")
    with pytest.warns(UserWarning, match="shuffles with torch's global generator"):
        again.fit(unseeded(), epochs=2, steps_per_epoch=2, verbose=0)
