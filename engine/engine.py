"""Engine: the user's model, loss and optimizer in; fit / evaluate / predict out.

Read top to bottom: a batch arrives, the engine finds (or plans) the program for its
shapes, feeds it, and records the loss. Planning is capture -> passes -> executor; the
programs are cached by mode and batch signature.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from ..annotations import param_annotation
from ..ir import Program, Slot, StateKind
from ..ir.capture import StepSpec, capture, flatten_batch
from ..ir.dist import ProcessMesh
from ..passes.context import PassContext, PlanInputs
from ..passes.parallel_layout import ParallelLayout
from ..passes.explain import explain_value
from ..passes.lower_optimizer import initial_state
from ..passes.manager import PassManager
from ..passes.partition import partition
from ..pipeline.job_programs import format_jobs
from ..pipeline.jobs import PipelinePlan, plan_pipeline
from ..pipeline.layout import PipelineLayout
from ..pipeline.timeline import chrome_trace
from ..runtime.distributed import RankPieces, input_cutter, rank_executor
from ..runtime.executor import Executor
from ..runtime.process_groups import MeshGroups, init_distributed, mesh_groups, p2p_group
from ..runtime.pipeline import PipelineExecutor, PipelinePieces
from ..runtime.pipeline_simulator import PipelineSimulator
from ..runtime.simulator import SimulatedExecutor
from ..strategy import Strategy
from .data import batch_size_of, batches
from .logging import ProgressLog
from .offline import PlanningDone, current_session
from ..ir.attrs import NAME

# Strategy sections this version can plan (completion places every value); any other
# enabled section is refused up front.
PLANNED_SECTIONS: set[str] = {"mesh", "data_parallel", "tensor_parallel", "pipeline"}

Metric = Callable[[Any, Any], float]


@dataclass
class Plan:
    """One planned program: what it computes, how to feed it, and (once it first runs)
    its executor: planning alone allocates nothing, so a plan for a model too big for
    this machine can still be made and inspected."""

    spec: StepSpec
    program: Program
    pass_timings: dict[str, float]
    mesh: ProcessMesh | None      # None: serial
    executor: Executor | SimulatedExecutor | None = None
    local: Program | None = None  # this rank's program, on real processes
    cut_inputs: Callable[[dict], dict] | None = None   # full feeds -> this rank's
    pipeline: PipelinePlan | None = None   # every pipeline rank's jobs and messages


class Engine:
    def __init__(self, model: torch.nn.Module, loss: Callable | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 metrics: dict[str, Metric] | Iterable[Metric] | None = None,
                 strategy: Strategy | None = None,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None):
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        self.metrics = _named_metrics(metrics)
        self.strategy = strategy if strategy is not None else Strategy()
        self.lr_scheduler = lr_scheduler
        self._session = current_session()
        if self._session is not None and self._session.strategy is not None:
            self.strategy = self._session.strategy
        _check_plannable(self.strategy)
        self.layout = ParallelLayout.of(self.strategy)
        self.dump_dir = self.strategy.resolved_dump_dir(os.environ)
        if self._session is not None and self._session.dump_dir is not None:
            self.dump_dir = self._session.dump_dir
        if self.strategy.debug.trace and self.dump_dir is None:
            raise ValueError("debug.trace writes <dump_dir>/pipeline_trace.json: set "
                             "debug.dump_dir (or AUTOPAR_DUMP_DIR)")
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        # torchrun's environment, read once: which process this is
        self.launch_rank = int(os.environ.get("RANK", "0"))
        self.launch_world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # where earlier programs placed each parameter: later ones keep it there
        self._kept: dict[str, Any] = {}
        # this process's state, on real processes (a pipeline's: the pieces of its stages)
        self._pieces: RankPieces | PipelinePieces | None = None
        self._p2p_group = None
        # Serial runs alias the model's own tensors: the model trains in place.
        self.state: dict[str, Any] = {n: p.detach() for n, p in model.named_parameters()}
        self.state.update({n: b for n, b in model.named_buffers()})
        self._plans: dict[tuple, Plan] = {}
        self.global_step = 0
        self.history: dict[str, list[float]] = {}

    # -- planning -----------------------------------------------------------------------
    def prepare(self, inputs: Any, labels: Any = None, mode: str = "train") -> Program:
        """Plan the program for a sample (global) batch without running it: in one plain
        process, for any mesh size. Dumps are written; ``explain`` answers questions."""
        return self._plan(mode, inputs, labels).program

    def explain(self, what: str, mode: str = "train") -> str:
        """Why a value of the last planned ``mode`` program has its placement, traced back
        to the annotations: ``what`` is a dump name (``%12``), a result (``loss``,
        ``grad[fc1.weight]``) or a parameter/input name (``fc1.weight``, ``batch/0``)."""
        plans = [plan for (m, *_), plan in self._plans.items() if m == mode]
        if not plans:
            raise ValueError(f"explain: nothing planned for mode {mode!r} yet; call "
                             f"engine.prepare(sample_inputs, sample_labels, mode={mode!r})")
        return explain_value(plans[-1].program, what)

    @property
    def distributed(self) -> bool:
        """Whether this engine runs its plans on several real processes (a launcher
        started more than one, and the strategy does not simulate them)."""
        return self.launch_world_size > 1 and not self.strategy.debug.simulate

    def _runnable(self, plan: Plan) -> Plan:
        """The plan with its executor: serial, every rank in this process (simulate), or
        this rank's part on real processes. A launch that does not match the strategy is
        refused before any collective could hang."""
        if self._session is not None:
            self._session.engine, self._session.plan = self, plan
            raise PlanningDone()
        if plan.executor is not None:
            return plan
        if plan.pipeline is not None:
            return self._runnable_pipeline(plan)
        several = plan.mesh is not None and plan.mesh.size > 1
        if several and not self.strategy.debug.simulate:
            groups = self._groups(plan.mesh)
            self._pieces.adopt(plan.program, self.state, self._fresh_optimizer_state)
            plan.cut_inputs = input_cutter(plan.program, groups)
            plan.executor = rank_executor(plan.program, plan.local, groups, self._pieces)
            return plan
        if not several:
            self.strategy.check_world_size(self.launch_world_size)
        self._init_optimizer_state(plan.program)
        plan.executor = (SimulatedExecutor if several else Executor)(plan.program, self.state)
        return plan

    def _runnable_pipeline(self, plan: Plan) -> Plan:
        """A pipelined plan: every process in this one (simulate), or this process's jobs,
        with its groups, messages and pieces of the state its stages hold."""
        layout = plan.pipeline.layout
        if self.strategy.debug.simulate:
            self._init_optimizer_state(plan.program)
            plan.executor = PipelineSimulator(plan.program, plan.pipeline, self.state)
            return plan
        pieces = self._pipeline_pieces(layout)
        pieces.adopt(plan.program, self.state, self._fresh_optimizer_state)
        plan.executor = PipelineExecutor(plan.program, plan.pipeline, pieces, pieces.groups,
                                         self._p2p_group, self._device())
        if self.strategy.debug.trace:
            plan.executor.trace = []
        return plan

    def _last_pipeline(self, mode: str) -> Plan | None:
        plans = [plan for (m, *_), plan in self._plans.items()
                 if m == mode and plan.pipeline is not None and plan.executor is not None]
        return plans[-1] if plans else None

    def _write_trace(self) -> None:
        """The last pipelined training program's jobs, per process on a timeline, as a
        Chrome/Perfetto trace: measured on real processes (a collective), the schedule's
        simulated timeline when simulating."""
        plan = self._last_pipeline("train")
        if plan is None:
            return
        events = plan.executor.trace_events(self.launch_rank)
        if self.is_logging_rank:
            path = Path(self.dump_dir) / "pipeline_trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(chrome_trace(events)))

    def _pipeline_pieces(self, layout: PipelineLayout) -> PipelinePieces:
        """This process's place in the pipeline and its state (made once: every program
        of the engine keeps its state where the first put it)."""
        if self._pieces is not None:
            if not isinstance(self._pieces, PipelinePieces) or self._pieces.layout.stage_ids \
                    != layout.stage_ids:
                raise ValueError("an engine's programs share one pipeline layout; this program "
                                 f"is planned on {layout.describe()}")
            return self._pieces
        groups = None
        if layout.world_size > 1 or self.launch_world_size > 1:
            init_distributed(self._device(), layout.world_size)
            groups = mesh_groups(layout.full_mesh)
            self._p2p_group = p2p_group(layout.full_mesh)
        place = layout.locate(self.launch_rank)
        if place is None:
            raise ValueError(f"process {self.launch_rank} is in no stage of the "
                             f"{layout.describe()}")
        self._pieces = PipelinePieces(layout, groups, *place)
        return self._pieces

    def _groups(self, mesh: ProcessMesh) -> MeshGroups:
        """Join the launch's process group and make the mesh's groups (once)."""
        if self._pieces is None:
            init_distributed(self._device(), mesh.size)
            self._pieces = RankPieces.empty(mesh_groups(mesh))
        if self._pieces.groups.mesh != mesh:
            raise ValueError(f"this engine runs on {self._pieces.groups.mesh}; a program "
                             f"planned on {mesh} cannot share its state")
        return self._pieces.groups

    def _device(self) -> torch.device:
        first = next(iter(self.model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    def _plan(self, mode: str, inputs: Any, labels: Any) -> Plan:
        key = (mode, _signature(inputs), _signature(labels))
        if key not in self._plans:
            if mode == "train" and self.optimizer is None:
                raise ValueError("training needs an optimizer: Engine(model, loss, optimizer=...)")
            with _gc_paused():
                self._plans[key] = self._plan_once(mode, inputs, labels)
        return self._plans[key]

    def _plan_once(self, mode: str, inputs: Any, labels: Any) -> Plan:
        captured = capture(self.model, self.loss, inputs, labels, mode=mode)
        inputs_ = PlanInputs(self.strategy, mode, self.optimizer, self.param_names,
                             self.layout.mesh, self.layout.pipeline,
                             self._micro_batches(mode, inputs, labels),
                             self._param_annotations(), dict(self._kept),
                             rank=self.launch_rank if self.distributed else 0)
        ctx = PassContext(inputs_)
        manager = PassManager(verify=self.strategy.debug.verify, dump_dir=self.dump_dir)
        program = manager.run(captured.program, ctx)
        for op in program.states(StateKind.PARAM):
            if op.result.dist is not None:
                self._kept.setdefault(op.attrs[NAME], op.result.dist)
        mesh, pipeline = ctx.state.mesh, ctx.state.pipeline
        plan = Plan(captured.spec, program, dict(manager.timings), mesh)
        if pipeline is not None:
            plan.pipeline = plan_pipeline(program, pipeline, ctx.state.schedule)
            self._dump_jobs(program, plan.pipeline, manager, ctx)
        elif mesh is not None and mesh.size > 1:
            plan.local = self._partition(program, mesh, manager, ctx)
        return plan

    def _partition(self, program: Program, mesh: ProcessMesh, manager: PassManager,
                   ctx: PassContext) -> Program | None:
        """This rank's local program on real processes; offline and simulated plans dump
        every rank's (when dumping) and keep none."""
        if self.distributed and self._session is None:
            local = partition(program, mesh.coordinate(self.launch_rank))
            manager.dump_rank_program(local, "partition", ctx.inputs.rank, ctx)
            return local
        if self.dump_dir is not None:
            for rank in mesh.process_ids:
                local = partition(program, mesh.coordinate(rank))
                manager.dump_rank_program(local, "partition", rank, ctx)
        return None

    def _micro_batches(self, mode: str, inputs: Any, labels: Any) -> int | None:
        """How many micro-batches a pipelined program of this batch uses: the strategy's for
        training (the batch must divide into dp x micro_batches, or the gradient would not
        be the full batch's); eval and predict use as many as split their batch evenly."""
        pipe = self.strategy.pipeline
        if pipe is None:
            return None
        rows = batch_size_of(inputs)
        dp = self.strategy.degree("data_parallel")
        if mode == "train":
            if rows % (dp * pipe.micro_batches):
                raise ValueError(
                    f"batch of {rows} rows does not split into data_parallel={dp} x "
                    f"pipeline.micro_batches={pipe.micro_batches} equal micro-batches "
                    f"({dp * pipe.micro_batches} must divide the global batch size); "
                    f"use a batch size that is a multiple of {dp * pipe.micro_batches}")
            return pipe.micro_batches
        # eval and predict: as many equal micro-batches as the batch allows, up to training's
        return max((k for k in range(1, pipe.micro_batches + 1) if rows % (dp * k) == 0),
                   default=1)

    def _dump_jobs(self, program: Program, pipeline: PipelinePlan, manager: PassManager,
                   ctx: PassContext) -> None:
        """Each process's jobs (``NN_jobs.txt``): this one's on real processes, every
        process's when planning offline or simulating."""
        if self.dump_dir is None:
            return
        layout = pipeline.layout
        mine = self.distributed and self._session is None
        processes = [self.launch_rank] if mine else sorted(
            i for ids in layout.stage_ids for i in ids)
        for process in processes:
            pp, coordinate = layout.locate(process)
            manager.dump_rank_text(format_jobs(program, pipeline, pp, coordinate), "jobs",
                                   process, ctx)

    def _param_annotations(self) -> dict:
        found = {name: param_annotation(p) for name, p in self.model.named_parameters()}
        return {name: dist for name, dist in found.items() if dist is not None}

    def _fresh_optimizer_state(self, name: str) -> torch.Tensor | None:
        """The full initial value of optimizer state ``<param>/<key>`` (None where torch
        creates it on the first step)."""
        param_name, _, key = name.rpartition("/")
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            for p in group["params"]:
                if self.param_names[id(p)] == param_name:
                    return initial_state(self.optimizer, group, p)[key]
        raise KeyError(f"no initial value for program state {name!r}")

    def _init_optimizer_state(self, program: Program) -> None:
        wanted = {op.attrs[NAME] for op in program.states(StateKind.OPTIM)}
        if not wanted - self.state.keys():
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name = self.param_names[id(p)]
                for key, value in initial_state(self.optimizer, group, p).items():
                    self.state.setdefault(f"{name}/{key}", value)

    def _feeds(self, inputs: Any, labels: Any, mode: str) -> dict[str, Any]:
        feeds = {f"batch/{i}": t for i, t in enumerate(flatten_batch(inputs, labels)[0])}
        if mode == "train":
            feeds.update({f"param_groups/{i}": g for i, g in enumerate(self.optimizer.param_groups)})
        return feeds

    def _run(self, plan: Plan, inputs: Any, labels: Any, mode: str,
             seed: int | None = None) -> dict[Slot, Any]:
        feeds = self._feeds(inputs, labels, mode)
        if plan.cut_inputs is not None:
            feeds = plan.cut_inputs(feeds)
        return plan.executor.run(feeds, seed=seed)

    # -- one step -----------------------------------------------------------------------
    def train_step(self, inputs: Any, labels: Any = None) -> float:
        plan = self._runnable(self._plan("train", inputs, labels))
        results = self._run(plan, inputs, labels, "train", seed=self.strategy.seed + self.global_step)
        self.global_step += 1
        self.optimizer._opt_called = True   # tells LR schedulers the optimizer stepped
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return float(results[Slot("loss")])

    def _forward(self, mode: str, inputs: Any, labels: Any) -> tuple[float | None, Any]:
        plan = self._runnable(self._plan(mode, inputs, labels))
        results = self._run(plan, inputs, labels, mode)
        loss = results.get(Slot("loss"))
        outputs = [v for s, v in results.items() if s.kind == "output"]
        return (None if loss is None else float(loss)), _rebuild(plan.spec, outputs)

    # -- the Keras/Paddle-style loops ---------------------------------------------------
    def fit(self, train_data, batch_size: int = 1, epochs: int = 1,
            steps_per_epoch: int | None = None, log_freq: int = 10, valid_data=None,
            valid_freq: int = 1, valid_steps: int | None = None,
            collate_fn: Callable | None = None, shuffle: bool = False,
            verbose: int = 2) -> dict[str, list[float]]:
        """Train; ``history["loss"]`` holds one global-batch mean loss per step."""
        if self.optimizer is None:
            raise ValueError("Engine.fit needs an optimizer: Engine(model, loss, optimizer=...)")
        history = self.history
        total = _steps_in(train_data, batch_size, steps_per_epoch)
        for epoch in range(epochs):
            log = ProgressLog(verbose, log_freq, total, f"epoch {epoch + 1}/{epochs}",
                              enabled=self.is_logging_rank)
            for step, (inputs, labels) in enumerate(
                    batches(train_data, batch_size, collate_fn, shuffle, self.strategy.seed + epoch),
                    start=1):
                if steps_per_epoch is not None and step > steps_per_epoch:
                    break
                lr = self.optimizer.param_groups[0]["lr"]
                loss = self.train_step(inputs, labels)
                history.setdefault("loss", []).append(loss)
                history.setdefault("lr", []).append(lr)
                log.step(step, {"loss": loss, "lr": lr})
            log.close()
            if valid_data is not None and (epoch + 1) % valid_freq == 0:
                scores = self.evaluate(valid_data, batch_size, valid_steps, collate_fn=collate_fn,
                                       verbose=0)
                for k, v in scores.items():
                    history.setdefault(f"val_{k}", []).append(v)
                if self.is_logging_rank and verbose:
                    print("validation " + " ".join(f"{k}: {v:.4f}" for k, v in scores.items()))
        self.sync_model()
        self.sync_optimizer_state()
        if self.strategy.debug.trace:
            self._write_trace()
        return history

    def evaluate(self, valid_data, batch_size: int = 1, steps: int | None = None,
                 log_freq: int = 10, collate_fn: Callable | None = None,
                 verbose: int = 0) -> dict[str, float]:
        """Mean loss and metrics over the data, weighted by batch size (eval mode)."""
        totals: dict[str, float] = {}
        count = 0
        log = ProgressLog(verbose, log_freq, steps, "evaluate", enabled=self.is_logging_rank)
        for step, (inputs, labels) in enumerate(batches(valid_data, batch_size, collate_fn), 1):
            if steps is not None and step > steps:
                break
            loss, outputs = self._forward("eval", inputs, labels)
            n = batch_size_of(inputs)
            scores = {"loss": loss} if loss is not None else {}
            scores.update({name: float(fn(outputs, labels)) for name, fn in self.metrics.items()})
            for k, v in scores.items():
                totals[k] = totals.get(k, 0.0) + v * n
            count += n
            log.step(step, scores)
        log.close()
        return {k: v / max(count, 1) for k, v in totals.items()}

    def predict(self, test_data, batch_size: int = 1, steps: int | None = None,
                collate_fn: Callable | None = None, verbose: int = 0) -> list[Any]:
        """The model's outputs for each batch, as full tensors in the model's own structure."""
        outputs = []
        for step, (inputs, labels) in enumerate(batches(test_data, batch_size, collate_fn), 1):
            if steps is not None and step > steps:
                break
            outputs.append(self._forward("predict", inputs, None)[1])
        return outputs

    # -- state --------------------------------------------------------------------------
    @property
    def is_logging_rank(self) -> bool:
        """Only rank 0 prints (every rank computes the same global loss)."""
        return not self.distributed or self.launch_rank == 0

    def peak_activation_bytes(self, mode: str = "train") -> list[int]:
        """A pipeline's high-water mark of activations held between jobs in the last step
        of ``mode``, per pipeline rank (on real processes: each rank's first process's,
        gathered; a collective, so every process calls it)."""
        plan = self._last_pipeline(mode)
        if plan is None:
            raise ValueError(f"peak_activation_bytes: no pipelined {mode!r} step has run")
        return plan.executor.peaks()

    def programs(self) -> dict[str, Program]:
        return {f"{mode}{i}": plan.program for i, ((mode, *_), plan) in enumerate(self._plans.items())}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers by their module paths. On real processes the pieces
        are gathered: a collective, so every rank calls it."""
        self.sync_model()
        names = [n for n, _ in self.model.named_parameters()] + [n for n, _ in self.model.named_buffers()]
        return {n: self.state[n] for n in names}

    def sync_model(self) -> None:
        """On real processes, gather this rank's pieces of the parameters and buffers into
        the model's own tensors (the model trains in place, as in serial runs). Collective;
        ``fit`` calls it at its end."""
        if self._pieces is None:
            return
        for name in self._pieces.names():
            if name in self.state and isinstance(self.state[name], torch.Tensor):
                self.state[name].copy_(self._pieces.full(name))

    def sync_optimizer_state(self) -> None:
        """Expose the engine's optimizer state through ``optimizer.state`` (state_dict works)."""
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name = self.param_names[id(p)]
                prefix = f"{name}/"
                own = {k[len(prefix):]: v for k, v in self.state.items() if k.startswith(prefix)}
                if self._pieces is not None:
                    own = {k[len(prefix):]: self._pieces.full(k)
                           for k in self._pieces.names() if k.startswith(prefix)}
                    own = {k: v for k, v in own.items() if v is not None}
                if own:
                    self.optimizer.state[p].update(own)


@contextlib.contextmanager
def _gc_paused():
    """Planning builds tens of thousands of long-lived objects (fake tensors, IR); Python's
    cyclic collector would rescan them all many times over. Refcounting still frees
    garbage meanwhile, and the collector resumes afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _check_plannable(strategy: Strategy) -> None:
    strategy.check_supported(PLANNED_SECTIONS)


def _steps_in(data, batch_size: int, limit: int | None) -> int | None:
    """Steps per epoch for the progress display, when the data has a length."""
    try:
        batches_in_data = len(data) if isinstance(data, torch.utils.data.DataLoader) \
            else -(-len(data) // batch_size)
    except TypeError:
        return limit
    return batches_in_data if limit is None else min(limit, batches_in_data)


def _named_metrics(metrics) -> dict[str, Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        return dict(metrics)
    return {getattr(m, "__name__", f"metric{i}"): m for i, m in enumerate(metrics)}


def _signature(tree: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(tree)
    return (str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                             for x in leaves))


def _rebuild(spec: StepSpec, leaves: list[Any]) -> Any:
    if spec.output_spec is None:
        return None
    tree = pytree.tree_unflatten(leaves, spec.output_spec)
    kind = spec.output_type
    if dataclasses.is_dataclass(kind) and isinstance(tree, dict):
        return kind(**tree)
    return tree
