"""What a step makes on the device is read on the host only where it is logged
(``engine/readings.py``): ``fit`` reads each step's loss at its log steps (and for the
epoch's mean), callbacks that read a step's logs read it then, and the history has every
value whenever anyone reads it. A counting stand-in for the device copy checks where the
reads happen; the values are the same as the eager reads' were."""
from __future__ import annotations

import torch

import autopar as ap
from autopar.engine.callbacks import Callback
from autopar.engine.readings import History, Reading, StepLogs

from ..parity import lm_data, parity_gpt


def test_a_reading_is_its_tensors_value_read_once():
    reading = Reading(torch.tensor(2.5))
    assert reading.value() == 2.5 and reading.value() == 2.5


def test_history_values_join_in_order_when_read():
    history = History(lr=[0.1])
    history.add("loss", Reading(torch.tensor(1.0)))
    history.setdefault("lr", []).append(0.2)          # another key: nothing read
    assert len(history._pending) == 1
    history.add("loss", Reading(torch.tensor(2.0)))
    assert history["loss"] == [1.0, 2.0] and not history._pending
    history.add("loss", Reading(torch.tensor(3.0)))
    assert dict(history) == {"lr": [0.1, 0.2], "loss": [1.0, 2.0, 3.0]}


def test_step_logs_read_a_reading_when_a_callback_reads_it():
    logs = StepLogs({"loss": Reading(torch.tensor(4.0)), "compile_s": 1.5})
    logs["lr"] = 0.1
    assert dict(logs) == {"loss": 4.0, "compile_s": 1.5, "lr": 0.1}
    assert logs.copy() == dict(logs)


class _Counted(Reading):
    reads: list[int] = []

    def value(self) -> float:
        if self._value is None:
            _Counted.reads.append(len(_Counted.made))
        return super().value()


_Counted.made = []


def _counting(monkeypatch):
    _Counted.reads, _Counted.made = [], []

    def make(tensor):
        reading = _Counted(tensor)
        _Counted.made.append(reading)
        return reading
    monkeypatch.setattr("autopar.engine.engine.Reading", make)
    return _Counted


def _engine():
    model = parity_gpt("adamw")
    return ap.Engine(model, ap.models.gpt.lm_loss, torch.optim.AdamW(model.parameters()))


def test_fit_reads_the_loss_at_log_steps_only(monkeypatch):
    counted = _counting(monkeypatch)
    engine = _engine()
    history = engine.fit(lm_data(12 * 2, 16, 64), batch_size=2, log_freq=4, verbose=2)
    # read at the log steps, each time with every loss made so far (the reads at step 4 find
    # steps 1-4 queued, at 8 steps 5-8...); nothing read between them
    assert counted.reads[:4] == [4, 4, 4, 4] and counted.reads[4:8] == [8] * 4
    assert len(counted.reads) == 12 and len(history["loss"]) == 12


def test_a_callback_that_reads_every_step_gets_every_value(monkeypatch):
    counted = _counting(monkeypatch)
    seen = []

    class EveryStep(Callback):
        def on_step_end(self, step, logs):
            seen.append(logs["loss"])
            assert counted.reads[-1] == len(counted.made)      # read right away
    history = _engine().fit(lm_data(6 * 2, 16, 64), batch_size=2, log_freq=100, verbose=0,
                            callbacks=[EveryStep()])
    assert seen == history["loss"] and len(seen) == 6


def test_train_step_returns_its_loss_as_before():
    engine = _engine()
    x, y = (torch.stack(t) for t in zip(*lm_data(2, 16, 64)))
    loss = engine.train_step(x, y)
    assert isinstance(loss, float) and loss > 0
