"""Engine: the user's model, loss and optimizer in; fit / evaluate / predict out.

Read top to bottom: a batch arrives from the data feed (``autopar.data``), the engine finds
(or plans) the step for its shapes (the step planner, ``autopar.planner``: capture ->
passes -> lowering), gets that step's executor from its runtime (this process alone, every
rank simulated, or this rank of real processes), feeds it, and records the loss.
"""
from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..auto import AutoPlan, auto_profile, format_auto_plan, plan_auto, with_auto
from ..checkpoint import latest_checkpoint
from ..cost import Profile, StepTime, default_profile
from ..data import FEED_SECTIONS, Feed, steps_in
from ..divergence import Divergence, EagerDivergence, EagerModel, locate_divergence
from ..ir import Program, Slot
from ..pass_infra import explain_value, summarize
from ..pipeline import chrome_trace
from ..planner import PlanMade, PlannedStep, StepCost, StepPlanner, planned_sections
from ..runtime import DistributedRuntime, LocalRuntime, compile_seconds, resolve_device
from ..state import (
    BackgroundSaver,
    RunRecord,
    TrainState,
    export_full,
    load_checkpoint,
    place_model,
    save_checkpoint,
)
from ..strategy import Strategy
from .callbacks import Callback, CallbackList, LRMonitor, ModelCheckpoint, ProgressBar
from .elastic import resized
from .launch import Launch
from .offline import finish_offline_plan
from .readings import History, Reading, StepLogs

# Sections the engine honours itself, besides those the planner's passes and options
# implement and the data feed's: ``auto`` is settled on the first batch, before planning;
# ``elastic`` when the launch's world differs from the strategy's.
ENGINE_SECTIONS: frozenset[str] = frozenset({"auto", "elastic"})

Metric = Callable[[Any, Any], float]


class DivergenceError(RuntimeError):
    """``debug.locate_divergence``: a plan's step differs from one device's (the report
    names the first op that does)."""


class Engine:
    def __init__(self, model: torch.nn.Module, loss: Callable | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 metrics: dict[str, Metric] | Iterable[Metric] | None = None,
                 strategy: Strategy | None = None,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 init_fn: Callable[[torch.nn.Module], Any] | None = None):
        """``init_fn``: for a model built on the meta device, what initializes it (called
        with the model); by default its ``init_weights()``, else each submodule's
        ``reset_parameters()``. Each process draws only its pieces (``meta_init``)."""
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metrics = _named_metrics(metrics)
        self.launch = Launch.from_environ(os.environ)     # the only read of the environment
        offline = self.launch.offline
        if offline is not None and offline.strategy is not None:
            strategy = Strategy.from_yaml(offline.strategy)
        if offline is not None and offline.auto is not None:
            strategy = with_auto(strategy or Strategy(), offline.auto,
                                 keep_layout=offline.strategy is not None)
        self.strategy = strategy if strategy is not None else Strategy()
        if offline is not None:     # ``plan --ranks``: whose lowered programs are dumped
            self.strategy = self.strategy.model_copy(update={"debug": type(
                self.strategy.debug).model_validate({**self.strategy.debug.model_dump(),
                                                     "dump_ranks": offline.dump_ranks})})
        self._resize()
        self.strategy.check_supported(planned_sections() | FEED_SECTIONS | ENGINE_SECTIONS)
        # ``auto``: the search picks the strategy on the first batch (``_settle_auto``)
        self.auto_plan: AutoPlan | None = None
        self._check_auto_devices()
        self.dump_dir = self.launch.dump_dir(self.strategy)
        if self.strategy.debug.trace and self.dump_dir is None:
            raise ValueError("debug.trace writes <dump_dir>/pipeline_trace.json: set "
                             "debug.dump_dir (or AUTOPAR_DUMP_DIR)")
        # the strategy checked against its mesh and schedule before any process group exists
        self.planner = self._planner()
        merge = self.strategy.gradient_merge
        if merge.is_enabled and optimizer is None:
            raise ValueError(f"gradient_merge: {{k_steps: {merge.k_steps}}} accumulates "
                             "gradients for an optimizer step, but Engine(...) has no "
                             "optimizer: pass optimizer=..., or drop gradient_merge")
        # where every process computes: the model's parameters and buffers move there first
        self.device = resolve_device(self.strategy.device, self.launch.local_rank)
        offload = self.strategy.sharding.offload if self.strategy.sharding else None
        place_model(model, self.device, params_on_host=offload is not None and offload.params)
        if self.device.type == "cuda":        # float32 means float32 unless amp.tf32 says
            torch.backends.cuda.matmul.allow_tf32 = self.strategy.amp.tf32
            torch.backends.cudnn.allow_tf32 = self.strategy.amp.tf32
        self.state = TrainState(model, optimizer, lr_scheduler, init_fn)
        simulate = self.strategy.debug.simulate
        if self.launch.several(simulate):
            self.runtime = DistributedRuntime(
                self.launch.rank, self.launch.world_size, self.device,
                timedelta(seconds=self.strategy.collective_timeout_s))
        else:
            self.runtime = LocalRuntime(self.state.tensors, simulate, self.launch.world_size,
                                        self.device)
        self.feed = Feed(self.strategy, self.device, self.planner.layout.mesh,
                         *((self.launch.rank, self.runtime.gather) if self.distributed
                           else (None, None)))
        # the checkpoint written in the background (``save(async_save=True)``), if any
        self._background = BackgroundSaver(timedelta(seconds=self.strategy.collective_timeout_s))
        self.history = History()     # lists of floats by name (values join when read)
        self.stop_training = False   # a callback sets it; fit checks it after each batch
        self.last_compile_s = 0.0    # seconds the last step spent compiling (``compile:``)
        self.last_plan_s = 0.0       # seconds the last step spent planning (a new shape)
        self.closed = False

    # how far the run has trained (the training state's ``Progress``)
    @property
    def global_step(self) -> int:
        """Optimizer steps taken (gradient merge: one per ``k_steps`` batches)."""
        return self.state.progress.global_step

    @property
    def batches_trained(self) -> int:
        """Training batches run (batch i draws its random numbers from ``seed + i``)."""
        return self.state.progress.batches_trained

    @property
    def epoch(self) -> int:
        """``fit``'s current epoch (between epochs, the next one)."""
        return self.state.progress.epoch

    @property
    def batch_in_epoch(self) -> int:
        """Batches of the current epoch trained: with ``epoch``, the data position."""
        return self.state.progress.batch_in_epoch

    @property
    def lr_scheduler(self) -> Any:
        return self.state.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.state.lr_scheduler = scheduler

    def _planner(self) -> StepPlanner:
        simulate = self.strategy.debug.simulate
        return StepPlanner(self.model, self.loss, self.optimizer, self.strategy,
                           dump_dir=self.dump_dir,
                           process=self.launch.rank if self.launch.several(simulate) else None,
                           every=simulate)

    def _resize(self) -> None:
        """An elastic restart on another world size: the strategy for the world launched
        (``elastic.on_resize``; ``engine.elastic``), said on the logging rank."""
        if not self.launch.several(self.strategy.debug.simulate):
            return
        self.strategy, note = resized(self.strategy, self.launch.world_size,
                                      self.launch.restarts > 0)
        if note is not None and self.launch.rank == 0:
            print(note, flush=True)

    def _check_auto_devices(self) -> None:
        auto = self.strategy.auto
        if auto is not None and self.launch.several(self.strategy.debug.simulate) \
                and auto.devices != self.launch.world_size:
            raise ValueError(f"auto: {{devices: {auto.devices}}} but the launch started "
                             f"{self.launch.world_size} processes: plan for the processes "
                             "you launch (auto.devices = torchrun's --nproc-per-node x nodes)")

    def _settle_auto(self, inputs: Any, labels: Any) -> None:
        """Under ``auto``, choose the strategy from this (first) batch and plan with it from
        now on. On real processes rank 0 searches and the others take its choice."""
        if self.strategy.auto is None:
            return
        def choose() -> str:
            plan = plan_auto(self.model, self.loss, self.optimizer, self.strategy, inputs,
                             labels)
            self.auto_plan = plan
            return plan.strategy.to_yaml()
        text = self.runtime.agree(choose) if self.distributed else choose()
        chosen = Strategy.from_yaml_str(text)
        if self.is_logging_rank and self.auto_plan is not None and self.launch.offline is None:
            print(format_auto_plan(self.auto_plan), flush=True)
        self.strategy = chosen
        self.dump_dir = self.launch.dump_dir(chosen)
        self.planner = self._planner()
        self.feed.use(chosen, self.planner.layout.mesh)

    # -- planning -----------------------------------------------------------------------
    def prepare(self, inputs: Any, labels: Any = None, mode: str = "train",
                accumulate_only: bool = False) -> Program:
        """Plan the program for a sample (global) batch without running it: in one plain
        process, for any mesh size. Dumps are written; ``explain`` answers questions.
        ``accumulate_only``: gradient merge's program of the batches that only accumulate
        (the returned one is the cycle's last, which steps the optimizer)."""
        inputs, labels, _ = self.feed.shaped(mode, inputs, labels)
        self._settle_auto(inputs, labels)
        return _cycle_part(self.planner.plan(mode, inputs, labels), accumulate_only).program

    def cost(self, inputs: Any, labels: Any = None, mode: str = "train",
             profile: Profile | None = None) -> StepCost:
        """Plan the step for a sample (global) batch without running it and return, per
        rank, its predicted memory (a ``MemoryEstimate``: bytes of parameters, gradients,
        optimizer state, buffers, peak activations, communication buffers and the peak;
        ``format_estimates`` prints them as a table), and in ``.time`` the predicted step
        time (``predict_time``; on ``profile``, default this machine's calibrated one, else
        the shipped reference, said in ``.profile_note``); with ``compile:``, ``.compile_s``
        is the seconds the step's programs took to compile once it has run (None before)."""
        inputs, labels, _ = self.feed.shaped(mode, inputs, labels)
        self._settle_auto(inputs, labels)
        step = self.planner.plan(mode, inputs, labels)
        note = ""
        if profile is None:
            profile, note = auto_profile(self.strategy)
        compiled = (compile_seconds(step.executor)
                    if step.executor is not None and step.lowered.compile is not None else None)
        return StepCost(self.planner.memory(step), self.planner.time(step, profile), note,
                        compiled)

    def predict_time(self, inputs: Any, labels: Any = None, mode: str = "train",
                     profile: Profile | None = None) -> StepTime:
        """Plan the step for a sample (global) batch without running it and predict its
        time from a machine profile (default: this machine's, measured by ``python -m
        autopar calibrate``): per rank, compute, exposed communication and op count, and the
        step's seconds, the slowest rank's (``cost.predict``)."""
        profile = profile if profile is not None else default_profile()
        inputs, labels, _ = self.feed.shaped(mode, inputs, labels)
        self._settle_auto(inputs, labels)
        return self.planner.time(self.planner.plan(mode, inputs, labels), profile)

    def explain(self, what: str, mode: str = "train", depth: int = 0) -> str:
        """Why a value of the last planned ``mode`` program has its placement: ``what`` is a
        dump name (``%12``), a result (``loss``, ``grad[fc1.weight]``) or a parameter/input
        name (``fc1.weight``, ``batch/0``). The answer first, in at most 10 lines (placement,
        the rule and pass that made it, the annotations and strategy choices behind it);
        ``depth`` > 0 adds the chain of reasons, value by value, that many levels deep."""
        step = self.planner.last(mode)
        if step is None:
            raise ValueError(f"explain: nothing planned for mode {mode!r} yet; call "
                             f"engine.prepare(sample_inputs, sample_labels, mode={mode!r})")
        return explain_value(step.program, what, depth)

    def summary(self, mode: str = "train") -> str:
        """The last planned ``mode`` step at a glance: mesh, placements, communication, and
        a pipeline's stages, bubble and messages."""
        step = self.planner.last(mode)
        if step is None:
            raise ValueError(f"summary: nothing planned for mode {mode!r} yet")
        return summarize(step.program, step.facts.mesh, step.lowered.jobs)

    def locate_divergence(self, inputs: Any, labels: Any = None, seed: int | None = None,
                          rtol: float = 1e-4, atol: float = 1e-5,
                          accumulate_only: bool = False, reference: str = "plan"
                          ) -> Divergence | EagerDivergence | None:
        """Where does the plan first stop computing what one device computes (None: it
        does not)? Changes no state; reads the model's current values.

        ``reference="plan"``: one training step of the plan for this batch runs on the
        simulator, op by op next to the plan's own global program on one device; the first
        op whose ranks' pieces, assembled, differ is returned (a ``Divergence``).
        ``accumulate_only``: gradient merge's step that only accumulates.

        ``reference="eager"``: the plan's global program on one device next to the user's
        model run eagerly (a copy; the same random draws, under amp O1 the same autocast):
        the first module whose forward output differs beyond its dtype's tolerance, then
        the loss, then each module's gradients in backward order, with the plan's ops inside
        it (an ``EagerDivergence``). This finds capture and rewrite bugs, which the plan's
        own reference shares."""
        self._settle_auto(inputs, labels)
        step = _cycle_part(self.planner.plan("train", inputs, labels), accumulate_only)
        self.state.materialize()
        eager = EagerModel(self.model, self.loss, inputs, labels, self.strategy.amp) \
            if reference == "eager" else None
        return locate_divergence(step.program, step.facts.mesh, self.state.tensors,
                                 self.state.initial, self._feeds(inputs, labels, "train"),
                                 self.strategy.seed if seed is None else seed,
                                 reference=reference, rtol=rtol, atol=atol, eager=eager)

    @property
    def distributed(self) -> bool:
        """Whether this engine runs its plans on several real processes (a launcher
        started more than one, and the strategy does not simulate them)."""
        return isinstance(self.runtime, DistributedRuntime)

    def _ready(self, mode: str, inputs: Any, labels: Any) -> PlannedStep:
        """The planned step with its executor (made on first use)."""
        if self.closed and self.distributed:
            raise RuntimeError("this engine was closed: its process groups are gone; make a "
                               "new Engine to train again")
        self._settle_auto(inputs, labels)
        made = len(self.planner.made)
        step = self.planner.plan(mode, inputs, labels)
        self._record_plan(self.planner.made[made:])
        if self.launch.offline is not None:      # ``python -m autopar plan`` ran the script
            finish_offline_plan(self, step.mode, self.launch.offline, inputs, labels)
        if step.executor is None:
            if not self.distributed:
                self.state.materialize()      # a meta model, whole in this one process
            self.state.learn(step.lowered.state_pieces())
            step.executor = self.runtime.executor(step.lowered, self.state.initial,
                                                  self.state.pieces)
            if step.lowered.pipeline is not None and self.strategy.debug.trace:
                step.executor.keep_trace()
        return step

    def _record_plan(self, made: list[PlanMade]) -> None:
        """A step that planned a new program says how long that took (the history's
        ``plan_s``, the step's log line) and for which shapes (``engine.planner.made``)."""
        self.last_plan_s = sum(m.seconds for m in made)
        if made:
            self.history.setdefault("plan_s", []).append(self.last_plan_s)

    def _feeds(self, inputs: Any, labels: Any, mode: str, shard: bool = False
               ) -> dict[str, Any]:
        """The step's feeds (``Feed.feeds``): random ops draw on the engine's device from
        here (engines in one process may use different ones)."""
        self.runtime.draw_on_device()
        groups = self.optimizer.param_groups if mode == "train" else None
        return self.feed.feeds(inputs, labels, groups, shard=shard)

    # -- one step -----------------------------------------------------------------------
    def train_step(self, inputs: Any, labels: Any = None) -> float:
        """Train on one batch; returns its loss. After an optimizer step the LR scheduler
        steps (unless it is a ``ReduceLROnPlateau``: ``fit`` steps that once per epoch on
        its metric). With ``gradient_merge`` the runtime steps through the planned cycle:
        the batch's gradients are accumulated, and every ``k_steps``-th batch (counted
        across epochs and ``fit`` calls) also runs the optimizer on their sum (their mean,
        ``avg``). The loss is read on the host when the step's work is done (``fit``
        reads it only where it logs: ``engine.readings``)."""
        return self._train(inputs, labels).value()

    def _train(self, inputs: Any, labels: Any) -> Reading:
        """One training step, queued: its loss as a reading copied without blocking."""
        inputs, labels, _ = self.feed.shaped("train", inputs, labels)
        step = self._ready("train", *self.feed.planning_batch(inputs, labels))
        batch = self.state.progress.batches_trained
        seed = self.strategy.seed + batch
        part = _cycle_part(step, not step.lowered.steps_optimizer(batch))
        if self.strategy.debug.locate_divergence and not part.checked:
            part.checked = True
            found = self.locate_divergence(inputs, labels, seed=seed,
                                           accumulate_only=part is not step)
            if found is not None:
                raise DivergenceError(str(found))
        compiled = compile_seconds(step.executor)
        results = step.executor.run(self._feeds(inputs, labels, "train", shard=True),
                                    seed=seed, batch=batch)
        self._record_compile(compile_seconds(step.executor) - compiled)
        self._record_reports(results)
        self.state.progress.batches_trained += 1
        if step.lowered.steps_optimizer(batch):
            self._after_optimizer_step()
        return Reading(results[Slot("loss")])

    def _after_optimizer_step(self) -> None:
        self.state.progress.global_step += 1
        self.optimizer._opt_called = True   # tells LR schedulers the optimizer stepped
        if self.lr_scheduler is not None and not self._on_plateau:
            self.lr_scheduler.step()

    @property
    def _on_plateau(self) -> bool:
        """A ReduceLROnPlateau scheduler steps once per epoch on its metric (``fit``), as
        Keras and Paddle step it, not once per optimizer step."""
        return isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _record_compile(self, seconds: float) -> None:
        """``compile:``: a step that compiled its program says how long that took (the
        history's ``compile_s``, and the step's log line)."""
        self.last_compile_s = seconds
        if seconds > 0:
            self.history.setdefault("compile_s", []).append(seconds)

    def _record_reports(self, results: dict[Slot, Any]) -> None:
        """What the step reports besides its loss goes into the history under its name: with
        loss scaling, the scale this step's gradients were scaled by (``loss_scale``) and
        whether an inf or nan skipped its update (``skipped``; the LR scheduler steps
        anyway, as eager code steps it after a GradScaler step that skipped
        ``optimizer.step()``)."""
        for slot, value in results.items():
            if slot.kind == "report":
                self.history.add(slot.name, Reading(value))

    def _forward(self, mode: str, inputs: Any, labels: Any) -> tuple[Reading | None, Any]:
        inputs, labels, fit = self.feed.shaped(mode, inputs, labels)
        step = self._ready(mode, inputs, labels)
        compiled = compile_seconds(step.executor)
        results = step.executor.run(self._feeds(inputs, labels, mode))
        self._record_compile(compile_seconds(step.executor) - compiled)
        loss = results.get(Slot("loss"))
        outputs = [v for s, v in results.items() if s.kind == "output"]
        return (None if loss is None else Reading(loss)), self.feed.outputs(step.spec, outputs,
                                                                            fit)

    # -- the Keras/Paddle-style loops ---------------------------------------------------
    def fit(self, train_data, batch_size: int = 1, epochs: int = 1,
            steps_per_epoch: int | None = None, log_freq: int = 10, valid_data=None,
            valid_freq: int = 1, valid_steps: int | None = None,
            collate_fn: Callable | None = None, shuffle: bool = False,
            verbose: int = 2, callbacks: Iterable[Callback] | None = None,
            save_dir: str | os.PathLike | None = None, save_freq: int | str = "epoch",
            keep_last: int = 2, resume: bool = False, save_async: bool = False
            ) -> dict[str, list[float]]:
        """Train; ``history["loss"]`` holds one global-batch mean loss per batch (with
        ``gradient_merge``, k batches make one optimizer step: ``train_step``) and
        ``history["lr"]`` each batch's learning rate. With ``amp.loss_scale``,
        ``history["loss_scale"]`` and ``history["skipped"]`` hold each optimizer step's
        scale and whether an inf/nan gradient skipped its update. ``callbacks``
        (``engine.callbacks``) run around each batch and epoch; one that sets
        ``engine.stop_training`` ends training after the current batch. A
        ``ReduceLROnPlateau`` scheduler steps after each epoch on its ``val_loss`` (its mean
        training loss when there is no ``valid_data``).

        ``epochs`` is the run's total, counted from its start (Lightning's ``max_epochs``;
        Keras' ``epochs`` with ``initial_epoch``): fit continues from the run's data position
        (the engine's, or a loaded checkpoint's) up to the end of epoch ``epochs``. So a
        second ``fit(epochs=1)`` after one epoch trains nothing, and says so; a script
        restarted from a checkpoint with the same call finishes the same run.

        Checkpoints: with ``save_dir``, a ``ModelCheckpoint`` saves ``save_dir/step_<N>``
        every ``save_freq`` optimizer steps (or each ``"epoch"``), keeping the last
        ``keep_last``. ``resume=True`` first loads the newest complete checkpoint there (if
        any) and continues from its data position. ``save_async=True`` writes them in the
        background (``save(async_save=True)``): training stalls only for the copy to CPU
        memory; fit waits for the last one before it returns."""
        if self.optimizer is None:
            raise ValueError("Engine.fit needs an optimizer: Engine(model, loss, optimizer=...)")
        if resume:
            self._resume_from(save_dir)
        progress = self.state.progress
        start, skip = progress.epoch, progress.batch_in_epoch
        loaded, progress.resume_at = progress.resume_at, None
        if start >= epochs:
            return self._nothing_to_train(epochs, loaded)
        saving = [ModelCheckpoint(save_dir, save_freq, keep_last, async_save=save_async)] \
            if save_dir else []
        hooks = CallbackList([*saving, *(callbacks or [])], self, before=[LRMonitor()],
                             after=_progress(verbose, log_freq))
        hooks.set_params({"epochs": epochs, "verbose": verbose, "log_freq": log_freq,
                          "steps": steps_in(train_data, batch_size, steps_per_epoch)})
        self.stop_training = False
        # a loaded checkpoint's data position: the first epoch resumes from it
        resume_data = self.feed.begin(train_data, progress.data, loaded, self.is_logging_rank)
        progress.data = None
        hooks.call("on_train_begin", {})
        for epoch in range(start, epochs):
            progress.epoch, progress.batch_in_epoch = epoch, skip
            hooks.call("on_epoch_begin", epoch, {})
            data, first = self.feed.epoch(train_data, batch_size, collate_fn, shuffle, epoch,
                                          skip, resume_data)
            resume_data = None
            logs = {"loss": self._train_epoch(data, steps_per_epoch, hooks, skip, log_freq,
                                              first)}
            skip = 0
            if valid_data is not None and (epoch + 1) % valid_freq == 0:
                scores = self._evaluate(valid_data, batch_size, valid_steps, collate_fn, hooks)
                for k, v in scores.items():
                    self.history.setdefault(f"val_{k}", []).append(v)
                    logs[f"val_{k}"] = v
            self._step_on_plateau(logs, valid_data is not None)
            progress.epoch, progress.batch_in_epoch = epoch + 1, 0
            hooks.call("on_epoch_end", epoch, logs)
            if self.stop_training:
                break
        hooks.call("on_train_end", {})
        self.wait_for_checkpoint()       # a callback's background save, committed or raised
        self._warn_mid_cycle()
        if not (self.distributed and self.state.deferred is not None):
            self.sync_model()     # a meta model's pieces stay pieces: state_dict() gathers
        if self.strategy.debug.trace:
            self._write_trace()
        self.history.settle()
        return self.history

    def _note_data_position(self) -> None:
        """Where ``fit``'s data stands, for the checkpoint about to be written."""
        progress = self.state.progress
        progress.data = self.feed.position(progress.batch_in_epoch)

    def _train_epoch(self, data, steps: int | None, hooks: CallbackList, skip: int = 0,
                     log_freq: int = 1, first: int = 1) -> float:
        """One epoch's batches (fewer when a callback stops training; resuming, the first
        ``skip`` were trained before the checkpoint: replayed and skipped, or, when the
        loader continues from its own state, not read again: ``data`` starts at batch
        ``first``); their mean loss."""
        losses: list[Reading] = []
        for step, (inputs, labels) in enumerate(data, start=first):
            if steps is not None and step > steps:
                break
            if step <= skip:
                continue
            hooks.call("on_step_begin", step, {})
            losses.append(self._train(inputs, labels))
            self.state.progress.batch_in_epoch = step
            self.history.add("loss", losses[-1])
            compiled = {"compile_s": self.last_compile_s} if self.last_compile_s else {}
            planned = {"plan_s": self.last_plan_s} if self.last_plan_s else {}
            hooks.call("on_step_end", step, StepLogs({"loss": losses[-1], **compiled,
                                                      **planned}))
            if step % max(1, log_freq) == 0:     # values read where they are logged, no sooner
                self.history.settle()
            if self.stop_training:
                break
        return sum(r.value() for r in losses) / max(len(losses), 1)

    def _step_on_plateau(self, logs: dict[str, float], validates: bool) -> None:
        """ReduceLROnPlateau: one step per epoch on the validation loss, on epochs that
        validated (the training loss when there is no validation data)."""
        if not self._on_plateau:
            return
        metric = logs.get("val_loss") if validates else logs["loss"]
        if metric is not None:
            self.lr_scheduler.step(metric)

    def _nothing_to_train(self, epochs: int, loaded: tuple[int, int] | None
                          ) -> dict[str, list[float]]:
        """A fit whose run already trained ``epochs``: it says so, and returns the history
        (with its usual keys, empty when nothing was ever trained)."""
        for key in ("loss", "lr"):
            self.history.setdefault(key, [])
        if not self.is_logging_rank:
            return self.history
        source = (f"the checkpoint it loaded ended at epoch {loaded[0]}, batch {loaded[1]}"
                  if loaded is not None else "this engine has trained them")
        warnings.warn(f"fit(epochs={epochs}): nothing to train: epochs counts the run's "
                      f"epochs from its start, and {self.epoch} are done ({source}); pass "
                      f"epochs={self.epoch + 1} or more to train further", stacklevel=3)
        return self.history

    def _warn_mid_cycle(self) -> None:
        """Gradient merge: batches of an unfinished cycle are in no parameter yet (the next
        batches trained finish it), which a model read after ``fit`` would not show."""
        step = self.planner.last("train")
        unfinished = step.lowered.unfinished(self.batches_trained) if step else 0
        if unfinished and self.is_logging_rank:
            warnings.warn(f"gradient_merge: fit ended {unfinished} batch(es) into a cycle of "
                          f"k_steps={step.lowered.k_steps}: their gradients wait in the "
                          "accumulators for the next batches trained, and are in no "
                          "parameter yet", stacklevel=3)

    def evaluate(self, valid_data, batch_size: int = 1, steps: int | None = None,
                 log_freq: int = 10, collate_fn: Callable | None = None,
                 verbose: int = 0, callbacks: Iterable[Callback] | None = None
                 ) -> dict[str, float]:
        """Mean loss and metrics over the data, weighted by batch size (eval mode)."""
        hooks = CallbackList(callbacks, self, after=_progress(verbose, log_freq))
        hooks.set_params({"steps": steps, "verbose": verbose, "log_freq": log_freq})
        return self._evaluate(valid_data, batch_size, steps, collate_fn, hooks)

    def _evaluate(self, valid_data, batch_size: int, steps: int | None,
                  collate_fn: Callable | None, hooks: CallbackList) -> dict[str, float]:
        seen: list[tuple[StepLogs, int]] = []     # each batch's scores (read at the end)
        hooks.call("on_eval_begin", {})
        data = self.feed.batches(valid_data, batch_size, collate_fn)
        for step, (inputs, labels) in enumerate(data, 1):
            if steps is not None and step > steps:
                break
            loss, outputs = self._forward("eval", inputs, labels)
            scores = StepLogs({"loss": loss} if loss is not None else {})
            scores.update({name: float(fn(outputs, labels)) for name, fn in self.metrics.items()})
            seen.append((scores, self.feed.rows(inputs)))
            hooks.call("on_eval_step_end", step, scores)
        totals: dict[str, float] = {}
        for batch_scores, n in seen:
            for k, v in batch_scores.items():
                totals[k] = totals.get(k, 0.0) + v * n
        count = sum(n for _, n in seen)
        scores = {k: v / max(count, 1) for k, v in totals.items()}
        hooks.call("on_eval_end", dict(scores))
        return scores

    def predict(self, test_data, batch_size: int = 1, steps: int | None = None,
                collate_fn: Callable | None = None, verbose: int = 0,
                callbacks: Iterable[Callback] | None = None) -> list[Any]:
        """The model's outputs for each batch, as full tensors in the model's own structure.
        ``callbacks`` get ``on_predict_begin`` and ``on_predict_end`` (its logs: ``steps``)."""
        hooks = CallbackList(callbacks, self)
        hooks.set_params({"steps": steps, "verbose": verbose})
        hooks.call("on_predict_begin", {})
        outputs = []
        data = self.feed.batches(test_data, batch_size, collate_fn)
        for step, (inputs, labels) in enumerate(data, 1):
            if steps is not None and step > steps:
                break
            outputs.append(self._forward("predict", inputs, None)[1])
        hooks.call("on_predict_end", {"steps": len(outputs)})
        return outputs

    # -- state --------------------------------------------------------------------------
    @property
    def is_logging_rank(self) -> bool:
        """Only rank 0 prints (every rank computes the same global loss)."""
        return not self.distributed or self.launch.rank == 0

    def programs(self) -> dict[str, Program]:
        return {f"{step.mode}{i}": step.program
                for i, step in enumerate(self.planner.steps.values())}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers by their module paths. On real processes the pieces
        are gathered: a collective, so every rank calls it."""
        self.sync_model()
        return {n: self.state.tensors[n] for n in self.state.module_state_names()}

    def save(self, path: str | os.PathLike, format: str = "dcp", async_save: bool = False
             ) -> Path:
        """``format="full"``: export the model's ``state_dict`` whole as one ``safetensors``
        file that ``model.load_state_dict`` and Hugging Face ``from_pretrained`` read
        (``state.safetensors_export``; gathered one tensor at a time; ``path`` a file, or a
        directory for ``path/model.safetensors``). Otherwise write a checkpoint to the directory
        ``path`` on torch.distributed.checkpoint: each process writes only the pieces it
        holds (parameters, buffers, optimizer and loss-scaler state) under their global
        shapes, with what exact resume needs (step counters, data position, LR scheduler
        and param groups) and the strategy it was written under. The directory appears
        only once every process has finished (it is written as ``<path>.partial`` and
        renamed). Every process calls it.

        ``async_save=True``: copy the state to CPU memory now and write it in the background
        (DCP's ``async_save``), returning once the copy is made: training may go on, the
        checkpoint holds the state of this call. It commits as above once every process's
        write finished. The next ``save``, ``load``, ``close`` (and the end of ``fit``) wait
        for it first, and raise ``CheckpointError`` naming the path if it failed;
        ``wait_for_checkpoint()`` waits for it explicitly. Returns the directory it will
        be."""
        self.wait_for_checkpoint()
        if async_save:
            if format != "dcp":
                raise ValueError(f"save: async_save=True writes a checkpoint (format='dcp'), "
                                 f"not format={format!r}")
            self._note_data_position()
            return self._background.save(self.state, self.runtime, path, self._run_record())
        if format == "full":
            return export_full(self.state, self.runtime, path)
        if format != "dcp":
            raise ValueError(f"save: format={format!r} is not 'dcp' (a checkpoint) or 'full' "
                             "(a safetensors export)")
        self._note_data_position()
        return save_checkpoint(self.state, self.runtime, path, self._run_record())

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Read a checkpoint written under any strategy into this engine's own: every
        process reads only the pieces it holds (before the first step, when that step places
        them). Restores the step counters, LR scheduler and param groups, and the data
        position the next ``fit`` continues from. A checkpoint of another model is refused,
        naming its missing, unexpected and reshaped keys. Returns the checkpoint's trainer
        record (``strategy``: the YAML it was written under). Every process calls it (after
        waiting for a background save in flight)."""
        self.wait_for_checkpoint()
        return load_checkpoint(self.state, self.runtime, path, self._run_record())

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the background save in flight (``save(async_save=True)``) is
        committed; its path, or None when none was in flight. Raises ``CheckpointError``,
        naming the path, when its write failed on any process (every process calls it)."""
        return self._background.wait()

    def _run_record(self) -> RunRecord:
        """The run's facts a checkpoint records (and where its dumps go)."""
        return RunRecord(self.strategy, self.launch.world_size,
                         self.launch.rank if self.distributed else 0, self.dump_dir,
                         [step.lowered for step in self.planner.steps.values()])

    def _resume_from(self, save_dir: str | os.PathLike | None) -> None:
        if save_dir is None:
            raise ValueError("fit(resume=True) resumes from the newest checkpoint in "
                             "save_dir: pass save_dir=...")
        found = latest_checkpoint(save_dir)
        if found is not None:
            self.load(found)
            if self.is_logging_rank:
                print(f"resuming from {found} (step {self.global_step}, epoch "
                      f"{self.epoch + 1}, batch {self.batch_in_epoch})", flush=True)

    def sync_model(self) -> None:
        """Put the trained values into the model's own tensors and the optimizer's state
        (on real processes the pieces are gathered: a collective; ``fit`` calls it at its
        end)."""
        self.state.write_back(self.runtime.names(), self.runtime.full)

    def close(self) -> None:
        """Release what the engine holds on real processes (its process groups; the
        default one too when the engine created it), so no collective or message is left
        pending at exit. Every process calls it after its last step (or leaves ``with
        Engine(...) as e``): they meet at a barrier first, so none tears down its
        connections while a peer is still finishing. Leaving ``with`` on an exception
        closes without the barrier. An atexit hook releases the groups for a script that
        does not close. A closed engine runs no more steps on real processes. A background
        save in flight is waited for first (a failed one raises, after the release)."""
        self._release(together=True)

    def _release(self, together: bool) -> None:
        try:
            self._background.close(together=together and not self.closed)
        finally:
            if not self.closed:
                self.runtime.close(together=together)
            self.closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._release(together=exc_type is None)

    # -- pipelines ----------------------------------------------------------------------
    def _last_pipeline(self, mode: str) -> PlannedStep | None:
        steps = [s for s in self.planner.steps.values() if s.mode == mode
                 and s.lowered.pipeline is not None and s.executor is not None]
        return steps[-1] if steps else None

    def peak_activation_bytes(self, mode: str = "train") -> list[int]:
        """A pipeline's high-water mark of activations held between jobs in the last step
        of ``mode``, per pipeline rank (on real processes: each rank's first process's,
        gathered; a collective, so every process calls it)."""
        step = self._last_pipeline(mode)
        if step is None:
            raise ValueError(f"peak_activation_bytes: no pipelined {mode!r} step has run")
        return step.executor.peaks()

    def _write_trace(self) -> None:
        """The last pipelined training step's jobs, per process on a timeline, as a
        Chrome/Perfetto trace: measured on real processes (a collective), the schedule's
        simulated timeline when simulating."""
        step = self._last_pipeline("train")
        if step is None:
            return
        events = step.executor.trace_events()
        if self.is_logging_rank:
            path = Path(self.dump_dir) / "pipeline_trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(chrome_trace(events)))


def _cycle_part(step: PlannedStep, accumulating: bool) -> PlannedStep:
    """A training step's plan, or with ``accumulating`` its gradient-merge cycle's
    accumulating one."""
    if not accumulating:
        return step
    if step.accumulating is None:
        raise ValueError(f"accumulate_only: the {step.mode} step accumulates gradients only "
                         "with gradient_merge (k_steps > 1)")
    return step.accumulating


def _progress(verbose: int, log_freq: int) -> list[Callback]:
    """The default progress display (none when silent)."""
    return [ProgressBar(verbose, log_freq)] if verbose else []


def _named_metrics(metrics) -> dict[str, Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        return dict(metrics)
    return {getattr(m, "__name__", f"metric{i}"): m for i, m in enumerate(metrics)}
