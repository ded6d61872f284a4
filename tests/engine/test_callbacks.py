"""Callbacks around fit / evaluate / predict: the hooks' order and counts, stopping from a
callback, EarlyStopping's stopping epoch against a hand-written eager loop, CSVLogger's file,
LRMonitor's learning rates, ReduceLROnPlateau stepped per epoch on the validation loss as
eager torch steps it, the progress display as before, and the errors."""
from __future__ import annotations

import csv
import re
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import autopar as ap
from autopar.engine.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    LRMonitor,
    ProgressBar,
    TensorBoard,
)
from autopar.models import MLP

from ..multiproc import run_ranks
from ..parity import (
    assert_same_losses,
    assert_same_params,
    one_thread,  # noqa: F401  (a fixture: pytestmark uses it)
    regression_data,
    twin,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN, VALID = regression_data(8, 16, 8), regression_data(8, 16, 8, seed=1)   # 2 batches of 4


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _model():
    torch.manual_seed(0)
    return MLP(16, 32, 8)


def _engine(model, lr=0.05, scheduler=None, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return ap.Engine(model, _mse, optimizer,
                     lr_scheduler=scheduler(optimizer) if scheduler else None, **kwargs)


class Recorder(Callback):
    """Every hook call, as (hook, its position argument or None)."""

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            calls = object.__getattribute__(self, "calls")
            return lambda *args: calls.append((name, args[0] if len(args) == 2 else None))
        return object.__getattribute__(self, name)


def _eager_epochs(model, optimizer, epochs, scheduler=None):
    """The eager loop: per epoch its training losses and its validation loss (batch-size
    weighted mean, as ``evaluate`` averages), stepping ``scheduler`` on the latter."""
    losses, val_losses, lrs = [], [], []
    for _ in range(epochs):
        lrs.append(optimizer.param_groups[0]["lr"])
        model.train()
        for x, y in DataLoader(TRAIN, batch_size=4):
            optimizer.zero_grad()
            loss = _mse(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            val_losses.append(sum(_mse(model(x), y).item() * len(x)
                                  for x, y in DataLoader(VALID, batch_size=4)) / len(VALID))
        if scheduler is not None:
            scheduler.step(val_losses[-1])
        yield losses, val_losses, lrs


def test_fit_calls_the_hooks_in_order_with_their_counts():
    recorder = Recorder()
    _engine(_model()).fit(TRAIN, batch_size=4, epochs=2, valid_data=VALID, valid_freq=2,
                          verbose=0, callbacks=[recorder])
    epoch = lambda e, val: ([("on_epoch_begin", e)]  # noqa: E731
                            + [("on_step_begin", 1), ("on_step_end", 1),
                               ("on_step_begin", 2), ("on_step_end", 2)]
                            + ([("on_eval_begin", None), ("on_eval_step_end", 1),
                                ("on_eval_step_end", 2), ("on_eval_end", None)] if val else [])
                            + [("on_epoch_end", e)])
    assert recorder.calls == ([("on_train_begin", None)]
                              + epoch(0, False) + epoch(1, True) + [("on_train_end", None)])


def test_evaluate_and_predict_call_their_hooks_with_the_scores():
    engine = _engine(_model())
    seen = {}

    class Keep(Callback):
        def on_eval_end(self, logs):
            seen["eval"] = dict(logs)

        def on_predict_end(self, logs):
            seen["predict"] = dict(logs)

    scores = engine.evaluate(VALID, batch_size=4, callbacks=[Keep()])
    outputs = engine.predict([x for x, _ in VALID], batch_size=3, callbacks=Keep())
    assert seen == {"eval": scores, "predict": {"steps": len(outputs)}} and len(outputs) == 3


def test_a_callback_stops_training_after_the_batch_it_saw():
    class StopAtThird(Callback):
        def on_step_end(self, step, logs):
            self.engine.stop_training = step == 1 and len(self.engine.history["loss"]) == 3

    recorder = Recorder()
    history = _engine(_model()).fit(TRAIN, batch_size=4, epochs=5, verbose=0,
                                    callbacks=[StopAtThird(), recorder])
    assert len(history["loss"]) == 3
    hooks = [h for h, _ in recorder.calls]
    assert hooks.count("on_epoch_end") == 2 and hooks[-1] == "on_train_end"


def test_early_stopping_stops_where_the_eager_loop_stops():
    patience, epochs = 2, 12
    model = _model()
    ref = twin(model)
    stop = EarlyStopping("val_loss", patience=patience)
    history = _engine(model).fit(TRAIN, batch_size=4, epochs=epochs, valid_data=VALID,
                                 verbose=0, callbacks=[stop])
    best, wait = float("inf"), 0                     # the rule, written out over eager torch
    for losses, val_losses, _ in _eager_epochs(ref, torch.optim.SGD(ref.parameters(), lr=0.05),
                                               epochs):
        if val_losses[-1] < best:
            best, wait = val_losses[-1], 0
        else:
            wait += 1
            if wait > patience:
                break
    assert 1 < len(val_losses) < epochs and stop.stopped_epoch == len(val_losses) - 1
    assert_same_losses(history["val_loss"], val_losses)
    assert_same_losses(history["loss"], losses)
    assert_same_params(model, ref)


def test_early_stopping_modes_and_missing_monitor():
    with pytest.raises(ValueError, match="mode 'best'"):
        EarlyStopping(mode="best")
    assert EarlyStopping("val_accuracy").sign == -1.0 and EarlyStopping("loss").sign == 1.0
    with pytest.warns(UserWarning, match="monitor 'val_los' is not in the epoch's logs"):
        _engine(_model()).fit(TRAIN, batch_size=4, valid_data=VALID, verbose=0,
                              callbacks=[EarlyStopping("val_los")])


def test_csv_logger_writes_one_row_per_epoch_or_per_step(tmp_path):
    by_epoch, by_step = CSVLogger(tmp_path / "epochs.csv"), CSVLogger(tmp_path / "steps.csv",
                                                                        per="step")
    history = _engine(_model()).fit(TRAIN, batch_size=4, epochs=3, valid_data=VALID,
                                    valid_freq=2, verbose=0, callbacks=[by_epoch, by_step])
    with open(tmp_path / "epochs.csv") as f:
        epochs = list(csv.DictReader(f))
    assert [list(r) for r in epochs] == [["epoch", "loss", "val_loss"]] * 3
    assert [r["epoch"] for r in epochs] == ["0", "1", "2"]
    assert [r["val_loss"] for r in epochs] == ["", repr(history["val_loss"][0]), ""]
    means = [(a + b) / 2 for a, b in zip(history["loss"][::2], history["loss"][1::2])]
    assert [float(r["loss"]) for r in epochs] == means
    with open(tmp_path / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert [(r["epoch"], r["step"]) for r in steps] == [(str(e), str(s)) for e in range(3)
                                                        for s in (1, 2)]
    assert [float(r["loss"]) for r in steps] == history["loss"]
    assert [float(r["lr"]) for r in steps] == history["lr"]


def test_only_the_logging_rank_writes_and_prints(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ap.Engine, "is_logging_rank", property(lambda self: False))
    history = _engine(_model()).fit(TRAIN, batch_size=4, valid_data=VALID, verbose=2,
                                    log_freq=1, callbacks=[CSVLogger(tmp_path / "log.csv")])
    assert len(history["loss"]) == 2 and not (tmp_path / "log.csv").exists()
    assert capsys.readouterr().out == ""


def test_lr_monitor_records_each_groups_lr_per_step():
    model = _model()
    ref = twin(model)

    def groups(m):
        return [{"params": m.layers.parameters()},
                {"params": m.head.parameters(), "lr": 0.01}]

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    optimizer = torch.optim.SGD(groups(model), lr=0.05)
    engine = ap.Engine(model, _mse, optimizer, lr_scheduler=schedule(optimizer))
    seen = []

    class Logs(Callback):
        def on_step_end(self, step, logs):
            seen.append(dict(logs))

    history = engine.fit(TRAIN, batch_size=4, epochs=4, verbose=0, callbacks=[Logs()])
    eager_opt = torch.optim.SGD(groups(ref), lr=0.05)
    eager_schedule, expected = schedule(eager_opt), []
    for _ in range(8):
        expected.append([g["lr"] for g in eager_opt.param_groups])
        eager_opt.step()
        eager_schedule.step()
    assert [[a, b] for a, b in zip(history["lr"], history["lr/1"])] == expected
    assert [[s["lr"], s["lr/1"]] for s in seen] == expected
    # the first step planned the program and says how long that took
    assert list(seen[0]) == ["loss", "plan_s", "lr", "lr/1"]
    assert list(seen[1]) == ["loss", "lr", "lr/1"]


def test_reduce_lr_on_plateau_steps_per_epoch_on_the_validation_loss():
    epochs = 5
    model = _model()
    ref = twin(model)

    def plateau(opt):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)

    history = _engine(model, lr=0.1, scheduler=plateau).fit(
        TRAIN, batch_size=4, epochs=epochs, valid_data=VALID, verbose=0)
    eager_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    *_, (losses, val_losses, lrs) = _eager_epochs(ref, eager_opt, epochs, plateau(eager_opt))
    assert history["lr"][::2] == history["lr"][1::2] == lrs      # constant within an epoch
    assert len(set(lrs)) > 2                                      # it did reduce, twice or more
    assert_same_losses(history["val_loss"], val_losses)
    assert_same_losses(history["loss"], losses)
    assert_same_params(model, ref)


def test_reduce_lr_on_plateau_without_validation_uses_the_epochs_training_loss():
    def plateau(opt):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5,
                                                          patience=0)

    history = _engine(_model(), lr=0.1, scheduler=plateau).fit(TRAIN, batch_size=4, epochs=4,
                                                                verbose=0)
    means = [(a + b) / 2 for a, b in zip(history["loss"][::2], history["loss"][1::2])]
    eager_opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    eager, lrs = plateau(eager_opt), []
    for mean in means:                    # eager torch's scheduler fed the same epoch means
        lrs.append(eager_opt.param_groups[0]["lr"])
        eager.step(mean)
    assert history["lr"][::2] == history["lr"][1::2] == lrs
    assert lrs == [0.1, 0.1, 0.05, 0.025]  # the loss falls: "max" mode reduces from epoch 2 on


def test_reduce_lr_on_plateau_under_gradient_merge_steps_per_epoch_too():
    def plateau(opt):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)

    strategy = ap.Strategy(gradient_merge={"k_steps": 2, "avg": True})
    history = _engine(_model(), lr=0.1, scheduler=plateau, strategy=strategy).fit(
        TRAIN, batch_size=2, epochs=4, valid_data=VALID, verbose=0)   # 2 optimizer steps/epoch
    eager_opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    eager, lrs = plateau(eager_opt), []
    for val_loss in history["val_loss"]:       # eager torch's scheduler fed the same losses
        lrs.append(eager_opt.param_groups[0]["lr"])
        eager.step(val_loss)
    assert [history["lr"][i:i + 4] for i in range(0, 16, 4)] == [[lr] * 4 for lr in lrs]
    assert len(set(lrs)) > 1


def test_progress_display_looks_as_before(capsys):
    engine = _engine(_model())
    engine.fit(TRAIN, batch_size=4, epochs=2, valid_data=VALID, log_freq=1, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    step = r"epoch {e}/2 step {s}/2 loss: \d+\.\d{{4}} lr: 0\.0500 \(\d+\.\d+ steps/s\)"
    planned = r"epoch 1/2 step 1: planned a new program for this batch's shapes in \d+\.\d\d s"
    expected = [planned, step.format(e=1, s=1), step.format(e=1, s=2),
                r"validation loss: \d+\.\d{4}",
                step.format(e=2, s=1), step.format(e=2, s=2), r"validation loss: \d+\.\d{4}"]
    assert len(lines) == len(expected)
    assert all(re.fullmatch(p, line) for p, line in zip(expected, lines)), lines

    engine.fit(TRAIN, batch_size=4, epochs=3, verbose=1)     # the run's third epoch
    out = capsys.readouterr().out
    assert re.fullmatch(r"(\repoch 3/3 [12]/2 \[=*\.*\] loss: \d+\.\d{4} lr: 0\.0500 "
                        r"\d+\.\ds){2}\n", out), repr(out)
    assert "[" + "=" * 30 + "]" in out

    engine.evaluate(VALID, batch_size=4, log_freq=1, verbose=2)
    assert re.fullmatch(r"(evaluate step [12]/\? loss: \d+\.\d{4} \(\d+\.\d+ steps/s\)\n){2}",
                        capsys.readouterr().out)

    engine.fit(TRAIN, batch_size=4, epochs=4, verbose=0)
    engine.fit(TRAIN, batch_size=4, epochs=5, verbose=0,
               callbacks=[ProgressBar(verbose=2, log_freq=2)])
    assert capsys.readouterr().out.count("step 2/2") == 1


def test_a_callback_that_is_not_a_callback_is_a_type_error():
    engine = _engine(_model())

    class Duck:
        def on_epoch_end(self, epoch, logs):
            pass

    for bad in (Duck(), EarlyStopping, print):
        with pytest.raises(TypeError, match="is not an autopar Callback: subclass "
                                            "autopar.callbacks.Callback"):
            engine.fit(TRAIN, batch_size=4, verbose=0, callbacks=[bad])
    with pytest.raises(TypeError, match="not an autopar Callback"):
        engine.evaluate(VALID, callbacks=[Duck()])
    assert "loss" not in engine.history                  # refused before any batch


def test_exceptions_in_callbacks_propagate():
    class Boom(Callback):
        def on_step_end(self, step, logs):
            raise RuntimeError(f"boom at step {step}")

    engine = _engine(_model())
    with pytest.raises(RuntimeError, match="boom at step 1"):
        engine.fit(TRAIN, batch_size=4, verbose=0, callbacks=[Boom()])
    assert len(engine.history["loss"]) == 1


def test_callbacks_run_alike_on_the_simulated_dp2_mesh():
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]},
                           data_parallel={"axis": "dp"}, debug={"simulate": True})
    stops = [EarlyStopping(patience=2), EarlyStopping(patience=2)]
    serial, dp = (_engine(_model(), **kw).fit(TRAIN, batch_size=4, epochs=12, valid_data=VALID,
                                              verbose=0, callbacks=[stop])
                  for stop, kw in zip(stops, ({}, {"strategy": strategy})))
    assert stops[0].stopped_epoch == stops[1].stopped_epoch is not None
    assert_same_losses(dp["val_loss"], serial["val_loss"])


def test_on_two_real_ranks_every_rank_stops_alike_and_rank0_alone_writes(tmp_path):
    model = _model()
    stop = EarlyStopping(patience=2)
    serial = _engine(model).fit(TRAIN, batch_size=4, epochs=12, valid_data=VALID, verbose=0,
                                callbacks=[stop])
    ranks = run_ranks("train_callbacks", 2, str(tmp_path), "12")
    assert [r["stopped_epoch"] for r in ranks] == [stop.stopped_epoch] * 2
    for r in ranks:
        assert_same_losses(r["val_loss"], serial["val_loss"])
    assert [f.name for f in tmp_path.glob("*.csv")] == ["log_rank0.csv"]
    with open(tmp_path / "log_rank0.csv") as f:
        assert len(list(csv.DictReader(f))) == stop.stopped_epoch + 1
    assert ranks[0]["printed"].count("validation loss:") == stop.stopped_epoch + 1
    assert ranks[1]["printed"] == ""


def test_tensorboard_without_the_package_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="needs the 'tensorboard' package"):
        TensorBoard("runs")


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    _engine(_model()).fit(TRAIN, batch_size=4, epochs=2, verbose=0,
                          callbacks=[LRMonitor(), TensorBoard(tmp_path)])
    assert list(tmp_path.glob("events.out.tfevents.*"))
