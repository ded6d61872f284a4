"""Callbacks for ``fit`` / ``evaluate`` / ``predict``, Keras/Paddle-style.

A ``Callback`` overrides the hooks it needs; each gets the engine (``self.engine``: its
``history``, ``optimizer``, ``stop_training``...) and the loop's sizes (``self.params``).
Every rank runs every callback (each sees the same global losses, so a decision such as
early stopping is the same on all); only the logging rank prints or writes files.

Hook order in ``fit``: ``on_train_begin``; per epoch ``on_epoch_begin``, per batch
``on_step_begin`` / ``on_step_end``, the validation's ``on_eval_begin`` / ``on_eval_step_end``
/ ``on_eval_end`` when it runs, ``on_epoch_end``; ``on_train_end``.
"""
from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path
from typing import Any, Iterable

from ..checkpoint import prune
from .logging import ProgressLog

Logs = dict[str, Any]


class Callback:
    """No-op hooks; subclasses override what they need."""

    engine: Any = None
    params: dict[str, Any] = {}

    def set_engine(self, engine) -> None:
        self.engine = engine

    def set_params(self, params: dict[str, Any]) -> None:
        """The loop's sizes: ``epochs``, ``steps`` (per epoch, None when unknown),
        ``verbose``, ``log_freq``."""
        self.params = params

    def on_train_begin(self, logs: Logs) -> None: ...
    def on_train_end(self, logs: Logs) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs) -> None: ...
    def on_step_begin(self, step: int, logs: Logs) -> None: ...
    def on_step_end(self, step: int, logs: Logs) -> None: ...
    def on_eval_begin(self, logs: Logs) -> None: ...
    def on_eval_step_end(self, step: int, logs: Logs) -> None: ...
    def on_eval_end(self, logs: Logs) -> None: ...
    def on_predict_begin(self, logs: Logs) -> None: ...
    def on_predict_end(self, logs: Logs) -> None: ...


HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))


class CallbackList:
    """The callbacks of one loop, called in order; exceptions propagate."""

    def __init__(self, callbacks: Iterable[Callback] | None, engine,
                 before: Iterable[Callback] = (), after: Iterable[Callback] = ()):
        """``before``/``after``: defaults around the user's callbacks (the lr monitor fills
        the step's logs before loggers read them; the progress bar shows them last). A
        default yields to a callback of its kind among the user's."""
        given = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        for cb in given:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks: {cb!r} ({type(cb).__name__}) is not an "
                                "autopar Callback: subclass autopar.callbacks.Callback "
                                f"and override the hooks it needs ({', '.join(HOOKS)})")
        kinds = {type(cb) for cb in given}
        self.callbacks = ([d for d in before if type(d) not in kinds] + given
                          + [d for d in after if type(d) not in kinds])
        for cb in self.callbacks:
            cb.set_engine(engine)

    def set_params(self, params: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.set_params(params)

    def call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)


class ProgressBar(Callback):
    """The progress display (logging rank only): verbose=1 a bar redrawn each step, 2 a log
    line every ``log_freq`` steps; a validation summary line after each validation."""

    def __init__(self, verbose: int = 2, log_freq: int = 10):
        self.verbose, self.log_freq = verbose, log_freq
        self.log: ProgressLog | None = None
        self.training = False

    def _open(self, total: int | None, prefix: str) -> ProgressLog:
        return ProgressLog(self.verbose, self.log_freq, total, prefix,
                           enabled=self.engine.is_logging_rank)

    def on_train_begin(self, logs: Logs) -> None:
        self.training = True

    def on_train_end(self, logs: Logs) -> None:
        self.training = False

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        self.log = self._open(self.params.get("steps"),
                              f"epoch {epoch + 1}/{self.params.get('epochs', '?')}")

    def on_step_end(self, step: int, logs: Logs) -> None:
        self.log.step(step, logs)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.log is not None:     # not closed by a validation
            self.log.close()
            self.log = None

    def on_eval_begin(self, logs: Logs) -> None:
        if self.training:            # fit's validation: the bar of the epoch ends first
            self.log.close()
            self.log = None
        else:
            self.log = self._open(self.params.get("steps"), "evaluate")

    def on_eval_step_end(self, step: int, logs: Logs) -> None:
        if not self.training:
            self.log.step(step, logs)

    def on_eval_end(self, logs: Logs) -> None:
        if not self.training:
            self.log.close()
        elif self.verbose and self.engine.is_logging_rank:
            print("validation " + " ".join(f"{k}: {v:.4f}" for k, v in logs.items()))


class LRMonitor(Callback):
    """Each training batch's learning rate (the one its optimizer step used) into
    ``history["lr"]`` and the step's logs; with several parameter groups, group i's also
    as ``lr/i``. ``fit`` adds one by default."""

    def on_step_begin(self, step: int, logs: Logs) -> None:
        self.current = {_lr_key(i): g["lr"]
                        for i, g in enumerate(self.engine.optimizer.param_groups)}

    def on_step_end(self, step: int, logs: Logs) -> None:
        for key, lr in self.current.items():
            self.engine.history.setdefault(key, []).append(lr)
        logs.update(self.current)


def _lr_key(group: int) -> str:
    return "lr" if group == 0 else f"lr/{group}"


class EarlyStopping(Callback):
    """Stop ``fit`` when ``monitor`` (an epoch log: ``val_loss``, ``loss``, ``val_<metric>``)
    has not improved by more than ``min_delta`` for ``patience`` epochs in a row. ``mode``:
    "min", "max", or "auto" (max for names with "acc", else min). Epochs without the value
    (no validation that epoch) neither count nor reset. ``stopped_epoch``: the last epoch
    trained when it stopped (0-based), None when it did not."""

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0,
                 mode: str = "auto"):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"EarlyStopping: mode {mode!r} is not 'auto', 'min' or 'max'")
        if mode == "auto":
            mode = "max" if "acc" in monitor else "min"
        self.monitor, self.patience, self.min_delta = monitor, patience, abs(min_delta)
        self.sign = 1.0 if mode == "min" else -1.0     # compare as "lower is better"

    def on_train_begin(self, logs: Logs) -> None:
        self.best, self.wait, self.stopped_epoch = math.inf, 0, None

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.monitor not in logs:
            if self.monitor.startswith("val_") and not any(k.startswith("val_") for k in logs):
                return                       # no validation this epoch (valid_freq)
            warnings.warn(f"EarlyStopping: monitor {self.monitor!r} is not in the epoch's "
                          f"logs (it has {sorted(logs)}); nothing to stop on", stacklevel=2)
            return
        value = self.sign * float(logs[self.monitor])
        if value < self.best - self.min_delta:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_epoch = epoch
            self.engine.stop_training = True


class ModelCheckpoint(Callback):
    """Checkpoints during ``fit`` (``Engine.save``, on every rank): ``dirpath/step_<N>``
    every ``save_freq`` optimizer steps (``"epoch"``: at each epoch's end; None: never),
    keeping the newest ``keep_last`` (older ones and stale partial ones are removed); with
    ``monitor`` (an epoch log such as ``val_loss``), also ``dirpath/best`` whenever it
    improves (``mode`` "min" or "max"). ``fit(resume=True)`` continues from the newest
    ``step_<N>``. ``saved``: the paths written, in order.

    ``async_save``: each save is written in the background (``Engine.save(...,
    async_save=True)``); pruning counts only committed checkpoints and never touches the
    one in flight (the newest, still ``.partial``), so up to ``keep_last`` + 1 directories
    exist until the end of training, when the last save is waited for and pruning runs
    again."""

    def __init__(self, dirpath: str | Path, save_freq: int | str | None = "epoch",
                 keep_last: int = 2, monitor: str | None = None, mode: str = "min",
                 async_save: bool = False):
        if not (save_freq is None or save_freq == "epoch"
                or (isinstance(save_freq, int) and save_freq > 0)):
            raise ValueError(f"ModelCheckpoint: save_freq={save_freq!r} is not a positive "
                             "number of optimizer steps, 'epoch' or None")
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint: mode {mode!r} is not 'min' or 'max'")
        if keep_last < 1:
            raise ValueError(f"ModelCheckpoint: keep_last={keep_last} keeps nothing to resume")
        self.dirpath, self.save_freq, self.keep_last = Path(dirpath), save_freq, keep_last
        self.monitor, self.sign = monitor, 1.0 if mode == "min" else -1.0
        self.best, self.saved = math.inf, []
        self.async_save = async_save

    def on_step_end(self, step: int, logs: Logs) -> None:
        engine = self.engine
        k = engine.strategy.gradient_merge.k_steps
        if isinstance(self.save_freq, int) and engine.batches_trained % k == 0 \
                and engine.global_step % self.save_freq == 0:
            self._save_step()

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.save_freq == "epoch" and \
                self.engine.batches_trained % self.engine.strategy.gradient_merge.k_steps == 0:
            self._save_step()
        value = logs.get(self.monitor) if self.monitor else None
        if value is not None and self.sign * float(value) < self.best:
            self.best = self.sign * float(value)
            self.saved.append(self.engine.save(self.dirpath / "best",
                                               async_save=self.async_save))

    def on_train_end(self, logs: Logs) -> None:
        if self.async_save:
            self.engine.wait_for_checkpoint()
            self._prune()                # the last save is committed: it counts now

    def _save_step(self) -> None:
        path = self.dirpath / f"step_{self.engine.global_step:08d}"
        if self.saved and self.saved[-1] == path:
            return                       # this step is saved already (step and epoch end)
        # an async save first waits for the one before (committed: counted by prune)
        self.saved.append(self.engine.save(path, async_save=self.async_save))
        self._prune()

    def _prune(self) -> None:
        """Only complete checkpoints count and go; the one in flight is the newest step,
        which prune never removes (it removes partial ones older than the newest complete)."""
        if not self.engine.distributed or self.engine.is_logging_rank:
            prune(self.dirpath, self.keep_last)


class CSVLogger(Callback):
    """The logs as CSV, one row per epoch (``per="epoch"``) or per training batch
    (``per="step"``); columns in the order they first appear (an epoch without validation
    leaves its ``val_*`` cells empty). The logging rank writes; the file is rewritten at each
    epoch's end, so it is complete after every epoch (a later ``fit`` starts it anew)."""

    def __init__(self, path: str | Path, per: str = "epoch"):
        if per not in ("epoch", "step"):
            raise ValueError(f"CSVLogger: per={per!r} is not 'epoch' or 'step'")
        self.path, self.per = Path(path), per

    def on_train_begin(self, logs: Logs) -> None:
        self.rows: list[Logs] = []

    def on_step_end(self, step: int, logs: Logs) -> None:
        if self.per == "step":
            self.rows.append({"epoch": self.epoch, "step": step, **logs})

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.per == "epoch":
            self.rows.append({"epoch": epoch, **logs})
        if self.engine.is_logging_rank:
            self._write()

    def _write(self) -> None:
        columns = list(dict.fromkeys(k for row in self.rows for k in row))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)


class TensorBoard(Callback):
    """Scalars for TensorBoard through ``torch.utils.tensorboard.SummaryWriter`` (the
    optional ``tensorboard`` package: ``pip install 'autopar[tensorboard]'``): each training
    batch's logs under ``step/`` by batches trained, each epoch's under ``epoch/``. The
    logging rank writes."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:     # torch raises this when tensorboard is missing
            raise ImportError("the TensorBoard callback needs the 'tensorboard' package: "
                              "pip install tensorboard (or 'autopar[tensorboard]')") from e
        self.log_dir, self.make_writer = str(log_dir), SummaryWriter
        self.writer = None

    def on_train_begin(self, logs: Logs) -> None:
        if self.engine.is_logging_rank:
            self.writer = self.make_writer(self.log_dir)

    def _scalars(self, prefix: str, logs: Logs, at: int) -> None:
        if self.writer is not None:
            for key, value in logs.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{prefix}/{key}", value, at)

    def on_step_end(self, step: int, logs: Logs) -> None:
        self._scalars("step", logs, self.engine.batches_trained)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        self._scalars("epoch", logs, epoch)

    def on_train_end(self, logs: Logs) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
